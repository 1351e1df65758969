// One rank process: started with fork/execvp in its own process group, stdin from /dev/null, its stdout and
// stderr captured through pipes.
#pragma once

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

namespace bmtrun {

struct SpawnSpec {
  int rank = 0;
  std::vector<std::string> argv;                            // argv[0] is looked up in PATH
  std::vector<std::pair<std::string, std::string>> env;     // set on top of bmtrun's environment
};

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int stdout_fd = -1;  // read ends in bmtrun (non-blocking); -1 once closed
  int stderr_fd = -1;
  bool running = true;
  int wait_status = 0;            // waitpid's status, once !running
  bool signalled_by_us = false;  // bmtrun sent it SIGTERM/SIGKILL/a forwarded signal
};

// Starts the process. Throws std::runtime_error when it cannot be created or its program cannot be executed
// (no such file, not executable): exec errors are reported back through a close-on-exec pipe.
Child spawn_child(const SpawnSpec& spec);

// "exited with code 3" / "was killed by signal SIGSEGV (11)".
std::string describe_wait_status(int wait_status);
bool exited_cleanly(int wait_status);
// bmtrun's exit code for a failed rank: 1 for a non-zero exit, 128 + S for death by signal S.
int failure_exit_code(int wait_status);

}  // namespace bmtrun
