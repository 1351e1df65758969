// bmtrun's own signal handling: SIGINT, SIGTERM and SIGCHLD are turned into bytes on a self-pipe, so the
// supervisor's poll() wakes up for them without races; SIGPIPE is ignored (a closed stdout must not kill the
// launcher while ranks still run).
#pragma once

#include <vector>

namespace bmtrun {

void install_signal_handlers();
// Read end of the self-pipe, for poll().
int signal_fd();
// Signals received since the last call, in arrival order.
std::vector<int> take_signals();
// In a forked child before exec: default dispositions again (an ignored signal would survive exec).
void restore_default_signals();

// "SIGSEGV" for 11; "SIG<n>" for numbers without a name here.
const char* signal_name(int sig);

}  // namespace bmtrun
