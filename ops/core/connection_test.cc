// The connection layer on its own, over a socketpair: framing, the out-queue's priority order,
// the receive state machine with every way of splitting the stream, payload sinks, abandoning a
// tag's buffers, and closing on malformed input or EOF.
#include "ops/core/connection.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

using ::prophet::testing::Contains;

// A read budget that never runs out: OnReadable reads until the socket is empty.
constexpr uint64_t kUntilEmpty = ~uint64_t{0};

void SetNonBlocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

FrameMeta Meta(const std::string& name, uint64_t round, uint64_t elements, FrameType type = FrameType::kPush) {
  FrameMeta m;
  m.type = type;
  m.dtype = DataType::kFloat32;
  m.name = name;
  m.round = round;
  m.shape = {static_cast<int64_t>(elements)};
  m.partition = 0;
  m.num_partitions = 1;
  m.offset = 0;
  m.payload_bytes = 4 * elements;
  return m;
}

std::vector<char> Pattern(size_t bytes, int seed) {
  std::vector<char> v(bytes);
  for (size_t i = 0; i < bytes; ++i) v[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return v;
}

// Records what the connection reports; the sink for each frame is chosen by its name.
class RecordingHandler : public Connection::Handler {
 public:
  struct Done {
    std::string name;
    PayloadSink::Kind kind;
    uint64_t tag;
    std::vector<char> payload;  // what reached the sink
  };

  PayloadSink OnFrame(Connection& /*c*/, const FrameMeta& meta) override {
    std::vector<char>& dst = received_[meta.name];
    dst.assign(meta.payload_bytes, 0);
    if (meta.name.rfind("into", 0) == 0) return PayloadSink::Into(dst.data(), 7);
    if (meta.name.rfind("landed", 0) == 0)  // in place, then each piece as it landed
      return PayloadSink::Into(
          dst.data(), 9,
          [this, name = meta.name, base = dst.data(), total = meta.payload_bytes](uint64_t at, const char* data,
                                                                                  uint64_t len) {
            if (at != streamed_[name] || data != base + at || ((at + len) % 8 != 0 && at + len != total))
              out_of_order_ = true;
            streamed_[name] = at + len;
          });
    if (meta.name.rfind("stream", 0) == 0)
      return PayloadSink::Stream(
          [this, name = meta.name](uint64_t at, const char* data, uint64_t len) {
            std::vector<char>& d = received_[name];
            // Pieces come in order and end on 8-byte boundaries (but the last).
            if (at != streamed_[name] || (len % 8 != 0 && at + len != d.size())) out_of_order_ = true;
            std::memcpy(d.data() + at, data, len);
            streamed_[name] = at + len;
          },
          8);
    if (meta.name.rfind("buffer", 0) == 0) return PayloadSink::Buffer();
    return PayloadSink::Discard();
  }
  void OnFrameDone(Connection& /*c*/, const FrameMeta& meta, PayloadSink::Kind kind, uint64_t tag,
                   ByteBuffer* buffered) override {
    if (buffered) received_[meta.name].assign(buffered->data(), buffered->data() + buffered->size());
    const bool consumed = meta.name.rfind("stream", 0) == 0 || meta.name.rfind("landed", 0) == 0;
    if (consumed && streamed_[meta.name] != meta.payload_bytes) out_of_order_ = true;  // all handed over
    done.push_back({meta.name, kind, tag, received_[meta.name]});
  }
  void OnClosed(Connection& /*c*/, const std::string& why) override { closed.push_back(why); }
  struct Flushed {
    uint64_t bytes;
    bool was_full, full;
  };
  void OnFlushed(Connection& /*c*/, uint64_t bytes, bool was_full, bool full) override {
    flushes.push_back({bytes, was_full, full});
  }

  std::vector<Done> done;
  std::vector<Flushed> flushes;
  std::vector<std::string> closed;
  bool out_of_order_ = false;

 private:
  std::map<std::string, std::vector<char>> received_;
  std::map<std::string, uint64_t> streamed_;
};

// One encoded frame (header, name, dims, payload) as bytes on the wire.
std::string Encoded(const FrameMeta& meta, const std::vector<char>& payload) {
  std::string out;
  EncodeFrameMeta(meta, &out);
  out.append(payload.data(), payload.size());
  return out;
}

struct Pair {
  int ours = -1, theirs = -1;
  Pair() {
    int fds[2];
    ::socketpair(AF_UNIX, SOCK_STREAM, 0, fds);
    ours = fds[0];
    theirs = fds[1];
    SetNonBlocking(ours);
  }
  ~Pair() {
    if (theirs >= 0) ::close(theirs);
  }
};

TEST(ReceivesFramesSplitAnywhereIntoEverySink) {
  // Frames of every sink kind, small and larger than the inbox and the stream's staging buffer,
  // delivered in pieces of random sizes (1 byte .. 300 KB).
  const std::vector<std::pair<std::string, uint64_t>> frames = {
      {"into/a", 3}, {"stream/b", 200000}, {"buffer/c", 1}, {"discard/d", 70000},
      {"into/e", 300000}, {"stream/f", 5}, {"buffer/g", 20000}, {"into/empty", 0},
      {"landed/h", 100001}, {"landed/i", 1}};
  std::string wire;
  std::vector<std::vector<char>> payloads;
  for (size_t i = 0; i < frames.size(); ++i) {
    payloads.push_back(Pattern(4 * frames[i].second, static_cast<int>(i)));
    wire += Encoded(Meta(frames[i].first, i, frames[i].second), payloads.back());
  }
  for (unsigned seed : {1u, 2u, 3u}) {
    Pair pair;
    RecordingHandler handler;
    Connection c(1, pair.ours, -1, &handler);
    std::mt19937 rng(seed);
    size_t at = 0;
    while (at < wire.size()) {
      const size_t piece = std::min<size_t>(wire.size() - at, seed == 1 ? 1 + rng() % 97 : 1 + rng() % 300000);
      size_t sent = 0;
      while (sent < piece) {
        const ssize_t n = ::send(pair.theirs, wire.data() + at + sent, piece - sent, MSG_DONTWAIT);
        if (n > 0) sent += static_cast<size_t>(n);
        else c.OnReadable(kUntilEmpty);  // the socket buffer is full: let the connection drain it
      }
      at += piece;
      c.OnReadable(kUntilEmpty);
    }
    c.OnReadable(kUntilEmpty);
    EXPECT_TRUE(c.open());
    EXPECT_TRUE(handler.closed.empty());
    EXPECT_TRUE(!handler.out_of_order_);
    EXPECT_EQ(handler.done.size(), frames.size());
    for (size_t i = 0; i < handler.done.size() && i < frames.size(); ++i) {
      const RecordingHandler::Done& d = handler.done[i];
      EXPECT_EQ(d.name, frames[i].first);
      if (frames[i].first.rfind("discard", 0) == 0) {
        EXPECT_TRUE(d.kind == PayloadSink::Kind::kDiscard);
        continue;
      }
      EXPECT_TRUE(d.payload == payloads[i]);
      if (frames[i].first.rfind("into", 0) == 0) EXPECT_EQ(d.tag, 7u);
      if (frames[i].first.rfind("stream", 0) == 0) EXPECT_EQ(d.tag, 8u);
      if (frames[i].first.rfind("landed", 0) == 0) EXPECT_EQ(d.tag, 9u);
    }
    EXPECT_EQ(c.bytes_received(), static_cast<uint64_t>(wire.size()));
  }
}

TEST(MalformedHeaderClosesWithTheReason) {
  Pair pair;
  RecordingHandler handler;
  Connection c(3, pair.ours, -1, &handler);
  std::string wire = Encoded(Meta("into/x", 0, 2), Pattern(8, 0));
  std::string bad = Encoded(Meta("into/y", 0, 2), Pattern(8, 1));
  bad[0] ^= 0x55;  // magic
  wire += bad;
  ::send(pair.theirs, wire.data(), wire.size(), 0);
  c.OnReadable(kUntilEmpty);
  EXPECT_EQ(handler.done.size(), 1u);  // the good frame before it still counts
  EXPECT_TRUE(!c.open());
  EXPECT_EQ(handler.closed.size(), 1u);
  if (!handler.closed.empty()) EXPECT_TRUE(Contains(handler.closed[0], "bad magic"));
  // A payload that does not fit its shape is refused before anything is read into a sink.
  Pair pair2;
  RecordingHandler handler2;
  Connection c2(3, pair2.ours, -1, &handler2);
  FrameMeta m = Meta("into/z", 0, 2);
  m.payload_bytes = 12;
  std::string too_long;
  EncodeFrameMeta(m, &too_long);
  ::send(pair2.theirs, too_long.data(), too_long.size(), 0);
  c2.OnReadable(kUntilEmpty);
  EXPECT_TRUE(!c2.open() && handler2.done.empty());
  if (!handler2.closed.empty()) EXPECT_TRUE(Contains(handler2.closed[0], "outside a tensor"));
}

TEST(PeerEofClosesOnce) {
  Pair pair;
  RecordingHandler handler;
  Connection c(2, pair.ours, -1, &handler);
  ::close(pair.theirs);
  pair.theirs = -1;
  c.OnReadable(kUntilEmpty);
  c.OnReadable(kUntilEmpty);
  EXPECT_TRUE(!c.open());
  EXPECT_EQ(handler.closed.size(), 1u);
  if (!handler.closed.empty()) EXPECT_TRUE(Contains(handler.closed[0], "closed the connection"));
}

TEST(ReadsAboutItsBudgetPerCallAndResumes) {
  // The engine reads a bounded amount per turn (then starts what was submitted meanwhile and
  // sends what the bytes completed): a call stops once its budget is spent, the next one goes on
  // where it stopped.
  Pair pair;
  const int buffer = 1 << 20;
  ::setsockopt(pair.theirs, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof(buffer));
  RecordingHandler handler;
  Connection c(1, pair.ours, -1, &handler);
  std::string wire;
  std::vector<std::vector<char>> payloads;
  for (int i = 0; i < 4; ++i) {
    payloads.push_back(Pattern(64 * 1024, i));
    wire += Encoded(Meta("into/" + std::to_string(i), 0, 16 * 1024), payloads.back());
  }
  EXPECT_EQ(::send(pair.theirs, wire.data(), wire.size(), MSG_DONTWAIT), static_cast<ssize_t>(wire.size()));
  c.OnReadable(100 * 1024);
  EXPECT_TRUE(!handler.done.empty() && handler.done.size() < 4);
  c.OnReadable(100 * 1024);
  c.OnReadable(100 * 1024);
  EXPECT_EQ(handler.done.size(), 4u);
  for (size_t i = 0; i < handler.done.size() && i < 4; ++i) EXPECT_TRUE(handler.done[i].payload == payloads[i]);
  EXPECT_EQ(c.bytes_received(), static_cast<uint64_t>(wire.size()));
}

TEST(DeliversEveryFrameItReadEvenWhenTheBudgetIsSpent) {
  // A read for a header takes up to 4 KiB, which may hold many small frames. Once read they are
  // no longer in the socket, so epoll reports nothing more for them: a call that stopped with
  // them in its inbox because its budget was spent would leave them there until the peer sends
  // again.
  Pair pair;
  RecordingHandler handler;
  Connection c(1, pair.ours, -1, &handler);
  std::string wire;
  int frames = 0;
  for (; wire.size() < 3000; ++frames) wire += Encoded(Meta("buffer/" + std::to_string(frames), 0, 4), Pattern(16, frames));
  EXPECT_EQ(::send(pair.theirs, wire.data(), wire.size(), MSG_DONTWAIT), static_cast<ssize_t>(wire.size()));
  c.OnReadable(1);
  EXPECT_EQ(handler.done.size(), static_cast<size_t>(frames));
  EXPECT_EQ(c.bytes_received(), static_cast<uint64_t>(wire.size()));
  EXPECT_TRUE(handler.closed.empty());
}

// Flushes `c` until its queue is empty, reading everything at the other end (`fd`).
std::string FlushAndCollect(Connection& c, int fd) {
  std::string all;
  for (int i = 0; i < 10000 && !c.idle(); ++i) {
    c.Flush();
    char buf[65536];
    while (true) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
      if (n <= 0) break;
      all.append(buf, static_cast<size_t>(n));
    }
  }
  return all;
}

