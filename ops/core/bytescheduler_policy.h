// ByteScheduler (Peng et al., "A Generic Communication Scheduler for Distributed DNN Training
// Acceleration", SOSP 2019; code: github.com/bytedance/byteps, folder bytescheduler/, in
// bytescheduler/common/bytecore.py) as a SchedulerPolicy, for comparison with prophet.
//
// What its code does, and what this policy does alike:
//  - a tensor above the partition size (BYTESCHEDULER_PARTITION, default 1,000,000 parameters) is
//    cut into ceil(size / partition) near-equal partitions; here the engine cuts them
//    (ScheduleTraits: 4,000,000 bytes, 1M float32 parameters, and nothing else cuts a tensor);
//  - ready partitions wait in one priority queue, the layer closest to the input first (among
//    the partitions of one tensor, the first partition first: here, arrival order);
//  - a credit (BYTESCHEDULER_CREDIT, default 4,000,000 parameters for a parameter server) bounds
//    the partitions started and not finished: the scheduler starts the most urgent partition
//    while credit is left (credit > 0, so the last one may overdraw it), subtracts its size, and
//    a partition returns its size when it finishes, i.e. when its push AND its pull completed
//    (the "end" operation runs after the pull wrote the sum). Here: when its RESULT, the sum, came
//    back (OnTransferDone), not when the push left this worker, as the other policies' credit.
// What differs, and why:
//  - the credit counts bytes on the wire (16,000,000 = 4M float32 parameters; half as many
//    parameters travel compressed), as the engine counts its credit;
//  - control collectives (the loss, metric state) go first and outside the credit: ByteScheduler
//    never saw them (MXNet computes metrics locally);
//  - its auto-tuning (Bayesian optimisation of the credit over trials of about 100 steps each,
//    bytescheduler/common/tuner.py) is not run in the training runtime: a few hundred steps of
//    trials do not fit a benchmark launch of 25 steps. The predictor searches the tuner's credit
//    range instead (prophet_tf/bench/schedule_map.py, --bytescheduler_credits);
//  - the transport below is this runtime's (one connection per peer, priority-ordered queues,
//    TCP_NOTSENT_LOWAT), not MXNet's ps-lite over ZeroMQ.
// A sum needs every worker's push of its partition, so this credit waits on other workers (the
// reason the engine's own credit returns when a push leaves: engine_options.h). Workers whose
// windows free at different moments choose differently when a more urgent gradient arrives in
// between: one releases the older partition, another the urgent one, and with three or more
// workers their windows can hold partitions that each waits on another's held-back push, for good
// (the step simulator finds it with every model; a parameter server that answers every worker's
// push at once makes it rarer, not impossible). So that the comparison runs, a window that has
// been full with no sum back for StallBreakNs() (the longer of kStallBreakFactor x the longest a
// recent sum took and kStallBreakLinkFactor x what the window's bytes take on the link at its
// measured rate; at least kMinStallBreakNs; kFirstStallBreakNs before a sum came back and the
// rate is known; never longer than that, since a rate measured through a small window can be far
// below the link's; sums waited for during a break do not count) is taken for a deadlock and opened: every partition queued then goes, most urgent
// first, without the credit, as fast as the engine's own credit lets it (over several calls if it must) (a "stall break", counted: stall_breaks(), Describe); the credit
// holds again for the partitions enqueued later. Releasing one partition at a time did not undo
// the deadlock: the partitions another worker waits for are not the ones this worker finds most
// urgent. Where nothing deadlocks, sums keep coming back and no break happens; a window that
// only waits long (a worker far behind) is opened too, which makes bytescheduler faster, never
// slower, than its own rule.
#ifndef PROPHET_OPS_CORE_BYTESCHEDULER_POLICY_H_
#define PROPHET_OPS_CORE_BYTESCHEDULER_POLICY_H_

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "ops/core/scheduler.h"

namespace prophet {

// ByteScheduler's defaults for a parameter server, in bytes of float32 parameters.
constexpr uint64_t kByteSchedulerPartitionBytes = 4'000'000;  // BYTESCHEDULER_PARTITION 1M
constexpr uint64_t kByteSchedulerCreditBytes = 16'000'000;    // BYTESCHEDULER_CREDIT 4M
// A full window with no sum back for this many times the longest push-to-sum time of the last
// kStallBreakSamples sums, and at least kMinStallBreakNs, is taken for a deadlock (above). The
// longest, not a median: a 4 MB partition's sum legitimately takes many times a bias's.
constexpr int64_t kStallBreakFactor = 2;
constexpr double kStallBreakLinkFactor = 8;
constexpr int64_t kMinStallBreakNs = 1'000'000;
constexpr int64_t kFirstStallBreakNs = 1'000'000'000;
constexpr size_t kStallBreakSamples = 64;

class ByteSchedulerPolicy : public SchedulerPolicy {
 public:
  explicit ByteSchedulerPolicy(uint64_t credit_bytes = kByteSchedulerCreditBytes,
                               const BandwidthOptions& bandwidth = BandwidthOptions());

  const char* name() const override { return "bytescheduler"; }
  void Enqueue(const SendTask& task) override;
  // Releases the most urgent partitions while the credit is not used up (ByteScheduler's rule)
  // and the engine's `credit_bytes` admits them (CreditWindow's rule).
  void Dequeue(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) override;
  // The sum came back: the partition's credit returns.
  void OnTransferDone(const TransferDone& d) override;
  // Released partitions of an operation that ended without their sums return their credit.
  void OnOperationEnded(uint64_t request_id) override;
  bool schedules_owned_partitions() const override { return true; }
  size_t queued() const override { return control_.size() + broken_.size() + queue_.size(); }
  // When a full window counts as a deadlock (above), or -1.
  int64_t NextWakeupNs() const override;
  std::string Describe() const override;

  uint64_t credit_bytes() const { return credit_; }
  // Bytes of released partitions whose sum has not come back.
  uint64_t in_flight_bytes() const { return in_flight_; }
  // Times the window stayed full with no sum back and was opened.
  uint64_t stall_breaks() const override { return stall_breaks_; }
  // How long a full window waits with no sum back before a stall break.
  int64_t StallBreakNs() const;

 private:
  struct Flying {
    uint64_t bytes = 0;
    uint64_t request_id = 0;
    bool waited_through_break = false;  // in the window when it was opened: no sample
  };
  bool Blocked() const { return !queue_.empty() && in_flight_ >= credit_; }

  uint64_t credit_;
  uint64_t in_flight_ = 0;
  // The last sum back or release (-1: none yet), the recent push-to-sum times, the breaks.
  int64_t last_progress_ns_ = -1;
  std::vector<int64_t> recent_waits_ns_;
  size_t next_wait_ = 0;
  uint64_t stall_breaks_ = 0;
  PriorityTaskQueue control_;
  PriorityTaskQueue broken_;  // opened by a stall break, not yet released
  PriorityTaskQueue queue_;
  std::map<std::tuple<std::string, uint64_t, int>, Flying> flying_;  // by (name, round, partition)
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_BYTESCHEDULER_POLICY_H_
