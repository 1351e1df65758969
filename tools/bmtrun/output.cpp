// Line splitting and prefixing of rank output (see output.h). Each line is written with one write(), so lines
// of different ranks never mix within a line.
#include "bmtrun/output.h"

#include <unistd.h>

#include <cerrno>

namespace bmtrun {
namespace {

// A rank printing without newlines (progress bars) must not grow memory without bound.
constexpr size_t kMaxLineBytes = 64 * 1024;

}  // namespace

LineStream::LineStream(int rank, int dest_fd, bool shown, size_t tail_lines)
    : rank_(rank), dest_fd_(dest_fd), shown_(shown), tail_lines_(tail_lines) {}

void LineStream::feed(const char* data, size_t nbytes) {
  pending_.append(data, nbytes);
  size_t start = 0;
  for (size_t nl; (nl = pending_.find('\n', start)) != std::string::npos; start = nl + 1)
    emit(pending_.substr(start, nl - start));
  pending_.erase(0, start);
  if (pending_.size() >= kMaxLineBytes) {
    emit(pending_);
    pending_.clear();
  }
}

void LineStream::finish() {
  if (!pending_.empty()) emit(pending_);
  pending_.clear();
}

void LineStream::emit(const std::string& line) {
  if (shown_) {
    write_all(dest_fd_, "[rank " + std::to_string(rank_) + "] " + line + "\n");
  } else if (tail_lines_ > 0) {
    tail_.push_back(line);
    if (tail_.size() > tail_lines_) tail_.pop_front();
  }
}

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

void say(const std::string& text) { write_all(STDERR_FILENO, "bmtrun: " + text + "\n"); }

}  // namespace bmtrun
