#include "bmt/runtime/launch_env_internal.h"

#include <cctype>
#include <cstdlib>
#include <limits>

#include "bmt/core/error.h"

namespace bmt {
namespace {

std::optional<std::string> process_env(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (!v || !*v) return std::nullopt;
  return std::string(v);
}

int parse_int(const std::string& name, const std::string& value) {
  // Digits with an optional sign, nothing else (no blanks, no "1.5", no "4x"), and within int's range.
  bool well_formed = !value.empty();
  for (size_t i = 0; i < value.size() && well_formed; ++i)
    well_formed = std::isdigit(static_cast<unsigned char>(value[i])) || (i == 0 && value.size() > 1 &&
                                                                          (value[0] == '-' || value[0] == '+'));
  long long v = 0;
  if (well_formed) {
    try {
      v = std::stoll(value);
    } catch (const std::exception&) {
      v = std::numeric_limits<long long>::max();  // beyond long long: reported as out of range below
    }
  }
  BMT_CHECK(well_formed, "environment variable ", name, "='", value, "' is not an integer");
  BMT_CHECK(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(), "environment variable ",
            name, "='", value, "' is out of range");
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
  // Replace every bracketed range by its first element: "node[03-05,07]" -> "node03",
  // "rack[0-3]_blade[0-41]" -> "rack0_blade0" (Slurm allows several ranges in one host name).
  std::string host;
  size_t i = 0;
  while (i < first.size()) {
    if (first[i] != '[') {
      host += first[i++];
      continue;
    }
    size_t close = first.find(']', i);
    std::string range = first.substr(i + 1, close == std::string::npos ? std::string::npos : close - i - 1);
    host += range.substr(0, range.find_first_of(",-"));
    if (close == std::string::npos) break;
    i = close + 1;
  }
  return host;
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
  BMT_CHECK(env.local_size >= 1, "local world size ", env.local_size, " (from ", env.source, ") must be >= 1");
  BMT_CHECK(env.local_rank >= 0 && env.local_rank < env.local_size, "local rank ", env.local_rank, " (from ",
            env.source, ") is out of range for local world size ", env.local_size);
  BMT_CHECK(env.master_port > 0 && env.master_port < 65536, "MASTER_PORT ", env.master_port,
            " is not a valid TCP port");
  return env;
}

}  // namespace bmt
