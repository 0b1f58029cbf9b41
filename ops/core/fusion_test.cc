// The fusion plan: every tensor in exactly one bucket, in priority order, runs of one key, sizes
// from N and the link, the same plan for the same inputs whatever order they are given in.
#include "ops/core/fusion.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ops/core/partition.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr uint64_t kKiB = 1024;

FusionInput In(const std::string& name, uint64_t bytes, int64_t priority, uint64_t key = 0) {
  FusionInput t;
  t.name = name;
  t.bytes = bytes;
  t.priority = priority;
  t.fuse_key = key;
  return t;
}

// Every input once; members contiguous in the bucket; members in priority order.
bool Covers(const std::vector<FusionInput>& in, const std::vector<FusionBucket>& plan) {
  std::vector<int> seen(in.size(), 0);
  for (const FusionBucket& b : plan) {
    if (b.members.empty() || b.members.size() != b.offsets.size()) return false;
    uint64_t at = 0;
    for (size_t i = 0; i < b.members.size(); ++i) {
      const int m = b.members[i];
      ++seen[m];
      if (b.offsets[i] != at) return false;
      at += in[m].bytes;
      if (i > 0 && in[m].priority > in[b.members[i - 1]].priority) return false;
    }
    if (at != b.bytes) return false;
    if (b.priority != in[b.members.front()].priority) return false;
  }
  return std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; });
}

TEST(BucketSizeFollowsWorkersAndLink) {
  // 1 Gbit/s: 9 x 125 MB/s x 20 us = 22.5 kB per owner.
  EXPECT_EQ(FusionOwnerBytes(125e6), 22500u);
  EXPECT_EQ(FusionBucketBytes(2, 125e6), 2 * 22500u);
  EXPECT_EQ(FusionBucketBytes(64, 125e6), 64 * 22500u);
  // 10 Gbit/s: 225 kB per owner, the last rate sized linearly; 100 Gbit/s: sized for
  // sqrt(100 x 10) Gbit/s, 9 x 3.953 GB/s x 20 us = 711.5 kB (2.25 MB if linear); a slow link:
  // the 4 KiB floor.
  EXPECT_EQ(FusionOwnerBytes(1.25e9), 225000u);
  EXPECT_EQ(FusionBucketBytes(8, 12.5e9), 8 * uint64_t{711513});
  EXPECT_EQ(FusionOwnerBytes(1e6), kFusionMinOwnerBytes);
  EXPECT_EQ(FusionBucketBytes(1, 125e6), 0u);
  EXPECT_EQ(ResolveFusionBytes(0, 64, 125e6), 0u);
  EXPECT_EQ(ResolveFusionBytes(kFusionAuto, 64, 125e6), FusionBucketBytes(64, 125e6));
  EXPECT_EQ(ResolveFusionBytes(12345, 4, 125e6), 12345u);
  EXPECT_EQ(ResolveFusionBytes(12345, 1, 125e6), 0u);
}

FusionBucket Fused(uint64_t bytes) {
  FusionBucket b;
  b.name = "fused:a..b/2";
  b.bytes = bytes;
  b.members = {0, 1};
  b.offsets = {0, bytes / 2};
  b.bucket = true;
  return b;
}

TEST(BucketsSpreadOverEveryOwnerTheyCanFeed) {
  for (int n : {2, 3, 16, 64, 256}) {
    const uint64_t full = FusionBucketBytes(n, 125e6);
    // A full bucket: every worker owns a part.
    std::vector<Partition> parts = PlanPartitions(Fused(full), n, 4u << 20, full);
    std::set<int> owners;
    uint64_t covered = 0;
    for (const Partition& p : parts) {
      owners.insert(p.owner);
      EXPECT_EQ(p.offset, covered);
      covered += p.bytes;
    }
    EXPECT_EQ(covered, full);
    EXPECT_EQ(owners.size(), static_cast<size_t>(n));
    // A small bucket: as many owners as minimise the busiest link's time plus the messages.
    const uint64_t small = full / 64 / 4 * 4 + 4;
    parts = PlanPartitions(Fused(small), n, 4u << 20, full);
    const double best = std::sqrt(4.5 * (n - 1) * static_cast<double>(small) / static_cast<double>(full / n));
    EXPECT_EQ(parts.size(), static_cast<size_t>(std::min<double>(n, std::ceil(best))));
    EXPECT_TRUE(parts.size() < static_cast<size_t>(n) || n <= 16);
  }
  // A tensor that cannot fuse is cut exactly as without fusion.
  FusionBucket lone;
  lone.name = "grad/x";
  lone.bytes = 1000;
  lone.members = {0};
  lone.offsets = {0};
  const std::vector<Partition> parts = PlanPartitions(lone, 8, 4u << 20, FusionBucketBytes(8, 125e6));
  const std::vector<Partition> plain = MakePartitions("grad/x", 1000, 4, 8, 4u << 20);
  EXPECT_EQ(parts.size(), plain.size());
  EXPECT_EQ(parts[0].owner, plain[0].owner);
}

