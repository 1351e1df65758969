// bmtrun: a torchrun-compatible launcher for bmtrain programs (no Python needed).
//   bmtrun --nproc 8 ./train --config c.json
// Starts --nproc ranks on this node with the torchrun environment, prefixes their output with "[rank R] ",
// and stops the whole job as soon as one rank fails. See options.cpp for the options and exit codes.
#include <cstdio>
#include <optional>
#include <stdexcept>
#include <string>

#include "bmtrun/child.h"
#include "bmtrun/options.h"
#include "bmtrun/output.h"
#include "bmtrun/port.h"
#include "bmtrun/signals.h"
#include "bmtrun/supervisor.h"

namespace {

// The torchrun variables bmt::read_launch_env (and torch.distributed) understand.
std::vector<std::pair<std::string, std::string>> rank_env(const bmtrun::Options& o, int local_rank, int port) {
  int rank = o.node_rank * o.nproc + local_rank;
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(o.nproc * o.nnodes)},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(o.nproc)},
          {"GROUP_RANK", std::to_string(o.node_rank)},
          {"MASTER_ADDR", o.master_addr},
          {"MASTER_PORT", std::to_string(port)}};
}

}  // namespace

int main(int argc, char** argv) {
  bmtrun::Options opts;
  try {
    opts = bmtrun::parse_options(argc, argv);
  } catch (const bmtrun::UsageError& e) {
    std::fprintf(stderr, "bmtrun: error: %s\n(run 'bmtrun --help' for usage)\n", e.what());
    return 2;
  }
  if (opts.help) {
    std::fputs(bmtrun::usage_text(), stdout);
    return 0;
  }

  bmtrun::SupervisorOptions sup_opts;
  sup_opts.rank0_only = opts.rank0_only;
  sup_opts.timeout_s = opts.timeout_s;
  bmtrun::Supervisor supervisor(sup_opts);
  std::optional<bmtrun::ReservedPort> reserved;  // held until the job ends
  try {
    bmtrun::install_signal_handlers();
    // Several nodes must agree on the port without talking first, hence torchrun's fixed default there.
    int port = opts.master_port ? opts.master_port : 29500;
    if (!opts.master_port && opts.nnodes == 1) port = reserved.emplace().port();
    for (int local = 0; local < opts.nproc; ++local) {
      bmtrun::SpawnSpec spec;
      spec.rank = opts.node_rank * opts.nproc + local;
      spec.argv = opts.program;
      spec.env = rank_env(opts, local, port);
      supervisor.add(bmtrun::spawn_child(spec));
    }
  } catch (const std::exception& e) {
    bmtrun::say(std::string("error: ") + e.what());
    supervisor.kill_all_now();
    return 127;
  }
  return supervisor.run();
}
