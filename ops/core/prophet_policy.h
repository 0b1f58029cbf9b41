// Prophet (Zhang et al., ICPP 2021) as a SchedulerPolicy: online profile, measured bandwidth,
// stage-sized blocks, no preemption of a block in flight, credit phase after the first layer.
//
// Lifecycle per training step (a step opens with the first TensorReady of a new round):
//  - Before a profile and a bandwidth estimate exist (first steps), or when the plan has no block
//    (e.g. all gradients ready at once), the policy behaves exactly like PriorityPolicy.
//  - At the start of every step the plan is (re)made if none exists or if ReplanReason() says the
//    plan no longer fits: the bandwidth moved by more than replan_threshold (seen at two step
//    starts in a row, in the same direction), tensors
//    appeared or left, or the ready times moved so that a new plan is forecast to send the step
//    clearly faster (a stage structure that only jitters keeps its plan). Plans change only at
//    step boundaries, so one step follows one plan.
//  - Blocks are sent one after another, in plan order (see planner.h for how they are formed):
//      * the open block releases its members' partitions as soon as they are queued, highest
//        priority first, under the byte credit; nothing else is released while any of them is
//        queued or has not left this worker (no preemption: a more urgent gradient that arrives
//        waits for the block to leave; "left" is the engine's OnPushLeft: the last byte is in the
//        kernel, which holds only a little unsent data);
//      * members that are ready go out even if other members of the block are not ready yet, so
//        the link is never idle while data of the open block waits;
//      * the open block ends when all its members were ready and have left. If it still waits for
//        members (late, or absent this step) while a later block already has data queued, it is
//        closed once what it released has left, and the next block opens (the link does not idle
//        for a gradient that may not come); a member of a closed block that arrives later joins
//        the block open at that time (or, with none open, is sent at once).
//  - Credit phase: when the first layer's gradient (the plan's highest-priority tensor, or any
//    tensor of higher priority) is ready, the open block's queued partitions are released and then
//    everything left goes under the credit in priority order (the first layer may overtake
//    released partitions of the block that have not started: the connection's queue is in
//    priority order). Tensors that fit in no block (a tensor bigger than its stage's budget is
//    one of them: as a block it would hold the more urgent ones back for longer than the stage,
//    see planner.h) and tensors the profile does not know yet are held for this phase, but only
//    while the plan keeps the link busy: when everything this policy
//    released has left and the open block waits for members that are not ready (and no later
//    block has data), or every block ended before the first layer, the held tensors go under the
//    credit, most urgent first, rather than the link idling (it idled 42% of the backward pass of
//    ResNet50 in the emulated benchmark). Should the first layer not show up (profile off by more
//    than the re-plan threshold), the credit phase starts anyway at its expected ready offset
//    x (1 + replan_threshold) (NextWakeupNs reports that time).
//  - Tasks of an earlier step still queued when a step opens are sent first, in priority order.
//  - Everything this policy waits for is local: a member's readiness, a deadline, and pushes
//    leaving this worker, whose credit the engine returns without waiting for any other worker.
//    (While the credit came back with a push's sum, workers whose plans differ held each other's
//    sums back: a deadlock at 4 workers with ResNet50.)
// Every SendTask carries its tensor's name, which places it in its block.
#ifndef PROPHET_OPS_CORE_PROPHET_POLICY_H_
#define PROPHET_OPS_CORE_PROPHET_POLICY_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "ops/core/planner.h"
#include "ops/core/profiler.h"
#include "ops/core/scheduler.h"

namespace prophet {

struct ProphetOptions {
  // Re-plan when the bandwidth moved by more than this fraction (see ReplanReason for the rest).
  double replan_threshold = kDefaultReplanThreshold;
  ProfilerOptions profiler;
  BandwidthOptions bandwidth;
};

class ProphetPolicy : public SchedulerPolicy {
 public:
  explicit ProphetPolicy(const ProphetOptions& options = ProphetOptions());

  const char* name() const override { return "prophet"; }
  void OnTensorReady(const TensorReady& ready) override;
  void Enqueue(const SendTask& task) override;
  void Dequeue(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) override;
  void OnPushLeft(const SendTask& task) override;
  size_t queued() const override;
  int64_t NextWakeupNs() const override;
  std::string Describe() const override;

