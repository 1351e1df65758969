// LaunchEnv: who am I in the job? Read from torchrun / bmtrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT) or Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, first host of SLURM_NODELIST).
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace bmt {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool use_agent_store = false;  // torchrun's TORCHELASTIC_USE_AGENT_STORE
  int restart_count = 0;
  std::string source = "default";  // "torchrun", "slurm" or "default" (single process)
};

using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;

// Reads the process environment (or `lookup`, for tests). Throws bmt::core::Error naming the variable when a
// value is malformed or inconsistent (e.g. RANK >= WORLD_SIZE).
LaunchEnv read_launch_env(const EnvLookup& lookup = {});

// First host of a Slurm node list: "node[03-05,07],gpu1" -> "node03".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace bmt
