// One peer's TCP stream as a sequence of frames (wire.h).
//
// Sending: frames wait in an out-queue in priority order (larger first, FIFO among equals; a
// frame already started keeps its place) and leave through writev. Receiving: a state machine
// (header, then name + dims, then payload) validates every header before it allocates or reads
// anything. The connection knows frames, not operations: when a frame's header has arrived, its
// Handler says where the payload goes (PayloadSink), and hears when it has arrived.
//
// Single-threaded: every method runs on the engine's I/O thread. Nothing here calls back into
// the handler from Queue(), so a caller may queue frames while it still uses its own state.
#ifndef PROPHET_OPS_CORE_CONNECTION_H_
#define PROPHET_OPS_CORE_CONNECTION_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "ops/core/buffer_pool.h"
#include "ops/core/wire.h"

namespace prophet {

// A frame waiting to be sent. Its payload is not copied: it points into the sender's tensor
// (`tag` names whose), unless Detach() had to copy it.
struct OutFrame {
  std::string head;  // encoded header + name + dims
  const char* payload = nullptr;
  uint64_t payload_len = 0;
  uint64_t written = 0;  // of head + payload
  uint64_t tag = 0;      // 0: payload not tied to a caller's buffer
  std::string owned;     // the payload, when the frame carries its own copy
  std::function<void()> on_sent;  // after the last byte was handed to the kernel
  int64_t priority = 0;
  uint64_t total() const { return head.size() + payload_len; }
};

// Error notices jump every queue.
constexpr int64_t kUrgentPriority = INT64_MAX;
// Behind everything queued (the departure notice).
constexpr int64_t kLastPriority = INT64_MIN;

// Encodes `meta` (whose payload_bytes must equal `payload_len`) in front of a payload that
// stays where it is until the frame is sent.
OutFrame MakeFrame(const FrameMeta& meta, const char* payload, int64_t priority, uint64_t tag,
                   std::function<void()> on_sent);
// The same with a payload the frame owns (error messages).
OutFrame MakeOwnedFrame(const FrameMeta& meta, std::string payload, int64_t priority);

// Where the payload of the frame being received goes.
struct PayloadSink {
  // (offset inside the payload, its bytes, length). Pieces come in order, each ends on an 8-byte
  // boundary of the payload (whole elements of every dtype) except the last, and are handed over
  // right after they were received, while they are still in cache.
  using Consumer = std::function<void(uint64_t at, const char* data, uint64_t len)>;
  enum class Kind : uint8_t {
    kDiscard,  // read and dropped
    kInto,     // straight into `into` (payload_bytes of room); then to `consume`, if set
    kStream,   // into a small staging buffer, each piece to `consume`, then forgotten
    kBuffer,   // held in a ByteBuffer, handed over whole when complete
  };
  Kind kind = Kind::kDiscard;
  char* into = nullptr;
  Consumer consume;
  uint64_t tag = 0;  // whose buffers kInto/kStream use (see Connection::Abandon)

  static PayloadSink Discard() { return PayloadSink(); }
  static PayloadSink Buffer();
  static PayloadSink Into(char* destination, uint64_t tag, Consumer consumer = nullptr);
  static PayloadSink Stream(Consumer consumer, uint64_t tag);
};

class Connection {
 public:
  class Handler {
   public:
    virtual ~Handler() = default;
    // The header, name and dims of a frame arrived: where does its payload go?
    virtual PayloadSink OnFrame(Connection& c, const FrameMeta& meta) = 0;
    // Its payload arrived completely (at once for an empty payload). `sink` is what OnFrame
    // returned, or kDiscard when it was abandoned meanwhile; `buffered` holds a kBuffer payload
    // (the handler may take it).
    virtual void OnFrameDone(Connection& c, const FrameMeta& meta, PayloadSink::Kind sink, uint64_t tag,
                             ByteBuffer* buffered) = 0;
    // The connection closed on an error (reset, EOF, a malformed frame). Called once.
    virtual void OnClosed(Connection& c, const std::string& why) = 0;
    // A Flush wrote `bytes` (0 or more) to the socket, which was full before it (`was_full`: an
    // earlier write was short and frames stayed queued) and is full after it (`full`). Called when
    // it wrote something or the socket filled or emptied: what the bandwidth monitor needs
    // (BandwidthMonitor::OnSocketWrite).
    virtual void OnFlushed(Connection& /*c*/, uint64_t /*bytes*/, bool /*was_full*/, bool /*full*/) {}
  };

