// CPU Adam kernel (scalar / AVX2 / AVX-512 bit-identity, rounding of half-precision stores, chunking) and the CPU
// has_inf_nan kernel. Torch-free except for nothing: plain std::vector buffers.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "bmt/core/dtype.h"
#include "bmt/core/error.h"
#include "bmt/core/kernels/adam.h"
#include "bmt/core/kernels/has_inf_nan_internal.h"
#include "bmt/core/kernels/thread_pool.h"
#include "element_bytes.h"

namespace k = bmt::core::kernels;
using bmt::core::DType;
using bmt::optim::testing::get_element;
using bmt::optim::testing::put_element;

namespace {

// One tensor's buffers for the kernel, in any dtype pair.
struct Buffers {
  DType pd, gd;
  int64_t n;
  std::vector<uint8_t> param, grad;
  std::vector<float> master, m, v;

  Buffers(DType pd_, DType gd_, int64_t n_, uint32_t seed) : pd(pd_), gd(gd_), n(n_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    param.resize(n * bmt::core::dtype_nbytes(pd));
    grad.resize(n * bmt::core::dtype_nbytes(gd));
    m.resize(n);
    v.resize(n);
    if (pd != DType::kFloat32) master.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      float p = dist(rng);
      put_element(param.data(), pd, i, p);
      if (pd != DType::kFloat32) master[i] = get_element(param.data(), pd, i);
      put_element(grad.data(), gd, i, dist(rng) * 0.1f);
      m[i] = dist(rng) * 0.01f;
      v[i] = std::abs(dist(rng)) * 0.001f;
    }
  }
  k::AdamTensorArgs args(double lr = 1e-2, double wd = 0.1, int64_t step = 3) {
    k::AdamTensorArgs a;
    a.param = param.data();
    a.grad = grad.data();
    a.master = master.empty() ? nullptr : master.data();
    a.exp_avg = m.data();
    a.exp_avg_sq = v.data();
    a.numel = n;
    a.param_dtype = pd;
    a.grad_dtype = gd;
    k::adam_step_scalars(a, lr, 0.9, 0.999, 1e-8, wd, step);
    return a;
  }
  bool same_bits(const Buffers& o) const {
    // Byte comparison (not ==) so that NaN payloads and -0.0 count; empty vectors may hold null data pointers.
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
    };
    return param == o.param && same(master, o.master) && same(m, o.m) && same(v, o.v);
  }
};

const DType kFloatTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

std::vector<k::CpuIsa> supported_isas() {
  std::vector<k::CpuIsa> out;
  for (k::CpuIsa isa : {k::CpuIsa::kScalar, k::CpuIsa::kAvx2, k::CpuIsa::kAvx512})
    if (k::adam_cpu_isa_supported(isa)) out.push_back(isa);
  return out;
}

}  // namespace

TEST(AdamKernel, IsaPathsAndChunkingAreBitIdentical) {
  std::printf("best CPU ISA: %s\n", k::cpu_isa_name(k::adam_cpu_best_isa()));
  for (DType pd : kFloatTypes) {
    for (DType gd : kFloatTypes) {
      for (int64_t n : {1, 7, 8, 15, 16, 17, 33, 1003}) {
        Buffers ref(pd, gd, n, 42);
        auto ra = ref.args();
        k::adam_cpu_range_isa(ra, 0.25f, 0, n, k::CpuIsa::kScalar);
        for (k::CpuIsa isa : supported_isas()) {
          for (int64_t split : {int64_t{0}, n / 3, n - 1}) {
            Buffers b(pd, gd, n, 42);
            auto a = b.args();
            k::adam_cpu_range_isa(a, 0.25f, 0, split, isa);
            k::adam_cpu_range_isa(a, 0.25f, split, n, isa);
            EXPECT_TRUE(b.same_bits(ref)) << "param " << bmt::core::dtype_name(pd) << " grad "
                                          << bmt::core::dtype_name(gd) << " n=" << n << " isa="
                                          << k::cpu_isa_name(isa) << " split=" << split;
          }
        }
      }
    }
  }
}

TEST(AdamKernel, FirstStepIsSignDescent) {
  // With zero moments, update 1 is p*(1 - lr*wd) - lr * g / (|g| + eps): about lr * sign(g).
  Buffers b(DType::kFloat32, DType::kFloat32, 100, 7);
  std::fill(b.m.begin(), b.m.end(), 0.0f);
  std::fill(b.v.begin(), b.v.end(), 0.0f);
  std::vector<float> p0(100), g(100);
  for (int i = 0; i < 100; ++i) p0[i] = get_element(b.param.data(), DType::kFloat32, i), g[i] = get_element(b.grad.data(), DType::kFloat32, i);
  auto a = b.args(1e-3, 0.01, 1);
  k::adam_cpu_range(a, 1.0f, 0, 100);
  for (int i = 0; i < 100; ++i) {
    double expect = p0[i] * (1 - 1e-3 * 0.01) - 1e-3 * g[i] / (std::abs(g[i]) + 1e-8);
    EXPECT_NEAR(get_element(b.param.data(), DType::kFloat32, i), expect, 1e-6) << i;
  }
}

