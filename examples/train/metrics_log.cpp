#include "train/metrics_log.h"

#include <cerrno>
#include <cmath>
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
      std::snprintf(buf, sizeof buf, "%.7g", *v);
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

}  // namespace examples
