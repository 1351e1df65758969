#include "train/progress.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>

namespace examples {

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

std::string format_duration(double s) {
  char buf[32];
  const int64_t t = static_cast<int64_t>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", static_cast<long>(t / 3600), static_cast<long>(t / 60 % 60));
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%ldm%02lds", static_cast<long>(t / 60), static_cast<long>(t % 60));
  else std::snprintf(buf, sizeof buf, "%lds", static_cast<long>(t));
  return buf;
}

std::string format_bytes(int64_t n) {
  char buf[32];
  const double x = static_cast<double>(n);
  if (x >= 1024.0 * 1024 * 1024) std::snprintf(buf, sizeof buf, "%.1fGiB", x / (1024.0 * 1024 * 1024));
  else std::snprintf(buf, sizeof buf, "%.0fMiB", x / (1024.0 * 1024));
  return buf;
}

Progress::Progress(int64_t total_steps, const std::string& mode, int64_t log_every)
    : total_steps_(total_steps), log_every_(log_every) {
  off_ = mode == "off";
  bar_ = mode == "bar" || (mode == "auto" && ::isatty(STDOUT_FILENO));
  if (log_every_ <= 0) log_every_ = std::max<int64_t>(1, total_steps / 30);
}

std::string Progress::fields(const StepStats& s) const {
  char buf[256];
  int n = std::snprintf(buf, sizeof buf, "%ld/%ld loss %.4f lr %.2e %.1fk tok/s", static_cast<long>(s.step),
                        static_cast<long>(total_steps_), s.loss, s.lr, s.tokens_per_s / 1000.0);
  std::string out(buf, static_cast<size_t>(n));
  if (s.mfu >= 0) {
    std::snprintf(buf, sizeof buf, " MFU %.1f%%", 100.0 * s.mfu);
    out += buf;
  }
  return out + " mem " + format_bytes(s.mem_nbytes) + " eta " + format_duration(s.eta_s);
}

void Progress::update(const StepStats& s) {
  if (off_) return;
  if (!bar_) {
    if (s.step % log_every_ == 0 || s.step == total_steps_ || s.step == 1) std::cout << "step " << fields(s) << std::endl;
    return;
  }
  const double t = now_s();
  if (s.step != total_steps_ && last_draw_s_ >= 0 && t - last_draw_s_ < 0.1) return;
  last_draw_s_ = t;
  constexpr int kWidth = 20;
  const int filled = static_cast<int>(kWidth * s.step / std::max<int64_t>(1, total_steps_));
  std::string bar = "[" + std::string(static_cast<size_t>(filled), '#') + std::string(static_cast<size_t>(kWidth - filled), '.') + "] ";
  std::cout << "\r\x1b[K" << bar << fields(s) << std::flush;
  bar_drawn_ = true;
}

void Progress::message(const std::string& line) {
  if (off_) return;
  if (bar_ && bar_drawn_) std::cout << "\r\x1b[K";
  std::cout << line << std::endl;
  bar_drawn_ = false;
  last_draw_s_ = -1;  // redraw the bar at the next update
}

void Progress::finish() {
  if (bar_ && bar_drawn_) std::cout << std::endl;
  bar_drawn_ = false;
}

}  // namespace examples
