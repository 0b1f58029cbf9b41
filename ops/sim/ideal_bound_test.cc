// The ideal bound against cases computed by hand (one tensor; the first layer's gradient ready
// last; preemption by a more urgent layer; latency, payload efficiency, control collectives,
// gradients no layer reads, one worker), against the naive bound max(compute, communication),
// and against the step simulator: no simulated schedule of the runtime steps faster.
#include "ops/sim/ideal_bound.h"

#include <cmath>
#include <algorithm>
#include <cstdio>
#include <random>
#include <string>

#include "ops/core/scheduler.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;
constexpr double kMsS = 1e-3;

// 1 MB/s links with no overheads: 1,000 bytes take 1 ms.
NetworkModel SlowNetwork(int workers) {
  NetworkModel network;
  network.workers = workers;
  network.link_Bps = 1e6;
  network.payload_efficiency = 1.0;
  network.frame_overhead_bytes = 0;
  network.socket_buffer_bytes = 0;
  return network;
}

ModelTensor Tensor(const std::string& name, uint64_t bytes, int64_t priority, int layer, int64_t ready_ns) {
  ModelTensor t;
  t.name = name;
  t.bytes = bytes;
  t.priority = priority;
  t.layer = layer;
  t.ready_ns = ready_ns;
  return t;
}

IdealBound Bound(const StepProfile& profile, const NetworkModel& network) {
  IdealBound bound;
  const Status s = ComputeIdealBound(profile, network, &bound);
  if (!s.ok()) std::fprintf(stderr, "ComputeIdealBound failed: %s\n", s.message().c_str());
  EXPECT_TRUE(s.ok());
  return bound;
}

