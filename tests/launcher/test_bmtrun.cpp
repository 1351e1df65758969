// bmtrun end to end: the real launcher binary runs fake_rank (see fake_rank.cpp) or bmt-demo-runtime, and the
// tests check its environment, output relaying, failure handling, signal forwarding and usage errors; the last
// one smoke-tests bmt-bench-comm through it.
// Every command runs under coreutils `timeout`, so a broken launcher fails a test instead of hanging it.
// Timing: the ranks that should be stopped sleep kSleepS = 60 s; "stopped promptly" means well under that (the
// bound kPromptS = 30 s holds on a loaded 2-core machine, where starting ranks can take seconds). Ordering between
// ranks or with the test uses files (fake_rank touch / wait-file, polling the output), never a sleep.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>

namespace {

const std::string kBmtrun = BMTRUN_PATH;
const std::string kFake = FAKE_RANK_PATH;
const std::string kDemo = DEMO_RUNTIME_PATH;
const std::string kBench = BENCH_COMM_PATH;

struct Result {
  int exit_code = -1;  // the shell's: 124 also when `timeout` had to stop the command
  std::string output;
  double seconds = 0;
};

// Runs `sh -c <shell>` (bounded by `limit_s`) and captures its stdout.
Result run_shell(const std::string& shell, int limit_s = 20) {
  std::string quoted = "'";
  for (char c : shell) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  std::string cmd = "timeout -k 2 " + std::to_string(limit_s) + " sh -c " + quoted;
  auto t0 = std::chrono::steady_clock::now();
  FILE* p = ::popen(cmd.c_str(), "r");
  Result r;
  if (!p) return r;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  int status = ::pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// bmtrun with `args`, stdout and stderr together.
Result bmtrun(const std::string& args, int limit_s = 20) { return run_shell(kBmtrun + " " + args + " 2>&1", limit_s); }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

constexpr const char* kSleep = "sleep=60";  // ranks that must be stopped, not waited for
constexpr double kPromptS = 30;              // "stopped promptly": far below the 60 s sleep
constexpr int kLimitS = 90;                  // the shell's bound for such runs

// A free port kept bound (SO_REUSEADDR, not listening) while the object lives, so parallel jobs are not handed it
// before rank 0's store binds it (bmtrun does the same for its own pick; the store sets SO_REUSEADDR too).
class ReservedPort {
 public:
  ReservedPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int on = 1;
    ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof addr;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0)
      port_ = ntohs(addr.sin_port);
  }
  ~ReservedPort() { ::close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A fresh temporary file name (the file is created empty and removed with the object).
struct TempPath {
  TempPath() {
    char tmpl[] = "/tmp/bmtrun_test_XXXXXX";
    int fd = ::mkstemp(tmpl);
    if (fd >= 0) ::close(fd);
    path = tmpl;
  }
  ~TempPath() { ::unlink(path.c_str()); }
  std::string path;
};

// "[rank R] RANK=.. ..." lines of fake_rank's `env` action, by the R of the prefix.
std::map<int, std::map<std::string, std::string>> env_lines(const std::string& output) {
  std::map<int, std::map<std::string, std::string>> by_rank;
  std::regex line_re(R"(^\[rank (\d+)\] (RANK=.*)$)");
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (!std::regex_match(line, m, line_re)) continue;
    std::istringstream fields(m[2].str());
    for (std::string kv; fields >> kv;) {
      auto eq = kv.find('=');
      by_rank[std::stoi(m[1].str())][kv.substr(0, eq)] = kv.substr(eq + 1);
    }
  }
  return by_rank;
}

TEST(Bmtrun, SetsTorchrunEnvironmentPerRank) {
  Result r = bmtrun("--nproc 3 " + kFake + " env");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto env = env_lines(r.output);
  ASSERT_EQ(env.size(), 3u) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    auto& e = env[rank];
    EXPECT_EQ(e["RANK"], std::to_string(rank));
    EXPECT_EQ(e["WORLD_SIZE"], "3");
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "3");
    EXPECT_EQ(e["GROUP_RANK"], "0");
    EXPECT_EQ(e["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(e["MASTER_PORT"], env[0]["MASTER_PORT"]) << "every rank must rendezvous on the same port";
  }
  int port = std::stoi(env[0]["MASTER_PORT"]);
  EXPECT_GT(port, 0);
  EXPECT_LE(port, 65535);
}

TEST(Bmtrun, MultiNodeRanksAndDefaultPort) {
  Result r = bmtrun("--nproc 2 --nnodes 3 --node-rank 2 --master-addr=10.1.2.3 " + kFake + " env");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto env = env_lines(r.output);
  ASSERT_EQ(env.size(), 2u) << r.output;
  for (int local = 0; local < 2; ++local) {
    auto& e = env[4 + local];  // node 2 of 2-process nodes holds ranks 4 and 5
    EXPECT_EQ(e["RANK"], std::to_string(4 + local));
    EXPECT_EQ(e["WORLD_SIZE"], "6");
    EXPECT_EQ(e["LOCAL_RANK"], std::to_string(local));
    EXPECT_EQ(e["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(e["GROUP_RANK"], "2");
    EXPECT_EQ(e["MASTER_ADDR"], "10.1.2.3");
    EXPECT_EQ(e["MASTER_PORT"], "29500");
  }
  Result explicit_port = bmtrun("--nproc 1 --master-port 31234 " + kFake + " env");
  EXPECT_EQ(env_lines(explicit_port.output)[0]["MASTER_PORT"], "31234") << explicit_port.output;
}

TEST(Bmtrun, PrefixesLinesAndKeepsStdoutAndStderrApart) {
  char err_path[] = "/tmp/bmtrun_test_stderr_XXXXXX";
  int fd = ::mkstemp(err_path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  Result r = run_shell(kBmtrun + " --nproc 2 " + kFake + " out=hello err=oops partial=no-newline 2>" + err_path);
  std::ifstream err_file(err_path);
  std::string err((std::istreambuf_iterator<char>(err_file)), std::istreambuf_iterator<char>());
  ::unlink(err_path);
  ASSERT_EQ(r.exit_code, 0) << r.output << err;
  for (int rank = 0; rank < 2; ++rank) {
    std::string prefix = "[rank " + std::to_string(rank) + "] ";
    EXPECT_TRUE(contains(r.output, prefix + "hello\n")) << r.output;
    EXPECT_TRUE(contains(r.output, prefix + "no-newline\n")) << "a last line without '\\n' is still relayed\n"
                                                             << r.output;
    EXPECT_TRUE(contains(err, prefix + "oops\n")) << err;
  }
  EXPECT_FALSE(contains(r.output, "oops")) << r.output;
}

TEST(Bmtrun, FindsProgramsInPathAndGivesRanksNoStdin) {
  Result r = run_shell("echo some-input | " + kBmtrun + " --nproc 2 echo hi 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] hi\n")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] hi\n")) << r.output;
  Result in = run_shell("echo some-input | " + kBmtrun + " --nproc 1 " + kFake + " stdin 2>&1");
  EXPECT_TRUE(contains(in.output, "[rank 0] stdin-bytes=0")) << in.output;
}

TEST(Bmtrun, FailingRankIsNamedAndOthersStopPromptly) {
  Result r = bmtrun("--nproc 3 " + kFake + " @1:exit=3 " + kSleep, kLimitS);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(bmtrun: rank 1 \(pid \d+\) exited with code 3)"))) << r.output;
  EXPECT_TRUE(contains(r.output, "the first was rank 1")) << r.output;
  EXPECT_LT(r.seconds, kPromptS) << "the sleeping ranks must be stopped, not waited for\n" << r.output;
}

TEST(Bmtrun, RankKilledBySignalIsNamedWithTheSignal) {
  struct Case {
    const char* sig;
    int number;
  };
  for (Case c : {Case{"SEGV", 11}, Case{"KILL", 9}}) {
    Result r = bmtrun("--nproc 2 " + kFake + " @0:signal=" + c.sig + " " + kSleep, kLimitS);
    EXPECT_EQ(r.exit_code, 128 + c.number) << r.output;
    std::string expected = std::string("was killed by signal SIG") + c.sig + " (" + std::to_string(c.number) + ")";
    EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(bmtrun: rank 0 \(pid \d+\) )" +
                                                       std::string("was killed by signal SIG") + c.sig)))
        << r.output;
    EXPECT_TRUE(contains(r.output, expected)) << r.output;
    EXPECT_LT(r.seconds, kPromptS) << r.output;
  }
}

