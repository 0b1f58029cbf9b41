// Scheduling between "partition ready" and "bytes on the wire".
//
// The engine hands every outgoing PUSH partition to a SchedulerPolicy and asks it, whenever the
// link may take more bytes, which partitions to send next. Policies never touch sockets; they only
// order and group. All methods are called from the engine's single I/O thread, so policies need no
// locking.
#ifndef PROPHET_OPS_CORE_SCHEDULER_H_
#define PROPHET_OPS_CORE_SCHEDULER_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "ops/core/bandwidth.h"

namespace prophet {

class ReadyTimeProfiler;

// The policies MakePolicy knows, and the one every entry point (EngineOptions, SchedulerOptions,
// the Python package through the C API) uses when none is asked for.
// bytescheduler and p3 are the published schedulers (bytescheduler_policy.h, p3_policy.h), kept
// for comparison; schedule_traits.h says what each asks of the partitions, credit and fusion.
inline constexpr const char* kScheduleNames[] = {"prophet", "priority", "fifo", "bytescheduler", "p3"};
inline constexpr char kDefaultSchedule[] = "prophet";
// prophet: re-plan when the bandwidth or a stage interval moved by more than this fraction.
constexpr double kDefaultReplanThreshold = 0.2;

// One partition of one tensor waiting to be pushed to the rank that owns it.
struct SendTask {
  std::string name;         // the tensor's logical name, identical on every worker
  uint64_t round = 0;       // how many times this worker submitted that name before
  uint64_t request_id = 0;  // engine's id of the operation
  int partition = 0;        // partition index inside the tensor
  int peer = 0;             // destination rank
  int64_t priority = 0;     // larger is more urgent (first layer has the largest)
  uint64_t bytes = 0;       // payload bytes of this partition on the wire (encoded, when compressed)
  int64_t ready_ns = 0;     // monotonic time its tensor became ready
  uint64_t enqueue_seq = 0; // global arrival order, for FIFO and stable ties
};

// A tensor handed to the runtime (all of its partitions follow through Enqueue).
struct TensorReady {
  const std::string* name = nullptr;  // logical name, identical on every worker
  uint64_t round = 0;                 // how many times this name was seen before (= step index
                                      // for gradients)
  int64_t priority = 0;
  uint64_t bytes = 0;                 // the tensor's (its tasks carry the bytes that travel)
  int64_t ready_ns = 0;
};

// A PUSH whose RESULT came back, or a stage of a small push_pull's exchange whose partner's
// frame came after this worker's (small_allreduce.h): both measure the link alike.
struct TransferDone {
  SendTask task;
  int64_t sent_ns = 0;      // released to the connection
  int64_t done_ns = 0;      // last byte of the reply received
  bool exchange = false;    // an exchange stage (the timeline names it so)
  // A partition this worker owns, released by a policy that schedules those
  // (SchedulerPolicy::schedules_owned_partitions): its sum is complete here. Nothing travelled,
  // so it is no bandwidth sample.
  bool local = false;
};

// A stretch of time a policy spent in one phase (a Prophet block, the credit phase), or a moment
// (a re-plan), for the timeline's "block" track.
struct PolicySpan {
  std::string label;
  int64_t start_ns = 0;
  int64_t end_ns = 0;
  size_t tasks = 0;   // tasks released during the span
  uint64_t bytes = 0;
  bool instant = false;  // a moment at start_ns, not a stretch of time
};

// Priorities at or above this mark control traffic: small collectives a training step waits on
// (metric state, loss-scale flags). Every policy sends them before any gradient, and Prophet
// leaves them out of its profile (they are not gradients). Python reads this value through the
// C API (prophet_tf/_library.py: ProphetStrategy's CONTROL_PRIORITY).
constexpr int64_t kControlPriority = int64_t{1} << 40;

// Priority order: true when `a` is less urgent than `b` (lower priority; among equals, the later
// arrival). A max-heap under this order pops the most urgent task.
inline bool LessUrgent(const SendTask& a, const SendTask& b) {
  if (a.priority != b.priority) return a.priority < b.priority;
  return a.enqueue_seq > b.enqueue_seq;
}

// A max-heap under LessUrgent: the most urgent task on top.
class PriorityTaskQueue {
 public:
  void Push(const SendTask& task);
  SendTask Pop();
  const SendTask& top() const { return heap_.front(); }
  bool empty() const { return heap_.empty(); }
  size_t size() const { return heap_.size(); }
  void MoveAllTo(PriorityTaskQueue* other);

 private:
  std::vector<SendTask> heap_;
};

// Arrival order.
class FifoTaskQueue {
 public:
  void Push(const SendTask& task) { queue_.push_back(task); }
  SendTask Pop();
  const SendTask& top() const { return queue_.front(); }
  bool empty() const { return queue_.empty(); }
  size_t size() const { return queue_.size(); }

 private:
  std::deque<SendTask> queue_;
};

// The engine's byte credit for one Dequeue call: the first task goes whenever any credit is left
// (so that a task larger than the whole credit still moves), later ones only while they fit. The
// credit bounds the released pushes that have not left this worker yet (SchedulerPolicy::OnPushLeft).
class CreditWindow {
 public:
  explicit CreditWindow(uint64_t credit_bytes) : credit_(credit_bytes) {}
  bool Admits(uint64_t bytes) const { return credit_ > 0 && (used_ == 0 || used_ + bytes <= credit_); }

