// The supervision loop (see supervisor.h).
#include "bmtrun/supervisor.h"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <string>

#include "bmtrun/signals.h"

namespace bmtrun {
namespace {

// Upper bound of one poll(): SIGCHLD wakes us anyway; this only bounds the cost of a lost wake-up.
constexpr int kPollCapMs = 200;
constexpr size_t kTailLines = 20;

std::string ranks_word(int n) { return std::to_string(n) + (n == 1 ? " rank" : " ranks"); }

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", s);
  return buf;
}

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

}  // namespace

Supervisor::Supervisor(SupervisorOptions options) : options_(options) {}

void Supervisor::add(Child child) {
  Rank r;
  bool shown = !options_.rank0_only || child.rank == 0;
  r.out = std::make_unique<LineStream>(child.rank, STDOUT_FILENO, shown, 0);
  r.err = std::make_unique<LineStream>(child.rank, STDERR_FILENO, shown, shown ? 0 : kTailLines);
  r.child = child;
  ranks_.push_back(std::move(r));
}

int Supervisor::running_count() const {
  return static_cast<int>(std::count_if(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.child.running; }));
}

int Supervisor::run() {
  while (running_count() > 0) {
    poll_once();
    for (int sig : take_signals()) {
      if (sig == SIGCHLD) continue;  // reaped below
      if (!stopping_) {
        say(std::string("received ") + signal_name(sig) + ", forwarding it to " + ranks_word(running_count()) +
            " (SIGKILL in " + seconds_text(options_.signal_grace.count() / 1000.0) + ")");
        begin_stop(sig, options_.signal_grace, 128 + sig);
      } else if (!killed_) {
        say(std::string("received ") + signal_name(sig) + " again while stopping: killing the ranks now");
        kill_at_ = Clock::now();
      }
    }
    reap();
    auto now = Clock::now();
    if (stopping_ && !killed_ && now >= kill_at_ && running_count() > 0) {
      say(ranks_word(running_count()) + " still running after the grace period: sending SIGKILL");
      send_all(SIGKILL);
      killed_ = true;
    }
    if (!stopping_ && options_.timeout_s > 0 &&
        now - started_ >= std::chrono::duration<double>(options_.timeout_s)) {
      say("timeout: the job ran longer than --timeout-s " + seconds_text(options_.timeout_s) + "; stopping " +
          ranks_word(running_count()));
      begin_stop(SIGTERM, options_.failure_grace, 124);
    }
  }
  print_hidden_tails();
  if (!failed_ranks_.empty())
    say(std::to_string(failed_ranks_.size()) + " of " + ranks_word(static_cast<int>(ranks_.size())) +
        " failed; the first was rank " + std::to_string(failed_ranks_.front()));
  return exit_code_;
}

void Supervisor::poll_once() {
  std::vector<pollfd> fds{{signal_fd(), POLLIN, 0}};
  for (auto& r : ranks_)
    for (int fd : {r.child.stdout_fd, r.child.stderr_fd})
      if (fd >= 0) fds.push_back({fd, POLLIN, 0});
  int wait_ms = kPollCapMs;
  if (stopping_ && !killed_) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(kill_at_ - Clock::now()).count();
    wait_ms = static_cast<int>(std::clamp<long long>(left, 0, kPollCapMs));
  }
  int n = ::poll(fds.data(), fds.size(), wait_ms);
  if (n <= 0) return;  // timeout or EINTR: the caller reaps and checks deadlines
  for (auto& r : ranks_) {
    read_from(r.child.stdout_fd, *r.out);
    read_from(r.child.stderr_fd, *r.err);
  }
}

// Reads what is available now (non-blocking); closes the descriptor at EOF.
void Supervisor::read_from(int& fd, LineStream& stream) {
  char buf[64 * 1024];
  while (fd >= 0) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      stream.feed(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    stream.finish();  // EOF or a read error
    close_fd(fd);
  }
}

void Supervisor::reap() {
  for (auto& r : ranks_) {
    if (!r.child.running) continue;
    int status = 0;
    pid_t p = ::waitpid(r.child.pid, &status, WNOHANG);
    if (p != r.child.pid) continue;
    r.child.running = false;
    r.child.wait_status = status;
    // Everything the rank wrote is in the pipes now; a process it left behind may keep them open, so read
    // what is there and stop listening.
    read_from(r.child.stdout_fd, *r.out);
    read_from(r.child.stderr_fd, *r.err);
    r.out->finish();
    r.err->finish();
    close_fd(r.child.stdout_fd);
    close_fd(r.child.stderr_fd);
    on_exit(r);
  }
}

void Supervisor::on_exit(Rank& r) {
  const Child& c = r.child;
  std::string who = "rank " + std::to_string(c.rank) + " (pid " + std::to_string(c.pid) + ")";
  if (exited_cleanly(c.wait_status)) return;
  if (c.signalled_by_us) {
    say(who + " stopped: " + describe_wait_status(c.wait_status));
    return;
  }
  say(who + " " + describe_wait_status(c.wait_status));
  failed_ranks_.push_back(c.rank);
  if (!stopping_) {
    int others = running_count();
    if (others > 0)
      say("stopping the other " + ranks_word(others) + " (SIGTERM, SIGKILL after " +
          seconds_text(options_.failure_grace.count() / 1000.0) + ")");
    begin_stop(SIGTERM, options_.failure_grace, failure_exit_code(c.wait_status));
  }
}

void Supervisor::begin_stop(int sig, std::chrono::milliseconds grace, int exit_code) {
  stopping_ = true;
  exit_code_ = exit_code;
  kill_at_ = Clock::now() + grace;
  send_all(sig);
}

void Supervisor::send_all(int sig) {
  for (auto& r : ranks_) {
    if (!r.child.running) continue;
    r.child.signalled_by_us = true;
    // The rank's whole process group (see spawn_child); the pid alone if the group is already gone.
    if (::kill(-r.child.pid, sig) != 0) ::kill(r.child.pid, sig);
  }
}

void Supervisor::kill_all_now() {
  send_all(SIGKILL);
  for (auto& r : ranks_) {
    if (!r.child.running) continue;
    while (::waitpid(r.child.pid, &r.child.wait_status, 0) < 0 && errno == EINTR) {
    }
    r.child.running = false;
    close_fd(r.child.stdout_fd);
    close_fd(r.child.stderr_fd);
  }
}

void Supervisor::print_hidden_tails() const {
  for (int rank : failed_ranks_) {
    for (const auto& r : ranks_) {
      if (r.child.rank != rank || r.err->tail().empty()) continue;
      say("last " + std::to_string(r.err->tail().size()) + " stderr lines of rank " + std::to_string(rank) + ":");
      for (const auto& line : r.err->tail()) write_all(STDERR_FILENO, "[rank " + std::to_string(rank) + "] " + line + "\n");
    }
  }
}

}  // namespace bmtrun