TEST(FusesRunsInPriorityOrder) {
  // Given in no particular order; 4 workers, buckets of 200 kB (50 kB per owner).
  std::vector<FusionInput> in = {In("c", 30000, 7), In("a", 40000, 9), In("big", 4 * 64 * kKiB, 8),
                                 In("b", 40000, 10), In("d", 50000, 6), In("e", 130000, 5), In("f", 4, 4)};
  const std::vector<FusionBucket> plan = PlanFusion(in, 4, 200000);
  EXPECT_TRUE(Covers(in, plan));
  // b(10) a(9): 80 kB >= one owner's 50 kB closes the most urgent bucket | big(8) alone, spread
  // already | c(7) d(6) e(5): 210 kB >= 200 kB closes | f(4)
  EXPECT_EQ(plan.size(), 4u);
  EXPECT_EQ(plan[0].name, std::string("fused:b..a/2"));
  EXPECT_EQ(plan[0].bytes, 80000u);
  EXPECT_EQ(plan[0].priority, 10);
  EXPECT_EQ(plan[1].name, std::string("big"));
  EXPECT_EQ(plan[2].name, std::string("fused:c..e/3"));
  EXPECT_EQ(plan[2].offsets[2], 80000u);
  // f alone, still a bucket: cut among owners as buckets are, not whole on one owner.
  EXPECT_EQ(plan[3].name, std::string("fused:f..f/1"));
  EXPECT_TRUE(plan[3].fused());
}

// ResNet50's first kernel (37,632 bytes) is the most urgent gradient and larger than the first
// bucket's cap (one owner's share), so it travels alone. Whole, its one owner takes 255 pushes
// and sends 255 sums at N = 256 (9.6 MB each way) while every other link has finished.
TEST(AFusableTensorAloneIsCutAsABucket) {
  const int n = 256;
  const uint64_t bucket_bytes = FusionBucketBytes(n, 125e6);
  std::vector<FusionInput> in = {In("grad/conv1_conv/kernel", 37632, 3), In("grad/conv1_conv/bias", 256, 2)};
  const std::vector<FusionBucket> plan = PlanFusion(in, n, bucket_bytes);
  EXPECT_TRUE(Covers(in, plan));
  EXPECT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].members.size(), 1u);
  EXPECT_TRUE(plan[0].fused());
  const std::vector<Partition> parts = PlanPartitions(plan[0], n, 4u << 20, bucket_bytes);
  const std::vector<Partition> as_bucket = BucketPartitions(plan[0].name, 37632, 4, n, 4u << 20, bucket_bytes);
  EXPECT_EQ(parts.size(), as_bucket.size());
  std::set<int> owners;
  for (const Partition& p : parts) owners.insert(p.owner);
  EXPECT_EQ(owners.size(), parts.size());  // each on its own owner
  EXPECT_TRUE(parts.size() >= 40);          // ceil(sqrt(4.5 x 255 x 37632 / 22500)) = 44
}

// The most urgent bucket leaves when the backward pass ends, so it holds one owner's share;
// every later bucket may be as large as all more urgent tensors together, up to the bucket size.
TEST(BucketSizesDoubleFromTheMostUrgent) {
  EXPECT_EQ(FusionBucketCap(0, 16, 640000), 40000u);
  EXPECT_EQ(FusionBucketCap(100000, 16, 640000), 100000u);
  EXPECT_EQ(FusionBucketCap(10000000, 16, 640000), 640000u);
  std::vector<FusionInput> in;
  for (int i = 0; i < 128; ++i) in.push_back(In("t" + std::to_string(1000 + i), 10000, 1000 - i));
  const std::vector<FusionBucket> plan = PlanFusion(in, 16, 640000);
  EXPECT_TRUE(Covers(in, plan));
  std::vector<uint64_t> sizes;
  for (const FusionBucket& b : plan) sizes.push_back(b.bytes);
  const std::vector<uint64_t> expected = {40000, 40000, 80000, 160000, 320000, 640000};
  EXPECT_TRUE(sizes == expected);
  for (size_t i = 0; i < sizes.size(); ++i) std::printf("bucket %zu: %llu bytes\n", i, static_cast<unsigned long long>(sizes[i]));
}

