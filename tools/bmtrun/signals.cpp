// Self-pipe signal delivery (see signals.h).
#include "bmtrun/signals.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace bmtrun {
namespace {

int g_pipe[2] = {-1, -1};

void on_signal(int sig) {
  int saved = errno;  // the handler may interrupt code that looks at errno
  unsigned char byte = static_cast<unsigned char>(sig);
  ssize_t ignored = ::write(g_pipe[1], &byte, 1);  // non-blocking: a full pipe already has wake-ups queued
  (void)ignored;
  errno = saved;
}

}  // namespace

void install_signal_handlers() {
  if (::pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    throw std::runtime_error(std::string("cannot create the signal pipe: ") + std::strerror(errno));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (int sig : {SIGINT, SIGTERM, SIGCHLD}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
}

int signal_fd() { return g_pipe[0]; }

std::vector<int> take_signals() {
  std::vector<int> sigs;
  unsigned char buf[64];
  for (;;) {
    ssize_t n = ::read(g_pipe[0], buf, sizeof buf);
    if (n > 0) {
      sigs.insert(sigs.end(), buf, buf + n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    break;  // EAGAIN: empty
  }
  return sigs;
}

void restore_default_signals() {
  for (int sig : {SIGINT, SIGTERM, SIGCHLD, SIGPIPE, SIGQUIT}) ::signal(sig, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: break;
  }
  static thread_local char buf[16];
  std::snprintf(buf, sizeof buf, "SIG%d", sig);
  return buf;
}

}  // namespace bmtrun
