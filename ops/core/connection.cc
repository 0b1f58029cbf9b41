#include "ops/core/connection.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

namespace prophet {

namespace {
constexpr size_t kInboxBytes = 64 * 1024;
// While a header is awaited, at most this much is read into the inbox: payload bytes that come
// along are copied out of it, while the rest of a payload goes straight to its sink.
constexpr size_t kHeaderReadBytes = 4 * 1024;
constexpr size_t kStageBytes = 256 * 1024;
}  // namespace

OutFrame MakeFrame(const FrameMeta& meta, const char* payload, int64_t priority, uint64_t tag,
                   std::function<void()> on_sent) {
  OutFrame f;
  EncodeFrameMeta(meta, &f.head);
  f.payload = payload;
  f.payload_len = meta.payload_bytes;
  f.tag = tag;
  f.on_sent = std::move(on_sent);
  f.priority = priority;
  return f;
}

OutFrame MakeOwnedFrame(const FrameMeta& meta, std::string payload, int64_t priority) {
  OutFrame f = MakeFrame(meta, nullptr, priority, 0, nullptr);
  f.owned = std::move(payload);
  f.payload_len = f.owned.size();
  return f;
}

PayloadSink PayloadSink::Buffer() {
  PayloadSink s;
  s.kind = Kind::kBuffer;
  return s;
}

PayloadSink PayloadSink::Into(char* destination, uint64_t tag, Consumer consumer) {
  PayloadSink s;
  s.kind = Kind::kInto;
  s.into = destination;
  s.consume = std::move(consumer);
  s.tag = tag;
  return s;
}

PayloadSink PayloadSink::Stream(Consumer consumer, uint64_t tag) {
  PayloadSink s;
  s.kind = Kind::kStream;
  s.consume = std::move(consumer);
  s.tag = tag;
  return s;
}

Connection::Connection(int peer, int fd, int epoll_fd, Handler* handler, BufferPool* pool)
    : peer_(peer), fd_(fd), epoll_fd_(epoll_fd), handler_(handler), pool_(pool), last_receive_ns_(NowNs()),
      inbox_(kInboxBytes) {}

Connection::~Connection() {
  if (fd_ >= 0) ::close(fd_);
}

// ------------------------------------------------------------------------------------------------
// Sending

void Connection::Queue(OutFrame frame) {
  if (!open_) return;
  // Insert after every queued frame at least as urgent; a frame already started keeps its place.
  auto at = out_.end();
  while (at != out_.begin()) {
    auto before = std::prev(at);
    if (before->priority >= frame.priority || before->written > 0) break;
    at = before;
  }
  out_.insert(at, std::move(frame));
  // Not flushed here: Flush runs on_sent callbacks and may close, and either may free state the
  // caller is still using. The engine flushes after every batch of work.
}

void Connection::Flush() {
  uint64_t written_now = 0;
  while (open_ && !out_.empty()) {
    iovec iov[64];
    int n_iov = 0;
    uint64_t offered = 0;
    for (auto it = out_.begin(); it != out_.end() && n_iov < 62; ++it) {
      uint64_t skip = it->written;
      if (skip < it->head.size()) {
        iov[n_iov++] = {const_cast<char*>(it->head.data()) + skip, it->head.size() - skip};
        skip = 0;
      } else {
        skip -= it->head.size();
      }
      // A copied payload lives in `owned` (possibly inside the string object itself, which moves
      // with the frame), so point at it afresh on every send.
      const char* payload = it->owned.empty() ? it->payload : it->owned.data();
      if (it->payload_len > skip) iov[n_iov++] = {const_cast<char*>(payload) + skip, it->payload_len - skip};
      offered += it->total() - it->written;
    }
    const ssize_t n = ::writev(fd_, iov, n_iov);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      Close(std::string("sending failed: ") + std::strerror(errno));
      return;
    }
    bytes_sent_.fetch_add(static_cast<uint64_t>(n), std::memory_order_relaxed);
    written_now += static_cast<uint64_t>(n);
    // Account every byte before running callbacks: a callback may fail an operation, and that
    // edits the queue (Abandon drops frames that have not started).
    uint64_t left = static_cast<uint64_t>(n);
    std::vector<std::function<void()>> sent;
    while (left > 0 && !out_.empty()) {
      OutFrame& f = out_.front();
      const uint64_t take = std::min(left, f.total() - f.written);
      f.written += take;
      left -= take;
      if (f.written < f.total()) break;
      if (f.on_sent) sent.push_back(std::move(f.on_sent));
      out_.pop_front();
      frames_sent_.fetch_add(1, std::memory_order_relaxed);
    }
    for (auto& callback : sent) callback();
    // A short write means the socket is full (it holds its unsent limit, transport.h): trying
    // again now would only return EAGAIN. EPOLLOUT says when it has room.
    if (static_cast<uint64_t>(n) < offered) break;
  }
  NoteFill(written_now);
  UpdateWriteInterest();
}

