// bmt-bench-ckpt: checkpoint save/load throughput of a preset model with populated Adam state, on every rank.
//
//   bmt-bench-ckpt [--preset gpt-1.3b|gpt2-124m|llama-7b|tiny] [--seq T] [--batch B] [--dir DIR] [--keep]
//                  [--repeat N (3)] [--warmup W (2)] [--steps S (5)] [--async-max-steps M (200)]
//                  [--ops safetensors,pt,sharded,async] [--drop-cache] [--json PATH] [--seed S]
//                  [--disk-gib G (0)] [--profile]
//   N ranks: build/tools/bmtrun --nproc N build/bench/bmt-bench-ckpt ... (any launcher init_distributed reads)
//
// Model: examples/models (GPT-2; Llama for llama-*) with vocabulary 50304, every layer a ZeRO-3 Block, bf16
// parameters on GPUs and fp32 on CPUs (BMT_BENCH_DTYPE=bf16|fp32 overrides), AdamOptimizer (fp32 moments, fp32
// master for bf16) under an OptimManager. W training steps on random tokens run first (so every parameter has
// optimizer state), then S timed steps give the baseline step time step_s (median).
//
// Measured (each op N times; `seconds` = the median (lower one for even N) over the repeats of the slowest rank's
// time, seconds_min = the best; per-rank figures are those of the median repeat):
//  save_safetensors / save_pt, load_safetensors / load_pt: bmt::save / bmt::load of one consolidated file (rank 0
//    writes/reads it, the other ranks send/receive their shards). bytes = the file's size on disk;
//    gb_per_s = bytes / seconds / 1e9; per rank: bytes / that rank's seconds.
//  save_sharded / load_sharded: bmt::checkpoint::save/load of model + optimizer (OptimManager) + step + RNG.
//    Per rank: bytes = this rank's shard file (rank-XXXXX.bin; for the load this is what the rank reads at an
//    unchanged world size, rounded to 1 MiB checksum blocks), gb_per_s = bytes / rank seconds; aggregate:
//    bytes = all shard files, gb_per_s = bytes / seconds (slowest rank). Included: staging every byte through host
//    memory (device → pinned host with CUDA; the optimizer state is read live, without a state-dict copy), and the
//    CRC-32 of every byte (save and load).
//  save_async: bmt::checkpoint::save(..., async) issued between two training steps, training continuing.
//    stall_s = time from calling save until it returns (planning + host snapshot); issue_step_s = stall + the step
//    that follows it; then steps run while any rank's background write is pending (at most M; agreed by an
//    all-reduce after each step, not timed): overlap_step_s = their mean, slowdown = overlap_step_s / step_s.
//    seconds = commit_s = save call -> checkpoint committed (rank 0's SaveStats::total_s); bytes = all shard files;
//    gb_per_s = bytes / commit_s; write_s = rank 0's write + fsync of its shard. Before the first async save the
//    bench calls prepare_async_save and trains until every rank's buffers are ready (prepare_call_s, prepare_ready_s,
//    prepare_steps); first_stall_s is the first save's stall (printed on its own line: it used to pin the whole
//    shard file inside the call).
// Timing: device synchronised and all ranks at a barrier before each op; each rank's clock stops after the op
// returned and the device is synchronised. Writes are durable: the library fsyncs files and directories before
// save returns (commit) and that is inside the timing. Reads are NOT cold unless --drop-cache: the files were
// just written, so the page cache may serve loads at memory speed. --drop-cache calls
// posix_fadvise(POSIX_FADV_DONTNEED) on every file of the checkpoint (all ranks) before each load; it drops
// clean cached pages on this host only (not a remote filesystem's server cache). storage_read_bytes (per rank,
// /proc/self/io read_bytes, null when unavailable) shows how much a load really read from storage.
// Verification (exits 4 on a mismatch): before saving, up to 64 evenly spaced elements of every parameter's local
// shard (sharded/async: also exp_avg, exp_avg_sq, master and the step count of its Adam state) are recorded; the
// live values are zeroed before each load and compared bit-exactly after it. The last async checkpoint is
// loaded and checked against the values recorded when it was issued.
// --json PATH (rank 0) appends one line per op: bench "checkpoint", config, framework "bmt", world, op, seconds,
// gb_per_s, bytes, stall_s (async, else null), step_s (baseline), git_commit, machine, date, plus details
// (per_rank, seconds_min, samples, verified, drop_cache, preset, seq, batch, params, device, dtype, ...).
// DIR defaults to a fresh /tmp/bmt-bench-ckpt-XXXXXX (needs a filesystem every rank sees), removed at the end
// unless --keep (left behind after a failure); only one repeat's files per op exist at a time (--keep: the last).
// The disk's own figures (--disk-gib G > 0, rank 0, before the ops, in DIR): `dd if=/dev/zero bs=64M` of G GiB with
//   conv=fsync (dd_write_fsync) and with oflag=direct + fsync (dd_write_direct), then `dd of=/dev/null bs=64M` of
//   that file warm (dd_read_warm, just written) and cold (dd_read_cold: only with --drop-cache); timed by wall
//   clock around the command; the file is deleted after. The table then gives our figures as a ratio of dd's.
// --drop-cache: as root also `sync; echo 3 > /proc/sys/vm/drop_caches` (else posix_fadvise only); the sharded
//   load is then measured twice per repeat: warm (load_sharded, the files just written) and cold
//   (load_sharded_cold).
// --profile: per-stage times of the saves (planning + collectives, snapshot, waiting for staged bytes = device
//   → host copies, write syscalls, waiting for the checksum workers, fsync, commit) and the loads (check = the
//   small entries; apply = the model's tensors, then the optimizer state, each read into place: bytes, seconds
//   and GB/s of each part), printed and in the JSON lines; the table then lists each part's rate (rank 0, median)
//   beside dd's warm or cold read.
// Exit codes: 0 ok, 1 error, 2 bad arguments, 4 a load returned different values.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_env.h"
#include "bmt/checkpoint/checkpoint.h"
#include "bmt/checkpoint/file_io.h"
#include "bmt/checkpoint/slice_plan.h"
#include "bmt/runtime/distributed.h"
#include "bmt/runtime/init.h"
#include "bmt/optim/adam.h"
#include "bmt/optim/optim_manager.h"
#include "bmt/params/parameter.h"
#include "models/language_model.h"
#include "models/presets.h"

