#include "bmt/pipeline/pipeline_schedule.h"

#include <algorithm>

#include "bmt/core/error.h"

namespace bmt {

PipeSchedule parse_pipe_schedule(const std::string& name) {
  if (name == "1f1b" || name == "1F1B") return PipeSchedule::k1F1B;
  if (name == "gpipe" || name == "GPipe") return PipeSchedule::kGPipe;
  BMT_ERROR("unknown pipeline schedule '", name, "': use 1f1b or gpipe");
}

const char* pipe_schedule_name(PipeSchedule s) { return s == PipeSchedule::k1F1B ? "1f1b" : "gpipe"; }

std::vector<PipeAction> pipe_schedule(PipeSchedule schedule, int stage, int stages, int micro_batches) {
  BMT_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipe_schedule: stage ", stage, " of ", stages);
  BMT_CHECK(micro_batches >= 1, "pipe_schedule: num_micro_batches ", micro_batches, " must be >= 1");
  const int M = micro_batches;
  std::vector<PipeAction> a;
  auto fwd = [&](int m) {
    a.push_back({PipeAction::kRecvAct, m});
    a.push_back({PipeAction::kForward, m});
    a.push_back({PipeAction::kSendAct, m});
  };
  auto bwd = [&](int m) {
    a.push_back({PipeAction::kRecvGrad, m});
    a.push_back({PipeAction::kBackward, m});
    a.push_back({PipeAction::kSendGrad, m});
  };
  if (schedule == PipeSchedule::kGPipe) {
    for (int m = 0; m < M; ++m) fwd(m);
    for (int m = 0; m < M; ++m) bwd(m);
  } else {
    const int warmup = std::min(stages - 1 - stage, M);
    const int steady = M - warmup;
    for (int m = 0; m < warmup; ++m) fwd(m);
    if (steady > 0) a.push_back({PipeAction::kRecvAct, warmup});
    for (int k = 0; k < steady; ++k) {
      const int m = warmup + k;
      a.push_back({PipeAction::kForward, m});
      a.push_back({PipeAction::kSendActRecvGrad, m, k});
      a.push_back({PipeAction::kBackward, k});
      if (k == steady - 1) a.push_back({PipeAction::kSendGrad, k});
      else a.push_back({PipeAction::kSendGradRecvAct, k, m + 1});
    }
    for (int k = steady; k < M; ++k) bwd(k);
  }
  // Drop the transfers over links this stage does not have.
  const bool has_prev = stage > 0, has_next = stage < stages - 1;
  std::vector<PipeAction> out;
  for (PipeAction x : a) {
    switch (x.kind) {
      case PipeAction::kRecvAct:
      case PipeAction::kSendGrad:
        if (has_prev) out.push_back(x);
        break;
      case PipeAction::kSendAct:
      case PipeAction::kRecvGrad:
        if (has_next) out.push_back(x);
        break;
      case PipeAction::kSendActRecvGrad:
        if (has_next) out.push_back(x);
        break;
      case PipeAction::kSendGradRecvAct:
        if (has_prev) out.push_back(x);
        break;
      default: out.push_back(x);
    }
  }
  return out;
}

std::string to_string(const PipeAction& a) {
  static const char* names[] = {"RecvAct", "Forward", "SendAct", "RecvGrad", "Backward", "SendGrad",
                                "SendActRecvGrad", "SendGradRecvAct"};
  std::string s = std::string(names[a.kind]) + "(" + std::to_string(a.micro);
  if (a.other >= 0) s += "," + std::to_string(a.other);
  return s + ")";
}

}  // namespace bmt
