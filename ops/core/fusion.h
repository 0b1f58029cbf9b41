// Fusion: small gradients travel together, in buckets, so that every bucket spreads over all N
// owners and costs N-1 messages per worker instead of N-1 per tensor (docs/design.md, "Fusion").
//
// The plan is a pure function of what every worker knows identically: the tensors' names, bytes,
// element sizes, priorities and how they travel (a `fuse_key` that must match for two tensors
// to share a bucket: dtype, encoding, averaging), plus N and the bucket size. Workers that are
// given the same tensors make the same buckets, with the same members in the same order at the
// same byte offsets, and each bucket is then partitioned and owned by MakePartitions under its
// own name like any tensor. The engine and the simulator both use it.
#ifndef PROPHET_OPS_CORE_FUSION_H_
#define PROPHET_OPS_CORE_FUSION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/partition.h"

namespace prophet {

// One collective a step makes, as the plan sees it.
struct FusionInput {
  std::string name;
  uint64_t bytes = 0;
  uint32_t element_size = 4;
  int64_t priority = 0;
  // Tensors fuse only with tensors of the same key (the caller packs what must agree inside one
  // payload: dtype, encoding, averaging). Control collectives must not be given a fusable key.
  uint64_t fuse_key = 0;
  bool fusable = true;  // false: never a bucket, travels alone (control collectives, sparse, ...)
};

struct FusionBucket {
  // A tensor that cannot fuse keeps its own name (so its partitions and owners are exactly the
  // unfused ones); a bucket is named after its members (kFusedPrefix, first and last member,
  // count), even a bucket of one: a fusable tensor that travels alone is still cut among owners
  // as a bucket is (BucketPartitions), since whole on one owner it would hold up the step while
  // that owner takes N-1 pushes and sends N-1 sums (ResNet50's first kernel, 37.6 kB, at N = 256:
  // 9.6 MB each way on one link).
  std::string name;
  uint64_t bytes = 0;
  uint32_t element_size = 4;
  int64_t priority = 0;              // its most urgent member's
  std::vector<int> members;          // indices into the plan's input, most urgent first
  std::vector<uint64_t> offsets;     // byte offset of each member inside the bucket
  bool bucket = false;               // travels as a bucket (fuser.h), of one member or more
  bool fused() const { return bucket; }
};

constexpr const char* kFusedPrefix = "fused:";
// A fusion setting (EngineOptions::fusion_bytes, RuntimeModel::fusion_bytes): kFusionAuto, 0
// (off) or a bucket size in bytes.
constexpr int64_t kFusionAuto = -1;

// The per-message cost the bucket size amortises: a frame's header and metadata, the system call
// and the engine thread's turn that handle it (an estimate, not a measurement of this machine).
constexpr int64_t kFusionMessageCostNs = 20000;
// A partition carries at least this many times the bytes the link moves during one message's
// cost: the message cost is then at most 1/(1 + kFusionAmortisation) of its time (10%).
constexpr double kFusionAmortisation = 9.0;

// The bytes each owner of a bucket sums at least: enough that a partition amortises the
// per-message cost, kFusionAmortisation x R x message_cost, and at least kFusionMinOwnerBytes (a
// frame's header is then at most 2.5% of it). R is the link rate up to kFusionLinearUpTo_Bps and
// grows as the square root beyond (sqrt(link_Bps x kFusionLinearUpTo_Bps)): a bucket also holds
// its earliest-ready bytes back until its last member is ready, and on fast links that wait costs
// more than the messages saved. Chosen with the predictor (ResNet50, 25 and 100 Gbit/s, N = 16-256,
// with no message cost and with 6 us per frame each end; docs/design.md, "Fusion"): linear sizing
// was the slowest at N = 64-256 (100 Gbit/s N = 256: 30.6 ms, 24.6 with the square root, ring
// 32.2), sizing for 10 Gbit/s at every rate fell behind the ring once messages cost 6 us (39.7 ms).
constexpr uint64_t kFusionMinOwnerBytes = 4096;
constexpr double kFusionLinearUpTo_Bps = 1.25e9;
uint64_t FusionOwnerBytes(double link_Bps, int64_t message_cost_ns = kFusionMessageCostNs);

// The bucket size for N workers on links of `link_Bps` (bytes/s per direction):
//   bucket = N x FusionOwnerBytes(link_Bps) = N x max(4 KiB, 9 x R x 20 us), R as above
// A full bucket is then cut into N partitions, one per owner (BucketPartitions), each of which
// amortises the per-message cost. 0 for one worker (nothing travels).
uint64_t FusionBucketBytes(int world_size, double link_Bps, int64_t message_cost_ns = kFusionMessageCostNs);

// How a fused bucket of B bytes is cut: among k = min(N, ceil(sqrt((N-1) B / (2 R c)))) owners
// (R c = bucket_bytes / N / kFusionAmortisation), which minimises (N-1) B / (k R), the time the
// busiest owner's link takes, plus 2 k c, the messages each worker handles; a full bucket gets
// all N owners. More partitions when `partition_bytes` or MakePartitions' pipelining asks for
// them; owners round-robin from the bucket name's hash (MakePartitions does the cutting).
std::vector<Partition> BucketPartitions(const std::string& name, uint64_t bytes, uint32_t element_size, int world_size,
                                        uint64_t partition_bytes, uint64_t bucket_bytes);
// BucketPartitions for a bucket (of one too), MakePartitions (with `min_split_bytes`) for a
// tensor that is not a bucket.
std::vector<Partition> PlanPartitions(const FusionBucket& bucket, int world_size, uint64_t partition_bytes,
                                      uint64_t bucket_bytes, uint64_t min_split_bytes = kDefaultMinSplitBytes);

// The link rate kFusionAuto assumes where the rate is not known alike on every worker (the
// engine: a bandwidth estimate differs from worker to worker, and the plan must not): 10 Gbit/s.
constexpr double kFusionAssumedLink_Bps = 1.25e9;

// The bucket size a setting gives: FusionBucketBytes for kFusionAuto (at `link_Bps`, or
// kFusionAssumedLink_Bps when that is not positive), 0 when off or for one worker, else the
// setting.
uint64_t ResolveFusionBytes(int64_t setting, int world_size, double link_Bps);

// How large a bucket may grow whose first member has `ahead_bytes` of more urgent tensors before
// it (in priority order): as large as those together, at least one owner's share (bucket_bytes /
// N), at most bucket_bytes. Why: a bucket leaves when its most urgent member is ready, and the
// most urgent bucket, which the next step's first layers wait for, becomes ready when the
// backward pass ends: everything it carries (and waits for) is on the step's critical path. A
// bucket of the full size there held up to bucket_bytes back until the backward pass ended (the
// whole of ResNet50 at N = 256; 6.3 MB at N = 16 and 100 Gbit/s, predicted). Sizes
// that double from the most urgent end keep that tail to one owner's share, while a less urgent
// bucket is ready before the more urgent bytes it may equal, which the links still carry after it.
uint64_t FusionBucketCap(uint64_t ahead_bytes, int world_size, uint64_t bucket_bytes);

// The plan of `tensors` whose buckets are exactly `groups` (each a bucket's members, indices into
// `tensors`, most urgent first), named and laid out as PlanFusion lays out its buckets; a tensor
// in no group is not a bucket. A lane of the engine carries the whole plan's buckets it was dealt
// (FusionByLane) this way: planned again from its share alone, with caps that double from its own
// most urgent bucket, they came out otherwise (BERT-base at N = 64 on 2 lanes, scaled: 23 buckets
// and 1436 partitions instead of the 19 and 1208 the simulator models).
std::vector<FusionBucket> PlanOfBuckets(const std::vector<FusionInput>& tensors,
                                        const std::vector<std::vector<int>>& groups);

// The lane each bucket of `plan` travels on where the engine runs `lanes` lanes (engine.h), -1
// for a tensor that is not a bucket: in plan order (most urgent first), each bucket to the lane
// with the fewest bucket bytes so far (the lowest such lane), so that every lane carries about
// the same bytes and buckets of every urgency. Dealt by count instead, a model whose small and
// large buckets alternate (BERT-base's feed-forward biases between its kernels) put every large
// bucket on every other lane. Used by the engine (FusionByLane) and the simulator.
std::vector<int> DealBucketsToLanes(const std::vector<FusionBucket>& plan, int lanes);

// Buckets in priority order (most urgent first; equal priorities by name): runs of consecutive
// fusable tensors of one fuse_key, each smaller than N x min_split_bytes (larger ones already
// spread over every owner and travel alone), closed once they reach their cap (FusionBucketCap:
// sizes that double from the most urgent bucket up to `bucket_bytes`) or when the next tensor
// cannot join (a fusable tensor alone is a bucket of one). Every input is in exactly one entry;
// the others are not buckets (fused() false) and travel alone. bucket_bytes == 0: no fusion (no
// buckets). Inputs must have distinct names.
std::vector<FusionBucket> PlanFusion(const std::vector<FusionInput>& tensors, int world_size, uint64_t bucket_bytes,
                                     uint64_t min_split_bytes = 64 * 1024);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FUSION_H_
