// Parses and validates bmtrun's options. Options stop at the first argument that is not one (or at "--"):
// everything after it belongs to the launched program.
#include "bmtrun/options.h"

#include <cerrno>
#include <cstdlib>
#include <string>

namespace bmtrun {
namespace {

long parse_long(const std::string& option, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno == ERANGE)
    throw UsageError(option + " expects an integer, got '" + text + "' (e.g. " + option + " 4)");
  return v;
}

// An int option checked against [lo, hi] before narrowing (4294967298 must not become 2).
int parse_int(const std::string& option, const std::string& text, long lo, long hi, const std::string& meaning) {
  const long v = parse_long(option, text);
  if (v < lo || v > hi)
    throw UsageError(option + " " + text + " is out of range: " + meaning + ", " + std::to_string(lo) + ".." +
                     std::to_string(hi));
  return static_cast<int>(v);
}

double parse_seconds(const std::string& option, const std::string& text) {
  char* end = nullptr;
  double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0')
    throw UsageError(option + " expects a number of seconds, got '" + text + "' (e.g. " + option + " 600)");
  return v;
}

}  // namespace

const char* usage_text() {
  return "usage: bmtrun --nproc N [--nnodes K --node-rank I --master-addr A --master-port P]\n"
         "              [--rank0-only] [--timeout-s S] [--] prog [args...]\n"
         "\n"
         "Starts N copies of prog on this node with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK,\n"
         "LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and prefixes every output line with\n"
         "'[rank R] '. When a rank fails, the others are stopped (SIGTERM, SIGKILL after 5 s).\n"
         "\n"
         "  --nproc N          processes on this node (alias --nproc-per-node)\n"
         "  --nnodes K         nodes in the job (default 1); run one bmtrun per node\n"
         "  --node-rank I      this node's index, 0..K-1 (default 0)\n"
         "  --master-addr A    address of node 0, where rank 0 hosts the rendezvous store (default 127.0.0.1)\n"
         "  --master-port P    its port (default 29500 with several nodes, else a free port)\n"
         "  --rank0-only       show only rank 0's output; failing ranks' last stderr lines are shown at the end\n"
         "  --timeout-s S      stop the job after S seconds (exit code 124)\n"
         "  -h, --help         this text\n"
         "\n"
         "Exit code: 0 when every rank exits 0; 1 when a rank exits non-zero; 128+S when a rank is killed by\n"
         "signal S or bmtrun receives it; 124 on --timeout-s; 127 when prog cannot be executed; 2 on usage errors.\n";
}

Options parse_options(int argc, const char* const* argv) {
  Options o;
  bool port_given = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.empty() || arg[0] != '-') break;  // the program starts here
    if (arg == "-h" || arg == "--help") {
      o.help = true;
      return o;
    }
    // "--name=value" or "--name value"
    std::string name = arg, value;
    bool inline_value = false;
    if (auto eq = arg.find('='); eq != std::string::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    auto take_value = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= argc) throw UsageError("option " + name + " needs a value (e.g. " + name + " 2)");
      return argv[++i];
    };
    if (name == "--rank0-only" && !inline_value) {
      o.rank0_only = true;
    } else if (name == "--nproc" || name == "--nproc-per-node" || name == "--nproc_per_node") {
      o.nproc = parse_int(name, take_value(), 1, 4096, "the number of processes to start on this node");
    } else if (name == "--nnodes") {
      o.nnodes = parse_int(name, take_value(), 1, 1 << 20, "the number of nodes");
    } else if (name == "--node-rank" || name == "--node_rank") {
      o.node_rank = parse_int(name, take_value(), 0, (1 << 20) - 1, "this node's index");
    } else if (name == "--master-addr" || name == "--master_addr") {
      o.master_addr = take_value();
    } else if (name == "--master-port" || name == "--master_port") {
      o.master_port = parse_int(name, take_value(), 1, 65535, "a TCP port");
      port_given = true;
    } else if (name == "--timeout-s") {
      o.timeout_s = parse_seconds(name, take_value());
    } else {
      throw UsageError("unknown option '" + arg + "'; run 'bmtrun --help' for the options, or put '--' before " +
                       "the program if it starts with '-'");
    }
  }
  for (; i < argc; ++i) o.program.emplace_back(argv[i]);

  if (o.nproc < 1)
    throw UsageError("--nproc " + std::to_string(o.nproc) + " is invalid: give the number of processes to start "
                     "on this node, at least 1 (e.g. --nproc 8 for 8 GPUs)");
  if (o.nproc > 4096)
    throw UsageError("--nproc " + std::to_string(o.nproc) + " is too large (at most 4096 per node)");
  if (o.nnodes < 1)
    throw UsageError("--nnodes " + std::to_string(o.nnodes) + " is invalid: it must be at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw UsageError("--node-rank " + std::to_string(o.node_rank) + " is out of range for --nnodes " +
                     std::to_string(o.nnodes) + ": use 0.." + std::to_string(o.nnodes - 1) +
                     " (one bmtrun per node, each with its own --node-rank)");
  if (port_given && (o.master_port < 1 || o.master_port > 65535))
    throw UsageError("--master-port " + std::to_string(o.master_port) + " is not a TCP port: use 1..65535");
  if (o.master_addr.empty()) throw UsageError("--master-addr is empty: give node 0's host name or IP address");
  if (o.timeout_s < 0) throw UsageError("--timeout-s must be positive (or 0 for no limit)");
  if (o.program.empty())
    throw UsageError("missing the program to run: put it after the options, e.g. 'bmtrun --nproc 2 ./train "
                     "--lr 1e-3'");
  return o;
}

}  // namespace bmtrun
