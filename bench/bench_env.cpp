#include "bench_env.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace bench {

std::string shell_line(const std::string& cmd) {
  std::string out;
  if (FILE* f = popen(cmd.c_str(), "r")) {
    char buf[256];
    if (fgets(buf, sizeof(buf), f)) out = buf;
    pclose(f);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r' || out.back() == ' ')) out.pop_back();
  return out;
}

std::string git_commit() {
  if (const char* c = std::getenv("BMT_GIT_COMMIT"); c && *c) return c;
  std::string c = shell_line(std::string("git -C '") + BMT_SOURCE_DIR + "' rev-parse --short HEAD 2>/dev/null");
  return c.empty() ? "unknown" : c;
}

std::string machine_name() {
  if (const char* m = std::getenv("BMT_BENCH_MACHINE"); m && *m) return m;
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace bench
