#include "train/metrics_log.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "bmt/core/error.h"

namespace examples {

MetricsLog::MetricsLog(const std::string& path, bool append) {
  file_ = std::fopen(path.c_str(), append ? "a" : "w");
  BMT_CHECK(file_ != nullptr, "cannot open metrics file '", path, "': ", std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

std::string to_json_line(const MetricFields& fields) {
  std::string out = "{";
  char buf[64];
  for (size_t i = 0; i < fields.size(); ++i) {
    out += (i ? ", \"" : "\"") + fields[i].first + "\": ";
    const std::optional<double>& v = fields[i].second;
    if (!v || !std::isfinite(*v)) {
      out += "null";
    } else if (*v == std::floor(*v) && std::fabs(*v) < 1e15) {
      std::snprintf(buf, sizeof buf, "%.0f", *v);
      out += buf;
    } else {
      // 7 digits where they read back as the same double, else 17 (exact): resumed runs are compared bit for bit.
      std::snprintf(buf, sizeof buf, "%.7g", *v);
      if (std::strtod(buf, nullptr) != *v) std::snprintf(buf, sizeof buf, "%.17g", *v);
      out += buf;
    }
  }
  return out + "}";
}

void MetricsLog::write(const MetricFields& fields) {
  if (!file_) return;
  std::string line = to_json_line(fields) + "\n";
  std::fwrite(line.data(), 1, line.size(), file_);
  std::fflush(file_);
}

MetricFields inspect_fields(const std::vector<bmt::inspect::TensorStats>& rows) {
  MetricFields out;
  for (const auto& r : rows) {
    const std::string k = "inspect." + r.name + ".";
    out.insert(out.end(), {{k + "mean", r.mean}, {k + "std", r.std}, {k + "min", r.min}, {k + "max", r.max},
                           {k + "grad_mean", r.grad_mean}, {k + "grad_std", r.grad_std},
                           {k + "grad_min", r.grad_min}, {k + "grad_max", r.grad_max}});
  }
  return out;
}

}  // namespace examples
