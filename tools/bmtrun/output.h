// Rank output: splits a child's byte stream into lines and prints each one prefixed with "[rank R] ", or keeps
// only the last few lines (--rank0-only) so that a failing hidden rank can still show why it failed.
#pragma once

#include <cstddef>
#include <deque>
#include <string>

namespace bmtrun {

class LineStream {
 public:
  // dest_fd: where shown lines go (1 or 2). tail_lines: how many hidden lines to keep (0: none).
  LineStream(int rank, int dest_fd, bool shown, size_t tail_lines);

  void feed(const char* data, size_t nbytes);  // emits every complete line
  void finish();                               // emits a last line without '\n'
  const std::deque<std::string>& tail() const { return tail_; }
  int rank() const { return rank_; }

 private:
  void emit(const std::string& line);

  int rank_;
  int dest_fd_;
  bool shown_;
  size_t tail_lines_;
  std::string pending_;  // bytes after the last '\n'
  std::deque<std::string> tail_;
};

// write() until everything is written; errors (a closed stdout) are ignored: the ranks keep running.
void write_all(int fd, const std::string& text);
// bmtrun's own messages: "bmtrun: <text>\n" on stderr.
void say(const std::string& text);

}  // namespace bmtrun
