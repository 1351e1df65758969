// Test helper: makes one Block's reduced gradient non-finite on rank 0 only (the first element of its first
// non-empty gradient shard becomes +inf), so tests can check that a step refuses or withholds a poisoned update
// even when the other ranks saw finite gradients. RAII: the grad-ready hook is removed when this goes out of scope.
#pragma once

#include <ATen/ATen.h>

#include <limits>

#include "bmt/engine/block.h"
#include "bmt/runtime/init.h"
#include "bmt/params/param_meta.h"

namespace tiny {

class InfGradOnRank0 {
 public:
  explicit InfGradOnRank0(const bmt::Block* poisoned)
      : id_(bmt::add_grad_ready_hook([poisoned](bmt::Block& b) {
          if (&b != poisoned || bmt::rank() != 0) return;
          for (auto& p : b.module()->parameters()) {
            at::Tensor g = bmt::main_grad(p);
            if (g.defined() && g.numel() > 0) {
              g.view(-1).narrow(0, 0, 1).fill_(std::numeric_limits<float>::infinity());
              return;
            }
          }
        })) {}
  ~InfGradOnRank0() { bmt::remove_grad_ready_hook(id_); }
  InfGradOnRank0(const InfGradOnRank0&) = delete;
  InfGradOnRank0& operator=(const InfGradOnRank0&) = delete;

 private:
  int id_;
};

}  // namespace tiny
