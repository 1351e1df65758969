#include "bmt/launch_env.h"

#include <cstdlib>

#include "bmt/core/error.h"

namespace bmt {
namespace {

std::optional<std::string> process_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

int parse_int(const std::string& name, const std::string& value) {
  size_t used = 0;
  long v = 0;
  try {
    v = std::stol(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  BMT_CHECK(used == value.size() && used > 0, "environment variable ", name, "='", value,
            "' is not an integer");
  return static_cast<int>(v);
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  std::string first;
  int depth = 0;
  for (char c : nodelist) {  // cut at the first top-level comma
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first += c;
  }
  auto open = first.find('[');
  if (open == std::string::npos) return first;
  std::string prefix = first.substr(0, open);
  std::string range = first.substr(open + 1);
  size_t end = range.find_first_of(",-]");
  return prefix + range.substr(0, end);
}

LaunchEnv read_launch_env(const EnvLookup& lookup_in) {
  EnvLookup lookup = lookup_in ? lookup_in : EnvLookup(process_env);
  LaunchEnv env;
  auto get_int = [&](const std::string& name) -> std::optional<int> {
    auto v = lookup(name);
    if (!v) return std::nullopt;
    return parse_int(name, *v);
  };
  if (lookup("RANK") || lookup("WORLD_SIZE")) {
    env.source = "torchrun";
    BMT_CHECK(lookup("RANK") && lookup("WORLD_SIZE"), "RANK and WORLD_SIZE must be set together (found only ",
              lookup("RANK") ? "RANK" : "WORLD_SIZE", "); launch with bmtrun or torchrun");
    env.rank = *get_int("RANK");
    env.world_size = *get_int("WORLD_SIZE");
    env.local_rank = get_int("LOCAL_RANK").value_or(env.rank);
    env.local_size = get_int("LOCAL_WORLD_SIZE").value_or(env.world_size);
  } else if (lookup("SLURM_PROCID") && lookup("SLURM_NTASKS")) {
    env.source = "slurm";
    env.rank = *get_int("SLURM_PROCID");
    env.world_size = *get_int("SLURM_NTASKS");
    env.local_rank = get_int("SLURM_LOCALID").value_or(0);
    env.local_size = get_int("SLURM_NTASKS_PER_NODE").value_or(env.world_size);
    if (auto nodes = lookup("SLURM_STEP_NODELIST") ? lookup("SLURM_STEP_NODELIST") : lookup("SLURM_NODELIST"))
      env.master_addr = first_slurm_host(*nodes);
  }
  if (auto addr = lookup("MASTER_ADDR")) env.master_addr = *addr;
  if (auto port = get_int("MASTER_PORT")) env.master_port = *port;
  if (auto agent = lookup("TORCHELASTIC_USE_AGENT_STORE")) env.use_agent_store = (*agent == "True" || *agent == "1");
  env.restart_count = get_int("TORCHELASTIC_RESTART_COUNT").value_or(0);

  BMT_CHECK(env.world_size >= 1, "world size ", env.world_size, " (from ", env.source, ") must be >= 1");
  BMT_CHECK(env.rank >= 0 && env.rank < env.world_size, "rank ", env.rank, " (from ", env.source,
            ") is out of range for world size ", env.world_size);
  BMT_CHECK(env.local_rank >= 0, "local rank ", env.local_rank, " (from ", env.source, ") must be >= 0");
  BMT_CHECK(env.master_port > 0 && env.master_port < 65536, "MASTER_PORT ", env.master_port,
            " is not a valid TCP port");
  return env;
}

}  // namespace bmt
