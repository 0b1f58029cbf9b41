// Loopback socket helpers shared by the tests that run real connections (engine, transport, fuzz).
#ifndef PROPHET_OPS_CORE_SOCKET_TESTING_H_
#define PROPHET_OPS_CORE_SOCKET_TESTING_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

namespace prophet {
namespace testing {

inline double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

inline sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return addr;
}

// Free TCP ports, bound to port 0 at the same time (so they differ), then released. Probed on the
// dual-stack wildcard [::]: such a port is free on 127.0.0.1 and on [::1] alike, whichever of them
// the runtime ends up listening on.
inline std::vector<int> FreePorts(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int zero = 0;
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ports.push_back(ntohs(addr.sin6_port));
    fds.push_back(fd);
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

// "127.0.0.1:port" for n free ports: the addresses of a job on this machine.
inline std::vector<std::string> LoopbackAddresses(int n) {
  std::vector<std::string> addresses;
  for (int p : FreePorts(n)) addresses.push_back("127.0.0.1:" + std::to_string(p));
  return addresses;
}

// A listener on 127.0.0.1:port that the test controls (accepts only if the test does).
inline int ListenOn(int port, int backlog) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  const sockaddr_in addr = Loopback(port);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, backlog) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Connects to 127.0.0.1:port, retrying until the listener exists. Returns -1 after the timeout.
inline int ConnectTo(int port, double timeout_s) {
  const auto t0 = std::chrono::steady_clock::now();
  while (SecondsSince(t0) < timeout_s) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    const sockaddr_in addr = Loopback(port);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

// Reads `len` bytes, or fewer on EOF or after the timeout; returns how many.
inline size_t ReadSome(int fd, void* buf, size_t len, double timeout_s) {
  size_t got = 0;
  const auto t0 = std::chrono::steady_clock::now();
  while (got < len && SecondsSince(t0) < timeout_s) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    const ssize_t n = ::recv(fd, static_cast<char*>(buf) + got, len - got, 0);
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  return got;
}

// Redirects stderr (where the core logs) to a file for the lifetime of the object.
class CaptureStderr {
 public:
  CaptureStderr() {
    std::fflush(stderr);
    file_ = std::tmpfile();
    saved_ = ::dup(2);
    ::dup2(::fileno(file_), 2);
  }
  std::string Finish() {
    if (saved_ < 0) return text_;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
    std::rewind(file_);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), file_)) > 0) text_.append(buf, n);
    std::fclose(file_);
    std::fprintf(stderr, "%s", text_.c_str());  // keep the log visible
    return text_;
  }
  ~CaptureStderr() { Finish(); }

 private:
  FILE* file_ = nullptr;
  int saved_ = -1;
  std::string text_;
};

}  // namespace testing
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_SOCKET_TESTING_H_
