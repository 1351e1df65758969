// Process creation for one rank (see child.h).
#include "bmtrun/child.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "bmtrun/signals.h"

namespace bmtrun {
namespace {

void make_pipe(int fds[2]) {
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe() failed: ") + std::strerror(errno));
}

// Runs in the forked child: never returns.
[[noreturn]] void exec_child(const SpawnSpec& spec, int out_w, int err_w, int exec_err_w, pid_t parent) {
  restore_default_signals();
  // Own process group: bmtrun's stop signals then reach the rank's helper processes too (data loaders, shells).
  ::setpgid(0, 0);
#ifdef __linux__
  // If bmtrun itself is killed (SIGKILL, OOM), its ranks must not linger holding GPUs and ports.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);  // the parent died before prctl took effect
#else
  (void)parent;
#endif
  // dup2 clears close-on-exec on the new descriptors only.
  // stdin is /dev/null: ranks share no terminal input, and a background process group reading the terminal
  // would be stopped (SIGTTIN), hanging the job.
  int null_fd = ::open("/dev/null", O_RDONLY);
  if (null_fd < 0 || ::dup2(null_fd, STDIN_FILENO) < 0) ::_exit(127);
  if (::dup2(out_w, STDOUT_FILENO) < 0 || ::dup2(err_w, STDERR_FILENO) < 0) ::_exit(127);
  for (const auto& [name, value] : spec.env) ::setenv(name.c_str(), value.c_str(), 1);
  std::vector<char*> argv;
  for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  int err = errno;
  ssize_t ignored = ::write(exec_err_w, &err, sizeof err);
  (void)ignored;
  ::_exit(127);
}

}  // namespace

Child spawn_child(const SpawnSpec& spec) {
  int out[2], err[2], exec_err[2];
  make_pipe(out);
  make_pipe(err);
  make_pipe(exec_err);
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) {
    int e = errno;
    for (int fd : {out[0], out[1], err[0], err[1], exec_err[0], exec_err[1]}) ::close(fd);
    throw std::runtime_error(std::string("fork() failed for rank ") + std::to_string(spec.rank) + ": " +
                             std::strerror(e) + " (too many processes or too little memory?)");
  }
  if (pid == 0) exec_child(spec, out[1], err[1], exec_err[1], parent);

  ::setpgid(pid, pid);  // also here, so that a signal sent right after spawn_child returns finds the group
  for (int fd : {out[1], err[1], exec_err[1]}) ::close(fd);
  // EOF on this pipe means the exec succeeded (close-on-exec); 4 bytes are the child's errno otherwise.
  int exec_errno = 0;
  ssize_t n;
  do {
    n = ::read(exec_err[0], &exec_errno, sizeof exec_errno);
  } while (n < 0 && errno == EINTR);
  ::close(exec_err[0]);
  if (n == static_cast<ssize_t>(sizeof exec_errno)) {
    ::close(out[0]);
    ::close(err[0]);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    throw std::runtime_error("cannot execute '" + spec.argv[0] + "' for rank " + std::to_string(spec.rank) +
                             ": " + std::strerror(exec_errno) +
                             "; check the program's path (a name without '/' is searched in PATH) and that it "
                             "is executable");
  }
  for (int fd : {out[0], err[0]}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  Child c;
  c.rank = spec.rank;
  c.pid = pid;
  c.stdout_fd = out[0];
  c.stderr_fd = err[0];
  return c;
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return std::string("was killed by signal ") + signal_name(sig) + " (" + std::to_string(sig) + ")" +
           (WCOREDUMP(status) ? ", core dumped" : "");
  }
  return "ended with wait status " + std::to_string(status);
}

bool exited_cleanly(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

int failure_exit_code(int status) {
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace bmtrun
