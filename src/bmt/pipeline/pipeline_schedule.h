// The order in which one pipeline stage runs its micro-batches and talks to its neighbours, as a plain list of
// actions (no communication here, so every schedule can be checked by simulation).
//
// 1F1B (PipeDream-flush, the default): stage s of P runs min(P-1-s, M) warm-up forwards, then alternates one
// forward and one backward, then drains the remaining backwards. At most P-s micro-batches are in flight on stage
// s (GPipe: all M), which bounds the activation memory; the bubble is the same (P-1)/(M+P-1).
// GPipe: all forwards, then all backwards (in micro-batch order).
//
// Communication pairing: a stage's action list and its neighbour's name every transfer over their link in the same
// order, and the two transfers that cross in steady-state 1F1B (my activation going down while the next stage's
// gradient comes up) are one fused action on both sides, so blocking transports cannot deadlock.
#pragma once

#include <string>
#include <vector>

namespace bmt {

enum class PipeSchedule { k1F1B, kGPipe };
PipeSchedule parse_pipe_schedule(const std::string& name);  // "1f1b" or "gpipe"; throws otherwise
const char* pipe_schedule_name(PipeSchedule s);

struct PipeAction {
  enum Kind {
    kRecvAct,         // activation of `micro` from the previous stage
    kForward,         // run this stage's layers on `micro`
    kSendAct,         // activation of `micro` to the next stage
    kRecvGrad,        // gradient of `micro`'s output from the next stage
    kBackward,        // backward of `micro`
    kSendGrad,        // gradient of `micro`'s input to the previous stage
    kSendActRecvGrad, // fused: send activation of `micro`, receive gradient of `other`
    kSendGradRecvAct, // fused: send gradient of `micro`, receive activation of `other`
  };
  Kind kind;
  int micro;
  int other = -1;
};

// Actions of stage `stage` of `stages` for `micro_batches` micro-batches; transfers to a missing neighbour (first or
// last stage) are dropped, fused ones keep their existing half.
std::vector<PipeAction> pipe_schedule(PipeSchedule schedule, int stage, int stages, int micro_batches);
std::string to_string(const PipeAction& a);

}  // namespace bmt
