#include "run_ranks.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <ftw.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace bmt::testing {
namespace {

std::string current_test_name() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return info ? std::string(info->test_suite_name()) + "." + info->name() : std::string();
}

// Counts run_ranks calls within the current test so a child runs only the call it was started for.
int next_call_index() {
  static std::string test;
  static int count = 0;
  std::string now = current_test_name();
  if (now != test) {
    test = now;
    count = 0;
  }
  return count++;
}

std::string tail_of(const std::string& path, size_t max_bytes = 3000) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > max_bytes ? "..." + s.substr(s.size() - max_bytes) : s;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

// Not std::filesystem::remove_all: libtorch.so exports an incompatible one that crashes (tests/examples).
void remove_tree(const std::string& dir) {
  nftw(dir.c_str(), [](const char* path, const struct stat*, int, FTW*) { return std::remove(path); }, 16,
       FTW_DEPTH | FTW_PHYS);
}

// Set when a rank process runs the body it was started for; checked when the process exits.
bool g_body_reached = false;

void fail_if_body_not_reached() {
  if (g_body_reached) return;
  const char msg[] =
      "run_ranks: this rank process ended without reaching the run_ranks call it was started for (the test took "
      "another path in the child than in the parent); failing instead of passing silently\n";
  fflush(stdout);
  if (write(STDERR_FILENO, msg, sizeof(msg) - 1) < 0) {
  }
  _exit(3);  // safe inside an exit handler, unlike exit()
}

// Registered before main in every rank process (this file is linked into every test that forks ranks).
const bool g_exit_check_registered = [] {
  if (std::getenv("BMT_TEST_CHILD_CALL")) std::atexit(fail_if_body_not_reached);
  return true;
}();

}  // namespace

bool in_rank_process() { return std::getenv("BMT_TEST_CHILD_CALL") != nullptr; }

bmt::InitOptions test_init() {
  bmt::InitOptions o;
  o.backend = bmt::Backend::kGloo;
  o.quiet = true;
  o.timeout = std::chrono::seconds(60);
  return o;
}

PortReservation::PortReservation() {
  fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw std::runtime_error(std::string("PortReservation: socket: ") + strerror(errno));
  int on = 1;
  setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);  // covers the 127.0.0.1 and 0.0.0.0 binds of a TCPStore
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    close(fd_);
    throw std::runtime_error(std::string("PortReservation: cannot bind port 0: ") + strerror(err));
  }
  port_ = ntohs(addr.sin_port);
}

PortReservation::~PortReservation() {
  if (fd_ >= 0) close(fd_);
}

std::string run_dir() {
  const char* dir = std::getenv("BMT_TEST_RUN_DIR");
  if (!dir) throw std::runtime_error("run_dir() is only valid inside a rank process started by run_ranks");
  return dir;
}

RankRunReport run_ranks(int world_size, const std::function<void()>& body, bmt::InitOptions init,
                        RankRunOptions run) {
  const int call = next_call_index();
  RankRunReport report;
  if (const char* child_call = std::getenv("BMT_TEST_CHILD_CALL")) {
    if (std::atoi(child_call) != call) return report;  // another call of this test
    g_body_reached = true;
    try {
      bmt::init_distributed(init);
      body();
      bmt::finalize(!::testing::Test::HasFailure());
    } catch (const std::exception& e) {
      ADD_FAILURE() << "rank " << std::getenv("RANK") << ": exception: " << e.what();
    }
    return report;
  }

  const std::string test = current_test_name();
  char dir_template[] = "/tmp/bmt_ranks_XXXXXX";
  std::string dir = mkdtemp(dir_template);
  const PortReservation reservation;  // held until every rank has exited
  const int port = reservation.port();
  std::vector<pid_t> pids(world_size);
  std::vector<std::string> logs(world_size);
  for (int r = 0; r < world_size; ++r) {
    logs[r] = dir + "/rank" + std::to_string(r) + ".log";
    pid_t pid = fork();
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(world_size).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("BMT_TEST_CHILD_CALL", std::to_string(call).c_str(), 1);
      setenv("BMT_TEST_RUN_DIR", dir.c_str(), 1);
      setenv("OMP_NUM_THREADS", "1", 0);
      FILE* f = std::freopen(logs[r].c_str(), "w", stdout);
      (void)f;
      dup2(fileno(stdout), fileno(stderr));
      std::string filter = "--gtest_filter=" + test;
      execl("/proc/self/exe", "/proc/self/exe", filter.c_str(), "--gtest_brief=1", static_cast<char*>(nullptr));
      _exit(127);
    }
    pids[r] = pid;
  }
  std::vector<int> status(world_size, -1);
  std::vector<bool> done(world_size, false);
  int remaining = world_size;
  auto deadline = std::chrono::steady_clock::now() + run.wall_timeout;
  bool timed_out = false;
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < world_size; ++r) {
      if (done[r]) continue;
      int st = 0;
      if (waitpid(pids[r], &st, WNOHANG) == pids[r]) {
        done[r] = true;
        status[r] = st;
        --remaining;
        progressed = true;
        bool ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        if (!ok && run.kill_on_first_failure)
          for (int o = 0; o < world_size; ++o)
            if (!done[o]) kill(pids[o], SIGKILL);
      }
    }
    if (remaining > 0 && std::chrono::steady_clock::now() > deadline) {
      timed_out = true;
      for (int o = 0; o < world_size; ++o)
        if (!done[o]) kill(pids[o], SIGKILL);
      deadline = std::chrono::steady_clock::now() + std::chrono::hours(1);
    }
    if (!progressed) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::ostringstream os;
  for (int r = 0; r < world_size; ++r) {
    bool ok = WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0;
    if (ok) continue;
    report.all_ok = false;
    os << "rank " << r << " of " << world_size << " failed (" << describe_status(status[r])
       << (timed_out ? ", run timed out" : "") << "); its output:\n"
       << tail_of(logs[r]) << "\n";
  }
  report.summary = os.str();
  if (!report.all_ok && !run.expect_failure) ADD_FAILURE() << test << " at world size " << world_size << ":\n" << report.summary;
  // Keep the logs of an unexpected failure for inspection; otherwise (success, or a fault test that expected the
  // failure and got the report) clean up.
  if (report.all_ok || run.expect_failure) {
    remove_tree(dir);
  }
  return report;
}

}  // namespace bmt::testing