// One layer (10 ms forward), one 100,000-byte gradient ready when the backward pass starts (and
// ends). N workers move 2(N-1)/N of it: 100 ms at N=2, 150 ms at N=4, before the next forward.
TEST(OneTensorWaitsForItsShareOfTheLink) {
  StepProfile profile;
  profile.layers = {{"dense", 10 * kMs, 0}};
  profile.tensors = {Tensor("grad/dense", 100'000, 1, 0, 0)};
  IdealBound b = Bound(profile, SlowNetwork(2));
  EXPECT_NEAR(b.step_s, 110 * kMsS, 1e-9);
  EXPECT_NEAR(b.compute_s, 10 * kMsS, 1e-9);
  EXPECT_NEAR(b.comm_s, 100 * kMsS, 1e-9);
  EXPECT_NEAR(b.wait_s, 100 * kMsS, 1e-9);
  EXPECT_EQ(b.binding_layer, 0);
  b = Bound(profile, SlowNetwork(4));
  EXPECT_NEAR(b.step_s, 160 * kMsS, 1e-9);
  // One worker: no communication, the profile's step.
  profile.launch_ns = 1 * kMs;
  profile.tail_ns = 2 * kMs;
  profile.gap_ns = 3 * kMs;
  b = Bound(profile, SlowNetwork(1));
  EXPECT_NEAR(b.step_s, 16 * kMsS, 1e-9);
  EXPECT_NEAR(b.wait_s, 0.0, 1e-12);
  EXPECT_EQ(b.binding_layer, -1);
}

// The same gradient compressed (fp16 or bf16): 50,000 bytes travel, 50 ms at N=2; a control
// collective beside it stays exact and counts as no gradient.
TEST(ACompressedGradientNeedsHalfTheLink) {
  StepProfile profile;
  profile.layers = {{"dense", 10 * kMs, 0}};
  profile.tensors = {Tensor("grad/dense", 100'000, 1, 0, 0), Tensor("metrics/loss", 8, kControlPriority, -1, 0)};
  IdealBound b = Bound(profile, SlowNetwork(2));
  EXPECT_EQ(b.gradient_bytes, 100'000u);
  CompressGradients(Encoding::kFloat16, &profile);
  b = Bound(profile, SlowNetwork(2));
  EXPECT_NEAR(b.step_s, 60 * kMsS + 0.008 * kMsS, 1e-9);  // the 8 control bytes go first
  EXPECT_NEAR(b.comm_s, 50.008 * kMsS, 1e-9);
  EXPECT_EQ(b.gradient_bytes, 50'000u);
}

// Two layers of 10 ms forward; the backward pass (20 ms) produces L1's 10,000 bytes at 10 ms and
// L0's at 20 ms (the first layer's gradient comes last). At N=2 each takes 10 ms of link:
// L1 done at 20, L0 at 30 ms after the backward start. L0's next forward starts at 30, L1's at
// 40 (after L0's forward), the next backward at 50: a 50 ms period, where compute is 40 ms and
// the naive bound max(40, 20) = 40 ms.
TEST(TheFirstLayersGradientReadyLastSetsTheBound) {
  StepProfile profile;
  profile.layers = {{"L0", 10 * kMs, 10 * kMs}, {"L1", 10 * kMs, 10 * kMs}};
  profile.backward_ns = 20 * kMs;
  profile.tensors = {Tensor("grad/L1", 10'000, 1, 1, 10 * kMs), Tensor("grad/L0", 10'000, 2, 0, 20 * kMs)};
  const IdealBound b = Bound(profile, SlowNetwork(2));
  EXPECT_NEAR(b.step_s, 50 * kMsS, 1e-9);
  EXPECT_NEAR(b.compute_s, 40 * kMsS, 1e-9);
  EXPECT_NEAR(b.done_s[1], 20 * kMsS, 1e-9);
  EXPECT_NEAR(b.done_s[0], 30 * kMsS, 1e-9);
  EXPECT_EQ(b.binding_layer, 0);
  // A one-way latency of 4 ms: every gradient completes 4 ms later; so does the step.
  NetworkModel far = SlowNetwork(2);
  far.latency_ns = 4 * kMs;
  EXPECT_NEAR(Bound(profile, far).step_s, 54 * kMsS, 1e-9);
  // Half the link carries payload: 20 ms per gradient. L0, ready at 20, preempts L1 (10..20):
  // L0 is done at 40, L1 at 50; x0 = 40, x1 = max(40 + 10, 50); period 60 ms.
  NetworkModel headers = SlowNetwork(2);
  headers.payload_efficiency = 0.5;
  const IdealBound slow = Bound(profile, headers);
  EXPECT_NEAR(slow.done_s[0], 40 * kMsS, 1e-9);
  EXPECT_NEAR(slow.done_s[1], 50 * kMsS, 1e-9);
  EXPECT_NEAR(slow.step_s, 60 * kMsS, 1e-9);
}

// L2's 50,000 bytes are ready first (0 ms), L0's 5,000 at 10 ms preempt them: L0 is done at 15 ms,
// L2 at 55 ms (50 ms of work plus the 5 ms it waited). L1 has no gradient. Forward 1 ms each.
// Chain: x0 = max(backward 10, 15) = 15; x1 = 16; x2 = max(17, 55) = 55; period 56 ms.
TEST(TheMoreUrgentLayerPreemptsTheLink) {
  StepProfile profile;
  profile.layers = {{"L0", 1 * kMs, 0}, {"L1", 1 * kMs, 0}, {"L2", 1 * kMs, 0}};
  profile.backward_ns = 10 * kMs;
  profile.tensors = {Tensor("grad/L2", 50'000, 1, 2, 0), Tensor("grad/L0", 5'000, 3, 0, 10 * kMs)};
  const IdealBound b = Bound(profile, SlowNetwork(2));
  EXPECT_NEAR(b.done_s[0], 15 * kMsS, 1e-9);
  EXPECT_TRUE(b.done_s[1] < 0);
  EXPECT_NEAR(b.done_s[2], 55 * kMsS, 1e-9);
  EXPECT_NEAR(b.step_s, 56 * kMsS, 1e-9);
  EXPECT_EQ(b.binding_layer, 2);
}

// A control collective (the loss) ready at the backward pass's end delays the step's return:
// 3,000 bytes at N=2 take 3 ms, then tail 1 + gap 1 + launch 1 before the next forward.
// Gradients no layer reads only need their share of the link: 500,000 bytes = 500 ms per step.
TEST(ControlCollectivesAndUngatedGradients) {
  StepProfile profile;
  profile.layers = {{"L0", 5 * kMs, 0}};
  profile.backward_ns = 10 * kMs;
  profile.tail_ns = profile.gap_ns = profile.launch_ns = 1 * kMs;
  profile.tensors = {Tensor("loss", 3'000, kControlPriority, -1, 10 * kMs)};
  EXPECT_NEAR(Bound(profile, SlowNetwork(2)).step_s, (10 + 3 + 3 + 5) * kMsS, 1e-9);
  profile.tensors.push_back(Tensor("grad/orphan", 500'000, 1, -1, 0));
  const IdealBound b = Bound(profile, SlowNetwork(2));
  EXPECT_NEAR(b.step_s, 503 * kMsS, 1e-9);
  EXPECT_NEAR(b.comm_s, 503 * kMsS, 1e-9);
}

TEST(BadInputIsRejected) {
  IdealBound b;
  StepProfile empty;
  EXPECT_TRUE(!ComputeIdealBound(empty, SlowNetwork(2), &b).ok());
  StepProfile profile;
  profile.layers = {{"L0", kMs, 0}};
  profile.tensors = {Tensor("grad/x", 4, 1, 3, 0)};
  EXPECT_TRUE(!ComputeIdealBound(profile, SlowNetwork(2), &b).ok());
  profile.tensors[0].layer = 0;
  NetworkModel network = SlowNetwork(2);
  network.link_Bps = 0;
  EXPECT_TRUE(!ComputeIdealBound(profile, network, &b).ok());
  network.link_Bps = 1e6;
  network.payload_efficiency = 1.5;
  EXPECT_TRUE(!ComputeIdealBound(profile, network, &b).ok());
}

// A model of `layers` layers with random forward times and gradients (a few large, many small),
// each gradient ready at the end of its layer's backward pass (2 x forward), as on an accelerator.
StepProfile RandomModel(std::mt19937* rng, int layers, double ms_scale) {
  std::uniform_real_distribution<double> forward(0.2, 3.0);
  std::uniform_int_distribution<int> tensors_per_layer(1, 3);
  std::uniform_real_distribution<double> log_bytes(2.0, 6.5);  // 100 B .. 3 MB
  StepProfile profile;
  std::vector<int64_t> backward;
  for (int k = 0; k < layers; ++k) {
    const int64_t f = static_cast<int64_t>(forward(*rng) * ms_scale * kMs);
    profile.layers.push_back({"L" + std::to_string(k), f, 2 * f});
    backward.push_back(2 * f);
  }
  int64_t at = 0;
  int64_t priority = 1000;
  std::vector<ModelTensor> reversed;
  for (int k = layers - 1; k >= 0; --k) {
    at += backward[k];
    const int count = tensors_per_layer(*rng);
    for (int i = 0; i < count; ++i) {
      uint64_t bytes = static_cast<uint64_t>(std::pow(10.0, log_bytes(*rng)));
      bytes -= bytes % 4;
      profile.tensors.push_back(Tensor("grad/L" + std::to_string(k) + "/w" + std::to_string(i), bytes + 4,
                                       priority--, k, at));
    }
  }
  profile.backward_ns = at;
  return profile;
}

// Every schedule the runtime has, with and without crossing, simulated on random models, N and
// link rates: never a step shorter than the ideal bound, and the bound is never below the naive
// one (max(compute, every gradient's 2(N-1)/N share of the link)).
TEST(NoSimulatedScheduleBeatsTheBound) {
  std::mt19937 rng(18);
  SimulationOptions options;
  options.warmup_steps = 3;
  options.steps = 4;
  int cases = 0;
  double closest = 1e9;  // the smallest simulated step / bound: how tight the bound gets
  for (int trial = 0; trial < 6; ++trial) {
    const StepProfile profile = RandomModel(&rng, 6 + 3 * trial, 1.0);
    for (const int workers : {2, 3, 4, 8}) {
      for (const double link_MBps : {5.0, 50.0, 500.0}) {
        NetworkModel network;
        network.workers = workers;
        network.link_Bps = link_MBps * 1e6;
        network.ingress_limited = trial % 2 == 0;
        network.latency_ns = trial % 3 == 0 ? 0 : 50'000;
        const IdealBound bound = Bound(profile, network);
        double gradient_bytes = 0;
        for (const ModelTensor& t : profile.tensors) gradient_bytes += static_cast<double>(t.bytes);
        const double naive = std::max(bound.compute_s, 2.0 * (workers - 1) / workers * gradient_bytes /
                                                           (network.link_Bps * network.payload_efficiency));
        EXPECT_TRUE(bound.step_s >= naive * (1 - 1e-12));
        for (const char* schedule : {"prophet", "priority", "fifo"}) {
          for (const bool cross : {true, false}) {
            RuntimeModel runtime;
            runtime.schedule = schedule;
            runtime.cross_barrier = cross;
            runtime.partition_bytes = 256 << 10;
            StepPrediction p;
            const Status s = Simulate(profile, network, runtime, options, &p);
            if (!s.ok()) continue;  // a deadlock is no step at all
            ++cases;
            closest = std::min(closest, p.step_s / bound.step_s);
            if (p.step_s < bound.step_s * (1 - 1e-9)) {
              std::fprintf(stderr, "%s cross=%d N=%d %.0f MB/s trial %d: step %.6f s < bound %.6f s\n", schedule,
                           cross, workers, link_MBps, trial, p.step_s, bound.step_s);
            }
            EXPECT_TRUE(p.step_s >= bound.step_s * (1 - 1e-9));
          }
        }
      }
    }
  }
  EXPECT_TRUE(cases > 300);
  std::printf("%d simulations; the closest came to %.4f x the bound\n", cases, closest);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
