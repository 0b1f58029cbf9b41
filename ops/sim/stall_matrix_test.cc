// Every schedule finishes every step at any N: the step simulator (which replays the engine's
// policies, partitions and credit) over a model of many small tensors and one large first-layer
// tensor, with the byte credit, the partition size and the socket buffers at their extremes, for
// 16 to 128 workers, unfused and fused. A stalled setting is reported by Simulate as a deadlock with where every
// worker waits. ops/core/engine_stress_test.cc runs the same matrix on 4 and 8 real engines.
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "ops/core/testing.h"
#include "ops/sim/simulator.h"

namespace prophet {
namespace {

constexpr int64_t kUs = 1'000;
constexpr uint64_t kKiB = 1024;

// 12 layers. Layer 0 holds a 1 MiB gradient, the most urgent and the last one the backward pass
// makes (an embedding or a first convolution); layers 1-11 hold small gradients of 1-60 KiB. The
// backward pass makes them from the last layer backwards in bursts of three, 50 us apart, with
// 1.5 ms between bursts: stages for Prophet's planner.
StepProfile ManySmallAndALargeFirst() {
  constexpr int kLayers = 12;
  StepProfile profile;
  int64_t t = 0;
  std::vector<int64_t> ready(kLayers);
  for (int i = kLayers - 1; i >= 0; --i) {
    t += (i % 3 == 2 ? 1500 : 50) * kUs;
    ready[i] = t;
  }
  for (int i = 0; i < kLayers; ++i) {
    ModelLayer layer;
    layer.name = "L" + std::to_string(i);
    layer.forward_ns = (50 + 25 * (i % 3)) * kUs;
    profile.layers.push_back(layer);
    ModelTensor tensor;
    tensor.name = "grad/L" + std::to_string(i);
    tensor.bytes = i == 0 ? 1024 * kKiB : (1 + (i * 7) % 60) * kKiB;
    tensor.priority = kLayers - i;
    tensor.layer = i;
    tensor.ready_ns = ready[i];
    tensor.apply_ns = 20 * kUs;
    profile.tensors.push_back(tensor);
  }
  ModelTensor metrics;  // a control collective (the loss) every step
  metrics.name = "metrics";
  metrics.bytes = 8;
  metrics.priority = kControlPriority;
  metrics.ready_ns = t;
  profile.tensors.push_back(metrics);
  profile.backward_ns = t;
  profile.tail_ns = 100 * kUs;
  profile.gap_ns = 100 * kUs;
  return profile;
}

TEST(EveryScheduleFinishesEveryStepAtAnyN) {
  const StepProfile profile = ManySmallAndALargeFirst();
  SimulationOptions options;
  options.warmup_steps = 3;  // prophet: a profile and a bandwidth estimate, then plans
  options.steps = 1;
  int runs = 0, stalls = 0;
  uint64_t bytescheduler_breaks = 0, other_breaks = 0;
  for (const int workers : {16, 32, 64, 128}) {
    for (const char* schedule : {"fifo", "priority", "prophet", "bytescheduler", "p3"}) {
      for (const uint64_t partition : {uint64_t{64} * kKiB, uint64_t{64} << 20}) {
        // One partition (the smallest credit that moves one push at a time), and no limit.
        for (const uint64_t credit : {partition, uint64_t{1} << 40}) {
          // The smallest socket buffers the runtime accepts, holding at most 1 KiB unsent, and the
          // defaults.
          for (const auto& [socket_buffer, unsent] :
               {std::pair<uint64_t, uint64_t>{kMinSocketBufferBytes, 1024},
                std::pair<uint64_t, uint64_t>{0, EngineOptions().socket_unsent_bytes}}) {
           // Unfused, and fused into buckets (fusion.h) sized for the link.
           for (const int64_t fusion : {int64_t{0}, kFusionAuto}) {
            // (Time: fused, the smallest buffers and the largest partitions run unfused only; a
            // fused bucket is cut by its own rule, and spreads over every pair of workers.)
            if (fusion != 0 && (unsent == 1024 || partition > 64 * kKiB)) continue;
            NetworkModel network;
            network.workers = workers;
            network.link_Bps = 1.25e9;  // 10 Gbit/s
            network.latency_ns = 20 * kUs;
            network.socket_buffer_bytes = socket_buffer;
            network.socket_unsent_bytes = unsent;
            RuntimeModel runtime;
            runtime.schedule = schedule;
            runtime.partition_bytes = partition;
            runtime.credit_bytes = credit;
            runtime.fusion_bytes = fusion;
            StepPrediction prediction;
            const Status s = Simulate(profile, network, runtime, options, &prediction);
            ++runs;
            (std::string(schedule) == "bytescheduler" ? bytescheduler_breaks : other_breaks) +=
                prediction.stall_breaks;
            if (s.ok() && prediction.step_s > 0) continue;
            ++stalls;
            std::fprintf(stderr, "%d workers, %s, partitions %llu, credit %llu, socket buffer %llu, unsent %llu, fusion %lld: %s\n",
                         workers, schedule, static_cast<unsigned long long>(partition),
                         static_cast<unsigned long long>(credit), static_cast<unsigned long long>(socket_buffer),
                         static_cast<unsigned long long>(unsent), static_cast<long long>(fusion), s.message().c_str());
           }
          }
        }
      }
    }
  }
  std::printf("%d settings, %d stalled; bytescheduler's stall breaks: %llu\n", runs, stalls,
              static_cast<unsigned long long>(bytescheduler_breaks));
  EXPECT_EQ(stalls, 0);
  // Its window of partitions waiting for their sums fills at these N, and only its breaks open it
  // (the prediction reports them); no other policy ever breaks its flow control.
  EXPECT_TRUE(bytescheduler_breaks > 0);
  EXPECT_EQ(other_breaks, 0u);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
