// Free-port selection by binding port 0: the kernel hands out an unused ephemeral port. There is a short race
// until rank 0's store binds it, far less likely than two jobs colliding on a fixed 29500.
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

int pick_free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw std::runtime_error(std::string("cannot create a socket to find a free port: ") + std::strerror(errno));
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
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace bmtrun
