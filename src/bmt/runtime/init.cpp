#include "bmt/runtime/init.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "bmt/core/error.h"
#include "bmt/runtime/gloo_communicator_internal.h"
#include "bmt/runtime/launch_env_internal.h"
#include "bmt/runtime/torch_store_internal.h"

#ifdef BMT_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include "bmt/core/nccl_communicator_internal.h"
#endif

namespace bmt {
namespace {

Config g_config;
std::once_flag g_atexit_once;

bool loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

int cuda_device_count() {
#ifdef BMT_WITH_CUDA
  return static_cast<int>(c10::cuda::device_count());
#else
  return 0;
#endif
}

std::unique_ptr<core::Communicator> make_world(Backend backend, const c10::intrusive_ptr<c10d::Store>& store,
                                               core::Store& core_store, const LaunchEnv& env,
                                               std::chrono::milliseconds timeout) {
  if (backend == Backend::kGloo) {
    std::string host;
    if (const char* h = std::getenv("BMT_GLOO_HOSTNAME")) host = h;
    else if (loopback(env.master_addr)) host = "127.0.0.1";
    return std::make_unique<GlooCommunicator>(store, env.rank, env.world_size, timeout, "world", host);
  }
#ifdef BMT_WITH_CUDA
  return core::NcclCommunicator::create(core_store, "bmt/nccl/world", env.rank, env.world_size, timeout.count(),
                                        "world");
#else
  (void)core_store;
  BMT_ASSERT(false, "NCCL requested in a CPU-only build");
#endif
}

// One heartbeat per rank on its own store connection; a rank silent for the timeout (or
// BMT_HEARTBEAT_TIMEOUT_S) is dead. BMT_HEARTBEAT=0 turns it off.
std::shared_ptr<core::PeerMonitor> make_peer_monitor(const LaunchEnv& env, std::chrono::milliseconds timeout) {
  if (env.world_size == 1) return nullptr;
  if (const char* h = std::getenv("BMT_HEARTBEAT"); h && std::string(h) == "0") return nullptr;
  core::PeerMonitorOptions o;
  o.stale_ms = timeout.count();
  if (const char* t = std::getenv("BMT_HEARTBEAT_TIMEOUT_S")) o.stale_ms = std::atoll(t) * 1000;
  BMT_CHECK(o.stale_ms >= 2000, "BMT_HEARTBEAT_TIMEOUT_S must be at least 2 s (got ", o.stale_ms, " ms)");
  o.interval_ms = std::min<int64_t>(1000, o.stale_ms / 4);
  o.store_host_rank = env.use_agent_store ? -1 : 0;  // connect_tcp_store: rank 0 hosts it without an agent
  auto c10_store = connect_tcp_store(env.master_addr, env.master_port, env.rank, env.world_size, env.use_agent_store,
                                     env.restart_count, timeout, /*client_only=*/true);
  auto store = std::make_shared<TorchStore>(c10::make_intrusive<c10d::PrefixStore>("bmtrain", c10_store),
                                            /*quiet=*/true);
  return std::make_shared<core::PeerMonitor>(store, "bmt/heartbeat", env.rank, env.world_size, o);
}

}  // namespace

Topology make_topology(int rank, int world, int pipe_size, int tp_size) {
  const std::string who = core::concat("rank ", rank, " of ", world);
  BMT_CHECK(tp_size >= 1, who, ": tp_size ", tp_size, " must be >= 1");
  BMT_CHECK(pipe_size >= 1, who, ": pipe_size ", pipe_size, " must be >= 1");
  BMT_CHECK(world % (tp_size * pipe_size) == 0, who, ": world size ", world, " is not pipe_size (", pipe_size,
            ") x tp_size (", tp_size, ") x data-parallel size: ", pipe_size, " x ", tp_size, " = ",
            pipe_size * tp_size, " does not divide ", world, ". Choose pipe_size and tp_size whose product divides "
            "the number of processes (or launch a multiple of ", pipe_size * tp_size, " processes)");
  Topology t;
  t.rank = rank;
  t.world_size = world;
  t.pipe_size = t.stages = pipe_size;
  t.tp_size = tp_size;
  t.dp_size = world / (pipe_size * tp_size);
  t.stage_size = world / pipe_size;
  t.stage_id = rank / t.stage_size;
  t.pipe_idx = rank % t.stage_size;
  t.tp_id = rank % tp_size;
  t.tp_idx = rank / tp_size;
  t.pp_zero_id = t.pipe_idx;
  t.pp_zero_idx = t.stage_id;
  t.pp_tp_zero_id = t.pipe_idx / tp_size;
  t.pp_tp_zero_idx = t.stage_id * tp_size + t.tp_id;
  return t;
}

namespace {
// (my rank in the group, which group) for a group name.
std::pair<int, int> group_position(const Topology& t, const std::string& name) {
  if (name == "pipe") return {t.stage_id, t.pipe_idx};
  if (name == "zero" || name == "pp_zero") return {t.pp_zero_id, t.pp_zero_idx};
  if (name == "tp") return {t.tp_id, t.tp_idx};
  if (name == "tp_zero" || name == "pp_tp_zero") return {t.pp_tp_zero_id, t.pp_tp_zero_idx};
  if (name == "world") return {t.rank, 0};
  BMT_ERROR("topology: unknown group '", name, "'; use pipe, zero (pp_zero), tp, tp_zero (pp_tp_zero) or world");
}
}  // namespace

int Topology::get_group_rank(const std::string& name) const { return group_position(*this, name).first; }
int Topology::get_group_id(const std::string& name) const { return group_position(*this, name).second; }

Backend parse_backend(const std::string& name) {
  if (name == "auto") return Backend::kAuto;
  if (name == "nccl") return Backend::kNccl;
  if (name == "gloo") return Backend::kGloo;
  BMT_ERROR("unknown backend '", name, "': use auto, nccl or gloo");
}

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kAuto: return "auto";
    case Backend::kNccl: return "nccl";
    case Backend::kGloo: return "gloo";
  }
  return "?";
}

