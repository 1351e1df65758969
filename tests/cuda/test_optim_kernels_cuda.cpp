// CUDA kernels against their CPU twins, torch-free (CUDA runtime + bmt_core only, so it also builds standalone
// with nvcc): fused multi-tensor Adam must be bit-identical to adam_cpu for every dtype pair, over several launches,
// with 64-bit indexing, and must do nothing when the device skip flag is set; has_inf_nan_cuda must find inf/NaN
// anywhere, including past 2^31 elements.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "bmt/core/dtype.h"
#include "bmt/core/kernels/adam.h"
#include "bmt/core/kernels/has_inf_nan_internal.h"
#include "bmt/core/kernels/thread_pool.h"
#include "element_bytes.h"

namespace k = bmt::core::kernels;
using bmt::core::DType;
using bmt::optim::testing::get_element;
using bmt::optim::testing::put_element;

namespace {

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

size_t free_gpu_bytes() {
  size_t free_b = 0, total = 0;
  cudaMemGetInfo(&free_b, &total);
  return free_b;
}

struct Dev {
  void* p = nullptr;
  explicit Dev(size_t bytes) {
    if (bytes && cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
};

// One tensor's host buffers (reference) and device copies.
struct Tensor {
  DType pd, gd;
  int64_t n;
  std::vector<uint8_t> param, grad;
  std::vector<float> master, m, v;
  std::unique_ptr<Dev> d_param, d_grad, d_master, d_m, d_v;

  Tensor(DType pd_, DType gd_, int64_t n_, uint32_t seed) : pd(pd_), gd(gd_), n(n_) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    size_t pb = bmt::core::dtype_nbytes(pd), gb = bmt::core::dtype_nbytes(gd);
    param.resize(n * pb);
    grad.resize(n * gb);
    m.resize(n);
    v.resize(n);
    if (pd != DType::kFloat32) master.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      put_element(param.data(), pd, i, dist(rng));
      if (pd != DType::kFloat32) master[i] = get_element(param.data(), pd, i);
      put_element(grad.data(), gd, i, dist(rng) * 0.1f);
      m[i] = dist(rng) * 0.01f;
      v[i] = std::abs(dist(rng)) * 0.001f;
    }
  }
  void upload() {
    auto up = [](std::unique_ptr<Dev>& d, const void* src, size_t bytes) {
      d = std::make_unique<Dev>(bytes);
      if (bytes) cudaMemcpy(d->p, src, bytes, cudaMemcpyHostToDevice);
    };
    up(d_param, param.data(), param.size());
    up(d_grad, grad.data(), grad.size());
    up(d_master, master.data(), master.size() * 4);
    up(d_m, m.data(), m.size() * 4);
    up(d_v, v.data(), v.size() * 4);
  }
  k::AdamTensorArgs args(bool device, int64_t step) {
    k::AdamTensorArgs a;
    a.param = device ? d_param->p : param.data();
    a.grad = device ? d_grad->p : grad.data();
    a.master = master.empty() ? nullptr : static_cast<float*>(device ? d_master->p : master.data());
    a.exp_avg = static_cast<float*>(device ? d_m->p : m.data());
    a.exp_avg_sq = static_cast<float*>(device ? d_v->p : v.data());
    a.numel = n;
    a.param_dtype = pd;
    a.grad_dtype = gd;
    k::adam_step_scalars(a, 1e-2, 0.9, 0.999, 1e-8, 0.1, step);
    return a;
  }
  // Device state equals host state, bit for bit.
  bool device_matches_host() const {
    auto same = [](const Dev* d, const void* host, size_t bytes) {
      if (bytes == 0) return true;
      std::vector<uint8_t> back(bytes);
      cudaMemcpy(back.data(), d->p, bytes, cudaMemcpyDeviceToHost);
      return std::memcmp(back.data(), host, bytes) == 0;
    };
    return same(d_param.get(), param.data(), param.size()) && same(d_master.get(), master.data(), master.size() * 4) &&
           same(d_m.get(), m.data(), m.size() * 4) && same(d_v.get(), v.data(), v.size() * 4);
  }
};

const DType kTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

}  // namespace

