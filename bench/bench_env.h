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

}  // namespace bench