  // Moves tasks from the top of `queue` to `out` while they are admitted; true when `queue` ran
  // empty (false: the credit is used up).
  template <typename TaskQueue>
  bool Release(TaskQueue* queue, std::vector<SendTask>* out) {
    while (!queue->empty()) {
      if (!Admits(queue->top().bytes)) return false;
      used_ += queue->top().bytes;
      out->push_back(queue->Pop());
    }
    return true;
  }

 private:
  uint64_t credit_;
  uint64_t used_ = 0;
};

class SchedulerPolicy {
 public:
  explicit SchedulerPolicy(const BandwidthOptions& bandwidth = BandwidthOptions()) : bandwidth_(bandwidth) {}
  virtual ~SchedulerPolicy() = default;
  virtual const char* name() const = 0;

  // Feedback: a tensor became ready. Called before its partitions are enqueued.
  virtual void OnTensorReady(const TensorReady& /*t*/) {}
  virtual void Enqueue(const SendTask& task) = 0;
  // Appends to `out` the tasks to put on the wire now, in order. `credit_bytes` is how many more
  // bytes may be released before released pushes have left this worker (a policy may exceed it by
  // at most one task, so that a task larger than the whole credit still moves). Returning nothing
  // while tasks are queued means "wait": the engine calls again after the next event (a released
  // push leaving returns its credit) or at NextWakeupNs().
  virtual void Dequeue(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) = 0;
  // Feedback: a released push left this worker (its last byte is in the kernel, which holds only
  // a little unsent data: transport.h), or will never leave (its operation ended). The engine
  // returns the push's credit at this moment, never later: waiting for its sum would wait for
  // every other worker's push of the partition, and workers whose credit is full of pushes that
  // wait on each other's held-back pushes would wait forever.
  virtual void OnPushLeft(const SendTask& /*task*/) {}
  // Feedback: the operation with this request id ended (its sums came back, or it failed and
  // those of its released pushes that left will have none).
  virtual void OnOperationEnded(uint64_t /*request_id*/) {}
  // Feedback: a push's sum came back. A policy that overrides this calls it.
  virtual void OnTransferDone(const TransferDone& d) {
    if (!d.local) bandwidth_.OnTransfer(d.task.bytes, d.sent_ns, d.done_ns);
  }
  // True: the partitions this worker owns are tasks too (SendTask::peer is this worker), released
  // in order with the pushes, under the credit; releasing one sends nothing (it leaves at once,
  // OnPushLeft) but its sum is not sent back before then, and OnTransferDone (`local`) reports
  // when the sum is complete. A parameter server's worker pushes every partition, its own
  // server's too: ByteScheduler's credit counts them all, so that every worker's credit holds the
  // same partitions (bytescheduler_policy.h).
  virtual bool schedules_owned_partitions() const { return false; }
  // This worker's link rate (bandwidth.h: what its full sockets took, or before any filled, the
  // completed transfers' goodput): the one estimate that the planner, the timeline's bandwidth
  // counter and schedule="auto" read.
  BandwidthMonitor* bandwidth() { return &bandwidth_; }
  const BandwidthMonitor* bandwidth() const { return &bandwidth_; }
  virtual size_t queued() const = 0;
  // Monotonic time at which Dequeue should be called again even without new events, or -1.
  virtual int64_t NextWakeupNs() const { return -1; }
  // One line of human-readable state for logs and the timeline (plan, bandwidth, ...).
  virtual std::string Describe() const { return name(); }
  // Drains the finished phase spans (policies without phases have none).
  virtual std::vector<PolicySpan> TakeSpans() { return {}; }
  // When this worker's gradients become ready, if the policy profiles them (prophet), else null.
  virtual const ReadyTimeProfiler* ready_time_profiler() const { return nullptr; }
  // Blocks of the plan the policy follows (prophet; 0 before its first plan or when the plan has
  // none), or -1 for a policy without plans.
  virtual int planned_blocks() const { return -1; }
  // Times the policy released work past its own flow control because it stayed blocked with
  // nothing coming back (bytescheduler's stall break: a window taken for a deadlock); 0 for
  // policies that never do. Reported by the engine's scheduler state and by the predictor.
  virtual uint64_t stall_breaks() const { return 0; }

 private:
  BandwidthMonitor bandwidth_;
};

// First come, first served: the order in which partitions became ready.
class FifoPolicy : public SchedulerPolicy {
 public:
  const char* name() const override { return "fifo"; }
  void Enqueue(const SendTask& task) override { queue_.Push(task); }
  void Dequeue(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) override;
  size_t queued() const override { return queue_.size(); }

 private:
  FifoTaskQueue queue_;
};

// ByteScheduler / P3: the most urgent ready partition first, under the engine's byte credit.
class PriorityPolicy : public SchedulerPolicy {
 public:
  const char* name() const override { return "priority"; }
  void Enqueue(const SendTask& task) override { queue_.Push(task); }
  void Dequeue(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) override;
  size_t queued() const override { return queue_.size(); }

 private:
  PriorityTaskQueue queue_;
};

// The byte credit is not here: the engine applies it on every Dequeue call.
struct SchedulerOptions {
  std::string policy = kDefaultSchedule;  // one of kScheduleNames
  double replan_threshold = kDefaultReplanThreshold;
  // bytescheduler: its credit, the job's credit_bytes as resolved (schedule_traits.h); 0: its
  // default.
  uint64_t credit_bytes = 0;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_SCHEDULER_H_