TEST(Bmtrun, RankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  // Rank 1 fails only once rank 0 ignores SIGTERM (rank 0 touches a file after), else under load the SIGTERM can
  // arrive before rank 0 got that far and the grace period is never needed.
  TempPath ignoring;
  ::unlink(ignoring.path.c_str());
  Result r = bmtrun("--nproc 2 " + kFake + " ignore-term @0:touch=" + ignoring.path + " @1:wait-file=" + ignoring.path +
                        " @1:exit=2 " + kSleep,
                    kLimitS);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "still running after the grace period: sending SIGKILL")) << r.output;
  EXPECT_TRUE(contains(r.output, "killed by signal SIGKILL")) << r.output;
  EXPECT_GE(r.seconds, 4.5) << r.output;  // the grace period is 5 s
  EXPECT_LT(r.seconds, kPromptS) << r.output;
}

TEST(Bmtrun, RankZeroOnlyHidesOthersButShowsTheFailingRanksStderrTail) {
  // Rank 2 fails only once rank 0 has printed (rank 0 touches a file after printing), then lets bmtrun relay it.
  TempPath printed;
  ::unlink(printed.path.c_str());
  Result r = bmtrun("--rank0-only --nproc 3 " + kFake + " out=hello @0:touch=" + printed.path +
                        " @2:err=why-i-failed @2:wait-file=" + printed.path + " @2:sleep=0.5 @2:exit=3 " + kSleep,
                    kLimitS);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] hello")) << r.output;
  EXPECT_FALSE(contains(r.output, "[rank 1] hello")) << r.output;
  EXPECT_FALSE(contains(r.output, "[rank 2] hello")) << r.output;
  EXPECT_TRUE(contains(r.output, "rank 2 (pid")) << r.output;
  EXPECT_TRUE(contains(r.output, "stderr lines of rank 2:\n[rank 2] why-i-failed")) << r.output;
  EXPECT_LT(r.seconds, kPromptS) << r.output;
}

