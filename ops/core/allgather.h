// allgather: every worker's tensor, concatenated along dimension 0 in rank order. Only the first
// dimension may differ across workers.
//
// Every rank sends its whole tensor to every other rank; received tensors are held until all
// are in, then handed to the done callback (GatherResult), which assembles the output.
// Compressed (codec.h), a worker encodes its tensor once for every peer, and its own part of the
// output is decoded from that same payload: every worker holds the same bits.
#ifndef PROPHET_OPS_CORE_ALLGATHER_H_
#define PROPHET_OPS_CORE_ALLGATHER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/collective.h"

namespace prophet {

class Allgather : public Collective {
 public:
  Allgather(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round)
      : Collective(host, id, std::move(request), round) {}

  void Start() override;
  PayloadSink OnFrame(int peer, const FrameMeta& meta) override;
  void OnPayloadDone(int /*peer*/, const FrameMeta& /*meta*/) override {}  // payloads come whole
  void OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) override;
  std::vector<bool> WaitingFor() const override;
  void Complete(const Status& status) override;

 private:
  FrameType frame_type() const override { return FrameType::kGather; }
  // Why `peer`'s tensor cannot be concatenated with this worker's, or "" when it can.
  std::string Mismatch(int peer, const FrameMeta& meta) const override;
  // This worker's encoded tensor (compressed) goes back to the pool.
  void ReleaseOwnEncoded();

  std::vector<ByteBuffer> gathered_;  // by rank (this rank's own: its encoded tensor, when compressed)
  std::vector<int> scale_exp_;        // by rank, when compressed
  std::vector<std::vector<int64_t>> gathered_shapes_;
  std::vector<bool> got_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_ALLGATHER_H_
