// Picks the rendezvous port of a single-node job.
#pragma once

namespace bmtrun {

// A TCP port that was free a moment ago (the kernel's choice for port 0). Throws std::runtime_error.
int pick_free_port();

}  // namespace bmtrun
