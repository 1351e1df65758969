// bmt-bench-comm: bandwidth of bmtrain's collectives (all_gather, reduce_scatter, all_reduce) over a sweep of
// message sizes, reported like nccl-tests: size = the whole buffer (all_gather's output, reduce_scatter's input),
// algbw = size / time, busbw = algbw * (n-1)/n (gather/scatter) or algbw * 2(n-1)/n (all_reduce).
//   bmtrun --nproc 8 build/tools/bmt-bench-comm [--backend auto|nccl|gloo] [--dtype bf16|fp16|fp32]
//          [--min-bytes 1K] [--max-bytes 256M] [--iters 20] [--warmup 5] [--ops all_gather,all_reduce]
//          [--json results.jsonl]
// The time of a size is the slowest rank's mean over --iters (a collective finishes with its slowest rank).
// CUDA: enqueued on config().load_stream (where ZeRO's gathers run) and timed with CUDA events; CPU: steady clock.
#include <ATen/ATen.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/runtime/tensor_adapter_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace {

using bmt::core::ReduceOp;

enum class Op { kAllGather, kReduceScatter, kAllReduce };

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllGather: return "all_gather";
    case Op::kReduceScatter: return "reduce_scatter";
    case Op::kAllReduce: return "all_reduce";
  }
  return "?";
}

// nccl-tests' bus bandwidth factor: the fraction of the buffer each rank's link carries.
double busbw_factor(Op op, int world) {
  if (world <= 1) return 0.0;
  double n = world;
  return op == Op::kAllReduce ? 2.0 * (n - 1) / n : (n - 1) / n;
}

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct BenchOptions {
  bmt::Backend backend = bmt::Backend::kAuto;
  at::ScalarType dtype = at::kBFloat16;
  size_t min_nbytes = 1024;
  size_t max_nbytes = 0;  // 0: 256 MiB on GPU, 16 MiB on CPU
  int iters = 20;
  int warmup_iters = 5;
  std::vector<Op> ops{Op::kAllGather, Op::kReduceScatter, Op::kAllReduce};
  std::string json_path;
};

const char* kUsage =
    "usage: bmt-bench-comm [--backend auto|nccl|gloo] [--dtype bf16|fp16|fp32] [--min-bytes N] [--max-bytes N]\n"
    "                      [--iters N] [--warmup N] [--ops all_gather,reduce_scatter,all_reduce] [--json PATH]\n"
    "Sizes take K, M, G suffixes (powers of 1024). Launch with bmtrun: bmtrun --nproc 8 bmt-bench-comm\n";

// "4096", "4K", "4KiB", "256M", "1G".
size_t parse_nbytes(const std::string& option, const std::string& text) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  std::string suffix(end);
  double scale = 1;
  if (suffix == "K" || suffix == "KiB" || suffix == "k") scale = 1024.0;
  else if (suffix == "M" || suffix == "MiB") scale = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "GiB") scale = 1024.0 * 1024 * 1024;
  else if (!suffix.empty() && suffix != "B") value = -1;
  if (text.empty() || end == text.c_str() || value <= 0)
    throw UsageError(option + " expects a positive size in bytes such as 1048576, 64K or 256M, got '" + text + "'");
  return static_cast<size_t>(value * scale);
}

int parse_count(const std::string& option, const std::string& text, int min_value) {
  char* end = nullptr;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || v < min_value)
    throw UsageError(option + " expects an integer >= " + std::to_string(min_value) + ", got '" + text + "'");
  return static_cast<int>(v);
}

at::ScalarType parse_dtype(const std::string& text) {
  if (text == "bf16" || text == "bfloat16") return at::kBFloat16;
  if (text == "fp16" || text == "half" || text == "float16") return at::kHalf;
  if (text == "fp32" || text == "float" || text == "float32") return at::kFloat;
  throw UsageError("--dtype '" + text + "' is not supported: use bf16, fp16 or fp32");
}

