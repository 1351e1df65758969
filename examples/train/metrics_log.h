// MetricsLog: a JSONL file with one flat JSON object per line, e.g.
//   {"step": 10, "loss": 2.31, "lr": 0.003, "tokens_per_s": 41230, "eval_loss": null, "task_acc": null}
// Values are numbers or null (not measured at this step). Each line is written whole with write(2) as it comes,
// so a crashed or running job can be plotted (tools/plot_metrics.cpp). A failed write (a full disk) throws,
// naming the file and the free space, after cutting the file back to its last complete line. An empty path
// disables it; append continues a resumed run's log.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bmt/engine/inspect.h"

namespace examples {

using MetricFields = std::vector<std::pair<std::string, std::optional<double>>>;

class MetricsLog {
 public:
  MetricsLog() = default;
  MetricsLog(const std::string& path, bool append);  // throws bmt::core::Error when the file cannot be opened
  ~MetricsLog();  // closes without reporting (close() reports)
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  MetricsLog(MetricsLog&& other) noexcept { swap(other); }
  MetricsLog& operator=(MetricsLog&& other) noexcept {
    swap(other);
    return *this;
  }

  void write(const MetricFields& fields);
  // Closes the file, throwing on a write-back error; later writes are ignored.
  void close();
  bool enabled() const { return fd_ >= 0; }

 private:
  void swap(MetricsLog& o) noexcept {
    std::swap(fd_, o.fd_);
    std::swap(path_, o.path_);
  }
  int fd_ = -1;
  std::string path_;
};

// inspect_model rows as fields "inspect.<name>.<stat>" (mean, std, min, max, grad_mean, grad_std, grad_min,
// grad_max; grad_* null without a gradient), for one step's line.
MetricFields inspect_fields(const std::vector<bmt::inspect::TensorStats>& rows);

// One JSON object (no trailing newline); integral values are printed without a fraction, NaN/inf as null, others
// with the fewest digits (7 or 17) that read back as the same double.
std::string to_json_line(const MetricFields& fields);

}  // namespace examples
