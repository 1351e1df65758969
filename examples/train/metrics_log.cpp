#include "train/metrics_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "bmt/checkpoint/file_io.h"
#include "bmt/core/error.h"

namespace examples {

MetricsLog::MetricsLog(const std::string& path, bool append) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC | (append ? O_APPEND : O_TRUNC), 0644);
  const int err = errno;
  BMT_CHECK(fd_ >= 0, "cannot open metrics file '", path, "': ", bmt::checkpoint::describe_write_error(path, err));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::close() {
  if (fd_ < 0) return;
  const int rc = ::close(fd_), err = errno;
  fd_ = -1;
  BMT_CHECK(rc == 0, "closing metrics file '", path_, "' failed: ", bmt::checkpoint::describe_write_error(path_, err));
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
  if (fd_ < 0) return;
  const std::string line = to_json_line(fields) + "\n";
  const off_t start = ::lseek(fd_, 0, SEEK_END);
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t w = ::write(fd_, line.data() + done, line.size() - done);
    const int err = w < 0 ? errno : ENOSPC;  // no progress without an error: treat as a full disk
    if (w < 0 && err == EINTR) continue;
    if (w <= 0) {
      if (start >= 0) (void)::ftruncate(fd_, start);  // no half line left behind
      ::close(fd_);
      fd_ = -1;
      BMT_ERROR("cannot write the metrics file '", path_, "': ", bmt::checkpoint::describe_write_error(path_, err),
                "; the lines so far are complete. Free space, or give --metrics a path on another disk");
    }
    done += static_cast<size_t>(w);
  }
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
