// init_distributed and the process-wide configuration (BMTrain's bmt.init_distributed / bmt.config).
//
// Topology (BMTrain's, with its size/communicator mismatches fixed): world = pipe_size stages of contiguous
// ranks; inside a stage, tensor-parallel groups are tp_size consecutive ranks.
//   comm          all ranks
//   zero_comm     the ranks of my pipeline stage (world when pipe_size == 1): non-TP parameters shard over it
//   tp_comm       my tensor-parallel group (tp_size ranks)
//   tp_zero_comm  ranks of my stage with my tp rank (data-parallel group; TP parameters shard over it)
//   pipe_comm     one rank per stage with my position inside the stage
// Every communicator exists (size 1 when the feature is off), so code never has to ask whether it is there.
// Rank layout (BMTrain's): world = pipe_size x dp x tp_size; stage s holds ranks [s*W/pp, (s+1)*W/pp); inside a
// stage rank r has tp rank r % tp. Example, world 8 = pp 2 x dp 2 x tp 2: stage 0 = ranks 0-3 (tp groups {0,1},
// {2,3}; dp groups {0,2}, {1,3}), stage 1 = ranks 4-7; pipe_comm groups {0,4}, {1,5}, {2,6}, {3,7}. Topology names
// every index (config().topology).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "bmt/core/communicator.h"
#include "bmt/core/peer_monitor.h"
#include "bmt/core/store.h"

namespace bmt {

enum class Backend { kAuto, kNccl, kGloo };
Backend parse_backend(const std::string& name);  // "auto", "nccl", "gloo"; throws on anything else
const char* backend_name(Backend b);

struct InitOptions {
  uint64_t seed = 0;
  int zero_level = 3;   // default ZeRO level of Blocks created without an explicit one (2 or 3)
  int tp_size = 1;
  // Tensor-parallel activation layout the model uses (BMTrain's, and the default of bmt::nn's parallel layers):
  // activations between TP regions split along dim 0 over the tp group, so tp-replicated parameters (norms,
  // row-parallel biases) get partial gradients that are summed over the group. false: Megatron's replicated
  // activations (identical gradients, averaged). Per parameter: set_tp_grad_reduce.
  bool sequence_parallel = true;
  int pipe_size = 1;
  // Micro-batches per pipelined step (PipelineTransformerBlockList's default); 0 = pipe_size (BMTrain's default).
  int num_micro_batches = 0;
  Backend backend = Backend::kAuto;  // auto: NCCL when CUDA is built and a GPU is visible, else Gloo
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};  // every blocking wait; env BMT_TIMEOUT_S overrides
  bool quiet = false;  // do not print the one-line initialisation summary on rank 0
};

// BMTrain's config["topology"]: this rank's indices in world = pipe_size x dp x tp_size. For a group, *_id is my
// rank inside it and *_idx which group of its kind it is (the BMTrain convention).
struct Topology {
  int rank = 0, world_size = 1;
  int pipe_size = 1, tp_size = 1, dp_size = 1;  // dp_size = world / (pipe_size * tp_size)
  int stages = 1;                               // = pipe_size
  int stage_size = 1;                           // ranks per stage = world / pipe_size
  int stage_id = 0;      // my stage: rank / stage_size (pipe_comm rank)
  int pipe_idx = 0;      // my position inside the stage: rank % stage_size (which pipe_comm group)
  int tp_id = 0;         // rank % tp_size (tp_comm rank)
  int tp_idx = 0;        // rank / tp_size (which tp group)
  int pp_zero_id = 0;    // = pipe_idx: my rank in my stage's group (zero_comm; BMTrain's pp_zero_comm)
  int pp_zero_idx = 0;   // = stage_id
  int pp_tp_zero_id = 0;   // = pipe_idx / tp_size: my data-parallel rank (tp_zero_comm; BMTrain's pp_tp_zero_comm)
  int pp_tp_zero_idx = 0;  // = stage_id * tp_size + tp_id
  bool is_first_stage() const { return stage_id == 0; }
  bool is_last_stage() const { return stage_id == stages - 1; }
  // Global rank of the rank at my position in stage `stage` (my pipe_comm peer there).
  int stage_rank(int stage) const { return stage * stage_size + pipe_idx; }
  // name: "pipe", "zero" (= "pp_zero", my stage's group), "tp", "tp_zero" (= "pp_tp_zero", the data-parallel
  // group), "world". BMTrain's "zero" is the world and its "tp_zero" spans stages; here both stay inside a stage,
  // which is where ZeRO shards. Unknown names throw, listing these.
  int get_group_rank(const std::string& name) const;  // my rank in the group (*_id)
  int get_group_id(const std::string& name) const;    // which group (*_idx)
};
// Computes the layout (no communication); throws bmt::core::Error naming the sizes when they do not divide.
Topology make_topology(int rank, int world_size, int pipe_size, int tp_size);

