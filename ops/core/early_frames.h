// Frames for operations not yet submitted on this worker.
//
// Workers submit the same operations in different orders and at different times, so a peer's
// PUSH, BROADCAST or GATHER frame often arrives before this worker has the operation. Such a frame
// is held whole in memory (a pooled buffer) under `name#round` and replayed when the operation is
// submitted. What is held is bounded: a frame larger than any partition, or one that would take
// the held bytes past max_early_bytes, is refused before anything is allocated (its header alone
// may claim 256 GiB), with a message that says which limit and how to raise it.
//
// Single-threaded: the engine's I/O thread owns it. It knows frames and limits, not connections
// or operations; the engine decides what a refusal does.
#ifndef PROPHET_OPS_CORE_EARLY_FRAMES_H_
#define PROPHET_OPS_CORE_EARLY_FRAMES_H_

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "ops/core/buffer_pool.h"
#include "ops/core/engine_options.h"
#include "ops/core/wire.h"

namespace prophet {

// A frame whose operation has not been submitted on this worker yet.
struct EarlyFrame {
  int peer = 0;
  FrameMeta meta;
  ByteBuffer data;
  uint64_t footprint = 0;  // what it counts against max_early_bytes
};

class EarlyFrames {
 public:
  explicit EarlyFrames(const EngineOptions& options);

  // The header of an early frame from `peer` arrived: why it cannot be held, or "" (then its
  // footprint is reserved while its payload is received, until Received(peer)).
  std::string Admit(int peer, const FrameMeta& meta);
  // The frame `peer` was sending is complete, or its connection closed: its reservation ends.
  void Received(int peer);
  // Holds a complete early frame until Take(its key).
  void Keep(int peer, const FrameMeta& meta, ByteBuffer data);
  // Removes and returns the frames held for `key` (name#round), in arrival order.
  std::vector<EarlyFrame> Take(const std::string& key);

 private:
  // Why an early frame of `footprint` bytes from `peer` cannot be held, or "".
  std::string Problem(int peer, const FrameMeta& meta, uint64_t footprint) const;

  const uint64_t partition_bytes_;
  const uint64_t max_early_bytes_;
  std::unordered_map<std::string, std::vector<EarlyFrame>> frames_;  // by key
  uint64_t bytes_ = 0;               // footprints of frames_ and of early frames being received
  std::vector<uint64_t> receiving_;  // by peer: the footprint of the early frame it is sending
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_EARLY_FRAMES_H_
