// Helpers of the train_gpt command-line tests: the real bmtrun and train_gpt binaries run through `sh -c` under
// coreutils `timeout` (a hang fails a test instead of blocking the suite), their output and exit status captured,
// and the checkpoint folders inspected from the outside.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace train_cli {

inline const std::string kBmtrun = BMTRUN_PATH;
inline const std::string kTrain = TRAIN_GPT_PATH;
inline const std::string kCkpt = BMT_CKPT_PATH;

struct Result {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
};

inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

inline Result run_shell(const std::string& shell, int limit_s = 240) {
  const std::string cmd = "timeout -k 5 " + std::to_string(limit_s) + " sh -c " + quote(shell + " 2>&1");
  const auto t0 = std::chrono::steady_clock::now();
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// A small, fast run of the tiny preset; `extra` adds or overrides options.
inline Result train(int nproc, const std::string& extra, const std::string& prefix = "") {
  return run_shell(prefix + kBmtrun + " --nproc " + std::to_string(nproc) + " " + kTrain +
                   " --batch 8 --seq 40 --eval-batches 1 --task-rows 16 --eval-every 1000 --samples 0"
                   " --progress lines --log-every 1 " + extra);
}

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

inline int count(const std::string& text, const std::string& part) {
  int n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

inline std::string temp_root(const std::string& name) {
  std::string tmpl = "/tmp/bmt_cli_" + name + "_XXXXXX";
  EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

inline void remove_root(const std::string& root) { EXPECT_EQ(std::system(("rm -rf " + quote(root)).c_str()), 0); }

inline std::string latest_of(const std::string& root) {
  std::string name;
  std::ifstream(root + "/latest") >> name;
  return name;
}

inline std::vector<std::string> step_folders(const std::string& root) {
  Result r = run_shell("ls -1 " + quote(root));
  std::vector<std::string> out;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("step_", 0) == 0) out.push_back(line);
  return out;
}

// Nothing a user should see by default: torch's C++ backtraces.
inline void expect_no_backtrace(const std::string& out) {
  EXPECT_FALSE(contains(out, "Exception raised from")) << out;
  EXPECT_FALSE(contains(out, "frame #")) << out;
}

}  // namespace train_cli