struct Config {
  bool initialized = false;
  int rank = 0, world_size = 1, local_rank = 0, local_size = 1;
  int zero_rank = 0, zero_size = 1;        // zero_comm
  int tp_rank = 0, tp_size = 1;            // tp_comm
  int tp_zero_rank = 0, tp_zero_size = 1;  // tp_zero_comm (data-parallel group)
  int pipe_rank = 0, pipe_size = 1;        // pipe_comm (pipe_rank = stage id)
  int zero_level = 3;
  int num_micro_batches = 1;  // default of PipelineTransformerBlockList (InitOptions::num_micro_batches)
  Topology topology;
  bool sequence_parallel = true;
  uint64_t seed = 0;
  Backend backend = Backend::kGloo;
  std::chrono::milliseconds timeout{0};
  c10::Device device{c10::kCPU};
  std::string master_addr;
  int master_port = 0;

  std::shared_ptr<core::Communicator> comm, zero_comm, tp_comm, tp_zero_comm, pipe_comm;
  std::shared_ptr<core::Store> store;
  // Heartbeats through the store (own connection): names a dead or stopped rank; the NCCL watchdog aborts on it.
  // Null at world size 1 or with BMT_HEARTBEAT=0.
  std::shared_ptr<core::PeerMonitor> peer_monitor;

  // CUDA only: calc_stream = the current stream at init; load_stream (high priority) carries ZeRO gathers and
  // reduce-scatters; tp_comm_stream tensor-parallel collectives; pp_comm_stream pipeline sends and receives.
  // Unset on CPU.
  std::optional<c10::Stream> calc_stream, load_stream, tp_comm_stream, pp_comm_stream;
};

// Must be called once per process before anything else in bmtrain. Reads the launch environment
// (torchrun, bmtrun, Slurm), rendezvous through a TCPStore, picks the device, seeds the RNGs, creates the
// communicators of every group and validates the topology.
void init_distributed(const InitOptions& options = {});
bool is_initialized();
// Throws bmt::core::Error("bmtrain is not initialized ...") before init_distributed.
const Config& config();
int world_size();
int rank();
// Raises DistError when one of cfg's communicators was aborted (a dead or stopped peer, a timeout) or the peer
// monitor has a verdict: cheap, no host synchronisation. For host code that launches collectives without calling
// the communicators (a replayed CUDA graph holds its NCCL kernels): replaying on an aborted communicator is
// undefined, so it must fail here instead. `what` names the caller in the message.
void check_communicators_alive(const Config& cfg, const char* what);
// Destroys the communicators (after a barrier when `barrier` is true). Safe to call twice; runs at exit.
void finalize(bool barrier = true);

// Seeds the default torch generators so that ranks of one tensor-parallel group agree and data-parallel ranks
// differ (dropout masks): seed + 1 + tp_zero_rank. init_parameters() calls it after initialising parameters
// (which needs the same stream of random numbers on every rank).
void seed_per_data_parallel_rank();

}  // namespace bmt
