#include "ops/core/transport.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>

#include "ops/core/wire.h"

namespace prophet {

namespace {

std::string Errno(int err) { return std::string(std::strerror(err)); }

// Reads or writes exactly `len` bytes on a blocking socket, giving up at `deadline_ns`.
bool IoExact(int fd, void* buf, size_t len, bool write, int64_t deadline_ns) {
  char* p = static_cast<char*>(buf);
  while (len > 0) {
    const int64_t left_ms = (deadline_ns - NowNs()) / 1000000;
    if (left_ms <= 0) return false;
    pollfd pfd{fd, static_cast<short>(write ? POLLOUT : POLLIN), 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left_ms > 1000 ? 1000 : left_ms));
    if (r < 0 && errno != EINTR) return false;
    if (r <= 0) continue;
    const ssize_t n = write ? ::send(fd, p, len, MSG_NOSIGNAL) : ::recv(fd, p, len, 0);
    if (n == 0) return false;
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return false;
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
  return true;
}

void SetNonBlocking(int fd, bool on) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK));
}

Status Resolve(const std::string& address, sockaddr_storage* out, socklen_t* out_len) {
  std::string host;
  int port = 0;
  Status s = ParseAddress(address, &host, &port);
  if (!s.ok()) return s;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr)
    return Status(Code::kUnavailable, "cannot resolve host '" + host + "' of address '" + address +
                                          "': " + gai_strerror(rc));
  std::memcpy(out, res->ai_addr, res->ai_addrlen);
  *out_len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return Status::OK();
}

}  // namespace

Status ParseAddress(const std::string& address, std::string* host, int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon + 1 == address.size())
    return Status(Code::kInvalidArgument,
                  "address '" + address + "' has no port; expected host:port, e.g. 10.0.0.1:2222");
  *host = address.substr(0, colon);
  if (host->size() >= 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  char* end = nullptr;
  const long p = std::strtol(address.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || p <= 0 || p > 65535)
    return Status(Code::kInvalidArgument, "address '" + address + "' has an invalid port; expected 1-65535");
  *port = static_cast<int>(p);
  if (host->empty()) return Status(Code::kInvalidArgument, "address '" + address + "' has no host");
  return Status::OK();
}

void TuneSocket(int fd, int buffer_bytes) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer_bytes, sizeof(buffer_bytes));
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buffer_bytes, sizeof(buffer_bytes));
  }
  // Detect a peer whose host vanished without closing the connection.
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
}

