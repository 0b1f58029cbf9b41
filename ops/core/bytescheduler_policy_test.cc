// ByteScheduler's policy: priority order, a credit that returns when a partition's sum comes
// back (not when its push leaves), its partition size and default credit.
#include "ops/core/bytescheduler_policy.h"

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

SendTask Task(const std::string& name, int partition, int64_t priority, uint64_t bytes, uint64_t seq) {
  return testing::MakeTask(name, partition, /*peer=*/1, priority, bytes, seq);
}

TransferDone Sum(const SendTask& task) {
  TransferDone d;
  d.task = task;
  d.sent_ns = 0;
  d.done_ns = 1000;
  return d;
}

TEST(ReleasesMostUrgentFirstWhileCreditIsLeft) {
  ByteSchedulerPolicy p(10'000);
  EXPECT_EQ(std::string(p.name()), std::string("bytescheduler"));
  p.Enqueue(Task("late_layer", 0, 1, 4'000, 0));
  p.Enqueue(Task("first_layer", 0, 9, 4'000, 1));
  p.Enqueue(Task("middle", 0, 5, 4'000, 2));
  p.Enqueue(Task("middle", 1, 5, 4'000, 3));
  // 0 < 10,000: first_layer; 4,000 < 10,000: middle#0; 8,000 < 10,000: middle#1 (overdraws to
  // 12,000, as ByteScheduler's "credit > 0" test lets the last one); then nothing.
  const std::vector<SendTask> out = ReleaseOnce(p);
  EXPECT_EQ(out.size(), 3u);
  if (out.size() == 3) {
    EXPECT_EQ(out[0].name, std::string("first_layer"));
    EXPECT_EQ(out[1].name, std::string("middle"));
    EXPECT_EQ(out[1].partition, 0);
    EXPECT_EQ(out[2].partition, 1);
  }
  EXPECT_EQ(p.in_flight_bytes(), 12'000u);
  EXPECT_EQ(p.queued(), 1u);
}

TEST(CreditReturnsWhenTheSumComesBackNotWhenThePushLeaves) {
  ByteSchedulerPolicy p(4'000);
  const SendTask a = Task("a", 0, 2, 4'000, 0);
  p.Enqueue(a);
  p.Enqueue(Task("b", 0, 1, 4'000, 1));
  EXPECT_EQ(ReleaseOnce(p).size(), 1u);
  p.OnPushLeft(a);  // left this worker: the engine's credit returns, ByteScheduler's does not
  EXPECT_EQ(ReleaseOnce(p).size(), 0u);
  EXPECT_EQ(p.in_flight_bytes(), 4'000u);
  p.OnTransferDone(Sum(a));  // push and pull completed
  EXPECT_EQ(p.in_flight_bytes(), 0u);
  const std::vector<SendTask> out = ReleaseOnce(p);
  EXPECT_EQ(out.size(), 1u);
  if (!out.empty()) EXPECT_EQ(out[0].name, std::string("b"));
  // A sum this policy did not release (an exchange, or a push of a policy it replaced) changes
  // nothing.
  TransferDone other = Sum(Task("other", 3, 1, 999, 9));
  p.OnTransferDone(other);
  EXPECT_EQ(p.in_flight_bytes(), 4'000u);
}

TEST(EngineCreditStillBoundsOneCall) {
  ByteSchedulerPolicy p(1'000'000);
  for (uint64_t i = 0; i < 5; ++i) p.Enqueue(Task("t", static_cast<int>(i), 1, 1'000, i));
  // CreditWindow's rule for the engine's credit: the first task whenever any is left, later ones
  // while they fit.
  EXPECT_EQ(ReleaseOnce(p, 2'500).size(), 2u);
  EXPECT_EQ(ReleaseOnce(p, 0).size(), 0u);
  EXPECT_EQ(ReleaseOnce(p, 500).size(), 1u);
}

TEST(ControlTasksGoFirstOutsideTheCredit) {
  ByteSchedulerPolicy p(1'000);
  const SendTask grad = Task("grad", 0, 3, 1'000, 0);
  p.Enqueue(grad);
  EXPECT_EQ(ReleaseOnce(p).size(), 1u);
  p.Enqueue(Task("grad2", 0, 3, 1'000, 1));
  p.Enqueue(Task("loss", 0, kControlPriority, 8, 2));
  const std::vector<SendTask> out = ReleaseOnce(p);
  EXPECT_EQ(out.size(), 1u);
  if (!out.empty()) EXPECT_EQ(out[0].name, std::string("loss"));
  EXPECT_EQ(p.in_flight_bytes(), 1'000u);
}

TEST(AnOperationThatEndsWithoutItsSumsReturnsTheirCredit) {
  ByteSchedulerPolicy p(2'000);
  SendTask a = Task("a", 0, 1, 2'000, 0);
  a.request_id = 41;
  p.Enqueue(a);
  p.Enqueue(Task("b", 0, 1, 2'000, 1));
  EXPECT_EQ(ReleaseOnce(p).size(), 1u);
  p.OnOperationEnded(40);  // another operation
  EXPECT_EQ(p.in_flight_bytes(), 2'000u);
  p.OnOperationEnded(41);
  EXPECT_EQ(p.in_flight_bytes(), 0u);
  EXPECT_EQ(ReleaseOnce(p).size(), 1u);
}

TEST(AFullWindowWithNoSumBackIsOpenedOnce) {
  ByteSchedulerPolicy p(1'000);
  // A link of 1 GB/s (a full socket for a second): the window's 1,000 bytes take 1 us on it, so
  // the sums' times decide below.
  p.bandwidth()->OnDrained(1'000'000'000, 0, 1'000'000'000);
  const SendTask a = Task("a", 0, 3, 1'000, 0);
  p.Enqueue(a);
  std::vector<SendTask> out;
  p.Dequeue(kNoEngineLimit, 0, &out);
  EXPECT_EQ(out.size(), 1u);
  // Before any sum came back, a full window waits kFirstStallBreakNs from the last release.
  // (The test's clock starts at 0, before the drained second: times only matter as differences.)
  EXPECT_EQ(p.NextWakeupNs(), -1);  // nothing queued: nothing to break for
  p.Enqueue(Task("b", 0, 2, 1'000, 1));
  EXPECT_EQ(p.StallBreakNs(), kFirstStallBreakNs);
  EXPECT_EQ(p.NextWakeupNs(), kFirstStallBreakNs);
  // a's sum took 4 ms: from then on a full window waits 2 x 4 ms, restarted by every sum.
  TransferDone da = Sum(a);
  da.sent_ns = 0;
  da.done_ns = 4'000'000;
  p.OnTransferDone(da);
  EXPECT_EQ(p.StallBreakNs(), kStallBreakFactor * 4'000'000);
  out.clear();
  p.Dequeue(kNoEngineLimit, da.done_ns, &out);  // b takes the freed credit
  EXPECT_EQ(out.size(), 1u);
  p.Enqueue(Task("c", 0, 1, 1'000, 2));
  p.Enqueue(Task("d", 0, 0, 1'000, 3));
  const int64_t due = da.done_ns + kStallBreakFactor * 4'000'000;
  EXPECT_EQ(p.NextWakeupNs(), due);
  out.clear();
  p.Dequeue(kNoEngineLimit, due - 1, &out);
  EXPECT_EQ(out.size(), 0u);
  p.Dequeue(kNoEngineLimit, due, &out);
  EXPECT_EQ(out.size(), 2u);  // everything queued, most urgent first, beyond the credit
  if (out.size() == 2) {
    EXPECT_EQ(out[0].name, std::string("c"));
    EXPECT_EQ(out[1].name, std::string("d"));
  }
  EXPECT_EQ(p.stall_breaks(), 1u);
  EXPECT_EQ(p.in_flight_bytes(), 3'000u);
  // What is enqueued later waits for the credit again.
  p.Enqueue(Task("e", 0, 9, 1'000, 4));
  out.clear();
  p.Dequeue(kNoEngineLimit, due + 1, &out);
  EXPECT_EQ(out.size(), 0u);
  // b was in the window when it was opened: its long wait is no sample.
  TransferDone db = Sum(Task("b", 0, 2, 1'000, 1));
  db.sent_ns = da.done_ns;
  db.done_ns = due + 50'000'000;
  p.OnTransferDone(db);
  EXPECT_EQ(p.StallBreakNs(), kStallBreakFactor * 4'000'000);
  // c was released by the break: its wait counts.
  TransferDone dc = Sum(Task("c", 0, 1, 1'000, 2));
  dc.sent_ns = due;
  dc.done_ns = due + 10'000'000;
  p.OnTransferDone(dc);
  EXPECT_EQ(p.StallBreakNs(), kStallBreakFactor * 10'000'000);
  EXPECT_EQ(p.stall_breaks(), 1u);
  // What the engine's scheduler state (and so the benchmark) reports, through the base class.
  const SchedulerPolicy& base = p;
  EXPECT_EQ(base.stall_breaks(), 1u);
  EXPECT_TRUE(PolicyStateJson(p).find("\"stall_breaks\": 1") != std::string::npos);
}

TEST(NoStallBreakBeforeTheLinksRateIsKnown) {
  ByteSchedulerPolicy p(1'000);
  TransferDone local = Sum(Task("own", 0, 1, 1'000, 0));
  local.local = true;  // no bandwidth sample
  p.Enqueue(local.task);
  std::vector<SendTask> out;
  p.Dequeue(kNoEngineLimit, 0, &out);
  local.sent_ns = 0;
  local.done_ns = 2'000'000;
  p.OnTransferDone(local);
  EXPECT_TRUE(!p.bandwidth()->has_estimate());
  EXPECT_EQ(p.StallBreakNs(), kFirstStallBreakNs);
}

// An 8 MB partition in the window after a 0.1 ms sum of a small one, with the link's rate measured
// from `drained_bytes` in one second.
void HoldEightMegabytesAfterOneShortSum(ByteSchedulerPolicy& p, uint64_t drained_bytes) {
  p.bandwidth()->OnDrained(drained_bytes, 0, 1'000'000'000);
  p.Enqueue(Task("big", 0, 1, 8'000'000, 0));
  std::vector<SendTask> out;
  p.Dequeue(kNoEngineLimit, 0, &out);
  TransferDone small = Sum(Task("tiny", 0, 1, 1'000, 1));
  small.sent_ns = 0;
  small.done_ns = 100'000;
  p.Enqueue(small.task);
  p.Dequeue(kNoEngineLimit, 0, &out);
  p.OnTransferDone(small);
}

TEST(TheWaitGrowsWithWhatTheWindowHoldsOnTheLink) {
  ByteSchedulerPolicy p(10'000'000);
  HoldEightMegabytesAfterOneShortSum(p, 1'000'000'000);  // 1 GB/s
  // 8 MB in the window: 8 ms at 1 GB/s, times kStallBreakLinkFactor; a 0.1 ms sum says little.
  EXPECT_EQ(p.StallBreakNs(), static_cast<int64_t>(kStallBreakLinkFactor * 8'000'000.0 / 1e9 * 1e9));
}

TEST(ABreakReleasesEveryPartitionItOpenedEvenWhereTheEnginesCreditIsSmaller) {
  ByteSchedulerPolicy p(1'000);
  p.Enqueue(Task("held", 0, 9, 1'000, 0));
  std::vector<SendTask> out;
  p.Dequeue(kNoEngineLimit, 0, &out);
  for (int i = 1; i <= 3; ++i) p.Enqueue(Task("q" + std::to_string(i), 0, 9 - i, 1'000, i));
  out.clear();
  // The break comes; the engine's credit admits one push per call.
  p.Dequeue(/*credit_bytes=*/1'000, kFirstStallBreakNs, &out);
  EXPECT_EQ(out.size(), 1u);
  EXPECT_EQ(p.stall_breaks(), 1u);
  EXPECT_EQ(p.NextWakeupNs(), -1);  // nothing left to wait for: the engine's credit paces the rest
  // The next calls release the rest at once (no second wait of StallBreakNs), most urgent first.
  for (int call = 0; call < 2; ++call) {
    std::vector<SendTask> more;  // the engine's credit freed: each call starts a new list
    p.Dequeue(1'000, kFirstStallBreakNs + 1 + call, &more);
    out.insert(out.end(), more.begin(), more.end());
  }
  EXPECT_EQ(out.size(), 3u);
  if (out.size() == 3) {
    EXPECT_EQ(out[0].name, std::string("q1"));
    EXPECT_EQ(out[2].name, std::string("q3"));
  }
  EXPECT_EQ(p.stall_breaks(), 1u);
  EXPECT_EQ(p.in_flight_bytes(), 4'000u);
  // A partition enqueued after the break waits for the credit again.
  p.Enqueue(Task("later", 0, 1, 1'000, 4));
  out.clear();
  p.Dequeue(kNoEngineLimit, kFirstStallBreakNs + 10, &out);
  EXPECT_EQ(out.size(), 0u);
}

TEST(AWindowNeverWaitsLongerThanTheFirstBreakForALink) {
  ByteSchedulerPolicy p(10'000'000);
  // A rate measured through a small window that waits on sums: 1 kB/s.
  HoldEightMegabytesAfterOneShortSum(p, 1'000);
  // 8 MB at 1 kB/s would be hours: the wait stays at kFirstStallBreakNs, below any timeout.
  EXPECT_EQ(p.StallBreakNs(), kFirstStallBreakNs);
}

TEST(DefaultsAreByteSchedulersForAParameterServer) {
  // BYTESCHEDULER_PARTITION = 1,000,000 and BYTESCHEDULER_CREDIT = 4,000,000 float32 parameters.
  const ScheduleTraits* traits = FindScheduleTraits("bytescheduler");
  EXPECT_TRUE(traits != nullptr);
  EXPECT_EQ(ResolvePartitionBytes(kPartitionAuto, "bytescheduler"), 4'000'000u);
  EXPECT_EQ(ResolveScheduleCreditBytes(kCreditAuto, "bytescheduler", 8, 4'000'000), 16'000'000u);
  EXPECT_EQ(ResolveScheduleCreditBytes(123'456, "bytescheduler", 8, 4'000'000), 123'456u);  // as set
  EXPECT_EQ(ByteSchedulerPolicy().credit_bytes(), 16'000'000u);
  SchedulerOptions options;
  options.policy = "bytescheduler";
  options.credit_bytes = 8'000'000;
  std::string error;
  std::unique_ptr<SchedulerPolicy> made = MakePolicy(options, &error);
  EXPECT_TRUE(made != nullptr);
  if (made) {
    EXPECT_EQ(std::string(made->name()), std::string("bytescheduler"));
    EXPECT_EQ(static_cast<ByteSchedulerPolicy*>(made.get())->credit_bytes(), 8'000'000u);
  }
  if (traits != nullptr) EXPECT_TRUE(!traits->automatic_fusion);
}

TEST(PartitionsAreCeilOfSizeOverPartitionNearEqualAndNothingMore) {
  // ByteScheduler cuts a tensor above the partition size into ceil(size / partition) near-equal
  // parts; the runtime's extra cuts across owners stay off. VGG16's fc1 kernel: 102,760,448
  // parameters -> 103 partitions.
  const uint64_t fc1 = 102'760'448ull * 4;
  const std::vector<Partition> parts =
      MakePartitions("fc1/kernel", fc1, 4, 8, ResolvePartitionBytes(kPartitionAuto, "bytescheduler"),
                     PartitionMinSplitBytes("bytescheduler"));
  EXPECT_EQ(parts.size(), 103u);
  uint64_t smallest = ~uint64_t{0}, largest = 0, total = 0;
  for (const Partition& p : parts) {
    smallest = std::min(smallest, p.bytes);
    largest = std::max(largest, p.bytes);
    total += p.bytes;
  }
  EXPECT_EQ(total, fc1);
  EXPECT_TRUE(largest <= 4'000'000u && largest - smallest <= 4u);
  // A 2 MB tensor on 8 workers is one partition (the runtime would cut it for 8 owners).
  EXPECT_EQ(MakePartitions("conv", 2'000'000, 4, 8, 4'000'000, PartitionMinSplitBytes("bytescheduler")).size(), 1u);
  EXPECT_TRUE(MakePartitions("conv", 2'000'000, 4, 8, 4'000'000, PartitionMinSplitBytes("priority")).size() >= 8u);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
