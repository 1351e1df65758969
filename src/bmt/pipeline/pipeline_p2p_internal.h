// Point-to-point transfers between neighbouring pipeline stages (internal to pipeline.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Stream.h>

#include <memory>
#include <optional>
#include <vector>

#include "bmt/core/communicator.h"

namespace bmt::detail {

// The pipe communicator and where its work runs: taken from bmt::init once, when a PipelineTransformerBlockList is
// built (pipeline.cpp), and handed to everything that talks to the neighbouring stages.
struct PipeLink {
  std::shared_ptr<core::Communicator> comm;  // the stages of this pipeline (InitOptions::pipe_size ranks)
  std::optional<c10::Stream> stream;         // the pipeline communication stream (nullopt on CPU)
  c10::Device device = c10::Device(c10::kCPU);
};

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
// gradients, then the activation payloads) over link.comm and returns the received activations. On a GPU it runs
// on link.stream, after the work queued so far on the current stream and before the work queued on it later; on
// CPU it returns when everything has arrived.
std::vector<at::Tensor> pipe_transfer(const PipeLink& link, PipeTransfer& t);

}  // namespace bmt::detail