namespace {

namespace ckio = bmt::checkpoint;  // file_io.h's POSIX helpers: std::filesystem::remove_all resolves to the copy
                                   // exported by torch's libtorch.so, which crashes
using bench::json_num;
using bench::json_str;
constexpr int64_t kVocab = 50304;

// Rank 0's string on every rank (its length, then its bytes, through the public collectives).
std::string broadcast_from_rank0(const std::string& mine) {
  const bmt::Config& cfg = bmt::config();
  auto on_device = at::TensorOptions().device(cfg.device);
  at::Tensor n = at::tensor({static_cast<int64_t>(mine.size())}, at::kLong).to(cfg.device);
  n = bmt::distributed::raw_broadcast(n, 0, *cfg.comm);
  const int64_t len = n.to(at::kCPU).item<int64_t>();
  at::Tensor bytes = at::zeros({len}, on_device.dtype(at::kByte));
  if (cfg.rank == 0 && len > 0)
    bytes.copy_(at::from_blob(const_cast<char*>(mine.data()), {len}, at::TensorOptions().dtype(at::kByte)));
  bytes = bmt::distributed::raw_broadcast(bytes, 0, *cfg.comm).to(at::kCPU).contiguous();
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(len));
}

struct Args {
  std::string preset = "gpt-1.3b", dir, json_path, ops = "safetensors,pt,sharded,async";
  std::string first_save = "prepare";  // how the first async save gets its buffers: prepare | device | host
  int64_t seq = 0, batch = 0, repeat = 3, warmup = 2, steps = 5, async_max_steps = 200, seed = 1234, disk_gib = 0;
  bool keep = false, drop_cache = false, profile = false;
};

const char* kUsage =
    "usage: bmt-bench-ckpt [--preset gpt-1.3b|gpt2-124m|llama-7b|tiny] [--seq T] [--batch B] [--dir DIR] [--keep]\n"
    "                      [--repeat N (3)] [--warmup W (2)] [--steps S (5)] [--async-max-steps M (200)]\n"
    "                      [--ops safetensors,pt,sharded,async] [--drop-cache] [--json PATH] [--seed S]\n"
    "                      [--disk-gib G (0)] [--profile] [--first-save prepare|device|host]\n"
    "  --first-save: the first async save's buffers: pinned ahead by prepare_async_save (default), or none\n"
    "                prepared: the state copied to device memory (device) or pinned inside the call (host)\n";

Args parse_args(int argc, char** argv) {
  Args a;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  const std::map<std::string, int64_t*> ints = {{"--seq", &a.seq},       {"--batch", &a.batch},
                                                 {"--repeat", &a.repeat}, {"--warmup", &a.warmup},
                                                 {"--steps", &a.steps},   {"--async-max-steps", &a.async_max_steps},
                                                 {"--seed", &a.seed},     {"--disk-gib", &a.disk_gib}};
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (auto it = ints.find(f); it != ints.end()) {
      const std::string v = need(i);
      size_t pos = 0;
      try {
        *it->second = std::stoll(v, &pos);
      } catch (const std::exception&) {
        pos = std::string::npos;
      }
      if (pos != v.size()) throw std::invalid_argument(f + ": not an integer: '" + v + "'");
    } else if (f == "--preset") a.preset = need(i);
    else if (f == "--dir") a.dir = need(i);
    else if (f == "--json") a.json_path = need(i);
    else if (f == "--ops") a.ops = need(i);
    else if (f == "--first-save") a.first_save = need(i);
    else if (f == "--keep") a.keep = true;
    else if (f == "--drop-cache") a.drop_cache = true;
    else if (f == "--profile") a.profile = true;
    else if (f == "--help" || f == "-h") std::printf("%s", kUsage), std::exit(0);
    else throw std::invalid_argument("unknown argument '" + f + "'");
  }
  if (a.repeat < 1 || a.warmup < 1 || a.steps < 1 || a.async_max_steps < 0 || a.seq < 0 || a.batch < 0 ||
      a.disk_gib < 0)
    throw std::invalid_argument("--repeat, --warmup, --steps must be >= 1, --seq, --batch, --async-max-steps, "
                                "--disk-gib >= 0");
  if (a.first_save != "prepare" && a.first_save != "device" && a.first_save != "host")
    throw std::invalid_argument("--first-save: '" + a.first_save + "' is not prepare, device or host");
  std::stringstream ss(a.ops);
  for (std::string op; std::getline(ss, op, ',');)
    if (op != "safetensors" && op != "pt" && op != "sharded" && op != "async")
      throw std::invalid_argument("--ops: unknown op '" + op + "' (safetensors, pt, sharded, async)");
  return a;
}