void Connection::NoteFill(uint64_t written_now) {
  if (!open_) return;
  const bool was_full = full_;
  full_ = !out_.empty();  // the loop above stops with frames left only at a full socket
  if (written_now > 0 || was_full != full_) handler_->OnFlushed(*this, written_now, was_full, full_);
}

void Connection::UpdateWriteInterest() {
  if (!open_ || epoll_fd_ < 0) return;
  const bool want = !out_.empty();
  if (want == want_write_) return;
  want_write_ = want;
  epoll_event ev{};
  ev.events = EPOLLIN | (want ? static_cast<uint32_t>(EPOLLOUT) : 0u);
  ev.data.u64 = static_cast<uint64_t>(peer_);
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd_, &ev);
}

void Connection::Abandon(uint64_t tag) {
  if (stage_ == Stage::kPayload && sink_.tag == tag &&
      (sink_.kind == PayloadSink::Kind::kInto || sink_.kind == PayloadSink::Kind::kStream)) {
    sink_ = PayloadSink::Discard();
    staged_fill_ = 0;
  }
  for (auto it = out_.begin(); it != out_.end();) {
    if (it->tag != tag) {
      ++it;
      continue;
    }
    if (it->written == 0) {
      it = out_.erase(it);
      continue;
    }
    if (it->payload_len && it->owned.empty()) {
      it->owned.assign(it->payload, it->payload_len);
      it->payload = nullptr;
    }
    it->tag = 0;
    it->on_sent = nullptr;
    ++it;
  }
}

// ------------------------------------------------------------------------------------------------
// Closing

void Connection::Close(const std::string& why) {
  if (!open_) return;
  open_ = false;
  if (epoll_fd_ >= 0) ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, fd_, nullptr);
  ::close(fd_);
  fd_ = -1;
  out_.clear();
  if (full_) {  // it will never drain: the bandwidth monitor must not count it as full
    full_ = false;
    handler_->OnFlushed(*this, 0, true, false);
  }
  handler_->OnClosed(*this, why);
}

void Connection::Refuse(const std::string& why) {
  if (!open_) return;
  refused_ = true;
  Flush();
  Close(why);
}

void Connection::FinishSending(int64_t deadline_ns) {
  while (open_ && !out_.empty() && NowNs() < deadline_ns) {
    Flush();
    if (!out_.empty()) ::usleep(1000);
  }
  if (open_) ::shutdown(fd_, SHUT_WR);
}

void Connection::AwaitEof(int64_t deadline_ns) {
  if (!open_) return;
  char sink[4096];
  while (NowNs() < deadline_ns) {
    const ssize_t r = ::recv(fd_, sink, sizeof(sink), 0);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) break;
    if (r < 0) ::usleep(1000);
  }
  ::close(fd_);
  fd_ = -1;
  open_ = false;
}

// ------------------------------------------------------------------------------------------------
// Receiving

uint64_t Connection::Receive(char* dst, uint64_t room, uint64_t* budget) {
  while (true) {
    const ssize_t r = ::recv(fd_, dst, room, 0);
    if (r > 0) {
      bytes_received_.fetch_add(static_cast<uint64_t>(r), std::memory_order_relaxed);
      last_receive_ns_ = NowNs();
      *budget -= std::min<uint64_t>(*budget, static_cast<uint64_t>(r));
      return static_cast<uint64_t>(r);
    }
    if (r == 0) {
      Close("the peer closed the connection");
      return 0;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) Close(std::string("receiving failed: ") + std::strerror(errno));
    return 0;
  }
}

