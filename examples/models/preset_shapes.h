// The example models' presets as shapes: the one table of their sizes (torch-free). presets.cpp adds the training
// defaults; bmt-estimate (tools/) and bmt.estimate_memory (python/csrc/bind_estimate.cpp) compile this file to
// describe a preset to the library's estimator (bmt::estimate_memory takes a ModelShape, it knows no presets).
//
//   tiny        gpt   L2  d64   h4  ff256   seq 64
//   gpt2-124m   gpt   L12 d768  h12 ff3072  seq 1024
//   gpt-1.3b    gpt   L24 d2048 h16 ff8192  seq 2048
//   gpt-6.7b    gpt   L32 d4096 h32 ff16384 seq 2048
//   llama-7b    llama L32 d4096 h32 ff11008 seq 2048
// Vocabulary 50304 (ModelShape's default).
#pragma once

#include <string>
#include <vector>

#include "bmt/runtime/estimate_memory.h"

namespace examples {

// The preset's shape; arch is the preset's own ("llama" for llama-*, else "gpt"). Throws bmt::core::Error listing
// the known names when `name` is unknown.
bmt::ModelShape preset_shape(const std::string& name);
std::vector<std::string> preset_shape_names();

}  // namespace examples