TEST(AdamKernel, HalfStoresRoundToNearestEvenInEveryPath) {
  // lr = 0 leaves the master untouched, so the parameter must equal the rounding of the master.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> special = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -1.0f - 0x1p-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f,
                                65504.0f, 65520.0f, 70000.0f, 1e-6f, 6e-8f, 3e-8f, 1e-40f, 3.4e38f, -inf, inf,
                                std::numeric_limits<float>::quiet_NaN(), 0.0f, -0.0f, 0.1f, 1.0f / 3.0f};
  for (DType pd : {DType::kBFloat16, DType::kFloat16}) {
    for (k::CpuIsa isa : supported_isas()) {
      int64_t n = static_cast<int64_t>(special.size());
      Buffers b(pd, DType::kFloat32, n, 3);
      b.master = special;
      std::fill(b.grad.begin(), b.grad.end(), 0);
      std::fill(b.m.begin(), b.m.end(), 0.0f);
      std::fill(b.v.begin(), b.v.end(), 0.0f);
      auto a = b.args(/*lr=*/0.0, /*wd=*/0.0, 1);
      k::adam_cpu_range_isa(a, 1.0f, 0, n, isa);
      for (int64_t i = 0; i < n; ++i) {
        uint16_t got;
        std::memcpy(&got, b.param.data() + 2 * i, 2);
        uint16_t want = pd == DType::kBFloat16 ? bmt::core::float_to_bf16_bits(special[i])
                                               : bmt::core::float_to_fp16_bits(special[i]);
        bool both_nan = std::isnan(special[i]);
        if (both_nan) {
          float back = pd == DType::kBFloat16 ? bmt::core::bf16_bits_to_float(got) : bmt::core::fp16_bits_to_float(got);
          EXPECT_TRUE(std::isnan(back));
        } else {
          EXPECT_EQ(got, want) << bmt::core::dtype_name(pd) << " " << k::cpu_isa_name(isa) << " value " << special[i];
        }
      }
    }
  }
}

TEST(AdamKernel, MultiTensorOnPoolMatchesSingleThread) {
  k::ThreadPool pool(3);
  std::vector<Buffers> ours, ref;
  const int64_t sizes[] = {0, 5, k::kAdamCpuChunkElems + 17, 2 * k::kAdamCpuChunkElems, 1000};
  for (int t = 0; t < 5; ++t) {
    ours.emplace_back(kFloatTypes[t % 3], kFloatTypes[(t + 1) % 3], sizes[t], 100 + t);
    ref.emplace_back(kFloatTypes[t % 3], kFloatTypes[(t + 1) % 3], sizes[t], 100 + t);
  }
  std::vector<k::AdamTensorArgs> args;
  for (auto& b : ours) args.push_back(b.args());
  k::adam_cpu(args.data(), args.size(), 0.5f, pool);
  for (size_t t = 0; t < ref.size(); ++t) {
    auto a = ref[t].args();
    k::adam_cpu_range(a, 0.5f, 0, a.numel);
    EXPECT_TRUE(ours[t].same_bits(ref[t])) << "tensor " << t;
  }
}

TEST(AdamKernel, BadArgumentsAreErrors) {
  Buffers b(DType::kBFloat16, DType::kFloat32, 4, 1);
  auto a = b.args();
  a.master = nullptr;
  EXPECT_THROW(k::adam_check_args(a, "x"), bmt::core::Error);
  a = b.args();
  a.grad_dtype = DType::kInt32;
  EXPECT_THROW(k::adam_check_args(a, "x"), bmt::core::Error);
  a = b.args();
  a.param_dtype = DType::kFloat64;
  EXPECT_THROW(k::adam_check_args(a, "x"), bmt::core::Error);
}

TEST(HasInfNanCpu, FindsInfAndNanAnywhere) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat64}) {
    for (int64_t n : {1, 100, 4096, 4097, 10001}) {
      size_t nb = bmt::core::dtype_nbytes(d);
      std::vector<uint8_t> buf(n * nb);
      auto put = [&](int64_t i, float x) {
        if (d == DType::kFloat64) {
          double y = x;
          std::memcpy(buf.data() + 8 * i, &y, 8);
        } else {
          put_element(buf.data(), d, i, x);
        }
      };
      for (int64_t i = 0; i < n; ++i) put(i, 0.5f * static_cast<float>(i % 13) - 3.0f);
      EXPECT_FALSE(k::has_inf_nan_cpu(buf.data(), n, d));
      for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
        for (float bad : {inf, -inf, nan}) {
          put(pos, bad);
          EXPECT_TRUE(k::has_inf_nan_cpu(buf.data(), n, d)) << bmt::core::dtype_name(d) << " n=" << n << " pos=" << pos;
          put(pos, 1.0f);
        }
      }
      EXPECT_FALSE(k::has_inf_nan_cpu(buf.data(), n, d));
    }
  }
  EXPECT_FALSE(k::has_inf_nan_cpu(nullptr, 0, DType::kFloat32));
  std::vector<int32_t> ints(10, -1);
  EXPECT_FALSE(k::has_inf_nan_cpu(ints.data(), 10, DType::kInt32));
  // The largest finite values are not inf.
  float big = 65504.0f;
  uint16_t h = bmt::core::float_to_fp16_bits(big);
  EXPECT_FALSE(k::has_inf_nan_cpu(&h, 1, DType::kFloat16));
}
