#include "ops/core/fusion.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace prophet {

uint64_t FusionOwnerBytes(double link_Bps, int64_t message_cost_ns) {
  const double rate = std::max(0.0, link_Bps);
  const double sized_for = rate <= kFusionLinearUpTo_Bps ? rate : std::sqrt(rate * kFusionLinearUpTo_Bps);
  const double amortised =
      kFusionAmortisation * sized_for * static_cast<double>(std::max<int64_t>(0, message_cost_ns)) / 1e9;
  return std::max<uint64_t>(kFusionMinOwnerBytes, static_cast<uint64_t>(std::ceil(amortised)));
}

uint64_t FusionBucketBytes(int world_size, double link_Bps, int64_t message_cost_ns) {
  if (world_size <= 1) return 0;
  return static_cast<uint64_t>(world_size) * FusionOwnerBytes(link_Bps, message_cost_ns);
}

std::vector<Partition> BucketPartitions(const std::string& name, uint64_t bytes, uint32_t element_size, int world_size,
                                        uint64_t partition_bytes, uint64_t bucket_bytes) {
  const uint64_t n = static_cast<uint64_t>(std::max(world_size, 1));
  const uint64_t elem = std::max<uint32_t>(element_size, 1);
  const uint64_t owner_bytes = std::max<uint64_t>(elem, bucket_bytes / n);
  // k owners: each receives (N-1) B / k bytes, which take (N-1) B / (k R), and every worker sends
  // and receives about 2k messages of cost c each; the sum is least at k = sqrt((N-1) B / (2 R c)),
  // and R c = owner_bytes / kFusionAmortisation.
  const double best = std::sqrt(kFusionAmortisation / 2 * static_cast<double>(n - 1) *
                                static_cast<double>(bytes) / static_cast<double>(owner_bytes));
  const uint64_t k = std::min<uint64_t>(n, std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(best))));
  // Partitions of at most ceil(bytes / k), on element boundaries, give k of them.
  const uint64_t elements = bytes / elem;
  const uint64_t cut = std::max<uint64_t>(1, (elements + k - 1) / k) * elem;
  return MakePartitions(name, bytes, elem, world_size, std::min(partition_bytes, cut), owner_bytes);
}

std::vector<Partition> PlanPartitions(const FusionBucket& bucket, int world_size, uint64_t partition_bytes,
                                      uint64_t bucket_bytes, uint64_t min_split_bytes) {
  if (!bucket.fused())
    return MakePartitions(bucket.name, bucket.bytes, bucket.element_size, world_size, partition_bytes, min_split_bytes);
  return BucketPartitions(bucket.name, bucket.bytes, bucket.element_size, world_size, partition_bytes, bucket_bytes);
}

uint64_t ResolveFusionBytes(int64_t setting, int world_size, double link_Bps) {
  if (world_size <= 1 || setting == 0) return 0;
  if (setting == kFusionAuto) return FusionBucketBytes(world_size, link_Bps > 0 ? link_Bps : kFusionAssumedLink_Bps);
  return static_cast<uint64_t>(std::max<int64_t>(0, setting));
}

std::vector<int> DealBucketsToLanes(const std::vector<FusionBucket>& plan, int lanes) {
  std::vector<uint64_t> carried(static_cast<size_t>(std::max(lanes, 1)), 0);
  std::vector<int> lane_of;
  lane_of.reserve(plan.size());
  for (const FusionBucket& b : plan) {
    if (!b.fused()) {
      lane_of.push_back(-1);
      continue;
    }
    const size_t lane = static_cast<size_t>(std::min_element(carried.begin(), carried.end()) - carried.begin());
    carried[lane] += b.bytes;
    lane_of.push_back(static_cast<int>(lane));
  }
  return lane_of;
}

uint64_t FusionBucketCap(uint64_t ahead_bytes, int world_size, uint64_t bucket_bytes) {
  const uint64_t owner_bytes = bucket_bytes / static_cast<uint64_t>(std::max(world_size, 1));
  return std::min(bucket_bytes, std::max(owner_bytes, ahead_bytes));
}

