// Free-port selection by binding port 0: the kernel hands out an unused ephemeral port. The socket stays bound
// (SO_REUSEADDR, never listening) while the job runs, so no other bind(0) or outgoing connection is handed the port
// before rank 0's store binds it (the store sets SO_REUSEADDR too, which Linux allows next to a non-listening
// socket).
#include "bmtrun/port.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace bmtrun {

ReservedPort::ReservedPort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);  // CLOEXEC: the ranks do not inherit it
  if (fd < 0) throw std::runtime_error(std::string("cannot create a socket to find a free port: ") + std::strerror(errno));
  int on = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);  // the store listens on every interface
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    int err = errno;
    ::close(fd);
    throw std::runtime_error(std::string("cannot find a free TCP port: ") + std::strerror(err) +
                             "; pass one with --master-port");
  }
  fd_ = fd;
  port_ = ntohs(addr.sin_port);
}

ReservedPort::~ReservedPort() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace bmtrun
