// bmtrun's command line: what to launch and where. Parsing only; nothing is started here.
//   bmtrun --nproc N [--nnodes K --node-rank I --master-addr A --master-port P] [--rank0-only]
//          [--timeout-s S] [--] prog args...
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace bmtrun {

struct Options {
  int nproc = 1;  // processes started on this node
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;      // 0: 29500 with several nodes, else a free local port
  bool rank0_only = false;  // show only rank 0's output (failing ranks' stderr tail is still printed)
  double timeout_s = 0;     // wall-clock limit of the whole job; 0: none
  bool help = false;
  std::vector<std::string> program;  // program and its arguments, passed to execvp untouched
};

// A mistake on the command line; bmtrun exits with code 2 and prints the message.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throws UsageError naming the offending option and how to fix it.
Options parse_options(int argc, const char* const* argv);
const char* usage_text();

}  // namespace bmtrun
