// Precompiled header of the extension bmtrain._C: pybind11 with torch's tensor casters, and LibTorch's module type.
#pragma once

#include <torch/csrc/utils/pybind.h>
#include <torch/nn/module.h>

#include <ATen/ATen.h>