  // Takes ownership of `fd` (connected, non-blocking). With `epoll_fd` >= 0 the connection keeps
  // its EPOLLOUT interest there in step with its out-queue (the fd must be registered with
  // data.u64 = peer). Buffered payloads come from `pool` when given.
  Connection(int peer, int fd, int epoll_fd, Handler* handler, BufferPool* pool = nullptr);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  int peer() const { return peer_; }
  bool open() const { return open_; }
  bool idle() const { return out_.empty(); }
  // The kernel buffer was full at the last Flush(): wait for EPOLLOUT rather than flush again.
  bool awaiting_room() const { return want_write_; }
  uint64_t bytes_sent() const { return bytes_sent_.load(std::memory_order_relaxed); }
  uint64_t bytes_received() const { return bytes_received_.load(std::memory_order_relaxed); }
  // Frames wholly written to the socket, and frames whose header arrived (every kind).
  uint64_t frames_sent() const { return frames_sent_.load(std::memory_order_relaxed); }
  uint64_t frames_received() const { return frames_received_.load(std::memory_order_relaxed); }
  // When bytes last arrived from the peer (the connection's creation before any did).
  int64_t last_receive_ns() const { return last_receive_ns_; }

  // Adds a frame to the out-queue (dropped when closed). No I/O, no callbacks: Flush() sends.
  void Queue(OutFrame frame);
  // Writes until the kernel buffer is full or the queue is empty; runs on_sent callbacks.
  void Flush();
  // Reads and processes frames until the socket is empty or about `budget` bytes were read (each
  // receive still takes as much as the kernel has for the current payload), so that one busy
  // peer cannot starve the others or the sends (the engine's budget: engine.cc, kReadTurnBytes).
  // Frames already read into the inbox are always processed before it returns.
  void OnReadable(uint64_t budget);

  // `tag`'s buffers are about to go away: a payload being received into them is read and
  // dropped instead; queued frames that point into them are dropped if not started, and copied
  // if half sent (the stream must stay well-formed).
  void Abandon(uint64_t tag);

  // Closes with an error: the handler hears OnClosed(why).
  void Close(const std::string& why);
  // Closes because the peer broke the protocol (a malformed frame, a size no operation can carry):
  // tries to send what is queued (an error notice) without waiting, then Close(why).
  void Refuse(const std::string& why);
  // Whether the connection was closed by Refuse (the peer's fault, not a lost peer).
  bool refused() const { return refused_; }
  // Graceful end: sends what is queued until `deadline_ns`, then half-closes.
  void FinishSending(int64_t deadline_ns);
  // After FinishSending: waits until `deadline_ns` for the peer's EOF, then closes (no callback).
  void AwaitEof(int64_t deadline_ns);

 private:
  enum class Stage : uint8_t { kHeader, kTail, kPayload };
  bool ConsumeMeta();  // header and tail from the inbox; false if the connection closed
  void BeginPayload();
  void Consume();
  void EndPayload();
  // recv() into `dst`; returns bytes (> 0), or 0 when the caller must stop (EAGAIN or closed).
  uint64_t Receive(char* dst, uint64_t room, uint64_t* budget);
  void UpdateWriteInterest();
  // After a Flush that wrote `written_now` bytes: whether the socket is full, for the handler.
  void NoteFill(uint64_t written_now);

  const int peer_;
  int fd_;
  const int epoll_fd_;
  Handler* const handler_;
  BufferPool* const pool_;
  bool open_ = true;
  bool refused_ = false;
  bool want_write_ = false;
  // The kernel's send buffer is full with frames still queued (the last write was short and the
  // queue has not emptied since).
  bool full_ = false;
  std::deque<OutFrame> out_;
  std::atomic<uint64_t> bytes_sent_{0}, bytes_received_{0};
  std::atomic<uint64_t> frames_sent_{0}, frames_received_{0};
  int64_t last_receive_ns_;

  // Receive state.
  std::vector<char> inbox_;
  size_t inbox_begin_ = 0, inbox_end_ = 0;
  Stage stage_ = Stage::kHeader;
  FrameHeader header_{};
  size_t header_got_ = 0;
  std::string tail_;
  size_t tail_got_ = 0;
  FrameMeta meta_;
  PayloadSink sink_;
  uint64_t payload_got_ = 0;
  std::vector<char> staged_;  // kStream: received, not yet handed over
  size_t staged_fill_ = 0;
  uint64_t consumed_ = 0;     // payload bytes already handed to sink_.consume
  ByteBuffer buffered_;        // kBuffer
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_CONNECTION_H_
