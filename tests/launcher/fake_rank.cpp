// fake_rank: a stand-in for a training program, for bmtrun's tests (no torch, starts in milliseconds).
// Runs its arguments as actions, in order; "@R:action" runs the action on rank R only.
//   env            print "RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. LOCAL_WORLD_SIZE=.. GROUP_RANK=.. MASTER_ADDR=..
//                  MASTER_PORT=.." on stdout
//   out=TEXT       print TEXT on stdout          err=TEXT   print TEXT on stderr
//   partial=TEXT   print TEXT on stdout without a newline
//   stdin          print "stdin-bytes=N", the number of bytes readable from stdin
//   exit=C         exit with code C              signal=S   raise signal S (a number, SEGV, KILL, ...)
//   sleep=S        sleep S seconds               ignore-term  ignore SIGTERM from now on
//   touch=PATH     create the file PATH          wait-file=PATH  wait (at most 60 s) until PATH exists
// (touch/wait-file order ranks without timing assumptions: a loaded machine may start a rank seconds late.)
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

const char* env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

int parse_signal(const std::string& s) {
  if (s == "SEGV") return SIGSEGV;
  if (s == "KILL") return SIGKILL;
  if (s == "TERM") return SIGTERM;
  if (s == "ABRT") return SIGABRT;
  if (s == "INT") return SIGINT;
  return std::atoi(s.c_str());
}

void run_action(const std::string& action) {
  auto eq = action.find('=');
  std::string verb = action.substr(0, eq), arg = eq == std::string::npos ? "" : action.substr(eq + 1);
  if (verb == "env") {
    std::printf("RANK=%s WORLD_SIZE=%s LOCAL_RANK=%s LOCAL_WORLD_SIZE=%s GROUP_RANK=%s MASTER_ADDR=%s MASTER_PORT=%s\n",
                env_or("RANK", "-"), env_or("WORLD_SIZE", "-"), env_or("LOCAL_RANK", "-"),
                env_or("LOCAL_WORLD_SIZE", "-"), env_or("GROUP_RANK", "-"), env_or("MASTER_ADDR", "-"),
                env_or("MASTER_PORT", "-"));
  } else if (verb == "out") {
    std::printf("%s\n", arg.c_str());
  } else if (verb == "err") {
    std::fprintf(stderr, "%s\n", arg.c_str());
  } else if (verb == "partial") {
    std::printf("%s", arg.c_str());
  } else if (verb == "stdin") {
    char buf[256];
    size_t total = 0;
    for (ssize_t n; (n = ::read(STDIN_FILENO, buf, sizeof buf)) > 0;) total += static_cast<size_t>(n);
    std::printf("stdin-bytes=%zu\n", total);
  } else if (verb == "exit") {
    std::exit(std::atoi(arg.c_str()));
  } else if (verb == "signal") {
    rlimit no_core{0, 0};  // a test's deliberate crash must not write core files
    ::setrlimit(RLIMIT_CORE, &no_core);
    std::fflush(nullptr);
    std::signal(parse_signal(arg), SIG_DFL);
    std::raise(parse_signal(arg));
  } else if (verb == "sleep") {
    std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(arg.c_str())));
  } else if (verb == "touch") {
    if (FILE* f = std::fopen(arg.c_str(), "w")) std::fclose(f);
  } else if (verb == "wait-file") {
    for (int i = 0; i < 6000 && ::access(arg.c_str(), F_OK) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } else if (verb == "ignore-term") {
    std::signal(SIGTERM, SIG_IGN);
  } else {
    std::fprintf(stderr, "fake_rank: unknown action '%s'\n", action.c_str());
    std::exit(100);
  }
  std::fflush(nullptr);  // stdout is a pipe: unflushed lines would be lost on a signal death
}

}  // namespace

int main(int argc, char** argv) {
  const int rank = std::atoi(env_or("RANK", "0"));
  for (int i = 1; i < argc; ++i) {
    std::string action = argv[i];
    if (action.size() > 1 && action[0] == '@') {  // "@R:action"
      auto colon = action.find(':');
      if (colon == std::string::npos) {
        std::fprintf(stderr, "fake_rank: '%s' lacks ':' (expected @RANK:action)\n", action.c_str());
        return 100;
      }
      if (std::atoi(action.substr(1, colon - 1).c_str()) != rank) continue;
      action = action.substr(colon + 1);
    }
    run_action(action);
  }
  return 0;
}
