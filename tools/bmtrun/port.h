// Picks the rendezvous port of a single-node job.
#pragma once

namespace bmtrun {

// A free TCP port (the kernel's choice for port 0), kept bound but not listening while this object lives so that
// no other process is handed it before rank 0's rendezvous store binds it. Throws std::runtime_error.
class ReservedPort {
 public:
  ReservedPort();
  ~ReservedPort();
  ReservedPort(const ReservedPort&) = delete;
  ReservedPort& operator=(const ReservedPort&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace bmtrun