TEST(CudaAdam, BitIdenticalToCpuTwinOverManyTensorsAndLaunches) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  k::ThreadPool& pool = k::ThreadPool::global();
  std::vector<std::unique_ptr<Tensor>> ts;
  const int64_t sizes[] = {0, 1, 7, 255, 256, 257, 1000, 4099, 1 << 20};
  uint32_t seed = 1;
  for (DType pd : kTypes)
    for (DType gd : kTypes)
      for (int rep = 0; rep < 45; ++rep, ++seed)  // 45 tensors per pair: more than one launch of 36
        ts.push_back(std::make_unique<Tensor>(pd, gd, sizes[seed % 9], seed));
  for (auto& t : ts) t->upload();
  for (int64_t step = 1; step <= 3; ++step) {
    std::vector<k::AdamTensorArgs> host, dev;
    for (auto& t : ts) {
      host.push_back(t->args(false, step));
      dev.push_back(t->args(true, step));
    }
    k::adam_cpu(host.data(), host.size(), 0.125f, pool);
    k::adam_cuda(dev.data(), dev.size(), 0.125f, nullptr, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
  }
  for (size_t i = 0; i < ts.size(); ++i)
    EXPECT_TRUE(ts[i]->device_matches_host()) << "tensor " << i << " param " << bmt::core::dtype_name(ts[i]->pd)
                                              << " grad " << bmt::core::dtype_name(ts[i]->gd) << " n=" << ts[i]->n;
}

TEST(CudaAdam, SkipFlagOnDeviceMakesTheLaunchANoOp) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Tensor t(DType::kBFloat16, DType::kFloat32, 5000, 9);
  t.upload();
  Dev flag(sizeof(int));
  int one = 1, zero = 0;
  CUDA_OK(cudaMemcpy(flag.p, &one, sizeof(int), cudaMemcpyHostToDevice));
  auto a = t.args(true, 1);
  k::adam_cuda(&a, 1, 1.0f, static_cast<const int*>(flag.p), nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(t.device_matches_host());  // untouched
  CUDA_OK(cudaMemcpy(flag.p, &zero, sizeof(int), cudaMemcpyHostToDevice));
  k::adam_cuda(&a, 1, 1.0f, static_cast<const int*>(flag.p), nullptr);
  auto h = t.args(false, 1);
  k::adam_cpu_range(h, 1.0f, 0, t.n);
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(t.device_matches_host());  // updated like the twin
}

