// The fusion plan replayed by the step simulator: the most urgent bucket soon after the backward
// pass, and a fused step shorter than an unfused one, each bucket's members finishing together.
#include <cstdio>
#include <string>
#include <vector>

#include "ops/core/fusion.h"
#include "ops/core/testing.h"
#include "ops/sim/simulator.h"

namespace prophet {
namespace {

struct SmallGradient {
  std::string name;
  uint64_t bytes;
  int64_t priority;
  int64_t ready_ns;
};

// A model of one layer (forward_ns) whose `count` gradients are described by gradient(i).
template <typename Gradient>
StepProfile OneLayerOfSmallGradients(int64_t forward_ns, int64_t backward_ns, int count, Gradient gradient) {
  StepProfile profile;
  profile.layers = {{"all", forward_ns, 0}};
  for (int i = 0; i < count; ++i) {
    const SmallGradient g = gradient(i);
    ModelTensor t;
    t.name = g.name;
    t.bytes = g.bytes;
    t.priority = g.priority;
    t.layer = 0;
    t.ready_ns = g.ready_ns;
    profile.tensors.push_back(t);
  }
  profile.backward_ns = backward_ns;
  return profile;
}

NetworkModel SixteenWorkersAt1Gbit() {
  NetworkModel network;
  network.workers = 16;
  network.link_Bps = 125e6;
  return network;
}

TEST(TheMostUrgentBucketFinishesSoonAfterTheBackwardPass) {
  const StepProfile profile = OneLayerOfSmallGradients(
      5'000'000, 30'000'000, 120, [](int i) {
        return SmallGradient{"grad/" + std::to_string(1000 + i), 3000, 1000 - i, 30'000'000 - 250'000 * int64_t{i}};
      });
  const NetworkModel network = SixteenWorkersAt1Gbit();
  SimulationOptions options;
  options.warmup_steps = 2;
  options.steps = 3;
  RuntimeModel runtime;
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  runtime.fusion_bytes = kFusionAuto;
  StepPrediction p;
  EXPECT_TRUE(Simulate(profile, network, runtime, options, &p).ok());
  const double backward_end_s = 5e-3 + 30e-3;
  const double tail_s = p.tensor_times[0].done_s - backward_end_s;
  std::printf("16 workers: the most urgent gradient is summed %.2f ms after the backward pass\n", tail_s * 1e3);
  EXPECT_TRUE(tail_s > 0);
  EXPECT_TRUE(tail_s < 1.5e-3);
}

// The simulator replays the plan: 40 small gradients on 16 workers at 1 Gbit/s. Fused, each
// bucket's members finish together, every gradient finishes, and the step is shorter than
// unfused (each tensor alone has one owner, which receives 15 pushes while other links idle).
TEST(SimulatorFusesAsTheEnginePlans) {
  const StepProfile profile = OneLayerOfSmallGradients(1'000'000, 400'000, 40, [](int i) {
    return SmallGradient{"grad/" + std::to_string(i), 4 * static_cast<uint64_t>(1000 + 500 * (i % 7)), 40 - i,
                         (40 - int64_t{i}) * 10'000};
  });
  const NetworkModel network = SixteenWorkersAt1Gbit();
  SimulationOptions options;
  options.warmup_steps = 2;
  options.steps = 3;
  StepPrediction unfused, fused;
  RuntimeModel runtime;
  runtime.schedule = "priority";
  EXPECT_TRUE(Simulate(profile, network, runtime, options, &unfused).ok());
  runtime.fusion_bytes = kFusionAuto;
  EXPECT_TRUE(Simulate(profile, network, runtime, options, &fused).ok());
  std::printf("16 workers, 40 gradients: %.2f ms unfused, %.2f ms fused\n", unfused.step_s * 1e3, fused.step_s * 1e3);
  EXPECT_TRUE(fused.step_s < unfused.step_s);
  std::vector<FusionInput> inputs;
  for (const ModelTensor& t : profile.tensors) {
    FusionInput in;
    in.name = t.name;
    in.bytes = t.bytes;
    in.priority = t.priority;
    inputs.push_back(in);
  }
  const std::vector<FusionBucket> plan = PlanFusion(inputs, 16, FusionBucketBytes(16, 125e6));
  EXPECT_TRUE(plan.size() > 1 && plan.size() < profile.tensors.size());
  for (const FusionBucket& b : plan) {
    for (const int m : b.members) {
      EXPECT_TRUE(fused.tensor_times[m].done_s > 0);
      EXPECT_NEAR(fused.tensor_times[m].done_s, fused.tensor_times[b.members.front()].done_s, 1e-12);
    }
  }
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
