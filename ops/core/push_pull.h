// push_pull: the sum (or mean) of one tensor over all workers.
//
// The tensor is cut into partitions (partition.h); partition i is owned by one rank. Every other
// rank PUSHes its values of the partition to the owner, when the scheduler releases that PUSH;
// the owner adds the N contributions into its output and sends the summed partition back as a
// RESULT, straight from its output. Each worker sends and receives about 2(N-1)/N of the tensor.
//
// Compressed (codec.h): a PUSH is encoded when the scheduler releases it, into a pooled buffer
// of the partition's wire size (no copy of the whole tensor); the owner adds the decoded codes to
// its own float32 values, encodes the sum once for every peer, and decodes that same payload into
// its own output, so every worker holds the same bits (docs/design.md, "Compression").
//
// The owner adds the contributions in one fixed order, whatever order they arrive in: float
// addition is not associative, so an arrival-order sum of 3 or more contributions differs in its
// last bits from run to run. The order is the owner's own values, then its peers from rank + 1
// upwards, wrapping around (own + first peer may land in either order: a + b == b + a exactly).
// The contribution whose turn it is streams into the output as it arrives; one that arrives
// before its turn is held whole (a pooled buffer) and added when its turn comes.
#ifndef PROPHET_OPS_CORE_PUSH_PULL_H_
#define PROPHET_OPS_CORE_PUSH_PULL_H_

#include <cstdint>
#include <vector>

#include "ops/core/collective.h"

namespace prophet {

class PushPull : public Collective {
 public:
  PushPull(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round)
      : Collective(host, id, std::move(request), round) {}

  void Start() override;
  PayloadSink OnFrame(int peer, const FrameMeta& meta) override;
  void OnPayloadDone(int peer, const FrameMeta& meta) override;
  void OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) override;
  void SendScheduled(const SendTask& task) override;
  std::vector<bool> WaitingFor() const override;
  void Complete(const Status& status) override;

 private:
  // Partitions owned by others: queued in the scheduler, released (in this worker's out-queue, its
  // credit held), sent (its last byte is in the kernel), its sum back.
  enum class PushState : uint8_t { kQueued, kReleased, kSent, kDone };

  FrameType frame_type() const override { return FrameType::kPush; }
  // The scheduler's task for the PUSH of partition `part`.
  SendTask PushTask(uint32_t part) const;
  // The PUSH of `part` left this worker: its credit returns (CollectiveHost::PushLeft).
  void PushSent(uint32_t part);
  // Checks a PUSH against this worker's own request.
  std::string Mismatch(int peer, const FrameMeta& meta) const override;
  // Adds payload bytes [at, at + len) of a contribution to owned partition `part` (encoded with
  // scale exponent `scale_exp` when compressed).
  void Accumulate(uint32_t part, uint64_t at, const char* data, uint64_t len, int scale_exp);
  // Where `peer`'s contribution comes in the summation order (0: this worker's own values).
  int SumPosition(int peer) const { return (peer - rank() + n()) % n(); }
  // Whether `peer`'s contribution to owned partition `part` is the next one to add.
  bool InTurn(uint32_t part, int peer) const { return SumPosition(peer) == added_[part]; }
  // The contribution in turn is summed: add the held ones whose turn follows, then finish.
  void ContributionDone(uint32_t part, int peer);
  // With every contribution added: average if asked, send the RESULT to every other rank.
  void FinishPartition(uint32_t part);
  // Bytes of partition `part` on the wire (what the scheduler, the credit and the bandwidth
  // monitor count).
  uint64_t WireBytes(uint32_t part) const { return codec().WireBytes(parts()[part].bytes); }
  // Hands the encoded payload of partition `part` back to the pool once sent.
  void ReleaseEncoded(uint32_t part) { host()->GiveBuffer(std::move(encoded_[part])); }

  std::vector<PushState> push_state_;
  std::vector<int64_t> push_released_ns_;
  // Owned partitions under a policy that schedules them (CollectiveHost::SchedulesOwnedPartitions):
  // kQueued until released, then kReleased; the sum is sent back only once released. kDone: not
  // scheduled (every other policy).
  std::vector<PushState> local_state_;
  // A contribution that arrived before its turn, held until then.
  struct Held {
    ByteBuffer data;
    uint64_t bytes = 0;  // on the wire (encoded when compressed)
    int scale_exp = 0;
    bool held = false;
  };
  // Owned partitions.
  std::vector<std::vector<bool>> contributed_;  // by rank: received (summed or held)
  std::vector<int> added_;                      // contributions summed, in SumPosition order
  std::vector<std::vector<Held>> held_;         // by SumPosition
  std::vector<int> result_sends_left_;
  // Output bytes [0, seeded) of an owned partition already hold the local values plus the
  // contributions summed so far; beyond that the output is not written yet. The first peer's
  // contribution streams in from offset 0 in order and extends this prefix with out = in +
  // received (one pass, no separate copy of the local values); every later one adds into it.
  std::vector<uint64_t> seeded_;
  // Compressed: by partition, the encoded PUSH or RESULT payload until it has been sent.
  std::vector<ByteBuffer> encoded_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_PUSH_PULL_H_
