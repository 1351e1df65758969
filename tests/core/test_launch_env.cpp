// read_launch_env with a fake environment: torchrun, Slurm, defaults, malformed and inconsistent values.
#include <gtest/gtest.h>

#include <map>

#include "bmt/core/error.h"
#include "bmt/runtime/launch_env_internal.h"

namespace {

using Env = std::map<std::string, std::string>;

bmt::EnvLookup fake(Env env) {
  return [env = std::move(env)](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

bmt::LaunchEnv read(const Env& env) { return bmt::read_launch_env(fake(env)); }

// The message of the bmt::core::Error that reading `env` throws.
std::string error_of(const Env& env) {
  try {
    bmt::LaunchEnv e = read(env);
    return "NO ERROR (rank " + std::to_string(e.rank) + " of " + std::to_string(e.world_size) + ")";
  } catch (const bmt::core::Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("NOT A bmt::core::Error: ") + e.what();
  }
}

void expect_error(const Env& env, const std::vector<std::string>& fragments) {
  std::string msg = error_of(env);
  for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
}

const Env kTorchrun = {{"RANK", "3"},         {"WORLD_SIZE", "8"},        {"LOCAL_RANK", "1"},
                       {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29811"}};

Env with(Env base, const Env& more) {
  for (auto& [k, v] : more) base[k] = v;
  return base;
}
Env without(Env base, const std::string& key) {
  base.erase(key);
  return base;
}

}  // namespace

TEST(LaunchEnv, DefaultsToASingleProcess) {
  bmt::LaunchEnv e = read({});
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_size, 1);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_FALSE(e.use_agent_store);
  EXPECT_EQ(e.restart_count, 0);
  EXPECT_EQ(e.source, "default");
  // Unrelated variables change nothing; MASTER_* alone are honoured.
  bmt::LaunchEnv m = read({{"PATH", "/bin"}, {"MASTER_ADDR", "host7"}, {"MASTER_PORT", "1234"}});
  EXPECT_EQ(m.world_size, 1);
  EXPECT_EQ(m.master_addr, "host7");
  EXPECT_EQ(m.master_port, 1234);
}

TEST(LaunchEnv, Torchrun) {
  bmt::LaunchEnv e = read(with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                           {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 4);
  EXPECT_EQ(e.master_addr, "10.1.2.3");
  EXPECT_EQ(e.master_port, 29811);
  EXPECT_TRUE(e.use_agent_store);
  EXPECT_EQ(e.restart_count, 2);

  EXPECT_FALSE(read(with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "False"}})).use_agent_store);
  EXPECT_TRUE(read(with(kTorchrun, {{"TORCHELASTIC_USE_AGENT_STORE", "1"}})).use_agent_store);

  // Only RANK and WORLD_SIZE (a hand-rolled launcher): one node is assumed.
  bmt::LaunchEnv minimal = read({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  EXPECT_EQ(minimal.rank, 2);
  EXPECT_EQ(minimal.world_size, 3);
  EXPECT_EQ(minimal.local_rank, 2);
  EXPECT_EQ(minimal.local_size, 3);
  EXPECT_EQ(minimal.master_addr, "127.0.0.1");
  EXPECT_EQ(minimal.master_port, 29500);
  // Signs and the extremes of the valid ranges.
  bmt::LaunchEnv plus = read({{"RANK", "+0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "65535"}});
  EXPECT_EQ(plus.rank, 0);
  EXPECT_EQ(plus.master_port, 65535);
}

TEST(LaunchEnv, Slurm) {
  const Env slurm = {{"SLURM_PROCID", "5"},
                     {"SLURM_NTASKS", "8"},
                     {"SLURM_LOCALID", "1"},
                     {"SLURM_NTASKS_PER_NODE", "4"},
                     {"SLURM_NODELIST", "node[03-05,07],gpu1"}};
  bmt::LaunchEnv e = read(slurm);
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_size, 4);
  EXPECT_EQ(e.master_addr, "node03");
  EXPECT_EQ(e.master_port, 29500);

  // The step's node list wins over the job's; MASTER_ADDR / MASTER_PORT override both.
  EXPECT_EQ(read(with(slurm, {{"SLURM_STEP_NODELIST", "gpu[10-11]"}})).master_addr, "gpu10");
  bmt::LaunchEnv o = read(with(slurm, {{"MASTER_ADDR", "head"}, {"MASTER_PORT", "4000"}}));
  EXPECT_EQ(o.master_addr, "head");
  EXPECT_EQ(o.master_port, 4000);
  // Without SLURM_LOCALID / SLURM_NTASKS_PER_NODE: local rank 0, one node of all tasks.
  bmt::LaunchEnv bare = read({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODELIST", "n1"}});
  EXPECT_EQ(bare.local_rank, 0);
  EXPECT_EQ(bare.local_size, 2);
  EXPECT_EQ(bare.master_addr, "n1");
  // torchrun inside a Slurm allocation: torchrun's variables describe the processes.
  bmt::LaunchEnv both = read(with(slurm, kTorchrun));
  EXPECT_EQ(both.source, "torchrun");
  EXPECT_EQ(both.rank, 3);
  EXPECT_EQ(both.master_addr, "10.1.2.3");
  // SLURM_PROCID without SLURM_NTASKS is not a Slurm task launch.
  EXPECT_EQ(read({{"SLURM_PROCID", "3"}}).source, "default");
}

TEST(LaunchEnv, FirstSlurmHost) {
  EXPECT_EQ(bmt::first_slurm_host("node[03-05,07],gpu1"), "node03");
  EXPECT_EQ(bmt::first_slurm_host("gpu1,gpu2"), "gpu1");
  EXPECT_EQ(bmt::first_slurm_host("single"), "single");
  EXPECT_EQ(bmt::first_slurm_host("node[7]"), "node7");
  EXPECT_EQ(bmt::first_slurm_host("node[7,9-12]"), "node7");
  EXPECT_EQ(bmt::first_slurm_host("rack1-node[010-020]"), "rack1-node010");
  EXPECT_EQ(bmt::first_slurm_host("node[3-4]-ib"), "node3-ib");
  EXPECT_EQ(bmt::first_slurm_host("rack[0-3]_blade[0-41],other"), "rack0_blade0");
  EXPECT_EQ(bmt::first_slurm_host("a[2,5],b[1-3]"), "a2");
  EXPECT_EQ(bmt::first_slurm_host("host.example.org,b"), "host.example.org");
}

TEST(LaunchEnv, MalformedValuesNameTheVariable) {
  expect_error(with(kTorchrun, {{"RANK", "abc"}}), {"RANK", "'abc'", "not an integer"});
  expect_error(with(kTorchrun, {{"WORLD_SIZE", "4x"}}), {"WORLD_SIZE", "'4x'", "not an integer"});
  expect_error(with(kTorchrun, {{"RANK", ""}}), {"RANK", "not an integer"});
  expect_error(with(kTorchrun, {{"RANK", "1.5"}}), {"RANK", "'1.5'"});
  expect_error(with(kTorchrun, {{"RANK", " 3"}}), {"RANK", "' 3'"});
  expect_error(with(kTorchrun, {{"RANK", "-"}}), {"RANK", "not an integer"});
  expect_error(with(kTorchrun, {{"WORLD_SIZE", "4294967297"}}), {"WORLD_SIZE", "4294967297", "out of range"});
  expect_error(with(kTorchrun, {{"WORLD_SIZE", "99999999999999999999999"}}), {"WORLD_SIZE", "out of range"});
  expect_error(with(kTorchrun, {{"LOCAL_RANK", "one"}}), {"LOCAL_RANK", "'one'"});
  expect_error(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "4 "}}), {"LOCAL_WORLD_SIZE", "'4 '"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", "http"}}), {"MASTER_PORT", "'http'"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", "70000"}}), {"MASTER_PORT", "70000", "not a valid TCP port"});
  expect_error(with(kTorchrun, {{"MASTER_PORT", "0"}}), {"MASTER_PORT", "0"});
  expect_error(with(kTorchrun, {{"TORCHELASTIC_RESTART_COUNT", "x"}}), {"TORCHELASTIC_RESTART_COUNT"});
  expect_error({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}}, {"SLURM_PROCID", "'x'"});
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "two"}}, {"SLURM_NTASKS", "'two'"});
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "?"}}, {"SLURM_LOCALID"});
}