std::vector<Op> parse_ops(const std::string& text) {
  std::vector<Op> ops;
  size_t start = 0;
  while (start <= text.size()) {
    size_t comma = text.find(',', start);
    std::string name = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (name == "all_gather") ops.push_back(Op::kAllGather);
    else if (name == "reduce_scatter") ops.push_back(Op::kReduceScatter);
    else if (name == "all_reduce") ops.push_back(Op::kAllReduce);
    else throw UsageError("--ops: unknown operation '" + name + "'; use all_gather, reduce_scatter, all_reduce");
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return ops;
}

BenchOptions parse_options(int argc, char** argv) {
  BenchOptions o;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "-h" || arg == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) throw UsageError("option " + arg + " needs a value (or is unknown); see --help");
    std::string value = argv[++i];
    try {
      if (arg == "--backend") o.backend = bmt::parse_backend(value);
      else if (arg == "--dtype") o.dtype = parse_dtype(value);
      else if (arg == "--min-bytes") o.min_nbytes = parse_nbytes(arg, value);
      else if (arg == "--max-bytes") o.max_nbytes = parse_nbytes(arg, value);
      else if (arg == "--iters") o.iters = parse_count(arg, value, 1);
      else if (arg == "--warmup") o.warmup_iters = parse_count(arg, value, 0);
      else if (arg == "--ops") o.ops = parse_ops(value);
      else if (arg == "--json") o.json_path = value;
      else throw UsageError("unknown option '" + arg + "'; see --help");
    } catch (const bmt::core::Error& e) {  // parse_backend's message
      throw UsageError(e.what());
    }
  }
  if (o.max_nbytes && o.max_nbytes < o.min_nbytes)
    throw UsageError("--max-bytes (" + std::to_string(o.max_nbytes) + ") is below --min-bytes (" +
                     std::to_string(o.min_nbytes) + "); swap them");
  return o;
}

#ifdef BMT_WITH_CUDA
void check_cuda(cudaError_t err, const char* what) {
  BMT_CHECK(err == cudaSuccess, "bmt-bench-comm: ", what, " failed: ", cudaGetErrorString(err));
}
#endif

// Runs and times one collective on preallocated buffers; the stream is the load stream on CUDA.
class CollectiveTimer {
 public:
  CollectiveTimer(bmt::core::Communicator& comm, const at::Tensor& send, const at::Tensor& recv)
      : comm_(comm), send_(send), recv_(recv), dtype_(bmt::to_core_dtype(send.scalar_type())) {
#ifdef BMT_WITH_CUDA
    if (send.is_cuda()) {
      stream_ = c10::cuda::CUDAStream(*bmt::config().load_stream).stream();
      check_cuda(cudaEventCreate(&start_), "cudaEventCreate");
      check_cuda(cudaEventCreate(&stop_), "cudaEventCreate");
    }
#endif
  }
  ~CollectiveTimer() {
#ifdef BMT_WITH_CUDA
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
#endif
  }

  // total_numel: elements of the whole buffer (all_gather's output, reduce_scatter's input).
  void launch(Op op, size_t total_numel) {
    const int n = comm_.size();
    switch (op) {
      case Op::kAllGather:
        comm_.all_gather(send_.data_ptr(), recv_.data_ptr(), total_numel / n, dtype_, stream_);
        break;
      case Op::kReduceScatter:
        comm_.reduce_scatter(send_.data_ptr(), recv_.data_ptr(), total_numel / n, dtype_, ReduceOp::kSum, stream_);
        break;
      case Op::kAllReduce:
        comm_.all_reduce(send_.data_ptr(), recv_.data_ptr(), total_numel, dtype_, ReduceOp::kSum, stream_);
        break;
    }
  }

  // Mean seconds of one call on this rank, after `warmup` untimed calls; ranks start together (barrier).
  double time(Op op, size_t total_numel, int warmup, int iters) {
    for (int i = 0; i < warmup; ++i) launch(op, total_numel);
    comm_.synchronize(stream_);
    comm_.barrier();
#ifdef BMT_WITH_CUDA
    if (stream_) {
      check_cuda(cudaEventRecord(start_, static_cast<cudaStream_t>(stream_)), "cudaEventRecord");
      for (int i = 0; i < iters; ++i) launch(op, total_numel);
      check_cuda(cudaEventRecord(stop_, static_cast<cudaStream_t>(stream_)), "cudaEventRecord");
      comm_.synchronize(stream_);  // polls NCCL errors while waiting, unlike cudaEventSynchronize
      float elapsed_ms = 0;
      check_cuda(cudaEventElapsedTime(&elapsed_ms, start_, stop_), "cudaEventElapsedTime");
      return elapsed_ms / 1e3 / iters;
    }
#endif
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) launch(op, total_numel);
    comm_.synchronize(stream_);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  }

 private:
  bmt::core::Communicator& comm_;
  at::Tensor send_, recv_;
  bmt::core::DType dtype_;
  bmt::core::StreamHandle stream_ = nullptr;
#ifdef BMT_WITH_CUDA
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
#endif
};

// The buffers hold ones, so every result is known: catches a communicator that is fast because it is wrong.
void check_result(Op op, const at::Tensor& recv, size_t total_numel, int world) {
  size_t out_numel = op == Op::kReduceScatter ? total_numel / world : total_numel;
  double expected = op == Op::kAllGather ? 1.0 : world;
  at::Tensor ends = at::stack({recv[0], recv[static_cast<int64_t>(out_numel) - 1]}).to(at::kCPU).to(at::kDouble);
  for (int i = 0; i < 2; ++i)
    BMT_CHECK(ends[i].item<double>() == expected, op_name(op), " of ", total_numel, " elements returned ",
              ends[i].item<double>(), " instead of ", expected, " on rank ", bmt::rank(),
              ": the communicator computes wrong results");
}

