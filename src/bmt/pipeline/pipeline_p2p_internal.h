// Point-to-point transfers between neighbouring pipeline stages (internal to pipeline.cpp).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "bmt/core/communicator.h"

namespace bmt::detail {

// One exchange with up to two neighbours. Activations carry their shapes and dtypes (the receiver does not know
// them); gradients are received into buffers the caller allocated (shaped like the activations it sent).
// Peers are ranks of the pipe communicator; -1 = none.
struct PipeTransfer {
  std::vector<at::Tensor> send_acts;
  int act_to = -1;
  std::vector<at::Tensor> send_grads;
  int grad_to = -1;
  int recv_acts = 0;  // how many activations to receive
  int act_from = -1;
  std::vector<at::Tensor> recv_grads;  // filled in place
  int grad_from = -1;
};

// Runs every send and receive of `t` concurrently (Communicator::batch_p2p, two rounds: metadata with the
// gradients, then the activation payloads) and returns the received activations. On a GPU it runs on
// config().pp_comm_stream, after the work queued so far on the current stream and before the work queued on it
// later; on CPU it returns when everything has arrived.
std::vector<at::Tensor> pipe_transfer(core::Communicator& comm, PipeTransfer& t, const at::Device& device);

}  // namespace bmt::detail
