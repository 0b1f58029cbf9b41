// A worker of the job played by a test: it joins through the real bootstrap (so the engine under
// test sees an authenticated peer), then sends whatever bytes the test gives it and hands every
// frame the engine sends to a callback.
#ifndef PROPHET_OPS_CORE_FUZZ_FAKE_PEER_H_
#define PROPHET_OPS_CORE_FUZZ_FAKE_PEER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/transport.h"
#include "ops/core/wire.h"

namespace prophet {
namespace fuzz {

class FakePeer {
 public:
  // (meta, payload) of a frame the engine sent; runs on the peer's reader thread.
  using FrameCallback = std::function<void(const FrameMeta& meta, const char* payload)>;

  // Listens as `options.rank`; the engine(s) may be started from then on. Join() completes the
  // bootstrap; only a job where the peer plays rank 0 of 2 is supported (the engine connects to it).
  static Status Listen(const BootstrapOptions& options, std::unique_ptr<FakePeer>* peer);
  ~FakePeer();

  Status Join(FrameCallback on_frame);
  // Writes `bytes` (one or more frames, or garbage) as one unit. False once the engine has closed
  // the connection or nothing could be written for `timeout_s`.
  bool Send(const std::string& bytes, double timeout_s = 10.0);
  // Half-closes (the engine reads EOF after what was sent), then waits up to `timeout_s` for the
  // engine to close its side. Returns whether it did.
  bool FinishAndAwaitClose(double timeout_s);
  // Whether the engine closed the connection (EOF or reset seen by the reader).
  bool closed_by_engine() const { return closed_.load(); }
  // The engine sent something that is not a well-formed frame (the first problem, or "").
  std::string protocol_error() const;
  uint64_t frames_received() const { return frames_received_.load(); }

 private:
  FakePeer() = default;
  void ReadLoop();

  BootstrapOptions options_;
  int listen_fd_ = -1;
  int fd_ = -1;
  FrameCallback on_frame_;
  std::thread reader_;
  std::mutex send_mu_;
  std::atomic<bool> closed_{false}, stop_{false};
  std::atomic<uint64_t> frames_received_{0};
  mutable std::mutex error_mu_;
  std::string protocol_error_;
};

}  // namespace fuzz
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FUZZ_FAKE_PEER_H_