double slowest_rank(double seconds) {
  const auto& cfg = bmt::config();
  at::Tensor t = at::full({1}, seconds, at::TensorOptions().dtype(at::kDouble).device(cfg.device));
  return bmt::distributed::all_reduce(t, ReduceOp::kMax, *cfg.comm).item<double>();
}

int run(const BenchOptions& opts) {
  bmt::InitOptions init;
  init.backend = opts.backend;
  bmt::init_distributed(init);
  const auto& cfg = bmt::config();
  const int world = cfg.world_size;
  const bool on_gpu = cfg.device.is_cuda();
  const size_t max_nbytes = opts.max_nbytes ? opts.max_nbytes : (on_gpu ? 256u << 20 : 16u << 20);
  const size_t elem_nbytes = at::elementSize(opts.dtype);
  const char* dtype_name = bmt::core::dtype_name(bmt::to_core_dtype(opts.dtype));
  BMT_CHECK(opts.min_nbytes <= max_nbytes, "--min-bytes (", opts.min_nbytes, ") is above the maximum size (",
            max_nbytes, "); lower it or pass --max-bytes");

  std::ofstream json;
  if (cfg.rank == 0 && !opts.json_path.empty()) {
    json.open(opts.json_path);
    BMT_CHECK(json.good(), "cannot write --json '", opts.json_path, "': ", std::strerror(errno),
              "; check that the directory exists and is writable");
  }

  // One pair of buffers for the largest size; smaller sizes use their prefix.
  const int64_t max_numel = static_cast<int64_t>(max_nbytes / elem_nbytes);
  auto options = at::TensorOptions().dtype(opts.dtype).device(cfg.device);
  at::Tensor send = at::ones({std::max<int64_t>(max_numel, world)}, options);
  at::Tensor recv = at::ones({std::max<int64_t>(max_numel, world)}, options);
#ifdef BMT_WITH_CUDA
  if (on_gpu) c10::cuda::device_synchronize();  // the buffers were filled on another stream than load_stream
#endif
  CollectiveTimer timer(*cfg.comm, send, recv);

  if (cfg.rank == 0) {
    std::printf("# bmt-bench-comm: world %d, backend %s, device %s, dtype %s, %d iterations after %d warm-up; "
                "time = slowest rank's mean\n",
                world, cfg.comm->backend_name(), cfg.device.str().c_str(), dtype_name, opts.iters,
                opts.warmup_iters);
    std::printf("# %-14s %12s %12s %12s %12s\n", "op", "size (B)", "time (us)", "algbw (GB/s)", "busbw (GB/s)");
    std::fflush(stdout);
  }
  for (Op op : opts.ops) {
    for (size_t nbytes = opts.min_nbytes; nbytes <= max_nbytes; nbytes *= 2) {
      // all_gather / reduce_scatter split the buffer evenly among the ranks: round down to a multiple of n.
      size_t total_numel = nbytes / elem_nbytes;
      if (op != Op::kAllReduce) total_numel = total_numel / world * world;
      if (total_numel == 0) continue;
      const size_t total_nbytes = total_numel * elem_nbytes;
      double seconds = slowest_rank(timer.time(op, total_numel, opts.warmup_iters, opts.iters));
      check_result(op, recv, total_numel, world);
      if (cfg.rank != 0) continue;
      double algbw_gbps = total_nbytes / seconds / 1e9;
      double busbw_gbps = algbw_gbps * busbw_factor(op, world);
      std::printf("  %-14s %12zu %12.2f %12.3f %12.3f\n", op_name(op), total_nbytes, seconds * 1e6, algbw_gbps,
                  busbw_gbps);
      std::fflush(stdout);
      if (json.is_open()) {
        json << "{\"op\":\"" << op_name(op) << "\",\"nbytes\":" << total_nbytes << ",\"numel\":" << total_numel
             << ",\"dtype\":\"" << dtype_name << "\",\"world_size\":" << world << ",\"backend\":\""
             << cfg.comm->backend_name() << "\",\"device\":\"" << cfg.device.str() << "\",\"iters\":" << opts.iters
             << ",\"time_us\":" << seconds * 1e6 << ",\"algbw_gbps\":" << algbw_gbps
             << ",\"busbw_gbps\":" << busbw_gbps << "}\n";
        json.flush();
      }
    }
  }
  bmt::finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  BenchOptions opts;
  try {
    opts = parse_options(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "bmt-bench-comm: error: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    return run(opts);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bmt-bench-comm: %s\n", e.what());
    return 1;
  }
}