namespace {

FusionBucket Alone(const std::vector<FusionInput>& tensors, int i) {
  FusionBucket b;
  b.name = tensors[i].name;
  b.bytes = tensors[i].bytes;
  b.element_size = tensors[i].element_size;
  b.priority = tensors[i].priority;
  b.members = {i};
  b.offsets = {0};
  return b;
}

// The name of a fused bucket: the same on every worker with the same plan, and different for
// different member runs (first, last and count determine a run of the priority order).
std::string FusedName(const std::vector<FusionInput>& tensors, const FusionBucket& b) {
  return std::string(kFusedPrefix) + tensors[b.members.front()].name + ".." + tensors[b.members.back()].name + "/" +
         std::to_string(b.members.size());
}

// Appends tensor `m` to bucket `b` (its first member sets the element size and priority).
void AddMember(const std::vector<FusionInput>& tensors, int m, FusionBucket* b) {
  if (b->members.empty()) {
    b->element_size = tensors[m].element_size;
    b->priority = tensors[m].priority;
  }
  b->members.push_back(m);
  b->offsets.push_back(b->bytes);
  b->bytes += tensors[m].bytes;
}

// A filled bucket, named after its members.
FusionBucket Sealed(const std::vector<FusionInput>& tensors, FusionBucket b) {
  b.name = FusedName(tensors, b);
  b.bucket = true;
  return b;
}

}  // namespace

std::vector<FusionBucket> PlanOfBuckets(const std::vector<FusionInput>& tensors,
                                        const std::vector<std::vector<int>>& groups) {
  std::vector<FusionBucket> plan;
  std::vector<bool> grouped(tensors.size(), false);
  for (const std::vector<int>& members : groups) {
    if (members.empty()) continue;
    FusionBucket b;
    for (const int m : members) {
      AddMember(tensors, m, &b);
      grouped[m] = true;
    }
    plan.push_back(Sealed(tensors, std::move(b)));
  }
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!grouped[i]) plan.push_back(Alone(tensors, static_cast<int>(i)));
  return plan;
}

std::vector<FusionBucket> PlanFusion(const std::vector<FusionInput>& tensors, int world_size, uint64_t bucket_bytes,
                                     uint64_t min_split_bytes) {
  std::vector<int> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    if (tensors[a].priority != tensors[b].priority) return tensors[a].priority > tensors[b].priority;
    return tensors[a].name < tensors[b].name;
  });
  // Already cut into at least N partitions on its own (MakePartitions' rule): nothing to gain.
  const uint64_t spread_bytes = static_cast<uint64_t>(std::max(world_size, 1)) * min_split_bytes;
  auto fusable = [&](int i) {
    return bucket_bytes > 0 && world_size > 1 && tensors[i].fusable && tensors[i].bytes < spread_bytes;
  };
  std::vector<FusionBucket> buckets;
  FusionBucket open;  // the bucket being filled (no members: none)
  uint64_t open_cap = 0;    // the open bucket closes once it holds this much (FusionBucketCap)
  uint64_t ahead_bytes = 0; // bytes of every tensor before the current one in priority order
  auto close = [&] {
    if (open.members.empty()) return;
    buckets.push_back(Sealed(tensors, std::move(open)));
    open = FusionBucket();
  };
  for (const int i : order) {
    const FusionInput& t = tensors[i];
    const uint64_t before = ahead_bytes;
    ahead_bytes += t.bytes;
    if (!fusable(i)) {
      close();
      buckets.push_back(Alone(tensors, i));
      continue;
    }
    if (!open.members.empty() && (tensors[open.members.front()].fuse_key != t.fuse_key || open.element_size != t.element_size))
      close();
    if (open.members.empty()) open_cap = FusionBucketCap(before, world_size, bucket_bytes);
    AddMember(tensors, i, &open);
    if (open.bytes >= open_cap) close();
  }
  close();
  return buckets;
}

}  // namespace prophet
