#include "bench_env.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <sstream>

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

std::string utc_now() {
  char buf[32];
  std::time_t t = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

std::string json_str(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\', o += c;
    else if (static_cast<unsigned char>(c) < 0x20) o += ' ';
    else o += c;
  }
  return o + "\"";
}

std::string json_num(double v, int precision) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os.precision(precision);
  os << v;
  return os.str();
}

double proc_value(const char* file, const char* key) {
  std::ifstream in(file);
  std::string k;
  while (in >> k) {
    double v = -1;
    if (k == key) return (in >> v) ? v : -1;
    in.ignore(1 << 16, '\n');
  }
  return -1;
}

}  // namespace bench
