// The two-level push_pull (EngineOptions::hierarchical; hosts.h says which workers share a host):
// the sum of one tensor over all workers, summed on each host first and then across hosts, so
// the network carries each host's share once (BytePS; Horovod's hierarchical all-reduce). The
// simulator predicts the same protocol (RuntimeModel::hierarchical, simulator.cc).
//
// The tensor is cut for the H hosts (MakePartitions with H; a fused bucket with BucketPartitions
// at the bucket's per-host share) and each partition is owned by a host. On every host one rank,
// the partition's leader (PartitionLeader: a host's partitions rotate over its ranks from the
// name's hash), sums it for the host:
//  1. every other rank of the host PUSHes its values of the partition to its leader over their
//     (loopback) connection, at once, outside the scheduler;
//  2. a leader whose host does not own the partition, once it has its host's sum, PUSHes that sum
//     to the owning host's leader through the scheduler, under the byte credit, as any push;
//  3. the owning host's leader adds the other hosts' sums to its host's, and sends the RESULT to
//     the other hosts' leaders and to its host's ranks;
//  4. every other leader passes the RESULT on to its host's ranks.
// Every frame carries the operation's codec (compressed: each PUSH, host sum and RESULT is an
// encoded block, and a leader forwards the RESULT's bytes as they came, so every worker decodes
// the same payload and holds the same bits).
//
// Summation order, fixed (deterministic whatever the arrival order, identical on every worker):
// host h's sum S_h adds its ranks' values starting from the partition's leader and going up its
// host's ranks (ascending rank order), wrapping around; the owning host o's leader adds
// S_o + S_{o+1} + ... + S_{o+H-1} (host indices mod H), one chain: its own values, its host's
// ranks in that order, then the other hosts' sums. With `average` the total is divided by N.
// A contribution whose turn it is is added as it lands; one that comes early is held whole until
// its turn.
#ifndef PROPHET_OPS_CORE_TWO_LEVEL_H_
#define PROPHET_OPS_CORE_TWO_LEVEL_H_

#include <cstdint>
#include <vector>

#include "ops/core/collective.h"
#include "ops/core/hosts.h"

namespace prophet {

class TwoLevelPushPull : public Collective {
 public:
  // `layout` outlives the operation (the engine's).
  TwoLevelPushPull(CollectiveHost* host, uint64_t id, OpRequest request, uint64_t round, const HostLayout& layout)
      : Collective(host, id, std::move(request), round), layout_(layout) {}

  void Start() override;
  PayloadSink OnFrame(int peer, const FrameMeta& meta) override;
  void OnPayloadDone(int peer, const FrameMeta& meta) override;
  void OnWholeFrame(int peer, const FrameMeta& meta, ByteBuffer* data) override;
  void SendScheduled(const SendTask& task) override;
  std::vector<bool> WaitingFor() const override;
  void Complete(const Status& status) override;

 private:
  // What this worker does for a partition: a member pushes to its host's leader and gets the
  // result from it; a leader sums its host's values and pushes them to the owner; the owner (the
  // owning host's leader) sums the hosts' sums and sends the result out.
  enum class Role : uint8_t { kMember, kLeader, kOwner };
  // A leader's push of its host's sum: the sum is not complete, queued in the scheduler, released
  // (its credit held), sent (its last byte is in the kernel), its result back.
  enum class PushState : uint8_t { kSumming, kQueued, kReleased, kSent, kDone };
  struct Held {  // a contribution that came before its turn
    ByteBuffer data;
    uint64_t bytes = 0;  // on the wire
    int scale_exp = 0;
    bool held = false;
  };
  struct Part {
    Role role = Role::kMember;
    int leader = 0;  // this host's leader of the partition
    int owner = 0;   // the owning host's leader
    // Leader and owner: contributions by position in the summation order (0: this worker's).
    int needed = 0;
    int added = 0;
    std::vector<bool> contributed;
    std::vector<Held> held;
    PushState push = PushState::kSumming;
    int64_t released_ns = 0;
    bool result = false;  // leader and member: the result has arrived
    int sends_left = 0;   // RESULT frames not yet written
    ByteBuffer push_encoded, result_encoded;  // compressed payloads until sent
    int result_scale_exp = 0;
  };

  FrameType frame_type() const override { return FrameType::kPush; }
  std::string Mismatch(int peer, const FrameMeta& meta) const override;
  // Where `peer`'s contribution to partition `part` comes in this worker's summation order, or
  // -1 when this worker sums no contribution of `peer` to it.
  int Position(uint32_t part, int peer) const;
  // The rank whose contribution comes at `position` (inverse of Position).
  int RankAt(uint32_t part, int position) const;
  // Whether a RESULT from `peer` is the one this worker waits for.
  bool ExpectedResult(int peer, const FrameMeta& meta) const;
  SendTask PushTask(uint32_t part) const;
  void SendMemberPush(uint32_t part);
  void PushSent(uint32_t part);
  void Accumulate(uint32_t part, uint64_t wire_at, const char* data, uint64_t wire_len, int scale_exp);
  void ContributionDone(uint32_t part);
  // Every contribution summed: a leader queues its push, the owner sends the result.
  void SumComplete(uint32_t part);
  // The result is in the output (decoded); a leader passes it on.
  void ResultArrived(uint32_t part);
  // Sends the result of `part` to `peers` (as `payload`); the last one written ends the partition.
  void SendResult(uint32_t part, const std::vector<int>& peers, const Payload& payload);
  uint64_t WireBytes(uint32_t part) const { return codec().WireBytes(parts()[part].bytes); }
  char* Out(uint32_t part) const { return static_cast<char*>(req_.output) + parts()[part].offset; }
  const char* In(uint32_t part) const { return static_cast<const char*>(req_.input) + parts()[part].offset; }
  int host_of_rank() const { return layout_.host_of[static_cast<size_t>(rank())]; }
  const std::vector<int>& my_host_ranks() const { return layout_.ranks[static_cast<size_t>(host_of_rank())]; }

  const HostLayout& layout_;
  uint64_t name_hash_ = 0;
  std::vector<Part> p_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_TWO_LEVEL_H_
