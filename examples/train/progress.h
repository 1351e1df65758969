// Progress: rank 0's view of a run. On a terminal, one live line redrawn in place (at most 10 times a second):
//   [#######.............] 420/1500 loss 1.234 lr 2.9e-03 45.1k tok/s MFU 31.2% mem 1.2GiB eta 1m05s
// When stdout is not a terminal (bmtrun pipes it, logs, CI), the same fields as plain lines every log_every
// steps. Messages (eval results, checkpoints) are printed on their own line without breaking the bar.
#pragma once

#include <cstdint>
#include <string>

namespace examples {

struct StepStats {
  int64_t step = 0;  // 1-based: steps done
  double loss = 0, lr = 0, tokens_per_s = 0;
  double mfu = -1;  // fraction of peak; < 0: not shown (CPU)
  int64_t mem_nbytes = 0;
  double eta_s = 0;
};

class Progress {
 public:
  // mode: auto | bar | lines | off. log_every <= 0: about 30 lines per run.
  Progress(int64_t total_steps, const std::string& mode, int64_t log_every);
  void update(const StepStats& s);
  void message(const std::string& line);
  void finish();  // ends the live line

 private:
  std::string fields(const StepStats& s) const;
  int64_t total_steps_;
  bool bar_ = false, off_ = false, bar_drawn_ = false;
  int64_t log_every_;
  double last_draw_s_ = -1;
};

std::string format_duration(double seconds);  // "1m05s", "2h03m", "12s"
std::string format_bytes(int64_t nbytes);     // "1.2GiB", "210MiB"

}  // namespace examples
