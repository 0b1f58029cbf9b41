// broadcast: the root's tensor on every worker.
//
// The root sends its tensor, cut into partitions (partition.h), to every other rank; the others
// receive each partition straight into their output.
#ifndef PROPHET_OPS_CORE_BROADCAST_H_
#define PROPHET_OPS_CORE_BROADCAST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/collective.h"

namespace prophet {

class Broadcast : public Collective {
 public:
  Broadcast(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round)
      : Collective(host, id, std::move(request), round) {}

  void Start() override;
  PayloadSink OnFrame(int peer, const FrameMeta& meta) override;
  void OnPayloadDone(int peer, const FrameMeta& meta) override;
  void OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) override;
  std::vector<bool> WaitingFor() const override;

 private:
  FrameType frame_type() const override { return FrameType::kBroadcast; }
  std::string Mismatch(int peer, const FrameMeta& meta) const override;
  // Partitions received (non-root): completion counts each partition once, never frames.
  std::vector<bool> received_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_BROADCAST_H_
