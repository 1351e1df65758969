#include "bmt/init.h"
#include <cstdio>
int main() {
  bmt::InitOptions o;
  o.backend = bmt::Backend::kGloo;
  bmt::init_distributed(o);
  std::printf("consumer: world %d rank %d\n", bmt::world_size(), bmt::rank());
  bmt::finalize();
}
