// Where a training step's time goes: how long the step waited for gradients, measured in the
// kernels that wait (the step report of ProphetStrategy's fit; docs/design.md, "Where the time
// goes").
//
// The question a user asks is "how much faster would my step be with an infinitely fast
// network?". With an infinitely fast network every sum would be there the moment its last
// contribution is, so the answer is the time during which the step could do nothing but wait for
// communication. TensorFlow does not say when its executor is idle, so that time is estimated
// from what the runtime's kernels see, in two parts that never overlap in time:
//
// - Gate wait (crossing the barrier): until its first gradient is handed to the runtime, a step
//   runs its forward pass, which waits at the gates of variables whose update from the previous
//   step is pending, and at collectives it needs (the loss's global batch size). A layer's
//   forward pass starts when its gate opens AND the layers before it are done; all gates start
//   waiting when the step starts, so a gate's wait also covers the forward compute of the layers
//   before it, and the sum or union of the waits overstates the stall (it counts compute that
//   went on meanwhile). What is known for sure:
//     * lower bound: the first layer's gate (the highest gradient priority): nothing of the
//       forward pass can run before it opens;
//     * upper bound: the union of the waits (gate waits and awaited collectives) before the first
//       gradient;
//     * the forward pass took F = (first gradient handed off) - (step start) = compute + stall.
//   The compute part of F is the same from step to step, so the meter keeps the smallest
//   F - (lower bound) seen since Reset() as the forward pass's compute, and reports
//   F - that reference, clamped to [lower bound, upper bound]. Exact when some step since Reset()
//   ran its forward pass without an interior stall: the strategy resets the meter before
//   reference steps that start once every pending update is applied
//   (prophet_tf/_keras/step_report.py); a validation, which waits for every update, or gates
//   that opened in time do the same.
//   Without one, the reference contains stall and the report is low (never below the lower
//   bound). Noise in the compute time makes it high by about that noise (never above the upper
//   bound).
// - Barrier wait: from the moment the step's last gradient is handed to the runtime, the step
//   has no more gradients to compute; what it then waits for (synchronous sums and the updates
//   they feed, metric sums, updates read at a gate right after they are applied) is the union of
//   those waits, from the last hand-off to the end of the step.
// Waits between the first and the last hand-off (during the backward pass) overlap the backward
// computation and are not counted. A step without a gradient counts the union of all its waits.
//
// Hooks are called from kernels on any thread; each costs one atomic load when no step is open.
#ifndef PROPHET_OPS_CORE_STEP_METER_H_
#define PROPHET_OPS_CORE_STEP_METER_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

namespace prophet {

// One step's figures, in nanoseconds.
struct StepMeasure {
  int64_t step_ns = 0;             // end - start
  int64_t wait_ns = 0;             // gate_wait_ns + barrier_wait_ns
  int64_t gate_wait_ns = 0;        // the estimate above, within [gate_lower_ns, gate_upper_ns]
  int64_t barrier_wait_ns = 0;
  int64_t gate_lower_ns = 0;       // the first layer's gate wait
  int64_t gate_upper_ns = 0;       // union of the waits before the first gradient
  int64_t first_gradient_ns = -1;  // from the step's start; -1: no gradient in this step
  int64_t forward_reference_ns = -1;  // the forward pass's compute as estimated so far; -1: none
};

class StepMeter {
 public:
  // Forgets the forward pass's compute reference (a new model or train function).
  void Reset();
  void BeginStep(int64_t now_ns);
  // Closes the step opened by BeginStep (a zero measure when none is open).
  StepMeasure EndStep(int64_t now_ns);
  bool step_open() const { return open_.load(std::memory_order_relaxed); }

  // A gate kept a read or write of a variable waiting from start_ns to end_ns for an update of
  // `priority` (its gradient's).
  void OnGateWaited(int64_t priority, int64_t start_ns, int64_t end_ns);
  // A tensor was handed to the runtime with `priority`: a gradient when 0 < priority <
  // kControlPriority (scheduler.h), otherwise ignored.
  void OnHandOff(int64_t priority, int64_t now_ns);
  // A collective whose result the step waits for ran from submit_ns to done_ns. Called before the
  // kernel finishes, so that the step's EndStep sees it.
  void OnAwaitedDone(int64_t submit_ns, int64_t done_ns);

  // Pure function behind EndStep, for tests: the figures of one step from its events.
  struct Wait {
    int64_t start_ns, end_ns;
    bool gate;              // a gate (else an awaited collective)
    int64_t priority;       // a gate's update priority
  };
  static StepMeasure Measure(int64_t start_ns, int64_t end_ns, const std::vector<Wait>& waits,
                             int64_t first_gradient_abs_ns, int64_t last_gradient_abs_ns,
                             int64_t first_layer_priority, int64_t* forward_reference_ns);

 private:
  std::atomic<bool> open_{false};
  std::mutex mu_;
  int64_t start_ns_ = 0;
  std::vector<Wait> waits_;
  int64_t first_gradient_ns_ = -1, last_gradient_ns_ = -1;  // absolute
  int64_t top_priority_ = 0;           // the largest gradient priority seen since Reset
  int64_t forward_reference_ns_ = -1;  // smallest (F - lower bound) since Reset
};

// The process-wide meter the kernels report to.
StepMeter& GlobalStepMeter();

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_STEP_METER_H_