// The step's tail after the backward pass: 120 gradients of 3,000 bytes on 16 workers at 1 Gbit/s,
// ready one every 250 us over a 30 ms backward pass (the most urgent last). The links keep up, so
// what the next step's first layer waits for is the most urgent bucket, sent when the backward
// pass ends: one owner's share (22.5 kB, about 0.4 ms there and back). With buckets of the full
// size (360 kB) it held every gradient back until the backward pass ended: about 6 ms.
TEST(KeysAndUnfusableSplitRuns) {
  std::vector<FusionInput> in = {In("a", 100, 9, 1), In("b", 100, 8, 2), In("c", 100, 7, 2), In("d", 100, 6, 2),
                                 In("e", 100, 5, 2)};
  in[3].fusable = false;  // e.g. a control collective
  const std::vector<FusionBucket> plan = PlanFusion(in, 8, 1 << 20);
  EXPECT_TRUE(Covers(in, plan));
  EXPECT_EQ(plan.size(), 4u);  // a | b c | d | e
  EXPECT_EQ(plan[1].members.size(), 2u);
  // Element sizes never mix either.
  std::vector<FusionInput> sizes = {In("x", 64, 2), In("y", 64, 1)};
  sizes[1].element_size = 8;
  EXPECT_EQ(PlanFusion(sizes, 4, 1 << 20).size(), 2u);
}

TEST(OffOrOneWorkerKeepsEveryTensorAlone) {
  std::vector<FusionInput> in = {In("a", 100, 2), In("b", 100, 1)};
  for (const std::vector<FusionBucket>& plan : {PlanFusion(in, 4, 0), PlanFusion(in, 1, 1 << 20)}) {
    EXPECT_EQ(plan.size(), 2u);
    EXPECT_EQ(plan[0].name, std::string("a"));
    EXPECT_EQ(plan[1].name, std::string("b"));
  }
}

// Large and small buckets alternate (BERT-base: each feed-forward bias alone between two
// kernels): dealt by count, every large bucket went to every other lane.
TEST(BucketsAreDealtToLanesByBytes) {
  std::vector<FusionBucket> plan;
  for (int i = 0; i < 16; ++i) {
    FusionBucket b = Fused(i % 2 == 0 ? 9000000 : 12000);
    b.name = "fused:" + std::to_string(i);
    plan.push_back(b);
  }
  FusionBucket lone;  // a tensor that is not a bucket stays off the deal
  lone.name = "grad/big";
  lone.bytes = 90000000;
  lone.members = {0};
  lone.offsets = {0};
  plan.insert(plan.begin() + 3, lone);
  const std::vector<int> lane_of = DealBucketsToLanes(plan, 4);
  EXPECT_EQ(lane_of.size(), plan.size());
  EXPECT_EQ(lane_of[3], -1);
  std::vector<uint64_t> bytes(4, 0);
  for (size_t b = 0; b < plan.size(); ++b)
    if (lane_of[b] >= 0) bytes[static_cast<size_t>(lane_of[b])] += plan[b].bytes;
  for (const uint64_t carried : bytes) EXPECT_TRUE(carried >= 18000000 && carried <= 18100000);  // two large buckets each
  EXPECT_EQ(lane_of[0], 0);  // the most urgent on the first lane
  // One lane: everything on it.
  for (const int lane : DealBucketsToLanes(plan, 1)) EXPECT_TRUE(lane == 0 || lane == -1);
}

TEST(SamePlanWhateverTheInputOrder) {
  std::mt19937 rng(7);
  std::vector<FusionInput> in;
  for (int i = 0; i < 200; ++i)
    in.push_back(In("t" + std::to_string(i), 4 * (1 + rng() % 20000), static_cast<int64_t>(rng() % 50)));
  const std::vector<FusionBucket> plan = PlanFusion(in, 16, FusionBucketBytes(16, 125e6));
  EXPECT_TRUE(Covers(in, plan));
  EXPECT_TRUE(plan.size() < in.size());
  auto describe = [](const std::vector<FusionInput>& inputs, const std::vector<FusionBucket>& p) {
    std::string s;
    for (const FusionBucket& b : p) {
      s += b.name + ":";
      for (size_t i = 0; i < b.members.size(); ++i)
        s += inputs[b.members[i]].name + "@" + std::to_string(b.offsets[i]) + ",";
      s += ";";
    }
    return s;
  };
  std::vector<FusionInput> shuffled = in;
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  EXPECT_EQ(describe(in, plan), describe(shuffled, PlanFusion(shuffled, 16, FusionBucketBytes(16, 125e6))));
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