void Connection::OnReadable(uint64_t budget) {
  // Bytes already read are processed even once the budget is spent: they are no longer in the
  // socket, so epoll (level-triggered on the socket) would not report them again.
  while (open_ && (budget > 0 || inbox_begin_ < inbox_end_)) {
    // Bytes already in the inbox are consumed first.
    if (inbox_begin_ < inbox_end_ && stage_ != Stage::kPayload) {
      if (!ConsumeMeta()) return;
      continue;
    }
    if (stage_ == Stage::kPayload) {
      const uint64_t want = meta_.payload_bytes - payload_got_;
      char* dst = nullptr;
      uint64_t room = 0;
      switch (sink_.kind) {
        // As much as the kernel has: every recv() that frees receive buffer may send a window
        // update, and on loopback the ACK's processing (freeing the peer's sent pages) runs here
        // too, so fewer, larger receives cost less than cache-sized ones, consumer or not
        // (measured: a 64 MiB push_pull took about 10% more CPU with 256 KiB receives).
        case PayloadSink::Kind::kInto: dst = sink_.into + payload_got_; room = want; break;
        case PayloadSink::Kind::kBuffer: dst = buffered_.data() + payload_got_; room = want; break;
        case PayloadSink::Kind::kStream:
          dst = staged_.data() + staged_fill_;
          room = std::min<uint64_t>(want, staged_.size() - staged_fill_);
          break;
        case PayloadSink::Kind::kDiscard: break;
      }
      uint64_t got = 0;
      if (inbox_begin_ < inbox_end_) {
        got = std::min<uint64_t>(want, inbox_end_ - inbox_begin_);
        if (dst) {
          got = std::min(got, room);
          std::memcpy(dst, inbox_.data() + inbox_begin_, got);
        }
        inbox_begin_ += got;
      } else if (dst) {
        got = Receive(dst, room, &budget);  // straight to the sink: the kernel's copy is the only one
        if (got == 0) return;
      } else {
        const uint64_t r = Receive(inbox_.data(), inbox_.size(), &budget);
        if (r == 0) return;
        inbox_begin_ = 0;
        inbox_end_ = r;
        continue;
      }
      payload_got_ += got;
      if (sink_.kind == PayloadSink::Kind::kStream) staged_fill_ += got;
      if (sink_.consume) Consume();  // while the bytes are still in cache
      if (payload_got_ == meta_.payload_bytes) EndPayload();
      continue;
    }
    // Header or tail needed and the inbox is empty: refill it.
    const uint64_t r = Receive(inbox_.data(), kHeaderReadBytes, &budget);
    if (r == 0) return;
    inbox_begin_ = 0;
    inbox_end_ = r;
  }
}

bool Connection::ConsumeMeta() {
  if (stage_ == Stage::kHeader) {
    const size_t take = std::min(sizeof(FrameHeader) - header_got_, inbox_end_ - inbox_begin_);
    std::memcpy(reinterpret_cast<char*>(&header_) + header_got_, inbox_.data() + inbox_begin_, take);
    inbox_begin_ += take;
    header_got_ += take;
    if (header_got_ < sizeof(FrameHeader)) return true;
    const Status s = ValidateHeader(header_);
    if (!s.ok()) {
      Refuse(s.message());
      return false;
    }
    stage_ = Stage::kTail;
    tail_.resize(MetaTailBytes(header_));
    tail_got_ = 0;
  }
  const size_t take = std::min(tail_.size() - tail_got_, inbox_end_ - inbox_begin_);
  std::memcpy(&tail_[tail_got_], inbox_.data() + inbox_begin_, take);
  inbox_begin_ += take;
  tail_got_ += take;
  if (tail_got_ < tail_.size()) return true;
  const Status s = DecodeFrameMeta(header_, tail_.data(), tail_.size(), &meta_);
  if (!s.ok()) {
    Refuse(s.message());
    return false;
  }
  header_got_ = 0;
  frames_received_.fetch_add(1, std::memory_order_relaxed);
  stage_ = Stage::kPayload;
  payload_got_ = 0;
  BeginPayload();
  if (open_ && meta_.payload_bytes == 0) EndPayload();
  return open_;
}

void Connection::BeginPayload() {
  sink_ = handler_->OnFrame(*this, meta_);
  // The handler may have refused the frame and closed the connection: allocate nothing for it.
  if (!open_) return;
  consumed_ = 0;
  switch (sink_.kind) {
    case PayloadSink::Kind::kBuffer:
      buffered_ = pool_ ? pool_->Take(meta_.payload_bytes) : ByteBuffer(meta_.payload_bytes);
      break;
    case PayloadSink::Kind::kStream:
      if (staged_.size() != kStageBytes) staged_.resize(kStageBytes);
      staged_fill_ = 0;
      break;
    default:
      break;
  }
}

void Connection::Consume() {
  const uint64_t end = payload_got_ == meta_.payload_bytes ? payload_got_ : payload_got_ & ~uint64_t{7};
  if (end <= consumed_) return;
  const uint64_t len = end - consumed_;
  if (sink_.kind == PayloadSink::Kind::kInto) {
    sink_.consume(consumed_, sink_.into + consumed_, len);
  } else {
    // Staged bytes start at consumed_; the few beyond `end` wait at the front for the next receive.
    sink_.consume(consumed_, staged_.data(), len);
    staged_fill_ -= len;
    if (staged_fill_) std::memmove(staged_.data(), staged_.data() + len, staged_fill_);
  }
  consumed_ = end;
}

void Connection::EndPayload() {
  const PayloadSink::Kind kind = sink_.kind;
  const uint64_t tag = sink_.tag;
  stage_ = Stage::kHeader;
  sink_ = PayloadSink::Discard();
  ByteBuffer buffered;
  if (kind == PayloadSink::Kind::kBuffer) buffered = std::move(buffered_);
  // meta_ stays valid during the call: this connection reads nothing until it returns.
  handler_->OnFrameDone(*this, meta_, kind, tag, kind == PayloadSink::Kind::kBuffer ? &buffered : nullptr);
}

}  // namespace prophet
