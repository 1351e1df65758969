// Counter-based random numbers for initialising parameters shard by shard (Philox4x32-10: Salmon, Moraes, Dror and
// Shaw, "Parallel random numbers: as easy as 1, 2, 3", SC'11). Element i of a stream is a pure function of
// (seed, stream, i), so every rank computes exactly the elements it holds and the values are the same at any world
// or tensor-parallel size. Torch-free: the reference for any device twin.
//
// Layout (fixed: changing it changes every initialised model):
//   key     = (seed low 32 bits, seed high 32 bits)
//   counter = (block low, block high, stream low, stream high), block = i / 4; element i takes output word i % 4
//   uniform = (word + 0.5) * 2^-32, in the open interval (0, 1)
//   normal  = Box-Muller over the word pairs (0, 1) and (2, 3) of a block, in double:
//             r = sqrt(-2 ln u_first), value_first = r cos(2 pi u_second), value_second = r sin(2 pi u_second)
//   value   = shift + scale * variate (double), rounded once to the destination dtype (float16/bfloat16 via float)
#pragma once

#include <array>
#include <cstdint>

#include "bmt/core/dtype.h"

namespace bmt::core {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

// One evaluation of Philox4x32 with 10 rounds (Random123's multipliers and Weyl key increments).
PhiloxCounter philox4x32_10(PhiloxCounter counter, PhiloxKey key);

enum class RandomDist { kUniform, kNormal };

struct RandomStream {
  RandomDist dist = RandomDist::kNormal;
  uint64_t seed = 0;
  uint64_t stream = 0;  // one per parameter (e.g. a hash of its name)
  double shift = 0.0;   // value = shift + scale * variate
  double scale = 1.0;
};

// The value of element i in double, before rounding to a dtype.
double random_value(const RandomStream& s, int64_t i);
// Writes elements [first, first + count) of the stream to `out` (float32, float64, bfloat16 or float16).
void random_fill(const RandomStream& s, int64_t first, int64_t count, DType dtype, void* out);

// A 64-bit stream key for a name (FNV-1a, then a splitmix64 finaliser so similar names land far apart).
uint64_t stream_of_name(const char* name, size_t nbytes);

}  // namespace bmt::core
