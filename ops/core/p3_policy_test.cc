// P3's policy: priority order, one released slice per peer waiting to leave, the popped slice
// held (blocking every other) while its peer is busy, and its slices of 40,000 parameters.
#include "ops/core/p3_policy.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "ops/core/engine_options.h"
#include "ops/core/partition.h"
#include "ops/core/policies.h"
#include "ops/core/policy_testing.h"
#include "ops/core/schedule_traits.h"
#include "ops/core/scheduler.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

using testing::kNoEngineLimit;
using testing::ReleaseOnce;

SendTask Slice(const std::string& name, int partition, int peer, int64_t priority, uint64_t seq) {
  return testing::MakeTask(name, partition, peer, priority, kP3SliceBytes, seq);
}

TEST(OneSlicePerPeerWaitsToLeave) {
  P3Policy p;
  EXPECT_EQ(std::string(p.name()), std::string("p3"));
  p.Enqueue(Slice("a", 0, 1, 5, 0));
  p.Enqueue(Slice("a", 1, 2, 5, 1));
  p.Enqueue(Slice("a", 2, 3, 5, 2));
  // Three peers, each connection empty: one slice each.
  std::vector<SendTask> out = ReleaseOnce(p);
  EXPECT_EQ(out.size(), 3u);
  EXPECT_EQ(p.unsent_to(1), 1);
  EXPECT_EQ(p.unsent_to(2), 1);
  EXPECT_EQ(p.queued(), 0u);
  // The next slice to peer 1 waits until the one before it left.
  const SendTask first = out[0];
  p.Enqueue(Slice("b", 0, 1, 5, 3));
  EXPECT_EQ(ReleaseOnce(p).size(), 0u);
  p.OnPushLeft(first);
  EXPECT_EQ(p.unsent_to(1), 0);
  out = ReleaseOnce(p);
  EXPECT_EQ(out.size(), 1u);
  if (!out.empty()) EXPECT_EQ(out[0].name, std::string("b"));
}

TEST(TheHeldSliceBlocksEveryPeerAndIsNotOvertaken) {
  P3Policy p;
  const SendTask to1 = Slice("x", 0, 1, 1, 0);
  p.Enqueue(to1);
  EXPECT_EQ(ReleaseOnce(p).size(), 1u);
  // The most urgent slice goes to the busy peer 1: the sender thread holds it, and the slice to
  // the idle peer 2 waits behind it (one sender thread, a blocking send).
  p.Enqueue(Slice("low_to_2", 0, 2, 1, 1));
  p.Enqueue(Slice("urgent_to_1", 0, 1, 9, 2));
  EXPECT_EQ(ReleaseOnce(p).size(), 0u);
  EXPECT_TRUE(p.held() != nullptr && p.held()->name == "urgent_to_1");
  EXPECT_EQ(p.queued(), 2u);
  // A still more urgent slice arriving now does not overtake the held one.
  p.Enqueue(Slice("most_urgent_to_2", 0, 2, 20, 3));
  EXPECT_EQ(ReleaseOnce(p).size(), 0u);
  p.OnPushLeft(to1);
  const std::vector<SendTask> out = ReleaseOnce(p);
  // The held slice, then the queue in priority order: most_urgent_to_2 takes peer 2, and
  // low_to_2 is popped and held behind it.
  EXPECT_EQ(out.size(), 2u);
  if (out.size() == 2) {
    EXPECT_EQ(out[0].name, std::string("urgent_to_1"));
    EXPECT_EQ(out[1].name, std::string("most_urgent_to_2"));
  }
  EXPECT_TRUE(p.held() != nullptr && p.held()->name == "low_to_2");
}

TEST(ControlTasksAreNeitherHeldNorCounted) {
  P3Policy p;
  p.Enqueue(Slice("g", 0, 1, 1, 0));
  EXPECT_EQ(ReleaseOnce(p).size(), 1u);
  p.Enqueue(Slice("g2", 0, 1, 1, 1));
  SendTask loss = Slice("loss", 0, 1, kControlPriority, 2);
  loss.bytes = 8;
  p.Enqueue(loss);
  const std::vector<SendTask> out = ReleaseOnce(p);
  EXPECT_EQ(out.size(), 1u);
  if (!out.empty()) EXPECT_EQ(out[0].name, std::string("loss"));
  p.OnPushLeft(loss);  // not counted: peer 1 still has the gradient slice waiting
  EXPECT_EQ(p.unsent_to(1), 1);
}

TEST(SlicesAreFortyThousandParameters) {
  EXPECT_EQ(ResolvePartitionBytes(kPartitionAuto, "p3"), 160'000u);
  EXPECT_EQ(ResolvePartitionBytes(kPartitionAuto, "prophet"), uint64_t{4} << 20);
  EXPECT_EQ(ResolvePartitionBytes(65'536, "p3"), 65'536u);  // as set
  // A 1,000,000-parameter array: 25 slices of 40,000, whatever the number of workers; the
  // runtime's rule cuts it into up to 8 per owner, none below 128 KiB, in whole rounds of the
  // owners: 28 on 4 workers.
  const uint64_t bytes = 4'000'000;
  for (const int workers : {2, 4, 16}) {
    const std::vector<Partition> parts = MakePartitions("w", bytes, 4, workers, 160'000, PartitionMinSplitBytes("p3"));
    EXPECT_EQ(parts.size(), 25u);
    for (const Partition& part : parts) EXPECT_EQ(part.bytes, 160'000u);
    // Round-robin owners.
    for (size_t i = 1; i < parts.size(); ++i) EXPECT_EQ(parts[i].owner, (parts[i - 1].owner + 1) % workers);
  }
  EXPECT_EQ(MakePartitions("w", bytes, 4, 4, 4u << 20).size(), 28u);
  // Below a slice: one partition.
  EXPECT_EQ(MakePartitions("b", 4'096, 4, 8, 160'000, PartitionMinSplitBytes("p3")).size(), 1u);
  SchedulerOptions options;
  options.policy = "p3";
  std::string error;
  std::unique_ptr<SchedulerPolicy> made = MakePolicy(options, &error);
  EXPECT_TRUE(made != nullptr && std::string(made->name()) == "p3");
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