TEST(LaunchEnv, InconsistentValues) {
  expect_error(with(kTorchrun, {{"RANK", "8"}}), {"rank 8", "world size 8", "torchrun"});
  expect_error(with(kTorchrun, {{"RANK", "9"}}), {"rank 9", "world size 8"});
  expect_error(with(kTorchrun, {{"RANK", "-1"}}), {"rank -1", "out of range"});
  expect_error(with(kTorchrun, {{"WORLD_SIZE", "0"}, {"RANK", "0"}}), {"world size 0", ">= 1"});
  expect_error({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "2"}}, {"rank 2", "world size 2", "slurm"});
  expect_error(with(kTorchrun, {{"LOCAL_RANK", "-2"}}), {"local rank -2"});
  expect_error(with(kTorchrun, {{"LOCAL_RANK", "4"}}), {"local rank 4", "local world size 4"});
  expect_error(with(kTorchrun, {{"LOCAL_WORLD_SIZE", "0"}}), {"local world size 0"});
  // Exactly one of RANK / WORLD_SIZE: says which one is there and how to launch.
  expect_error(without(kTorchrun, "WORLD_SIZE"), {"RANK and WORLD_SIZE must be set together", "only RANK"});
  expect_error(without(kTorchrun, "RANK"), {"RANK and WORLD_SIZE must be set together", "only WORLD_SIZE"});
  expect_error({{"WORLD_SIZE", "2"}}, {"only WORLD_SIZE", "torchrun"});
}
