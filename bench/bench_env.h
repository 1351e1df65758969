// Facts about the run that every benchmark records in its JSON lines: the source commit and the machine.
#pragma once

#include <string>

namespace bench {

// First line of a shell command's output, trailing whitespace removed ("" on failure).
std::string shell_line(const std::string& cmd);
// BMT_GIT_COMMIT, else `git rev-parse --short HEAD` of the source tree, else "unknown".
std::string git_commit();
// BMT_BENCH_MACHINE, else the host name.
std::string machine_name();
// The current UTC time as 2026-01-31T12:00:00Z.
std::string utc_now();
// A JSON string literal (quotes and backslashes escaped, control characters as spaces).
std::string json_str(const std::string& s);
// A JSON number with `precision` significant digits; null when not finite.
std::string json_num(double v, int precision = 6);
// The number after `key` in a /proc file ("VmHWM:" of /proc/self/status, "read_bytes:" of /proc/self/io); -1 if absent.
double proc_value(const char* file, const char* key);

}  // namespace bench