TEST(CudaAdam, SixtyFourBitIndexing) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = (int64_t{1} << 31) + 1000;  // bf16 param + bf16 grad + 3 fp32 buffers: 16 bytes/element
  if (free_gpu_bytes() < static_cast<size_t>(n) * 16 + (size_t{2} << 30)) GTEST_SKIP() << "not enough GPU memory";
  Dev p(n * 2), g(n * 2), master(n * 4), m(n * 4), v(n * 4);
  ASSERT_TRUE(p.p && g.p && master.p && m.p && v.p);
  // Fill the last 1000 elements of each buffer from a host tensor; the rest holds whatever cudaMalloc returned
  // (elements are independent, so only the tail is compared).
  const int64_t tail = 1000, start = n - tail;
  Tensor ref(DType::kBFloat16, DType::kBFloat16, tail, 77);
  CUDA_OK(cudaMemcpy(static_cast<uint16_t*>(p.p) + start, ref.param.data(), tail * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(static_cast<uint16_t*>(g.p) + start, ref.grad.data(), tail * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(static_cast<float*>(master.p) + start, ref.master.data(), tail * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(static_cast<float*>(m.p) + start, ref.m.data(), tail * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(static_cast<float*>(v.p) + start, ref.v.data(), tail * 4, cudaMemcpyHostToDevice));
  k::AdamTensorArgs a = ref.args(false, 2);
  a.param = p.p;
  a.grad = g.p;
  a.master = static_cast<float*>(master.p);
  a.exp_avg = static_cast<float*>(m.p);
  a.exp_avg_sq = static_cast<float*>(v.p);
  a.numel = n;
  k::adam_cuda(&a, 1, 1.0f, nullptr, nullptr);
  CUDA_OK(cudaDeviceSynchronize());
  auto h = ref.args(false, 2);
  k::adam_cpu_range(h, 1.0f, 0, tail);
  std::vector<uint16_t> back_p(tail);
  std::vector<float> back_m(tail), back_master(tail);
  CUDA_OK(cudaMemcpy(back_p.data(), static_cast<uint16_t*>(p.p) + start, tail * 2, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(back_m.data(), static_cast<float*>(m.p) + start, tail * 4, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(back_master.data(), static_cast<float*>(master.p) + start, tail * 4, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::memcmp(back_p.data(), ref.param.data(), tail * 2), 0);
  EXPECT_EQ(std::memcmp(back_m.data(), ref.m.data(), tail * 4), 0);
  EXPECT_EQ(std::memcmp(back_master.data(), ref.master.data(), tail * 4), 0);
}

TEST(CudaHasInfNan, FindsInfAndNanAndAccumulatesTheFlag) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (DType d : kTypes) {
    for (int64_t n : {1, 255, 256, 100000}) {
      size_t nb = bmt::core::dtype_nbytes(d);
      std::vector<uint8_t> host(n * nb);
      for (int64_t i = 0; i < n; ++i) put_element(host.data(), d, i, 0.25f * static_cast<float>(i % 9) - 1.0f);
      Dev buf(host.size()), flag(sizeof(int));
      auto check = [&](bool expect) {
        int zero = 0, got = -1;
        cudaMemcpy(buf.p, host.data(), host.size(), cudaMemcpyHostToDevice);
        cudaMemcpy(flag.p, &zero, sizeof(int), cudaMemcpyHostToDevice);
        k::has_inf_nan_cuda(buf.p, n, d, static_cast<int*>(flag.p), nullptr);
        cudaMemcpy(&got, flag.p, sizeof(int), cudaMemcpyDeviceToHost);
        EXPECT_EQ(got, expect ? 1 : 0) << bmt::core::dtype_name(d) << " n=" << n;
        EXPECT_EQ(k::has_inf_nan_cpu(host.data(), n, d), expect);
      };
      check(false);
      for (int64_t pos : {int64_t{0}, n - 1}) {
        for (float bad : {inf, -inf, nan}) {
          put_element(host.data(), d, pos, bad);
          check(true);
          put_element(host.data(), d, pos, 0.5f);
        }
      }
    }
  }
  // The flag is only ever set: a clean buffer after a dirty one keeps it at 1.
  Dev flag(sizeof(int));
  int one = 1, got = 0;
  cudaMemcpy(flag.p, &one, sizeof(int), cudaMemcpyHostToDevice);
  float clean = 1.0f;
  Dev buf(4);
  cudaMemcpy(buf.p, &clean, 4, cudaMemcpyHostToDevice);
  k::has_inf_nan_cuda(buf.p, 1, DType::kFloat32, static_cast<int*>(flag.p), nullptr);
  k::has_inf_nan_cuda(buf.p, 0, DType::kFloat32, static_cast<int*>(flag.p), nullptr);
  cudaMemcpy(&got, flag.p, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(got, 1);
}

TEST(CudaHasInfNan, BeyondTwoToTheThirtyOne) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = (int64_t{1} << 31) + 10;
  if (free_gpu_bytes() < static_cast<size_t>(n) * 2 + (size_t{1} << 30)) GTEST_SKIP() << "not enough GPU memory";
  Dev buf(n * 2), flag(sizeof(int));
  ASSERT_NE(buf.p, nullptr);
  CUDA_OK(cudaMemset(buf.p, 0, n * 2));
  int zero = 0, got = -1;
  CUDA_OK(cudaMemcpy(flag.p, &zero, sizeof(int), cudaMemcpyHostToDevice));
  k::has_inf_nan_cuda(buf.p, n, DType::kBFloat16, static_cast<int*>(flag.p), nullptr);
  CUDA_OK(cudaMemcpy(&got, flag.p, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, 0);
  uint16_t inf_bits = 0x7f80;
  CUDA_OK(cudaMemcpy(static_cast<uint16_t*>(buf.p) + n - 1, &inf_bits, 2, cudaMemcpyHostToDevice));
  k::has_inf_nan_cuda(buf.p, n, DType::kBFloat16, static_cast<int*>(flag.p), nullptr);
  CUDA_OK(cudaMemcpy(&got, flag.p, sizeof(int), cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, 1);
}
