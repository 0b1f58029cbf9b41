#include "ops/core/fuzz/fake_peer.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

namespace prophet {
namespace fuzz {

Status FakePeer::Listen(const BootstrapOptions& options, std::unique_ptr<FakePeer>* peer) {
  if (options.rank != 0 || options.world_size != 2)
    return Status(Code::kInvalidArgument, "FakePeer plays rank 0 of a 2-worker job");
  std::unique_ptr<FakePeer> p(new FakePeer());
  p->options_ = options;
  Status s = prophet::Listen(options, &p->listen_fd_);
  if (!s.ok()) return s;
  *peer = std::move(p);
  return Status::OK();
}

Status FakePeer::Join(FrameCallback on_frame) {
  std::vector<int> fds;
  Status s = ConnectAll(options_, listen_fd_, &fds);
  listen_fd_ = -1;  // ConnectAll closed it
  if (!s.ok()) return s;
  fd_ = fds[1];
  on_frame_ = std::move(on_frame);
  reader_ = std::thread([this] { ReadLoop(); });
  return Status::OK();
}

FakePeer::~FakePeer() {
  stop_.store(true);
  if (reader_.joinable()) reader_.join();
  if (fd_ >= 0) ::close(fd_);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

bool FakePeer::Send(const std::string& bytes, double timeout_s) {
  std::lock_guard<std::mutex> lock(send_mu_);
  const int64_t deadline = NowNs() + static_cast<int64_t>(timeout_s * 1e9);
  size_t done = 0;
  while (done < bytes.size()) {
    if (closed_.load() || NowNs() > deadline) return false;
    const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return false;
    pollfd p{fd_, POLLOUT, 0};
    ::poll(&p, 1, 10);
  }
  return true;
}

bool FakePeer::FinishAndAwaitClose(double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(send_mu_);
    ::shutdown(fd_, SHUT_WR);
  }
  const int64_t deadline = NowNs() + static_cast<int64_t>(timeout_s * 1e9);
  while (!closed_.load() && NowNs() < deadline) ::usleep(200);
  return closed_.load();
}

std::string FakePeer::protocol_error() const {
  std::lock_guard<std::mutex> lock(error_mu_);
  return protocol_error_;
}

void FakePeer::ReadLoop() {
  std::string buffer;
  char chunk[64 * 1024];
  while (!stop_.load()) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      closed_.store(true);
      return;
    }
    if (n < 0) continue;
    buffer.append(chunk, static_cast<size_t>(n));
    size_t used = 0;
    while (true) {
      FrameMeta meta;
      const char* payload = nullptr;
      const Status s = DecodeFrame(buffer.data() + used, buffer.size() - used, &meta, &payload);
      if (s.code() == Code::kFailedPrecondition) break;  // truncated: wait for more
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (protocol_error_.empty()) protocol_error_ = "the engine sent a malformed frame: " + s.message();
        closed_.store(true);
        return;
      }
      frames_received_.fetch_add(1);
      if (on_frame_) on_frame_(meta, payload);
      used = static_cast<size_t>(payload - buffer.data()) + meta.payload_bytes;
    }
    buffer.erase(0, used);
  }
}

}  // namespace fuzz
}  // namespace prophet
