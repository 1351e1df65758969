#include "train/test_kill.h"

#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "bmt/checkpoint/file_io.h"
#include "bmt/core/error.h"
#include "bmt/runtime/distributed.h"
#include "train/checkpoint.h"

namespace examples {

namespace {

struct KillSpec {
  std::string point;
  int64_t step = -1;
  int rank = -1;
};

KillSpec& spec() {
  static KillSpec s;
  return s;
}

[[noreturn]] void die(const char* point, int64_t step) {
  std::fprintf(stderr, "train_gpt: BMT_TRAIN_TEST_KILL: rank %d kills itself at %s of step %ld\n",
               bmt::config().rank, point, static_cast<long>(step));
  std::fflush(stderr);
  ::raise(SIGKILL);
  std::abort();  // not reached
}

}  // namespace

void install_test_kill_hook() {
  const char* env = std::getenv("BMT_TRAIN_TEST_KILL");
  if (!env || !*env) return;
  const std::string v = env;
  const size_t a = v.find(':'), b = a == std::string::npos ? a : v.find(':', a + 1);
  KillSpec s;
  if (b != std::string::npos) {
    s.point = v.substr(0, a);
    char* end = nullptr;
    s.step = std::strtoll(v.c_str() + a + 1, &end, 10);
    const bool step_ok = end == v.c_str() + b;
    s.rank = static_cast<int>(std::strtol(v.c_str() + b + 1, &end, 10));
    if (!step_ok || *end != '\0') s.point.clear();
  }
  BMT_CHECK((s.point == "step" || s.point == "save" || s.point == "commit") && s.step > 0 && s.rank >= 0,
            "BMT_TRAIN_TEST_KILL='", v, "' must be <step|save|commit>:<step >= 1>:<rank>");
  spec() = s;
  if (s.point != "save" || s.rank != bmt::config().rank) return;
  const std::string tmp_part = "/" + step_dir_name(s.step) + ".tmp-";
  bmt::checkpoint::set_write_hook([tmp_part, step = s.step](const std::string& path, int64_t, int64_t) {
    if (path.find(tmp_part) != std::string::npos) die("save", step);
  });
}

void test_kill_point(const std::string& point, int64_t step) {
  const KillSpec& s = spec();
  if (s.point == point && s.step == step && s.rank == bmt::config().rank) die(point.c_str(), step);
}

}  // namespace examples