bool has_op(const Args& a, const std::string& op) { return ("," + a.ops + ",").find("," + op + ",") != a.ops.npos; }
double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? NAN : v[(v.size() - 1) / 2];  // the lower median: N = 2 gives the best
}
double max_of(const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); }
double storage_read_bytes() { return bench::proc_value("/proc/self/io", "read_bytes:"); }
double file_nbytes(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 ? static_cast<double>(st.st_size) : NAN;
}

// Drops the clean cached pages of `path` (a file, or the files of a directory) from this host's page cache; as
// root, the whole page cache too.
void drop_cache(const std::string& path) {
  if (::geteuid() == 0) {
    ::sync();
    std::ofstream("/proc/sys/vm/drop_caches") << "3\n";
  }
  std::vector<std::string> files{path};
  if (ckio::is_directory(path)) {
    files.clear();
    for (const std::string& n : ckio::list_directory(path)) files.push_back(ckio::join_path(path, n));
  }
  for (const auto& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw std::runtime_error("--drop-cache: cannot open " + f);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

struct Failure : std::runtime_error {
  int code;
  Failure(const std::string& what, int c) : std::runtime_error(what), code(c) {}
};

// The value of every rank, on every rank.
std::vector<double> gather(double v) {
  const auto& cfg = bmt::config();
  at::Tensor t = at::full({1}, v, at::TensorOptions().dtype(at::kDouble).device(cfg.device));
  at::Tensor all = bmt::distributed::all_gather(t, *cfg.comm).cpu().reshape({-1});
  return std::vector<double>(all.data_ptr<double>(), all.data_ptr<double>() + all.numel());
}

struct Timed {  // one rank's figures for one run of an op
  double seconds, bytes, storage_read;
};
using Ranks = std::vector<Timed>;

struct Bench {
  Args a;
  int64_t B = 0, T = 0, num_params = 0, steps_done = 0;
  int rank = 0, world = 1;
  bool cuda = false, own_dir = false;
  std::string dtype_name, config, dir;
  double step_s = NAN;
  std::shared_ptr<examples::LanguageModel> model;
  std::vector<at::Tensor> params, batches;
  std::shared_ptr<bmt::optim::AdamOptimizer> optimizer;
  std::shared_ptr<bmt::optim::OptimManager> manager;
  std::vector<std::string> table_rows;
  std::map<std::string, double> ours_gb_per_s;
  std::string result;  // the RESULT line

  void sync() { if (cuda) torch::cuda::synchronize(); }
  void barrier() { sync(), bmt::synchronize(); }
  void step() {
    const at::Tensor& tokens = batches[static_cast<size_t>(steps_done++ % 2)];
    at::Tensor loss = examples::lm_loss(model->forward(tokens.narrow(1, 0, T)), tokens.narrow(1, 1, T));
    manager->backward(loss);
    manager->step();
    manager->zero_grad();
  }

  // The tensors verified: every parameter's local shard, with_state: and its Adam state (the step as a copy).
  std::vector<at::Tensor> probed(bool with_state) const {
    std::vector<at::Tensor> ts;
    for (const auto& p : params) {
      ts.push_back(p);
      if (!with_state) continue;
      const bmt::optim::AdamState* s = optimizer->find_state(p);
      if (!s) throw std::runtime_error("a parameter has no Adam state after the warm-up steps");
      ts.insert(ts.end(), {s->exp_avg, s->exp_avg_sq, at::full({1}, static_cast<double>(s->step), at::kDouble)});
      if (s->master.defined()) ts.push_back(s->master);
    }
    return ts;
  }
  // Up to 64 evenly spaced elements of each, as one float64 CPU tensor (exact for fp32/bf16/int).
  at::Tensor probe(bool with_state) const {
    at::NoGradGuard ng;
    std::vector<at::Tensor> parts{at::zeros({0}, at::kDouble)};
    for (const at::Tensor& t : probed(with_state)) {
      const int64_t n = t.numel();
      if (n == 0) continue;
      at::Tensor idx = at::linspace(0, static_cast<double>(n - 1), std::min<int64_t>(n, 64),
                                    at::TensorOptions().dtype(at::kDouble).device(t.device())).to(at::kLong);
      parts.push_back(t.reshape({-1}).index_select(0, idx).to(at::kDouble).cpu());
    }
    return at::cat(parts);
  }
  void scramble(bool with_state) {  // so that a load that writes nothing cannot pass
    at::NoGradGuard ng;
    for (at::Tensor t : probed(with_state)) t.zero_();
    sync();
  }
  void verify(const at::Tensor& expected, bool with_state, const std::string& op) {
    at::Tensor got = probe(with_state);
    const int64_t bad = got.sizes() == expected.sizes() ? (got != expected).sum().item<int64_t>() : got.numel();
    double total = 0;
    for (double b : gather(static_cast<double>(bad))) total += b;
    if (total > 0)
      throw Failure(op + ": VERIFICATION FAILED: " + json_num(total) + " sampled values differ after the load (" +
                        std::to_string(bad) + " of " + std::to_string(expected.numel()) + " on rank " +
                        std::to_string(rank) + ")", 4);
  }

  void setup() {
    bmt::InitOptions init;
    init.seed = static_cast<uint64_t>(a.seed);
    init.quiet = true;
    bmt::init_distributed(init);
    const auto& cfg = bmt::config();
    rank = cfg.rank;
    world = cfg.world_size;
    cuda = cfg.device.is_cuda();
    const examples::Preset& p = examples::find_preset(a.preset);  // throws listing the known names
    examples::ModelConfig shape = p.model;
    shape.arch = a.preset.rfind("llama", 0) == 0 ? "llama" : "gpt";
    shape.vocab_size = kVocab;
    if (a.seq > 0) shape.max_seq_len = a.seq;
    shape.validate();
    T = shape.max_seq_len;
    B = a.batch > 0 ? a.batch : p.train.batch_per_rank;
    at::ScalarType dtype = examples::default_param_dtype();
    if (const char* d = std::getenv("BMT_BENCH_DTYPE")) dtype = std::string(d) == "bf16" ? at::kBFloat16 : at::kFloat;
    dtype_name = dtype == at::kBFloat16 ? "bf16" : "fp32";
    model = examples::make_model(shape, {3, false}, dtype);
    at::manual_seed(static_cast<uint64_t>(a.seed));
    bmt::init_parameters(*model);
    for (const auto& item : model->named_parameters()) num_params += bmt::meta_of(item.value()).full_numel;
    for (const auto& q : model->parameters()) params.push_back(q);
    optimizer = std::make_shared<bmt::optim::AdamOptimizer>(
        params, bmt::optim::AdamOptions(3e-4, {0.9, 0.95}, 1e-8, 0.1).decoupled_weight_decay(true));
    manager = std::make_shared<bmt::optim::OptimManager>();
    manager->add_optimizer(optimizer);
    at::manual_seed(static_cast<uint64_t>(a.seed) + 1);
    for (int i = 0; i < 2; ++i)
      batches.push_back(at::randint(kVocab, {B, T + 1}, at::TensorOptions().dtype(at::kLong).device(cfg.device)));
    config = a.preset + " seq" + std::to_string(T) + " batch" + std::to_string(B);
    std::string d = a.dir;  // rank 0 picks the directory, every rank uses it
    if (rank == 0 && d.empty()) {
      char tmpl[] = "/tmp/bmt-bench-ckpt-XXXXXX";
      if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
      d = tmpl;
      own_dir = true;
    } else if (rank == 0 && !ckio::path_exists(d)) {
      ckio::make_directory(d);
    }
    dir = broadcast_from_rank0(d);
    if (rank == 0)
      std::printf("bench_ckpt: %s | %s on %s x%d | %.1fM params, %s + fp32 Adam state | dir %s\n", config.c_str(),
                  shape.describe().c_str(), cfg.device.str().c_str(), world, static_cast<double>(num_params) / 1e6,
                  dtype_name.c_str(), dir.c_str());
    for (int64_t i = 0; i < a.warmup; ++i) step();
    barrier();
    std::vector<double> ts;
    for (int64_t i = 0; i < a.steps; ++i) {
      const double t0 = now_s();
      step();
      sync();
      ts.push_back(now_s() - t0);
    }
    step_s = max_of(gather(median(ts)));
    if (rank == 0)
      std::printf("bench_ckpt: baseline step %.4f s (median of %ld after %ld warm-up)\n", step_s,
                  static_cast<long>(a.steps), static_cast<long>(a.warmup));
  }

  void remove(const std::string& path) {
    barrier();
    if (rank == 0) ckio::remove_tree(path);
    barrier();
  }
  // Runs fn (returns this rank's bytes) timed on every rank; every rank's figures.
  Ranks timed(const std::function<double()>& fn) {
    barrier();
    const double io0 = storage_read_bytes(), t0 = now_s();
    const double bytes = fn();
    sync();
    const double s = now_s() - t0, io1 = storage_read_bytes();
    return all_ranks({s, bytes, io0 >= 0 && io1 >= 0 ? io1 - io0 : NAN});
  }
  Ranks all_ranks(const Timed& t) {
    const auto s = gather(t.seconds), b = gather(t.bytes), io = gather(t.storage_read);
    Ranks v;
    for (size_t r = 0; r < s.size(); ++r) v.push_back({s[r], b[r], io[r]});
    return v;
  }

  // One table row and one JSON line for an op from its repeats; total_bytes: the op's bytes.
  void report(const std::string& op, const std::vector<Ranks>& reps, double total_bytes, double stall = NAN,
              const std::string& extra_json = "") {
    std::vector<double> walls;
    auto slower = [](const Timed& x, const Timed& y) { return x.seconds < y.seconds; };
    for (const Ranks& r : reps) walls.push_back(std::max_element(r.begin(), r.end(), slower)->seconds);
    const double med = median(walls), best = *std::min_element(walls.begin(), walls.end());
    const Ranks& at_med = reps[static_cast<size_t>(std::find(walls.begin(), walls.end(), med) - walls.begin())];
    std::ostringstream pr, rg, samples;
    for (size_t r = 0; r < at_med.size(); ++r) {
      const Timed& t = at_med[r];
      pr << (r ? "," : "") << "{\"rank\":" << r << ",\"seconds\":" << json_num(t.seconds) << ",\"bytes\":"
         << json_num(t.bytes, 15) << ",\"gb_per_s\":" << json_num(t.bytes / t.seconds / 1e9)
         << ",\"storage_read_bytes\":" << json_num(t.storage_read, 15) << "}";
      rg << (r ? " " : "") << json_num(t.bytes / t.seconds / 1e9, 3);
    }
    for (size_t i = 0; i < walls.size(); ++i) samples << (i ? "," : "") << json_num(walls[i]);
    char row[256];
    std::snprintf(row, sizeof row, "%-17s %9.4f %9.4f %9.4f %8.3f %8s  %s", op.c_str(), med, best, total_bytes / 1e9,
                  total_bytes / med / 1e9, std::isfinite(stall) ? json_num(stall, 4).c_str() : "-", rg.str().c_str());
    table_rows.push_back(row);
    result += op + "=" + json_num(total_bytes / med / 1e9, 3) + "GB/s";
    ours_gb_per_s[op] = total_bytes / med / 1e9;
    result += std::isfinite(stall) ? ",stall=" + json_num(stall, 3) + "s " : " ";
    if (rank != 0 || a.json_path.empty()) return;
    std::ostringstream j;
    j << "{\"bench\":\"checkpoint\",\"config\":" << json_str(config) << ",\"framework\":\"bmt\",\"world\":" << world
      << ",\"op\":" << json_str(op) << ",\"seconds\":" << json_num(med) << ",\"gb_per_s\":"
      << json_num(total_bytes / med / 1e9) << ",\"bytes\":" << json_num(total_bytes, 15) << ",\"stall_s\":"
      << json_num(stall) << ",\"step_s\":" << json_num(step_s) << ",\"git_commit\":" << json_str(bench::git_commit())
      << ",\"machine\":" << json_str(bench::machine_name()) << ",\"date\":" << json_str(bench::utc_now())
      << ",\"seconds_min\":" << json_num(best) << ",\"samples\":[" << samples.str() << "],\"per_rank\":[" << pr.str()
      << "],\"verified\":true,\"drop_cache\":" << (a.drop_cache ? "true" : "false") << ",\"preset\":"
      << json_str(a.preset) << ",\"seq\":" << T << ",\"batch\":" << B << ",\"params\":" << num_params
      << ",\"device\":" << json_str(bmt::config().device.str()) << ",\"dtype\":" << json_str(dtype_name)
      << ",\"dir\":" << json_str(dir) << extra_json << "}";
    std::ofstream out(a.json_path, std::ios::app);
    if (!out) throw std::runtime_error("cannot open --json file " + a.json_path);
    out << j.str() << "\n";
  }
  void maybe_drop(const std::string& path) { if (a.drop_cache) drop_cache(path); }
  bmt::checkpoint::TrainingState training_state() {
    bmt::checkpoint::TrainingState st;
    st.model = model.get();
    st.add("optim", *manager);
    st.step = steps_done;
    return st;
  }

  void consolidated(const std::string& ext) {
    const at::Tensor expected = probe(false);
    std::vector<Ranks> saves, loads;
    double nbytes = 0;
    for (int64_t r = 0; r < a.repeat; ++r) {
      const std::string path = dir + "/model-" + std::to_string(r) + "." + ext;
      saves.push_back(timed([&] {
        bmt::save(*model, path);
        return 0.0;
      }));
      nbytes = gather(rank == 0 ? file_nbytes(path) : 0.0)[0];  // the file is rank 0's
      for (Timed& t : saves.back()) t.bytes = nbytes;
      maybe_drop(path);
      scramble(false);
      loads.push_back(timed([&] {
        bmt::load(*model, path);
        return nbytes;
      }));
      verify(expected, false, "load_" + ext);
      if (r + 1 < a.repeat || !a.keep) remove(path);
    }
    report("save_" + ext, saves, nbytes);
    report("load_" + ext, loads, nbytes);
  }

  // The profile of a save as JSON fields and a printed line (rank 0's figures).
  std::string save_profile(const std::string& op, const bmt::checkpoint::SaveStats& s) {
    const double commit = s.total_s - s.stall_s;
    std::ostringstream j;
    j << ",\"profile\":{\"plan_s\":" << json_num(s.plan_s) << ",\"snapshot_s\":" << json_num(s.snapshot_s)
      << ",\"wait_data_s\":" << json_num(s.wait_data_s) << ",\"write_syscalls_s\":" << json_num(s.write_syscalls_s)
      << ",\"crc_wait_s\":" << json_num(s.crc_wait_s) << ",\"fsync_s\":" << json_num(s.fsync_s)
      << ",\"write_s\":" << json_num(s.write_s) << ",\"total_s\":" << json_num(s.total_s) << "}";
    if (a.profile && rank == 0)
      std::printf("bench_ckpt: profile %s (rank 0): plan+collectives %.3f s, snapshot %.3f s | shard write %.3f s = "
                  "waiting for staged bytes (D2H/memcpy) %.3f + write syscalls %.3f + waiting for CRC %.3f + fsync "
                  "%.3f | after the write (markers, metadata, commit) %.3f s | total %.3f s\n", op.c_str(), s.plan_s,
                  s.snapshot_s, s.write_s, s.wait_data_s, s.write_syscalls_s, s.crc_wait_s, s.fsync_s,
                  std::max(0.0, commit - s.write_s), s.total_s);
    return a.profile ? j.str() : "";
  }
  // Rank 0's read rate of each part of a load ("<op>.model", "<op>.state"), one value per repeat.
  std::map<std::string, std::vector<double>> part_gb_per_s;
  std::string load_profile(const std::string& op, const bmt::checkpoint::LoadInfo& info, double seconds) {
    const double model_gb = static_cast<double>(info.model_bytes_read) / 1e9;
    const double state_gb = static_cast<double>(info.state_bytes_read) / 1e9;
    if (info.model_s > 0) part_gb_per_s[op + ".model"].push_back(model_gb / info.model_s);
    if (info.state_s > 0) part_gb_per_s[op + ".state"].push_back(state_gb / info.state_s);
    std::ostringstream j;
    j << ",\"profile\":{\"check_s\":" << json_num(info.check_s) << ",\"apply_s\":" << json_num(info.apply_s)
      << ",\"model_s\":" << json_num(info.model_s) << ",\"state_s\":" << json_num(info.state_s)
      << ",\"bytes_read\":" << info.bytes_read << ",\"model_bytes_read\":" << info.model_bytes_read
      << ",\"state_bytes_read\":" << info.state_bytes_read << "}";
    if (a.profile && rank == 0)
      std::printf("bench_ckpt: profile %s (rank 0): %.3f s = check (small entries) %.3f s + apply %.3f s: model %.3f "
                  "GB in %.3f s (%.2f GB/s), optimizer state %.3f GB in %.3f s (%.2f GB/s); %.3f GB read from shard "
                  "files\n", op.c_str(), seconds, info.check_s, info.apply_s, model_gb, info.model_s,
                  info.model_s > 0 ? model_gb / info.model_s : 0.0, state_gb, info.state_s,
                  info.state_s > 0 ? state_gb / info.state_s : 0.0, static_cast<double>(info.bytes_read) / 1e9);
    return a.profile ? j.str() : "";
  }

  void sharded() {
    const at::Tensor expected = probe(true);
    std::vector<Ranks> saves, loads, cold_loads;
    double total = 0;
    std::string save_prof, load_prof, cold_prof;
    for (int64_t r = 0; r < a.repeat; ++r) {
      const std::string d = dir + "/sharded-" + std::to_string(r);
      bmt::checkpoint::TrainingState st = training_state();
      bmt::checkpoint::SaveStats stats;
      saves.push_back(timed([&] {
        stats = bmt::checkpoint::save(d, st).wait();
        total = static_cast<double>(stats.total_nbytes);
        return static_cast<double>(stats.rank_nbytes);
      }));
      save_prof = save_profile("save_sharded", stats);
      for (const bool cold : {false, true}) {
        if (cold && !a.drop_cache) break;
        if (cold) drop_cache(d);
        scramble(true);
        bmt::checkpoint::LoadInfo info;
        const Ranks t = timed([&] {
          info = bmt::checkpoint::load(d, st);
          return file_nbytes(ckio::join_path(info.path, bmt::checkpoint::shard_file_name(rank)));
        });
        (cold ? cold_loads : loads).push_back(t);
        (cold ? cold_prof : load_prof) = load_profile(cold ? "load_sharded_cold" : "load_sharded", info, t[0].seconds);
        verify(expected, true, cold ? "load_sharded_cold" : "load_sharded");
        if (info.step != steps_done)
          throw Failure("load_sharded: step " + std::to_string(info.step) + ", saved " + std::to_string(steps_done), 4);
      }
      if (r + 1 < a.repeat || !a.keep) remove(d);
    }
    report("save_sharded", saves, total, NAN, save_prof);
    report("load_sharded", loads, total, NAN, load_prof);
    if (!cold_loads.empty()) report("load_sharded_cold", cold_loads, total, NAN, cold_prof);
  }

  // The disk's own rates on rank 0 (see the header); every rank waits.
  std::map<std::string, double> dd_gb_per_s;
  void disk() {
    barrier();
    if (rank == 0) {
      const std::string f = dir + "/dd.bin";
      const int64_t count = a.disk_gib * 16;  // 64 MiB blocks
      const double nbytes = static_cast<double>(count) * (64 << 20);
      auto run = [&](const std::string& op, const std::string& cmd) {
        const double t0 = now_s();
        const int rc = std::system(cmd.c_str());
        const double sec = now_s() - t0;
        if (rc != 0) {
          std::printf("bench_ckpt: %s failed (exit %d): %s\n", op.c_str(), rc, cmd.c_str());
          return;
        }
        dd_gb_per_s[op] = nbytes / sec / 1e9;
        char row[256];
        std::snprintf(row, sizeof row, "%-17s %9.4f %9s %9.4f %8.3f %8s  (dd, rank 0)", op.c_str(), sec, "-", nbytes / 1e9,
                      nbytes / sec / 1e9, "-");
        table_rows.push_back(row);
        result += op + "=" + json_num(nbytes / sec / 1e9, 3) + "GB/s ";
        if (a.json_path.empty()) return;
        std::ofstream out(a.json_path, std::ios::app);
        out << "{\"bench\":\"checkpoint\",\"config\":" << json_str(config) << ",\"framework\":\"dd\",\"world\":" << world
            << ",\"op\":" << json_str(op) << ",\"seconds\":" << json_num(sec) << ",\"gb_per_s\":"
            << json_num(nbytes / sec / 1e9) << ",\"bytes\":" << json_num(nbytes, 15) << ",\"stall_s\":null"
            << ",\"git_commit\":" << json_str(bench::git_commit()) << ",\"machine\":" << json_str(bench::machine_name())
            << ",\"date\":" << json_str(bench::utc_now()) << ",\"command\":" << json_str(cmd) << ",\"drop_cache\":"
            << (a.drop_cache ? "true" : "false") << ",\"root\":" << (::geteuid() == 0 ? "true" : "false")
            << ",\"dir\":" << json_str(dir) << "}\n";
      };
      const std::string n = std::to_string(count);
      // Direct first: it leaves nothing in the page cache; the buffered write then leaves the file cached.
      run("dd_write_direct", "dd if=/dev/zero of=" + f + " bs=64M count=" + n + " oflag=direct conv=fsync status=none");
      ckio::remove_tree(f);
      run("dd_write_fsync", "dd if=/dev/zero of=" + f + " bs=64M count=" + n + " conv=fsync status=none");
      run("dd_read_warm", "dd if=" + f + " of=/dev/null bs=64M status=none");
      if (a.drop_cache) {
        drop_cache(f);
        run("dd_read_cold", "dd if=" + f + " of=/dev/null bs=64M status=none");
      }
      ckio::remove_tree(f);
      std::fflush(stdout);
    }
    barrier();
  }

  void async() {
    std::vector<Ranks> commits;
    std::vector<double> stalls, issues, overlap_s, counts, writes, commit_s;
    double total = 0;
    std::string async_prof;
    const auto& cfg = bmt::config();
    // As a training job does once it knows it will save asynchronously: the first save's host buffers (pinned on
    // GPUs: the whole shard file) are allocated on a background thread while training goes on
    // (prepare_async_save); the first save then finds them ready. Steps run until every rank's are.
    double prepare_call_s = 0, prepare_ready_s = 0;
    int64_t prepare_steps = 0;
    bool first_device_staged = false;
    if (a.first_save == "prepare") {
      bmt::checkpoint::TrainingState st = training_state();
      barrier();
      const double tp = now_s();
      bmt::checkpoint::prepare_async_save(st);
      prepare_call_s = max_of(gather(now_s() - tp));
      while (max_of(gather(bmt::checkpoint::async_save_prepared() ? 0.0 : 1.0)) > 0 && prepare_steps < 10000) {
        step();
        sync();
        ++prepare_steps;
      }
      prepare_ready_s = now_s() - tp;
    }
    for (int64_t r = 0; r < a.repeat; ++r) {
      const std::string d = dir + "/async-" + std::to_string(r);
      const bool last = r + 1 == a.repeat;
      const at::Tensor expected = last ? probe(true) : at::Tensor();  // the state the checkpoint must hold
      bmt::checkpoint::TrainingState st = training_state();
      bmt::checkpoint::SaveOptions opts;
      opts.async = true;
      opts.device_staging = a.first_save != "host";
      barrier();
      const double t0 = now_s();
      bmt::checkpoint::SaveHandle h = bmt::checkpoint::save(d, st, opts);
      const double stall = now_s() - t0;
      step();
      sync();
      const double issue = now_s() - t0;
      std::vector<double> overlap;
      for (;;) {  // steps while any rank's write is pending (rank 0: until the commit)
        at::Tensor pending = at::full({1}, h.done() ? 0.0f : 1.0f, at::TensorOptions().device(cfg.device));
        pending = bmt::distributed::all_reduce(pending, bmt::core::ReduceOp::kMax, *cfg.comm);
        if (pending.item<float>() == 0.0f || static_cast<int64_t>(overlap.size()) >= a.async_max_steps) break;
        const double ts = now_s();
        step();
        sync();
        overlap.push_back(now_s() - ts);
      }
      const bmt::checkpoint::SaveStats s = h.wait();
      if (r == 0) first_device_staged = s.device_staged;
      async_prof = save_profile("save_async", s);
      total = static_cast<double>(s.total_nbytes);
      commits.push_back(all_ranks({s.total_s, static_cast<double>(s.rank_nbytes), NAN}));
      commit_s.push_back(commits.back()[0].seconds);  // rank 0: save call -> commit
      for (Timed& t : commits.back()) t.seconds = commit_s.back();
      stalls.push_back(max_of(gather(stall)));  // the slowest rank holds the others up at the next collective
      issues.push_back(max_of(gather(issue)));
      double sum = 0;
      for (double o : overlap) sum += o;
      overlap_s.push_back(overlap.empty() ? NAN : sum / static_cast<double>(overlap.size()));
      counts.push_back(static_cast<double>(overlap.size()));
      writes.push_back(gather(s.write_s)[0]);
      if (!last) remove(d);
      if (last) {
        bmt::checkpoint::TrainingState ld = training_state();
        maybe_drop(d);
        scramble(true);
        bmt::checkpoint::load(d, ld);
        verify(expected, true, "save_async (reloaded)");
        if (!a.keep) remove(d);
      }
    }
    const double stall = median(stalls), ov = median(overlap_s), n = median(counts);
    std::ostringstream x;
    x << ",\"commit_s\":" << json_num(median(commit_s)) << ",\"issue_step_s\":" << json_num(median(issues))
      << ",\"overlap_steps\":" << json_num(n) << ",\"overlap_step_s\":" << json_num(ov)
      << ",\"slowdown\":" << json_num(ov / step_s) << ",\"write_s\":" << json_num(median(writes))
      << ",\"async_max_steps\":" << a.async_max_steps << ",\"first_stall_s\":" << json_num(stalls.front())
      << ",\"prepare_call_s\":" << json_num(prepare_call_s) << ",\"prepare_ready_s\":" << json_num(prepare_ready_s)
      << ",\"prepare_steps\":" << prepare_steps << ",\"first_save\":\"" << a.first_save
      << "\",\"first_device_staged\":" << (first_device_staged ? "true" : "false") << ",\"stall_samples\":[";
    for (size_t i = 0; i < stalls.size(); ++i) x << (i ? "," : "") << json_num(stalls[i]);
    report("save_async", commits, total, stall, x.str() + "]" + async_prof);
    char buf[96] = "no later step overlapped the write";
    if (n > 0) std::snprintf(buf, sizeof buf, "%.0f steps overlapped the write at %.4f s (%.2fx)", n, ov, ov / step_s);
    if (rank == 0)
      std::printf("bench_ckpt: async: stall %.4f s, issuing step %.4f s (baseline %.4f s), %s, committed after %.3f s "
                  "(rank 0 wrote for %.3f s)%s\n", stall, median(issues), step_s, buf, median(commit_s), median(writes),
                  n >= static_cast<double>(a.async_max_steps) ? " [write outlasted --async-max-steps]" : "");
    if (rank == 0 && a.first_save != "prepare")
      std::printf("bench_ckpt: async: first save stall %.4f s (--first-save %s: no buffers prepared; the snapshot %s)\n",
                  stalls.front(), a.first_save.c_str(),
                  first_device_staged ? "went to device memory" : "pinned its host buffers inside the call");
    else if (rank == 0)
      std::printf("bench_ckpt: async: first save stall %.4f s (its host buffers prepared ahead by prepare_async_save: "
                  "call %.3f s, ready after %.2f s and %ld training steps, %.4f s per step against %.4f s without)\n",
                  stalls.front(), prepare_call_s, prepare_ready_s, static_cast<long>(prepare_steps),
                  prepare_steps > 0 ? (prepare_ready_s - prepare_call_s) / static_cast<double>(prepare_steps) : 0.0,
                  step_s);
  }

  void finish() {
    if (rank == 0) {
      std::printf("\n%-17s %9s %9s %9s %8s %8s  %s\n", "op", "seconds", "best", "GB", "GB/s", "stall_s",
                  "GB/s of rank 0 1 ...");
      for (const std::string& r : table_rows) std::printf("%s\n", r.c_str());
      for (const auto& [ours, theirs] : std::vector<std::pair<std::string, std::string>>{
               {"save_sharded", "dd_write_fsync"}, {"save_safetensors", "dd_write_fsync"},
               {"load_sharded_cold", "dd_read_cold"}, {"load_sharded", "dd_read_warm"}}) {
        auto o = ours_gb_per_s.find(ours);
        auto d = dd_gb_per_s.find(theirs);
        if (o != ours_gb_per_s.end() && d != dd_gb_per_s.end())
          std::printf("%s / %s = %.2f\n", ours.c_str(), theirs.c_str(), o->second / d->second);
      }
      // The two parts of each load on their own (rank 0, median over the repeats).
      for (const auto& [part, rates] : part_gb_per_s) {
        const std::string load_op = part.substr(0, part.find('.'));
        auto d = dd_gb_per_s.find(load_op == "load_sharded_cold" ? "dd_read_cold" : "dd_read_warm");
        const double m = median(rates);
        std::printf("%s: %.3f GB/s (rank 0)", part.c_str(), m);
        if (d != dd_gb_per_s.end()) std::printf(" = %.2fx %s", m / d->second, d->first.c_str());
        std::printf("\n");
      }
      std::printf("(median of %ld, slowest rank; world %d; %s; baseline step %.4f s; rank 0 host peak %.2f GiB)\n",
                  static_cast<long>(a.repeat), world,
                  a.drop_cache ? "page cache dropped before loads" : "loads may be served from the page cache", step_s,
                  bench::proc_value("/proc/self/status", "VmHWM:") / (1 << 20));
      std::printf("RESULT config=\"%s\" world=%d %s\n", config.c_str(), world, result.c_str());  // run_gpu_bench.sh
    }
    barrier();
    if (rank == 0 && own_dir && !a.keep) ckio::remove_tree(dir);
    if (rank == 0 && !a.json_path.empty()) std::printf("bench_ckpt: appended to %s\n", a.json_path.c_str());
    std::fflush(stdout);
    bmt::finalize();
  }
};

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  try {
    b.a = parse_args(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bmt-bench-ckpt: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    b.setup();
    if (b.a.disk_gib > 0) b.disk();
    if (has_op(b.a, "safetensors")) b.consolidated("safetensors");
    if (has_op(b.a, "pt")) b.consolidated("pt");
    if (has_op(b.a, "sharded")) b.sharded();
    if (has_op(b.a, "async")) b.async();
    b.finish();
    return 0;
  } catch (const Failure& e) {
    std::fprintf(stderr, "bmt-bench-ckpt: %s\n", e.what());
    return e.code;
  } catch (const c10::Error& e) {
    const bool debug = std::getenv("BMT_DEBUG") && std::string(std::getenv("BMT_DEBUG")) == "1";  // with the backtrace
    std::fprintf(stderr, "bmt-bench-ckpt: error: %s\n",
                 std::string(debug ? e.what() : e.what_without_backtrace()).substr(0, debug ? 20000 : 2000).c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bmt-bench-ckpt: error: %s\n", e.what());
    return 1;
  }
}