Status Listen(const BootstrapOptions& o, int* listen_fd) {
  std::string host;
  int port = 0;
  Status s = ParseAddress(o.addresses[o.rank], &host, &port);
  if (!s.ok()) return s;
  // Listen on every interface: in Kubernetes the address in TF_CONFIG is a service name that
  // resolves to an address the pod cannot bind.
  const int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int fd4 = -1;
  int use_fd = fd;
  int zero = 0, one = 1;
  if (fd >= 0) {
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
  } else {
    fd4 = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    use_fd = fd4;
  }
  if (use_fd < 0) return Status(Code::kInternal, "socket(): " + Errno(errno));
  ::setsockopt(use_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc;
  if (use_fd == fd) {
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    addr.sin6_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    rc = ::bind(fd4, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  if (rc != 0) {
    const int err = errno;
    ::close(use_fd);
    if (err == EADDRINUSE)
      return Status(Code::kUnavailable,
                    "port " + std::to_string(port) + " (rank " + std::to_string(o.rank) + ", address " +
                        o.addresses[o.rank] +
                        ") is already in use: another process holds it (a stale worker? see `ss -ltnp "
                        "'sport = :" + std::to_string(port) + "'`); stop it or choose another port in TF_CONFIG");
    return Status(Code::kUnavailable, "cannot bind port " + std::to_string(port) + ": " + Errno(err));
  }
  if (::listen(use_fd, 128) != 0) {
    const int err = errno;
    ::close(use_fd);
    return Status(Code::kUnavailable, "listen(): " + Errno(err));
  }
  *listen_fd = use_fd;
  return Status::OK();
}

Status ConnectAll(const BootstrapOptions& o, int listen_fd, std::vector<int>* fds) {
  const int n = o.world_size;
  fds->assign(n, -1);
  const int64_t deadline = NowNs() + static_cast<int64_t>(o.connect_timeout_s * 1e9);
  const uint64_t token_hash = HashString(o.token);
  std::mutex mu;
  std::string accept_error;
  std::atomic<int> accepted{0};
  const int expected_accepts = n - 1 - o.rank;  // ranks above us connect to us

  // Accept connections from higher ranks on a helper thread while we connect to lower ranks.
  std::thread acceptor([&] {
    while (accepted.load() < expected_accepts && NowNs() < deadline) {
      pollfd pfd{listen_fd, POLLIN, 0};
      if (::poll(&pfd, 1, 200) <= 0) continue;
      const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      Hello hello{};
      HelloReply reply{};
      reply.magic = kFrameMagic;
      reply.version = kProtocolVersion;
      // A silent or slow client gets a few seconds, not the whole bootstrap.
      if (!IoExact(fd, &hello, sizeof(hello), false, std::min(deadline, NowNs() + int64_t{5000000000}))) {
        PROPHET_WARN("dropped an incoming connection that sent no valid handshake");
        ::close(fd);
        continue;
      }
      std::string reason;
      if (hello.magic != kFrameMagic) {
        reason = "not a prophet_tf peer (bad magic)";
      } else if (hello.version != kProtocolVersion) {
        reason = "protocol version " + std::to_string(hello.version) + " but this worker speaks " +
                 std::to_string(kProtocolVersion) + ": install the same prophet_tf on every worker";
      } else if (hello.world_size != n) {
        reason = "world size " + std::to_string(hello.world_size) + " but this worker was started with " +
                 std::to_string(n) + ": every worker needs the same TF_CONFIG cluster";
      } else if (hello.token_hash != token_hash) {
        reason = "job token mismatch: PROPHET_JOB_TOKEN differs between workers (a worker of another job?)";
      } else if (hello.rank <= o.rank || hello.rank >= n) {
        reason = "unexpected rank " + std::to_string(hello.rank);
      } else {
        std::lock_guard<std::mutex> lock(mu);
        if ((*fds)[hello.rank] != -1) reason = "rank " + std::to_string(hello.rank) + " is already connected";
      }
      reply.accepted = reason.empty() ? 1 : 0;
      std::snprintf(reply.reason, sizeof(reply.reason), "%s", reason.c_str());
      const bool sent = IoExact(fd, &reply, sizeof(reply), true, NowNs() + int64_t{5000000000});
      if (!reason.empty() || !sent) {
        if (hello.magic == kFrameMagic)
          PROPHET_WARN("rejected a connection from a peer claiming rank %d: %s", hello.rank,
                       reason.empty() ? "reply failed" : reason.c_str());
        else
          PROPHET_WARN("rejected a connection that is not a prophet_tf peer (bad magic in the handshake)");
        ::close(fd);
        continue;
      }
      std::lock_guard<std::mutex> lock(mu);
      (*fds)[hello.rank] = fd;
      accepted.fetch_add(1);
    }
    if (accepted.load() < expected_accepts) {
      std::lock_guard<std::mutex> lock(mu);
      accept_error = "timed out waiting for connections from higher ranks";
    }
  });

  Status result = Status::OK();
  for (int peer = 0; peer < o.rank && result.ok(); ++peer) {
    sockaddr_storage addr{};
    socklen_t addr_len = 0;
    int attempts = 0;
    while (true) {
      Status s = Resolve(o.addresses[peer], &addr, &addr_len);
      int fd = -1;
      if (s.ok()) {
        fd = ::socket(addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && ::connect(fd, reinterpret_cast<sockaddr*>(&addr), addr_len) == 0) {
          Hello hello{kFrameMagic, kProtocolVersion, 0, o.rank, n, token_hash};
          HelloReply reply{};
          const int64_t hs_deadline = std::min(deadline, NowNs() + int64_t{10000000000});
          if (IoExact(fd, &hello, sizeof(hello), true, hs_deadline) &&
              IoExact(fd, &reply, sizeof(reply), false, hs_deadline)) {
            if (reply.accepted == 1 && reply.magic == kFrameMagic) {
              std::lock_guard<std::mutex> lock(mu);
              (*fds)[peer] = fd;
              break;
            }
            reply.reason[sizeof(reply.reason) - 1] = '\0';
            ::close(fd);
            result = Status(Code::kFailedPrecondition, "rank " + std::to_string(peer) + " at " +
                                                           o.addresses[peer] + " rejected this worker: " +
                                                           (reply.magic == kFrameMagic ? reply.reason : "not a prophet_tf peer"));
            break;
          }
        }
        if (fd >= 0) ::close(fd);
      }
      if (NowNs() >= deadline) {
        result = Status(Code::kDeadlineExceeded,
                        "could not connect to rank " + std::to_string(peer) + " at " + o.addresses[peer] +
                            " within " + SecondsString(o.connect_timeout_s) + " (" + std::to_string(attempts) + " attempts" + (s.ok() ? "" : ": " + s.message()) +
                            "): is that worker started, with the same TF_CONFIG, and reachable?");
        break;
      }
      ++attempts;
      std::this_thread::sleep_for(std::chrono::milliseconds(attempts < 20 ? 50 : 250));
    }
  }
  acceptor.join();
  ::close(listen_fd);
  if (result.ok() && !accept_error.empty()) {
    std::string missing;
    for (int r = o.rank + 1; r < n; ++r)
      if ((*fds)[r] == -1) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    result = Status(Code::kDeadlineExceeded,
                    "rank(s) " + missing + " did not connect to this worker (" + o.addresses[o.rank] + ") within " +
                        SecondsString(o.connect_timeout_s) + ": are they started with the same TF_CONFIG and PROPHET_JOB_TOKEN?");
  }
  if (!result.ok()) {
    for (int& fd : *fds)
      if (fd >= 0) ::close(fd), fd = -1;
    return result;
  }
  for (int fd : *fds) {
    if (fd < 0) continue;
    TuneSocket(fd, o.socket_buffer_bytes);
    SetNonBlocking(fd, true);
  }
  return Status::OK();
}

}  // namespace prophet
