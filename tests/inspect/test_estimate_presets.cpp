// examples::preset_shape (what bmt-estimate and bmt.estimate_memory hand the estimator) agrees with the training
// presets (examples/models/presets.cpp), and every training preset has a shape.
#include <gtest/gtest.h>

#include "bmt/runtime/estimate_memory.h"
#include "models/preset_shapes.h"
#include "models/presets.h"

TEST(EstimatePresets, ShapesEqualTheExamplesPresets) {
  for (const std::string& name : examples::preset_names()) {
    const examples::ModelConfig& c = examples::find_preset(name).model;
    const bmt::ModelShape s = examples::preset_shape(name);
    EXPECT_EQ(s.layers, c.num_layers) << name;
    EXPECT_EQ(s.hidden, c.dim) << name;
    EXPECT_EQ(s.heads, c.num_heads) << name;
    EXPECT_EQ(s.ffn, c.ffn_dim) << name;
    EXPECT_EQ(s.max_seq, c.max_seq_len) << name;
  }
}
