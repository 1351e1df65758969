// A test-only hook that makes one rank of train_gpt SIGKILL itself at a named point, so that crash/resume tests
// (tests/examples/test_train_gpt_kill_resume_multirank.cpp) hit "during a save" deterministically instead of
// racing a timer. Off unless the environment variable is set:
//   BMT_TRAIN_TEST_KILL=<point>:<step>:<rank>
//     step    rank <rank> dies in step <step> (1-based), after its backward and before the optimizer update
//     save    rank <rank> dies at its first write() into step <step>'s temporary checkpoint folder (the shard
//             file; rank 0 also writes checkpoint.meta there): with --async-save this happens on the background
//             writer thread while training goes on
//     commit  rank <rank> dies after step <step>'s checkpoint folder is committed, before `latest` moves
// A malformed value is an error (nothing is silently ignored).
#pragma once

#include <cstdint>
#include <string>

namespace examples {

// Reads BMT_TRAIN_TEST_KILL (after init_distributed: needs the rank) and installs the write hook for "save".
void install_test_kill_hook();
// SIGKILLs this process when BMT_TRAIN_TEST_KILL names this point, step and rank.
void test_kill_point(const std::string& point, int64_t step);

}  // namespace examples
