// The step report's waiting time: the forward pass's stall at the gates between its bounds, the
// compute reference learned from steps that did not stall, the barrier after the last gradient,
// and hooks that record nothing outside a step.
#include "ops/core/step_meter.h"

#include <thread>
#include <vector>

#include "ops/core/scheduler.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;
constexpr int64_t kFirstLayer = 3;  // gradient priorities 1..3, the first layer's is 3

// A step of a three-layer model starting at `t0`: the gates of the layers with priority 3, 2, 1
// open at t0 + gate_ms[i] (0: not waited), the first gradient is handed off at t0 + first_ms and
// the last at t0 + last_ms, the step ends at t0 + end_ms.
StepMeasure RunStep(StepMeter* meter, int64_t t0, std::vector<int64_t> gate_ms, int64_t first_ms, int64_t last_ms,
                    int64_t end_ms, std::vector<std::pair<int64_t, int64_t>> awaited_ms = {}) {
  meter->BeginStep(t0);
  for (size_t i = 0; i < gate_ms.size(); ++i)
    if (gate_ms[i] > 0) meter->OnGateWaited(kFirstLayer - static_cast<int64_t>(i), t0, t0 + gate_ms[i] * kMs);
  meter->OnHandOff(1, t0 + first_ms * kMs);
  meter->OnHandOff(kFirstLayer, t0 + last_ms * kMs);
  for (const auto& [a, b] : awaited_ms) meter->OnAwaitedDone(t0 + a * kMs, t0 + b * kMs);
  return meter->EndStep(t0 + end_ms * kMs);
}

TEST(AStepWithoutWaitsWaitedNothingAndTeachesTheForwardCompute) {
  StepMeter meter;
  const StepMeasure m = RunStep(&meter, 1000 * kMs, {}, 20, 50, 52);
  EXPECT_EQ(m.step_ns, 52 * kMs);
  EXPECT_EQ(m.wait_ns, 0);
  EXPECT_EQ(m.first_gradient_ns, 20 * kMs);
  EXPECT_EQ(m.forward_reference_ns, 20 * kMs);
}

TEST(TheForwardStallIsTheForwardPassBeyondItsCompute) {
  StepMeter meter;
  RunStep(&meter, 1000 * kMs, {}, 20, 50, 52);  // a clean step: the forward pass computes 20 ms
  // The first layer waits 10 ms, the third layer's gate opens at 35 ms while the forward pass has
  // computed 2 layers of it since 10 ms: it finishes at 45 ms, 25 ms late.
  const StepMeasure m = RunStep(&meter, 2000 * kMs, {10, 0, 35}, 45, 75, 77);
  EXPECT_EQ(m.gate_lower_ns, 10 * kMs);
  EXPECT_EQ(m.gate_upper_ns, 35 * kMs);
  EXPECT_EQ(m.gate_wait_ns, 25 * kMs);
  EXPECT_EQ(m.barrier_wait_ns, 0);
  EXPECT_EQ(m.wait_ns, 25 * kMs);
}

TEST(WithoutACleanStepTheReportIsTheLowerBound) {
  StepMeter meter;
  const StepMeasure m = RunStep(&meter, 0, {10, 0, 35}, 45, 75, 77);
  EXPECT_EQ(m.forward_reference_ns, 35 * kMs);  // F - lower bound: contains the interior stall
  EXPECT_EQ(m.gate_wait_ns, 10 * kMs);
}

TEST(TheEstimateNeverLeavesItsBounds) {
  StepMeter meter;
  RunStep(&meter, 0, {}, 20, 50, 52);
  // A forward pass slowed by something else than the gates (here 100 ms): only the gates' 5 ms
  // are waiting for gradients.
  StepMeasure m = RunStep(&meter, 1000 * kMs, {5}, 120, 150, 152);
  EXPECT_EQ(m.gate_wait_ns, 5 * kMs);
  // Faster than the reference (noise): never below the first layer's wait.
  m = RunStep(&meter, 2000 * kMs, {8}, 24, 60, 62);
  EXPECT_EQ(m.gate_wait_ns, 8 * kMs);
}

TEST(ResetForgetsTheReference) {
  StepMeter meter;
  RunStep(&meter, 0, {}, 20, 50, 52);
  meter.Reset();
  const StepMeasure m = RunStep(&meter, 1000 * kMs, {10, 0, 35}, 45, 75, 77);
  EXPECT_EQ(m.gate_wait_ns, 10 * kMs);
}

TEST(TheBarrierIsWhatTheStepWaitsForAfterItsLastGradient) {
  StepMeter meter;
  // Synchronous sums pending from 30 and 40 ms until 90 ms, a metric sum from 92 to 94 ms; the
  // last gradient is handed off at 60 ms, the step ends at 95 ms. The sums' time before 60 ms
  // overlapped the backward pass.
  const StepMeasure m = RunStep(&meter, 0, {}, 20, 60, 95, {{30, 90}, {40, 90}, {92, 94}});
  EXPECT_EQ(m.barrier_wait_ns, 32 * kMs);
  EXPECT_EQ(m.gate_wait_ns, 0);
  EXPECT_EQ(m.wait_ns, 32 * kMs);
}

TEST(ACollectiveTheForwardPassWaitsForCountsLikeAGate) {
  StepMeter meter;
  RunStep(&meter, 0, {}, 20, 50, 52);
  // The loss's global batch size arrives 15 ms late (a slower peer): the forward pass ends at 35.
  const StepMeasure m = RunStep(&meter, 1000 * kMs, {}, 35, 65, 67, {{1, 35}});
  EXPECT_EQ(m.gate_upper_ns, 34 * kMs);
  EXPECT_EQ(m.gate_wait_ns, 15 * kMs);
}

TEST(AStepWithoutGradientsCountsTheUnionOfItsWaits) {
  StepMeter meter;
  meter.BeginStep(0);
  meter.OnAwaitedDone(10 * kMs, 30 * kMs);
  meter.OnGateWaited(1, 20 * kMs, 40 * kMs);
  const StepMeasure m = meter.EndStep(50 * kMs);
  EXPECT_EQ(m.first_gradient_ns, -1);
  EXPECT_EQ(m.wait_ns, 30 * kMs);
}

TEST(OnlyGradientPrioritiesAreHandOffs) {
  StepMeter meter;
  meter.BeginStep(0);
  meter.OnHandOff(0, 5 * kMs);                     // a barrier, an initial broadcast
  meter.OnHandOff(kControlPriority, 6 * kMs);      // a metric sum
  meter.OnAwaitedDone(5 * kMs, 10 * kMs);
  EXPECT_EQ(meter.EndStep(20 * kMs).first_gradient_ns, -1);
}

TEST(NothingIsRecordedOutsideAStep) {
  StepMeter meter;
  meter.OnGateWaited(1, 0, 10 * kMs);
  meter.OnAwaitedDone(0, 10 * kMs);
  EXPECT_EQ(meter.EndStep(20 * kMs).step_ns, 0);  // no step open
  meter.BeginStep(100 * kMs);
  const StepMeasure m = meter.EndStep(120 * kMs);
  EXPECT_EQ(m.step_ns, 20 * kMs);
  EXPECT_EQ(m.wait_ns, 0);
  EXPECT_TRUE(!meter.step_open());
}

TEST(ConcurrentHooksAreAllCounted) {
  StepMeter meter;
  meter.BeginStep(0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&meter, t] {
      for (int i = 0; i < 1000; ++i) meter.OnAwaitedDone((t * 1000 + i) * kMs, (t * 1000 + i + 1) * kMs);
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(meter.EndStep(4000 * kMs).wait_ns, 4000 * kMs);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