TEST(Bmtrun, ForwardsSigintAndSigterm) {
  for (auto [sig, number] : {std::pair<const char*, int>{"INT", 2}, {"TERM", 15}}) {
    // Background jobs of a non-interactive shell start with SIGINT ignored; bmtrun installs its own handler.
    // The signal is sent once both ranks have printed (bmtrun installed its handler before starting them), polled
    // in bmtrun's output file rather than guessed with a sleep.
    TempPath out;
    Result r = run_shell(kBmtrun + " --nproc 2 " + kFake + " out=started " + kSleep + " >" + out.path +
                             " 2>&1 & pid=$!; while [ $(grep -c started " + out.path +
                             ") -lt 2 ]; do sleep 0.05; done; kill -" + sig + " $pid; wait $pid; rc=$?; cat " +
                             out.path + "; exit $rc",
                         kLimitS);
    EXPECT_EQ(r.exit_code, 128 + number) << r.output;
    EXPECT_TRUE(contains(r.output, std::string("received SIG") + sig + ", forwarding it to 2 ranks")) << r.output;
    EXPECT_TRUE(contains(r.output, std::string("stopped: was killed by signal SIG") + sig)) << r.output;
    EXPECT_LT(r.seconds, kPromptS) << r.output;
  }
}

TEST(Bmtrun, TimeoutStopsTheJob) {
  Result r = bmtrun("--timeout-s 1 --nproc 2 " + kFake + " " + kSleep, kLimitS);
  EXPECT_EQ(r.exit_code, 124) << r.output;
  EXPECT_TRUE(contains(r.output, "timeout: the job ran longer than --timeout-s 1 s")) << r.output;
  EXPECT_LT(r.seconds, kPromptS) << r.output;
}

TEST(Bmtrun, UsageErrorsExitTwoAndNameTheProblem) {
  const std::pair<std::string, std::string> cases[] = {
      {"--bogus " + kFake, "unknown option '--bogus'"},
      {"--nproc 0 " + kFake, "--nproc 0 is out of range: the number of processes to start on this node, 1..4096"},
      // Past 32 bits: range-checked before narrowing (these used to start 2 ranks and take port 0).
      {"--nproc 4294967298 " + kFake, "--nproc 4294967298 is out of range"},
      {"--master-port 4294967296 " + kFake, "--master-port 4294967296 is out of range: a TCP port, 1..65535"},
      {"--nnodes 4294967297 " + kFake, "--nnodes 4294967297 is out of range"},
      {"--nproc x " + kFake, "--nproc expects an integer, got 'x'"},
      {"--nproc", "option --nproc needs a value"},
      {"--nproc 2", "missing the program to run"},
      {"--nnodes 2 --node-rank 2 " + kFake, "--node-rank 2 is out of range for --nnodes 2: use 0..1"},
      {"--master-port 70000 " + kFake, "--master-port 70000 is out of range: a TCP port, 1..65535"},
  };
  for (const auto& [args, message] : cases) {
    Result r = bmtrun(args);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_TRUE(contains(r.output, "bmtrun: error: " + message)) << args << "\n" << r.output;
  }
  Result help = bmtrun("--help");
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_TRUE(contains(help.output, "usage: bmtrun --nproc N")) << help.output;
}

