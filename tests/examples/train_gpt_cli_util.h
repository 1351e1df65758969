// Helpers of the train_gpt end-to-end tests (test_train_gpt_cli_multirank.cpp, test_train_gpt_kill_resume_multirank
// .cpp): the real bmtrun and train_gpt binaries run under coreutils `timeout` (a hang fails a test instead of
// blocking the suite), their output captured.
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

namespace cli_test {

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

// The options of a small, fast run of the tiny preset on `nproc` ranks (without the bmtrun prefix).
inline std::string small_run_options() {
  return " --batch 8 --seq 40 --eval-batches 1 --task-rows 16 --eval-every 1000 --samples 0"
         " --progress lines --log-every 1 ";
}

// A small, fast run of the tiny preset; `extra` adds or overrides options.
inline Result train(int nproc, const std::string& extra, const std::string& prefix = "") {
  return run_shell(prefix + kBmtrun + " --nproc " + std::to_string(nproc) + " " + kTrain + small_run_options() +
                   extra);
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

// Every name in root starting with "step_" (temporary "step_*.tmp-*" folders included), sorted.
inline std::vector<std::string> step_folders(const std::string& root) {
  Result r = run_shell("ls -1 " + quote(root));
  std::vector<std::string> out;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);)
    if (line.rfind("step_", 0) == 0) out.push_back(line);
  return out;
}

inline std::string step_name(int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08ld", static_cast<long>(step));
  return name;
}

// Nothing a user should see by default: torch's C++ backtraces.
inline void expect_no_backtrace(const std::string& out) {
  EXPECT_FALSE(contains(out, "Exception raised from")) << out;
  EXPECT_FALSE(contains(out, "frame #")) << out;
}

// One training step's line of a --metrics file, the values read back exactly (the file prints every double with
// the digits that round-trip).
struct StepMetrics {
  int64_t step = 0;
  double loss = 0, grad_norm = 0, lr = 0;
};

inline double metric_value(const std::string& line, const std::string& key) {
  const std::string tag = "\"" + key + "\": ";
  const size_t at = line.find(tag);
  if (at == std::string::npos) {
    ADD_FAILURE() << "no " << key << " in " << line;
    return 0;
  }
  return std::strtod(line.c_str() + at + tag.size(), nullptr);
}

// Every step line (step >= 1) in file order; a resumed run appends, so a step may appear more than once.
inline std::vector<StepMetrics> read_step_metrics(const std::string& path) {
  std::vector<StepMetrics> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (!contains(line, "\"grad_norm\": ")) continue;  // the step-0 eval line has no training values
    StepMetrics m;
    m.step = static_cast<int64_t>(metric_value(line, "step"));
    m.loss = metric_value(line, "loss");
    m.grad_norm = metric_value(line, "grad_norm");
    m.lr = metric_value(line, "lr");
    out.push_back(m);
  }
  return out;
}

// Every line of `run` equals the reference's line of the same step, bit for bit (loss, gradient norm, learning
// rate); every step first..last (default: all of the reference's) appears in `run`.
inline void expect_same_steps(const std::vector<StepMetrics>& reference, const std::vector<StepMetrics>& run,
                              const std::string& what, int64_t first = 1, int64_t last = -1) {
  if (last < 0) last = static_cast<int64_t>(reference.size());
  ASSERT_FALSE(reference.empty()) << what;
  std::vector<int> seen(reference.size() + 1, 0);
  for (const StepMetrics& m : run) {
    ASSERT_GE(m.step, 1) << what;
    ASSERT_LE(m.step, static_cast<int64_t>(reference.size())) << what;
    const StepMetrics& r = reference[static_cast<size_t>(m.step - 1)];
    ASSERT_EQ(r.step, m.step) << "the reference's lines are steps 1..N in order: " << what;
    EXPECT_EQ(m.loss, r.loss) << what << ": loss of step " << m.step;
    EXPECT_EQ(m.grad_norm, r.grad_norm) << what << ": gradient norm of step " << m.step;
    EXPECT_EQ(m.lr, r.lr) << what << ": learning rate of step " << m.step;
    ++seen[static_cast<size_t>(m.step)];
  }
  for (int64_t s = first; s <= last && s < static_cast<int64_t>(seen.size()); ++s)
    EXPECT_GE(seen[static_cast<size_t>(s)], 1) << what << ": step " << s << " never ran";
}

}  // namespace cli_test
