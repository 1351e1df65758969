// CPU has_inf_nan: branch-free exponent-mask test over blocks (auto-vectorised), early exit between blocks.
#include "bmt/core/kernels/has_inf_nan_internal.h"

#include "bmt/core/error.h"

namespace bmt::core::kernels {
namespace {

constexpr int64_t kBlockElems = 4096;

template <typename Bits, Bits kExpMask>
bool scan(const void* data, int64_t numel) {
  const Bits* x = static_cast<const Bits*>(data);
  for (int64_t begin = 0; begin < numel; begin += kBlockElems) {
    int64_t end = begin + kBlockElems < numel ? begin + kBlockElems : numel;
    unsigned found = 0;
    for (int64_t i = begin; i < end; ++i) found |= static_cast<unsigned>((x[i] & kExpMask) == kExpMask);
    if (found) return true;
  }
  return false;
}

}  // namespace

bool has_inf_nan_cpu(const void* data, int64_t numel, DType dtype) {
  BMT_CHECK(numel >= 0, "has_inf_nan: negative element count ", numel);
  if (numel == 0) return false;
  BMT_CHECK(data != nullptr, "has_inf_nan: null buffer with ", numel, " elements");
  switch (dtype) {
    case DType::kFloat32: return scan<uint32_t, 0x7f800000u>(data, numel);
    case DType::kFloat16: return scan<uint16_t, 0x7c00u>(data, numel);
    case DType::kBFloat16: return scan<uint16_t, 0x7f80u>(data, numel);
    case DType::kFloat64: return scan<uint64_t, 0x7ff0000000000000ull>(data, numel);
    default: return false;
  }
}

}  // namespace bmt::core::kernels