TEST(SendsInPriorityOrderAndNeverPreemptsAStartedFrame) {
  Pair pair;
  RecordingHandler handler;
  Connection c(1, pair.ours, -1, &handler);
  // A frame larger than the socket buffer starts first and stays first.
  int small = 16 * 1024;
  ::setsockopt(pair.ours, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  const std::vector<char> big = Pattern(4 << 20, 1), tiny = Pattern(16, 2);
  int sent_callbacks = 0;
  c.Queue(MakeFrame(Meta("low", 0, big.size() / 4), big.data(), 1, 0, [&] { ++sent_callbacks; }));
  c.Flush();
  EXPECT_TRUE(!c.idle());  // only part of it fits
  EXPECT_TRUE(c.bytes_sent() > 0 && c.bytes_sent() < big.size());
  c.Queue(MakeFrame(Meta("mid-1", 0, 4), tiny.data(), 5, 0, nullptr));
  c.Queue(MakeFrame(Meta("high", 0, 4), tiny.data(), 9, 0, nullptr));
  c.Queue(MakeFrame(Meta("mid-2", 0, 4), tiny.data(), 5, 0, nullptr));
  FrameMeta error = Meta("error", 0, 0, FrameType::kError);
  error.payload_bytes = 5;
  c.Queue(MakeOwnedFrame(error, "boom!", kUrgentPriority));
  std::vector<std::vector<char>> payloads;
  std::vector<std::string> names;
  const std::string all = FlushAndCollect(c, pair.theirs);
  EXPECT_TRUE(c.idle());
  EXPECT_EQ(sent_callbacks, 1);
  size_t at = 0;
  while (at < all.size()) {
    FrameMeta meta;
    const char* payload = nullptr;
    if (!DecodeFrame(all.data() + at, all.size() - at, &meta, &payload).ok()) break;
    names.push_back(meta.name);
    payloads.emplace_back(payload, payload + meta.payload_bytes);
    at = static_cast<size_t>(payload - all.data()) + meta.payload_bytes;
  }
  const std::vector<std::string> expected = {"low", "error", "high", "mid-1", "mid-2"};
  EXPECT_TRUE(names == expected);
  if (payloads.size() == 5) {
    EXPECT_TRUE(payloads[0] == big);
    EXPECT_EQ(std::string(payloads[1].begin(), payloads[1].end()), std::string("boom!"));
  }
}

TEST(ReportsWritesAndWhenTheSocketIsFull) {
  // What the bandwidth monitor needs (BandwidthMonitor::OnSocketWrite): every write, and whether
  // the socket was full before it and is after it; full from the short write until the queue
  // empties; a closed socket is no longer full.
  Pair pair;
  RecordingHandler handler;
  Connection c(1, pair.ours, -1, &handler);
  int small = 16 * 1024;
  ::setsockopt(pair.ours, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  const std::vector<char> big = Pattern(1 << 20, 3), tiny = Pattern(16, 4);
  c.Queue(MakeFrame(Meta("big", 0, big.size() / 4), big.data(), 1, 0, nullptr));
  c.Flush();
  const uint64_t at_once = c.bytes_sent();
  EXPECT_TRUE(!c.idle() && at_once > 0);
  EXPECT_EQ(handler.flushes.size(), 1u);
  if (!handler.flushes.empty()) {
    EXPECT_TRUE(handler.flushes[0].bytes == at_once && !handler.flushes[0].was_full && handler.flushes[0].full);
  }
  c.Flush();  // still full: nothing taken, nothing reported
  EXPECT_EQ(handler.flushes.size(), 1u);
  FlushAndCollect(c, pair.theirs);
  EXPECT_TRUE(c.idle() && handler.flushes.size() > 2);
  uint64_t while_full = 0;
  for (size_t i = 1; i < handler.flushes.size(); ++i) {
    const RecordingHandler::Flushed& f = handler.flushes[i];
    EXPECT_TRUE(f.was_full == handler.flushes[i - 1].full);  // one state, reported in order
    EXPECT_TRUE(f.was_full && f.bytes > 0);
    while_full += f.bytes;
  }
  EXPECT_EQ(while_full, c.bytes_sent() - at_once);
  EXPECT_TRUE(!handler.flushes.back().full);
  // An idle socket takes a small frame at once: a write, never full.
  c.Queue(MakeFrame(Meta("tiny", 0, 4), tiny.data(), 1, 0, nullptr));
  c.Flush();
  EXPECT_TRUE(c.idle() && !handler.flushes.back().was_full && !handler.flushes.back().full);
  // Full, then closed: reported as no longer full.
  c.Queue(MakeFrame(Meta("big2", 0, big.size() / 4), big.data(), 1, 0, nullptr));
  c.Flush();
  EXPECT_TRUE(handler.flushes.back().full);
  c.Close("test");
  EXPECT_TRUE(handler.flushes.back().was_full && !handler.flushes.back().full && handler.flushes.back().bytes == 0);
}

TEST(AbandonDropsAReceiveAndDetachesQueuedFrames) {
  // Receiving: a payload half received into tag 7's buffer; the rest is dropped.
  {
    Pair pair;
    RecordingHandler handler;
    Connection c(1, pair.ours, -1, &handler);
    const std::vector<char> payload = Pattern(40000, 3);
    const std::string wire = Encoded(Meta("into/x", 0, payload.size() / 4), payload);
    const size_t half = wire.size() / 2;
    ::send(pair.theirs, wire.data(), half, 0);
    c.OnReadable(kUntilEmpty);
    c.Abandon(8);  // another tag: no effect
    c.Abandon(7);
    ::send(pair.theirs, wire.data() + half, wire.size() - half, 0);
    c.OnReadable(kUntilEmpty);
    EXPECT_EQ(handler.done.size(), 1u);
    if (!handler.done.empty()) {
      EXPECT_TRUE(handler.done[0].kind == PayloadSink::Kind::kDiscard);
      EXPECT_TRUE(handler.done[0].payload != payload);  // only the first part arrived
    }
    // The stream stays in step: the next frame is read normally.
    const std::string next = Encoded(Meta("buffer/y", 1, 3), Pattern(12, 4));
    ::send(pair.theirs, next.data(), next.size(), 0);
    c.OnReadable(kUntilEmpty);
    EXPECT_EQ(handler.done.size(), 2u);
    if (handler.done.size() == 2) EXPECT_TRUE(handler.done[1].payload == Pattern(12, 4));
  }
  // Sending: tag 5's frames; the unsent one is dropped, the started one finishes from a copy.
  {
    Pair pair;
    RecordingHandler handler;
    Connection c(1, pair.ours, -1, &handler);
    int small = 16 * 1024;
    ::setsockopt(pair.ours, SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    std::vector<char> tensor = Pattern(1 << 20, 5);
    const std::vector<char> original = tensor;
    int callbacks = 0;
    c.Queue(MakeFrame(Meta("started", 0, tensor.size() / 4), tensor.data(), 0, 5, [&] { ++callbacks; }));
    c.Flush();
    c.Queue(MakeFrame(Meta("unsent", 0, 4), tensor.data(), 0, 5, [&] { ++callbacks; }));
    c.Queue(MakeFrame(Meta("other", 0, 4), tensor.data(), 0, 6, [&] { ++callbacks; }));
    c.Abandon(5);
    std::fill(tensor.begin(), tensor.end(), 0);  // the owner frees its tensor
    const std::string all = FlushAndCollect(c, pair.theirs);
    FrameMeta meta;
    const char* payload = nullptr;
    EXPECT_TRUE(DecodeFrame(all.data(), all.size(), &meta, &payload).ok());
    EXPECT_EQ(meta.name, std::string("started"));
    if (payload) EXPECT_TRUE(std::memcmp(payload, original.data(), original.size()) == 0);
    const size_t first = static_cast<size_t>(payload - all.data()) + meta.payload_bytes;
    EXPECT_TRUE(DecodeFrame(all.data() + first, all.size() - first, &meta, &payload).ok());
    EXPECT_EQ(meta.name, std::string("other"));
    EXPECT_EQ(callbacks, 1);  // only "other": abandoned frames run no callback
  }
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