TEST(Bmtrun, UnexecutableProgramIsReported) {
  Result r = bmtrun("--nproc 2 /nonexistent/program");
  EXPECT_EQ(r.exit_code, 127) << r.output;
  EXPECT_TRUE(contains(r.output, "cannot execute '/nonexistent/program' for rank 0: No such file or directory"))
      << r.output;
}

// The real runtime: init_distributed over Gloo through bmtrun's environment, then collectives.
TEST(Bmtrun, RunsTheRuntimeDemoOnTwoRanks) {
  Result r = run_shell("BMT_TIMEOUT_S=15 " + kBmtrun + " --timeout-s 18 --nproc 2 " + kDemo + " 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] rank 0/2")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 1] rank 1/2")) << r.output;
  EXPECT_TRUE(contains(r.output, "all_gather=[1,1,1,2,2,2] all_reduce=3")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] expected all_reduce = 3 -> OK")) << r.output;
}

// Two simulated nodes of two ranks each on this host, started concurrently like two machines would be.
TEST(Bmtrun, RunsTheRuntimeDemoOnTwoSimulatedNodes) {
  const ReservedPort reserved;  // held until both simulated nodes are done
  const int port = reserved.port();
  ASSERT_GT(port, 0);
  auto node_cmd = [&](int node) {
    return "BMT_TIMEOUT_S=15 " + kBmtrun + " --timeout-s 18 --nnodes 2 --node-rank " + std::to_string(node) +
           " --nproc 2 --master-addr 127.0.0.1 --master-port " + std::to_string(port) + " " + kDemo + " --tp 2 2>&1";
  };
  // Node 1 in the background, node 0 in the foreground: both run at once; the shell reports both statuses.
  Result r = run_shell("(" + node_cmd(1) + "; echo node1-exit=$?) & " + node_cmd(0) + "; echo node0-exit=$?; wait",
                       kLimitS);
  EXPECT_TRUE(contains(r.output, "node0-exit=0")) << r.output;
  EXPECT_TRUE(contains(r.output, "node1-exit=0")) << r.output;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_TRUE(contains(r.output, "[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) + "/4"))
        << r.output;
  EXPECT_TRUE(contains(r.output, "all_gather=[1,1,1,2,2,2,3,3,3,4,4,4] all_reduce=10")) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] expected all_reduce = 10 -> OK")) << r.output;
  EXPECT_LT(r.seconds, 40) << r.output;  // the ranks' own timeouts are 15-18 s
}

// bmt-bench-comm on two Gloo ranks: a short sweep, the table on rank 0 only, one JSON object per row.
TEST(Bmtrun, RunsTheCommBenchmark) {
  char json_path[] = "/tmp/bmt_bench_comm_XXXXXX";
  int fd = ::mkstemp(json_path);
  ASSERT_GE(fd, 0);
  ::close(fd);
  Result r = run_shell("BMT_TIMEOUT_S=15 " + kBmtrun + " --timeout-s 18 --nproc 2 " + kBench +
                       " --backend gloo --min-bytes 1K --max-bytes 8K --iters 2 --warmup 1 --json " + json_path +
                       " 2>&1");
  std::ifstream json_file(json_path);
  std::vector<std::string> json_lines;
  for (std::string line; std::getline(json_file, line);) json_lines.push_back(line);
  ::unlink(json_path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "[rank 0] # bmt-bench-comm: world 2, backend gloo")) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(\[rank 0\]   all_gather +8192 )"))) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(\[rank 0\]   reduce_scatter +1024 )"))) << r.output;
  EXPECT_TRUE(std::regex_search(r.output, std::regex(R"(\[rank 0\]   all_reduce +4096 )"))) << r.output;
  EXPECT_FALSE(contains(r.output, "[rank 1]   all_reduce")) << "only rank 0 prints the table\n" << r.output;
  ASSERT_EQ(json_lines.size(), 12u) << "3 ops x 4 sizes";
  EXPECT_TRUE(contains(json_lines[0], R"({"op":"all_gather","nbytes":1024,"numel":512,"dtype":"bfloat16")"))
      << json_lines[0];
  EXPECT_TRUE(contains(json_lines[11], R"("op":"all_reduce","nbytes":8192)")) << json_lines[11];
  EXPECT_TRUE(contains(json_lines[11], R"("busbw_gbps":)")) << json_lines[11];
}

}  // namespace
