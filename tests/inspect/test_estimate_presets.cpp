// bmt::model_shape_preset (the estimator's shape-only copies of the presets) agrees with examples/models/presets.cpp.
#include <gtest/gtest.h>

#include "bmt/runtime/estimate_memory.h"
#include "models/presets.h"

TEST(EstimatePresets, ShapesEqualTheExamplesPresets) {
  for (const std::string& name : examples::preset_names()) {
    const examples::ModelConfig& c = examples::find_preset(name).model;
    const bmt::ModelShape s = bmt::model_shape_preset(name);
    EXPECT_EQ(s.layers, c.num_layers) << name;
    EXPECT_EQ(s.hidden, c.dim) << name;
    EXPECT_EQ(s.heads, c.num_heads) << name;
    EXPECT_EQ(s.ffn, c.ffn_dim) << name;
    EXPECT_EQ(s.max_seq, c.max_seq_len) << name;
  }
}
