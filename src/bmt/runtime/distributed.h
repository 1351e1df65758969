// bmt::distributed: collectives on at::Tensor (differentiable) and BMTrain's helpers (synchronize, sum_loss,
// gather_result, print_rank).
//
// Gradient convention: the objective is the SUM over ranks of each rank's local loss. Hence
//   all_gather      (ws, *x.shape)     backward: reduce_scatter(sum) of the gradient (BMTrain keeps only the
//                                                local slice, which drops other ranks' contributions)
//   reduce_scatter  (x.shape[0]/ws,..) backward: all_gather of the gradient (/ws for avg)
//   all_reduce      same shape         backward: all_reduce(sum) of the gradient, then per op: avg /ws,
//                                                max/min to the ranks holding the extreme (ties share it evenly),
//                                                prod: product of the other ranks' factors (zeros handled)
//   broadcast       same shape         backward: sum of every rank's gradient, delivered to the root only
//   send/recv_activations              point-to-point with shape/dtype metadata (not differentiable)
// Every op runs on the tensor's current stream (CUDA) and takes the communicator explicitly.
#pragma once

#include <ATen/ATen.h>

#include <iostream>
#include <sstream>

#include "bmt/core/communicator.h"
#include "bmt/runtime/init.h"

namespace bmt::distributed {

at::Tensor all_gather(const at::Tensor& x, core::Communicator& comm);
at::Tensor reduce_scatter(const at::Tensor& x, core::ReduceOp op, core::Communicator& comm);
at::Tensor all_reduce(const at::Tensor& x, core::ReduceOp op, core::Communicator& comm);
at::Tensor broadcast(const at::Tensor& x, int root, core::Communicator& comm);
void send_activations(const at::Tensor& x, int peer, core::Communicator& comm);
at::Tensor recv_activations(int peer, core::Communicator& comm, const at::Device& device);

// Non-differentiable versions (same shapes), on the tensor's current stream.
at::Tensor raw_all_gather(const at::Tensor& x, core::Communicator& comm);
at::Tensor raw_reduce_scatter(const at::Tensor& x, core::ReduceOp op, core::Communicator& comm);
at::Tensor raw_all_reduce(const at::Tensor& x, core::ReduceOp op, core::Communicator& comm);
at::Tensor raw_broadcast(const at::Tensor& x, int root, core::Communicator& comm);

}  // namespace bmt::distributed

namespace bmt {

// Cross-rank barrier over the world that also waits for this rank's queued device work (BMTrain's does not).
void synchronize();
// Mean of `loss` over the world (BMTrain's name; it has always returned the mean).
at::Tensor sum_loss(const at::Tensor& loss);
// All-gathers along dim 0 over the world: (B, ...) -> (B * world, ...).
at::Tensor gather_result(const at::Tensor& x);

// Prints the arguments on one rank (default 0), prefixed with nothing; other ranks do nothing.
template <typename... Args>
void print_rank_on(int on_rank, const Args&... args) {
  if (bmt::rank() != on_rank) return;
  std::ostringstream os;
  (os << ... << args);
  std::cout << os.str() << std::endl;
}
template <typename... Args>
void print_rank(const Args&... args) {
  print_rank_on(0, args...);
}

}  // namespace bmt
