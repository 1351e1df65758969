// A find_package(bmtrain) consumer: every installed API header must compile without the implementation-only
// (*_internal.h, not installed) ones.
#include <cstdio>
#include <type_traits>

#include "bmt/bmt.h"
#include "bmt/checkpoint/checkpoint.h"

static_assert(std::is_move_constructible_v<bmt::optim::OffloadOverlap>, "the overlap handle is movable");

int main() {
  bmt::InitOptions o;
  o.backend = bmt::Backend::kGloo;
  bmt::init_distributed(o);
  std::printf("consumer: world %d rank %d\n", bmt::world_size(), bmt::rank());
  bmt::finalize();
}