void init_distributed(const InitOptions& options_in) {
  BMT_CHECK(!g_config.initialized, "init_distributed called twice on rank ", g_config.rank,
            "; call bmt::finalize() first to re-initialise");
  InitOptions options = options_in;
  if (const char* t = std::getenv("BMT_TIMEOUT_S")) options.timeout = std::chrono::seconds(std::atoll(t));
  LaunchEnv env = read_launch_env();
  const int world = env.world_size;
  const std::string who = core::concat("rank ", env.rank, " of ", world);

  // Topology first: a wrong one must fail before anything waits on the network.
  BMT_CHECK(options.num_micro_batches >= 0, who, ": num_micro_batches ", options.num_micro_batches,
            " must be >= 0 (0 = pipe_size)");
  const Topology topo = make_topology(env.rank, world, options.pipe_size, options.tp_size);
  BMT_CHECK(options.zero_level == 2 || options.zero_level == 3, who, ": zero_level ", options.zero_level,
            " is not supported; use 2 (shard gradients + optimizer states) or 3 (also parameters)");
  BMT_CHECK(options.timeout.count() > 0, who, ": timeout must be positive");

  Backend backend = options.backend;
  if (backend == Backend::kAuto) backend = cuda_device_count() > 0 ? Backend::kNccl : Backend::kGloo;
#ifndef BMT_WITH_CUDA
  BMT_CHECK(backend != Backend::kNccl, who, ": backend nccl was requested but this bmtrain was built without "
            "CUDA (BMT_WITH_CUDA=OFF); use backend gloo or rebuild with CUDA");
#endif
  c10::Device device(c10::kCPU);
  if (backend == Backend::kNccl) {
    int n = cuda_device_count();
    BMT_CHECK(n > 0, who, ": backend nccl needs a GPU but none is visible (CUDA_VISIBLE_DEVICES?); use gloo");
    BMT_CHECK(env.local_rank < n, who, ": local rank ", env.local_rank, " has no GPU (", n,
              " visible on this node); start at most ", n, " processes per node (--nproc ", n, ")");
    device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
#ifdef BMT_WITH_CUDA
    c10::cuda::set_device(device.index());
#endif
  }

  // Split the cores among the ranks of this node unless the user chose (OMP_NUM_THREADS).
  if (!std::getenv("OMP_NUM_THREADS")) {
    int cores = static_cast<int>(std::thread::hardware_concurrency());
    at::set_num_threads(std::max(1, cores / std::max(1, env.local_size)));
  }

  auto c10_store = connect_tcp_store(env.master_addr, env.master_port, env.rank, world, env.use_agent_store,
                                     env.restart_count, options.timeout);
  auto bmt_store = c10::make_intrusive<c10d::PrefixStore>("bmtrain", c10_store);
  auto core_store = std::make_shared<TorchStore>(bmt_store);

  Config cfg;
  cfg.rank = env.rank;
  cfg.world_size = world;
  cfg.local_rank = env.local_rank;
  cfg.local_size = env.local_size;
  cfg.zero_level = options.zero_level;
  cfg.topology = topo;
  cfg.num_micro_batches = options.num_micro_batches > 0 ? options.num_micro_batches : options.pipe_size;
  cfg.sequence_parallel = options.sequence_parallel;
  cfg.seed = options.seed;
  cfg.backend = backend;
  cfg.timeout = options.timeout;
  cfg.device = device;
  cfg.master_addr = env.master_addr;
  cfg.master_port = env.master_port;
  cfg.store = core_store;

  std::shared_ptr<core::Communicator> world_comm = make_world(backend, bmt_store, *core_store, env, options.timeout);
  // After the world is up (every rank is alive), before the splits (they inherit it).
  cfg.peer_monitor = make_peer_monitor(env, options.timeout);
  world_comm->set_peer_monitor(cfg.peer_monitor);
  const int tp = options.tp_size, pp = options.pipe_size;
  const int stage_id = topo.stage_id, pipe_idx = topo.pipe_idx, tp_rank = topo.tp_id;
  cfg.comm = world_comm;
  cfg.zero_comm = pp == 1 ? world_comm : std::shared_ptr<core::Communicator>(world_comm->split(stage_id, env.rank, "zero"));
  cfg.tp_comm = world_comm->split(env.rank / tp, tp_rank, "tp");
  cfg.tp_zero_comm = tp == 1 ? cfg.zero_comm
                             : std::shared_ptr<core::Communicator>(world_comm->split(stage_id * tp + tp_rank, env.rank, "tp_zero"));
  cfg.pipe_comm = world_comm->split(pipe_idx, stage_id, "pipe");
  cfg.zero_rank = cfg.zero_comm->rank();
  cfg.zero_size = cfg.zero_comm->size();
  cfg.tp_rank = cfg.tp_comm->rank();
  cfg.tp_size = cfg.tp_comm->size();
  cfg.tp_zero_rank = cfg.tp_zero_comm->rank();
  cfg.tp_zero_size = cfg.tp_zero_comm->size();
  cfg.pipe_rank = cfg.pipe_comm->rank();
  cfg.pipe_size = cfg.pipe_comm->size();
  BMT_ASSERT(cfg.tp_size == tp && cfg.pipe_size == pp && cfg.tp_zero_size == topo.dp_size &&
                 cfg.pipe_rank == topo.stage_id && cfg.zero_rank == topo.pp_zero_id &&
                 cfg.tp_zero_rank == topo.pp_tp_zero_id && cfg.tp_rank == topo.tp_id,
             "group sizes disagree with the topology");

#ifdef BMT_WITH_CUDA
  if (device.is_cuda()) {
    cfg.calc_stream = c10::cuda::getCurrentCUDAStream(device.index()).unwrap();
    cfg.load_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index()).unwrap();
    cfg.tp_comm_stream = c10::cuda::getStreamFromPool(true, device.index()).unwrap();
    cfg.pp_comm_stream = c10::cuda::getStreamFromPool(true, device.index()).unwrap();
  }
