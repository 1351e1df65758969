// Precompiled header for the LibTorch layer: the narrow set of torch headers most files need.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <torch/nn/module.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