  // Introspection for tests, logs and the timeline.
  bool blocks_active() const { return blocks_active_; }  // this step follows a plan
  bool has_plan() const { return has_plan_; }
  int planned_blocks() const override { return has_plan_ ? static_cast<int>(plan_.blocks.size()) : 0; }
  const Plan& plan() const { return plan_; }
  // Index of the block being sent in this step, -1 when not following blocks (fallback, or after
  // the last block).
  int open_block() const;
  bool credit_phase() const { return credit_phase_; }
  uint64_t replans() const { return replans_; }
  const std::string& last_replan_reason() const { return last_replan_reason_; }
  const ReadyTimeProfiler& profiler() const { return profiler_; }
  const ReadyTimeProfiler* ready_time_profiler() const override { return &profiler_; }
  // Pushes this policy released that have not left this worker.
  size_t pushes_unsent() const { return unsent_.size(); }

  // For the timeline's "block" track: when each block released its first task until it ended,
  // and the credit phase from its start until its queue ran empty (times are Dequeue's now_ns).
  // Labels read "block 2/3 (2 tensors, 1.00MB planned)" or "credit phase".
  using PhaseSpan = PolicySpan;
  // Drains the finished spans (at most the last 1024 are kept when nobody drains them).
  std::vector<PolicySpan> TakeSpans() override;

 private:
  void ReleasePlanned(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out);
  // The plan has nothing to send now (the open block waits for members, or every block ended
  // before the first layer) and everything released has left: what it holds for the credit phase
  // goes under the credit, most urgent first.
  void FillIdleLink(CreditWindow* window, int64_t now_ns, std::vector<SendTask>* out);
  // Remembers released tasks until they leave: `block` is the block they were released for (-1:
  // none).
  void TrackUnsent(const std::vector<SendTask>& out, size_t from, int block);
  bool BlockUnsent(int block) const { return block >= 0 && block < static_cast<int>(block_unsent_.size()) && block_unsent_[block] > 0; }
  void StartStep(int64_t origin_ns);
  void MaybeReplan();
  bool LaterBlockQueued() const;
  void EndBlocks();  // credit phase: what is left of the blocks joins the credit queue
  int64_t CreditDeadlineNs() const;
  // Phase spans: Begin once the phase releases its first task, End when it is over.
  // `block` -1: the credit phase, -2: an idle-link fill.
  void NoteReleased(const std::vector<SendTask>& out, size_t from, int64_t now_ns, int block);
  void EndPhaseSpan(int64_t now_ns);
  std::string BlockLabel(int block) const;

  ProphetOptions options_;
  ReadyTimeProfiler profiler_;

  bool has_plan_ = false;
  Plan plan_;
  uint64_t replans_ = 0;
  int bandwidth_moved_before_ = 0;  // BandwidthMoved at the previous step start
  std::string last_replan_reason_;

  // The open step.
  int64_t step_origin_ns_ = 0;
  bool blocks_active_ = false;
  bool credit_phase_ = true;          // true = plain priority order
  int open_block_ = 0;                // == blocks.size() once every block ended
  std::vector<PriorityTaskQueue> block_queues_;
  std::vector<int> block_missing_;    // members of each block not yet ready in this step
  std::set<std::string> ready_this_step_;
  PriorityTaskQueue late_queue_;     // members of closed blocks, when no block is open
  PriorityTaskQueue credit_queue_;   // fallback order, and tensors sent in the credit phase
  PriorityTaskQueue overdue_queue_;  // tasks of an earlier step

  // Bytes this worker pushed per tensor (what the link carries, in the bandwidth's unit); the plan
  // uses the last complete step's values.
  std::map<std::string, uint64_t> wire_bytes_this_step_;
  std::map<std::string, uint64_t> wire_bytes_last_step_;

  // Pushes released that have not left this worker, by (name, round, partition): the block of
  // this step they were released for, or -1. block_unsent_ counts them per block.
  std::map<std::tuple<std::string, uint64_t, int>, int> unsent_;
  std::vector<int> block_unsent_;

  bool span_open_ = false;
  int open_span_block_ = 0;  // NoteReleased's `block` of the open span
  PhaseSpan open_span_;
  std::vector<PhaseSpan> finished_spans_;
};

std::unique_ptr<SchedulerPolicy> MakeProphetPolicy(const SchedulerOptions& options);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_PROPHET_POLICY_H_