#endif
  cfg.initialized = true;
  g_config = std::move(cfg);
  at::manual_seed(options.seed);  // same on every rank: init_parameters needs identical random streams
  std::call_once(g_atexit_once, [] {
    std::atexit([] {
      try {
        finalize(false);
      } catch (...) {
      }
    });
  });
  if (!options.quiet && env.rank == 0)
    std::fprintf(stderr, "[bmtrain] initialized: world %d (tp %d, pipe %d, data-parallel %d), backend %s, device %s, "
                 "rendezvous %s:%d (%s), timeout %lld s\n", world, tp, pp, g_config.tp_zero_size,
                 backend_name(backend), device.str().c_str(), env.master_addr.c_str(), env.master_port,
                 env.source.c_str(), static_cast<long long>(options.timeout.count() / 1000));
}

bool is_initialized() { return g_config.initialized; }

const Config& config() {
  BMT_CHECK(g_config.initialized, "bmtrain is not initialized: call bmt::init_distributed() first");
  return g_config;
}

int world_size() { return config().world_size; }
int rank() { return config().rank; }

void check_communicators_alive(const Config& cfg, const char* what) {
  if (!cfg.initialized) return;
  for (const auto* c : {&cfg.comm, &cfg.zero_comm, &cfg.tp_comm, &cfg.tp_zero_comm, &cfg.pipe_comm})
    if (*c) (*c)->check_async_error();  // (throws DistError with the recorded reason)
  if (cfg.peer_monitor) {
    const std::string verdict = cfg.peer_monitor->verdict();
    if (!verdict.empty())
      BMT_THROW_AS(core::DistError, what, " on rank ", cfg.rank, " of ", cfg.world_size, ": a peer rank failed (",
                   verdict, "); the job cannot continue: restart it from the last checkpoint (the launcher's "
                   "report names the rank's exit)");
  }
}

void finalize(bool barrier) {
  if (!g_config.initialized) return;
  if (barrier && g_config.comm) g_config.comm->barrier();
  // Children before the world communicator.
  Config empty;
  Config old = std::move(g_config);
  g_config = Config();
  old.pipe_comm.reset();
  old.tp_zero_comm.reset();
  old.tp_comm.reset();
  old.zero_comm.reset();
  old.comm.reset();
  old.peer_monitor.reset();  // says goodbye: peers stop watching this rank
  old.store.reset();
}

void seed_per_data_parallel_rank() {
  const Config& c = config();
  at::manual_seed(c.seed + 1 + static_cast<uint64_t>(c.tp_zero_rank));
}

}  // namespace bmt
