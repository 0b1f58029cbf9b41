#include "ops/core/early_frames.h"

#include <algorithm>
#include <utility>

#include "ops/core/collective.h"

namespace prophet {
namespace {

// Memory an early frame holds: its payload and its bookkeeping (so that many empty frames count).
uint64_t Footprint(const FrameMeta& meta) {
  return meta.payload_bytes + meta.name.size() + 8 * meta.shape.size() + sizeof(EarlyFrame) + 64;
}

}  // namespace

EarlyFrames::EarlyFrames(const EngineOptions& options)
    : partition_bytes_(options.partition_bytes),
      max_early_bytes_(options.max_early_bytes),
      receiving_(static_cast<size_t>(std::max(options.world_size, 0)), 0) {}

std::string EarlyFrames::Admit(int peer, const FrameMeta& meta) {
  const uint64_t footprint = Footprint(meta);
  std::string problem = Problem(peer, meta, footprint);
  if (!problem.empty()) return problem;
  bytes_ += footprint;
  receiving_[peer] = footprint;
  return "";
}

void EarlyFrames::Received(int peer) {
  bytes_ -= receiving_[peer];
  receiving_[peer] = 0;
}

void EarlyFrames::Keep(int peer, const FrameMeta& meta, ByteBuffer data) {
  const uint64_t footprint = Footprint(meta);
  bytes_ += footprint;
  frames_[OperationKey(meta.name, meta.round)].push_back(EarlyFrame{peer, meta, std::move(data), footprint});
}

std::vector<EarlyFrame> EarlyFrames::Take(const std::string& key) {
  auto it = frames_.find(key);
  if (it == frames_.end()) return {};
  std::vector<EarlyFrame> frames = std::move(it->second);
  frames_.erase(it);
  for (const EarlyFrame& e : frames) bytes_ -= e.footprint;
  return frames;
}

std::string EarlyFrames::Problem(int peer, const FrameMeta& meta, uint64_t footprint) const {
  const std::string what = std::string(CollectiveOfFrame(meta.type)) + " '" + meta.name + "' (round " +
                           std::to_string(meta.round) + "): rank " + std::to_string(peer) + " sent " +
                           std::to_string(meta.payload_bytes) + " bytes for it before this worker started it";
  // PUSH and BROADCAST frames carry one partition; an allgather frame the whole tensor.
  if (meta.type != FrameType::kGather && meta.payload_bytes > partition_bytes_)
    return what + ", but partitions are at most partition_bytes = " + std::to_string(partition_bytes_) +
           " bytes here: do all workers run with the same partition_bytes?";
  if (bytes_ + footprint <= max_early_bytes_) return "";
  const std::string held = bytes_ == 0 ? "" : "; with the " + std::to_string(bytes_) + " bytes held already for " +
                                                  std::to_string(frames_.size()) + " operation(s) not started here,";
  return what + held + " that passes max_early_bytes = " + std::to_string(max_early_bytes_) +
         ". Raise max_early_bytes if workers legitimately run that far apart (e.g. a large broadcast to a worker "
         "that starts late)";
}

}  // namespace prophet
