#include "ops/core/step_meter.h"

#include <algorithm>

#include "ops/core/scheduler.h"

namespace prophet {
namespace {

// Total length of the union of [first, second) intervals (sorted in place).
int64_t UnionNs(std::vector<std::pair<int64_t, int64_t>>* intervals) {
  std::sort(intervals->begin(), intervals->end());
  int64_t total = 0, run_start = 0, run_end = 0;
  bool in_run = false;
  for (const auto& [a, b] : *intervals) {
    if (b <= a) continue;
    if (in_run && a <= run_end) {
      run_end = std::max(run_end, b);
      continue;
    }
    if (in_run) total += run_end - run_start;
    run_start = a;
    run_end = b;
    in_run = true;
  }
  if (in_run) total += run_end - run_start;
  return total;
}

}  // namespace

void StepMeter::Reset() {
  std::lock_guard<std::mutex> lock(mu_);
  top_priority_ = 0;
  forward_reference_ns_ = -1;
}

void StepMeter::BeginStep(int64_t now_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  start_ns_ = now_ns;
  waits_.clear();
  first_gradient_ns_ = last_gradient_ns_ = -1;
  open_.store(true, std::memory_order_relaxed);
}

StepMeasure StepMeter::EndStep(int64_t now_ns) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!open_.load(std::memory_order_relaxed)) return StepMeasure{};
  open_.store(false, std::memory_order_relaxed);
  return Measure(start_ns_, now_ns, waits_, first_gradient_ns_, last_gradient_ns_, top_priority_,
                 &forward_reference_ns_);
}

void StepMeter::OnGateWaited(int64_t priority, int64_t start_ns, int64_t end_ns) {
  if (!open_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (open_.load(std::memory_order_relaxed)) waits_.push_back(Wait{start_ns, end_ns, true, priority});
}

void StepMeter::OnHandOff(int64_t priority, int64_t now_ns) {
  if (priority <= 0 || priority >= kControlPriority || !open_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (!open_.load(std::memory_order_relaxed)) return;
  if (first_gradient_ns_ < 0) first_gradient_ns_ = now_ns;
  last_gradient_ns_ = std::max(last_gradient_ns_, now_ns);
  top_priority_ = std::max(top_priority_, priority);
}

void StepMeter::OnAwaitedDone(int64_t submit_ns, int64_t done_ns) {
  if (!open_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (open_.load(std::memory_order_relaxed)) waits_.push_back(Wait{submit_ns, done_ns, false, 0});
}

StepMeasure StepMeter::Measure(int64_t start_ns, int64_t end_ns, const std::vector<Wait>& waits,
                               int64_t first_gradient_abs_ns, int64_t last_gradient_abs_ns,
                               int64_t first_layer_priority, int64_t* forward_reference_ns) {
  StepMeasure m;
  end_ns = std::max(end_ns, start_ns);
  m.step_ns = end_ns - start_ns;
  const bool has_gradient = first_gradient_abs_ns >= 0;
  // The forward pass: the whole step when it hands off no gradient.
  const int64_t forward_end = has_gradient ? std::clamp(first_gradient_abs_ns, start_ns, end_ns) : end_ns;
  std::vector<std::pair<int64_t, int64_t>> forward, barrier;
  for (const Wait& w : waits) {
    const int64_t a = std::max(w.start_ns, start_ns), b = std::min(w.end_ns, end_ns);
    if (b <= a) continue;
    if (a < forward_end) {
      forward.emplace_back(a, std::min(b, forward_end));
      if (w.gate && first_layer_priority > 0 && w.priority == first_layer_priority)
        m.gate_lower_ns = std::max(m.gate_lower_ns, std::min(b, forward_end) - a);
    }
    if (has_gradient && b > last_gradient_abs_ns)
      barrier.emplace_back(std::max(a, last_gradient_abs_ns), b);
  }
  m.gate_upper_ns = UnionNs(&forward);
  m.gate_lower_ns = std::min(m.gate_lower_ns, m.gate_upper_ns);
  m.barrier_wait_ns = UnionNs(&barrier);
  if (!has_gradient) {
    m.gate_wait_ns = m.gate_upper_ns;
  } else {
    m.first_gradient_ns = forward_end - start_ns;
    // F - lower bound = compute + (stall beyond the lower bound) >= compute: the smallest value
    // seen is the best estimate of the forward pass's compute.
    const int64_t compute_sample = m.first_gradient_ns - m.gate_lower_ns;
    if (*forward_reference_ns < 0 || compute_sample < *forward_reference_ns) *forward_reference_ns = compute_sample;
    m.forward_reference_ns = *forward_reference_ns;
    m.gate_wait_ns = std::clamp(m.first_gradient_ns - *forward_reference_ns, m.gate_lower_ns, m.gate_upper_ns);
  }
  m.wait_ns = m.gate_wait_ns + m.barrier_wait_ns;
  return m;
}

StepMeter& GlobalStepMeter() {
  static StepMeter* meter = new StepMeter();  // outlives every kernel at exit
  return *meter;
}

}  // namespace prophet
