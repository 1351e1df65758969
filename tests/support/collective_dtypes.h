// The element types the collective tests run every operation over (Gloo on CPU ranks, NCCL on GPUs).
#pragma once

#include <c10/core/ScalarType.h>

#include "bmt/core/dtype.h"

namespace bmt::testing {

struct CollectiveDType {
  at::ScalarType st;
  core::DType dt;
  const char* name;
};

inline const CollectiveDType kCollectiveDTypes[] = {{at::kFloat, core::DType::kFloat32, "fp32"},
                                                    {at::kHalf, core::DType::kFloat16, "fp16"},
                                                    {at::kBFloat16, core::DType::kBFloat16, "bf16"},
                                                    {at::kLong, core::DType::kInt64, "int64"}};

}  // namespace bmt::testing
