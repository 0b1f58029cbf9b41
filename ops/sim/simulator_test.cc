// The step simulator against cases computed by hand: one tensor on two workers (exact step time,
// link efficiency and latency), priority vs FIFO order under a one-partition credit, what the
// kernel's socket holds ahead of an urgent push, the credit returning when a push leaves, crossing the
// barrier (the next step's first layer waits only for its own update), an owner's incast with and
// without ingress limits, and MultiWorkerMirroredStrategy's ring all-reduce.
#include "ops/sim/simulator.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#include "ops/core/partition.h"
#include "ops/core/scheduler.h"
#include "ops/core/small_allreduce.h"
#include "ops/core/testing.h"
#include "ops/sim/ideal_bound.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;
constexpr double kMsS = 1e-3;

// A name whose single partition `owner` owns among `workers` (owners follow the name's hash).
std::string NameOwnedBy(const std::string& base, int owner, int workers) {
  for (int i = 0;; ++i) {
    const std::string name = base + "_" + std::to_string(i);
    if (MakePartitions(name, 4, 4, workers, 4u << 20)[0].owner == owner) return name;
  }
}

// 1 MB/s links with no overheads: 1,000 bytes take 1 ms.
NetworkModel SlowNetwork(int workers) {
  NetworkModel network;
  network.workers = workers;
  network.link_Bps = 1e6;
  network.payload_efficiency = 1.0;
  network.frame_overhead_bytes = 0;
  network.socket_buffer_bytes = 0;  // autotuned, up to nothing: the kernel holds no bytes
  network.autotuned_socket_buffer_bytes = 0;
  network.ingress_limited = true;
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

StepPrediction Run(const StepProfile& profile, const NetworkModel& network, const RuntimeModel& runtime,
                   const SimulationOptions& options = SimulationOptions()) {
  StepPrediction prediction;
  const Status s = Simulate(profile, network, runtime, options, &prediction);
  if (!s.ok()) std::fprintf(stderr, "Simulate failed: %s\n", s.message().c_str());
  EXPECT_TRUE(s.ok());
  return prediction;
}

// The owner path for every tensor (RuntimeModel::small_allreduce off): the hand-computed cases
// below are about it; small tensors by exchange have tests of their own.
RuntimeModel OwnerPath() {
  RuntimeModel runtime;
  runtime.small_allreduce = EngineOptions::kSmallAllreduceNever;
  return runtime;
}

// One layer (10 ms forward), one 100,000-byte tensor ready when the backward pass starts (which
// ends at once). The non-owner pushes it (100 ms), the owner sums and sends it back (100 ms):
// every step takes 10 + 100 + 100 ms.
StepProfile OneTensor() {
  StepProfile profile;
  profile.layers = {{"dense", 10 * kMs, 0}};
  profile.tensors = {Tensor("grad/dense", 100'000, 1, 0, 0)};
  return profile;
}

TEST(OneTensorTwoWorkersExactStepTime) {
  for (const bool cross : {false, true}) {
    RuntimeModel runtime = OwnerPath();
    runtime.schedule = "priority";
    runtime.cross_barrier = cross;
    const StepPrediction p = Run(OneTensor(), SlowNetwork(2), runtime);
    EXPECT_NEAR(p.step_s, 210 * kMsS, 1e-6);
    EXPECT_EQ(p.periods_s.size(), static_cast<size_t>(20));
    EXPECT_NEAR(p.periods_s.front(), p.periods_s.back(), 1e-9);
    EXPECT_NEAR(p.single_step_s, 10 * kMsS, 1e-9);
    // Crossing, a step begins when the previous backward pass ends and its forward pass waits
    // 200 ms at the gate for the previous update.
    const double begin_to_forward = cross ? 200 * kMsS : 0;
    EXPECT_NEAR(p.tensor_times[0].ready_s, begin_to_forward + 10 * kMsS, 1e-6);
    EXPECT_NEAR(p.tensor_times[0].done_s, begin_to_forward + 210 * kMsS, 1e-6);
    EXPECT_NEAR(p.gate_wait_s, begin_to_forward, 1e-6);
    // Worker 0 sends 100,000 bytes per step (a push or a sum) in 100 ms; none of it overlaps.
    EXPECT_NEAR(p.wire_bytes_per_step, 100'000, 1e-6);
    EXPECT_NEAR(p.comm_s, 100 * kMsS, 1e-6);
    EXPECT_NEAR(p.overlap, 0.0, 1e-9);
  }
}

TEST(LinkEfficiencyOverheadAndLatencyAddUp) {
  NetworkModel network = SlowNetwork(2);
  network.payload_efficiency = 0.5;     // 2 ms per 1,000 bytes
  network.frame_overhead_bytes = 1000;  // +2 ms per frame
  network.latency_ns = 3 * kMs;         // +3 ms per frame
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "fifo";
  runtime.cross_barrier = false;
  const StepPrediction p = Run(OneTensor(), network, runtime);
  // 10 ms forward, then two frames of (200 + 2 + 3) ms.
  EXPECT_NEAR(p.step_s, (10 + 2 * 205) * kMsS, 1e-6);
}

TEST(OneWorkerIsTheProfile) {
  StepProfile profile = OneTensor();
  profile.launch_ns = 1 * kMs;
  profile.tail_ns = 2 * kMs;
  profile.gap_ns = 3 * kMs;
  RuntimeModel runtime;
  NetworkModel network = SlowNetwork(1);
  const StepPrediction p = Run(profile, network, runtime);
  EXPECT_NEAR(p.step_s, 16 * kMsS, 1e-9);
  EXPECT_NEAR(p.single_step_s, 16 * kMsS, 1e-9);
  EXPECT_NEAR(p.comm_s, 0.0, 1e-12);
}

// Three tensors of 10,000 bytes, all owned by worker 0, so worker 1 pushes them one at a time
// (a credit of one byte, returned when a push has left): g_last (least urgent) first, at the
// backward pass's start b; g_mid and g_first become ready while it is out and wait. At b+10,
// FIFO sends g_mid, priority sends g_first; each push and each sum takes 10 ms, and the owner's
// sums follow the pushes' arrivals.
TEST(PriorityOrderBeatsFifoForTheFirstLayer) {
  const std::string last = NameOwnedBy("g_last", 0, 2), mid = NameOwnedBy("g_mid", 0, 2),
                    first = NameOwnedBy("g_first", 0, 2);
  StepProfile profile;
  profile.layers = {{"only", 10 * kMs, 0}};
  profile.backward_ns = 2 * kMs;
  profile.tensors = {Tensor(last, 10'000, 0, 0, 0), Tensor(mid, 10'000, 1, 0, 1 * kMs),
                     Tensor(first, 10'000, 2, 0, 2 * kMs)};
  RuntimeModel runtime = OwnerPath();
  runtime.cross_barrier = false;
  runtime.credit_bytes = 1;
  runtime.schedule = "fifo";
  const StepPrediction fifo = Run(profile, SlowNetwork(2), runtime);
  runtime.schedule = "priority";
  const StepPrediction priority = Run(profile, SlowNetwork(2), runtime);
  // Times from the step's begin: the backward pass starts at 10 ms.
  EXPECT_NEAR(fifo.tensor_times[0].done_s, 30 * kMsS, 1e-6);
  EXPECT_NEAR(fifo.tensor_times[1].done_s, 40 * kMsS, 1e-6);
  EXPECT_NEAR(fifo.tensor_times[2].done_s, 50 * kMsS, 1e-6);
  EXPECT_NEAR(priority.tensor_times[0].done_s, 30 * kMsS, 1e-6);
  EXPECT_NEAR(priority.tensor_times[2].done_s, 40 * kMsS, 1e-6);
  EXPECT_NEAR(priority.tensor_times[1].done_s, 50 * kMsS, 1e-6);
  // Without crossing the step waits for everything: the same step time either way.
  EXPECT_NEAR(fifo.step_s, 50 * kMsS, 1e-6);
  EXPECT_NEAR(priority.step_s, 50 * kMsS, 1e-6);
}

// What the kernel holds: four 10,000-byte pushes to worker 0 (the least urgent) leave worker 1
// when the backward pass starts (b); an urgent 1,000-byte gradient is ready 1 ms later. Queued
// frames cannot overtake those whose first byte is already in the socket, which holds what the
// kernel lets it (KernelSendBufferBytes) beyond what has left the NIC.
//   SO_SNDBUF 10,000 -> 20,000 bytes: the pushes starting at 0, 10,000 and 20,000 bytes are in
//     the socket; the urgent push goes out at b+30 ms, arrives at b+31, and its sum waits behind
//     the result of the third push (b+30..b+40): done at b+41.
//   capped at 5,000 -> 10,000 bytes: it goes out at b+20, its sum at b+30..b+31: done at b+31.
//   autotuned up to 1 MB, but TCP_NOTSENT_LOWAT 5,000 and 5 ms (5,000 bytes) queued below the
//     socket: 10,000 bytes, as above.
//   nothing held: behind the first push only, out at b+10, sum at b+20..b+21: done at b+21.
TEST(UrgentPushesWaitBehindWhatTheKernelHolds) {
  StepProfile profile;
  profile.layers = {{"only", 10 * kMs, 0}};
  profile.backward_ns = 1 * kMs;
  for (int i = 0; i < 4; ++i) profile.tensors.push_back(Tensor(NameOwnedBy("bulk" + std::to_string(i), 0, 2), 10'000, 0, 0, 0));
  profile.tensors.push_back(Tensor(NameOwnedBy("urgent", 0, 2), 1'000, 1, 0, 1 * kMs));
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  struct Case {
    uint64_t buffer, cap, autotuned, unsent;
    double queue_s, window, urgent_done_ms;
  };
  for (const Case& c : {Case{10'000, 0, 0, 0, 0, 20'000, 41}, Case{10'000, 5'000, 0, 0, 0, 10'000, 31},
                        Case{0, 0, 1'000'000, 5'000, 0.005, 10'000, 31}, Case{0, 0, 0, 0, 0, 0, 21}}) {
    NetworkModel network = SlowNetwork(2);
    network.socket_buffer_bytes = c.buffer;
    network.max_socket_buffer_bytes = c.cap;
    network.autotuned_socket_buffer_bytes = c.autotuned;
    network.socket_unsent_bytes = c.unsent;
    network.sender_queue_s = c.queue_s;
    EXPECT_EQ(KernelSendBufferBytes(network), static_cast<uint64_t>(c.window));
    const StepPrediction p = Run(profile, network, runtime);
    // From the step's begin: the backward pass starts after the 10 ms forward pass.
    EXPECT_NEAR(p.tensor_times[4].done_s, (10 + c.urgent_done_ms) * kMsS, 1e-6);
  }
  // The runtime's defaults: an autotuned buffer, of which the socket holds its unsent limit plus
  // what is queued below it (1 ms of 1 Gbit/s).
  EXPECT_EQ(KernelSendBufferBytes(NetworkModel()), static_cast<uint64_t>(EngineOptions().socket_unsent_bytes) + 125'000);
}

// What TCP queues below the sockets is about sender_queue_s of the link in all, shared by the
// connections leaving a host (each gets its share of the link, and TCP small queues keep about
// 1 ms of a connection's own rate): 5 workers on 1 MB/s links, 40 ms (40,000 bytes) below the
// sockets, so 10,000 bytes per connection. Every worker pushes 100,000-byte bulk tensors, cut into
// 1,000-byte partitions spread over every owner, when the backward pass starts; an urgent
// 1,000-byte tensor owned by worker 0 is
// ready 10 ms later. Its pushes wait behind at most 4 connections x 10,000 bytes at each sender,
// its sum again at worker 0: at most about 2 x 40 ms plus its own bytes (54 ms here). Counting
// 40,000 bytes for each connection (the whole link's 40 ms per peer) made it 174 ms.
TEST(UrgentPushesWaitBehindOneQueueOfTheLinkNotOnePerPeer) {
  constexpr int kWorkers = 5;
  StepProfile profile;
  profile.layers = {{"only", 10 * kMs, 0}};
  profile.backward_ns = 10 * kMs;
  for (int owner = 0; owner < kWorkers; ++owner)
    profile.tensors.push_back(Tensor(NameOwnedBy("bulk" + std::to_string(owner), owner, kWorkers), 100'000, 0, 0, 0));
  profile.tensors.push_back(Tensor(NameOwnedBy("urgent", 0, kWorkers), 1'000, 1, 0, 10 * kMs));
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  runtime.partition_bytes = 1'000;
  NetworkModel network = SlowNetwork(kWorkers);
  network.autotuned_socket_buffer_bytes = 1'000'000'000;
  network.socket_unsent_bytes = 1;
  network.sender_queue_s = 0.040;
  EXPECT_EQ(KernelSendBufferBytes(network), 10'001u);
  NetworkModel two = network;
  two.workers = 2;  // one connection: all of it
  EXPECT_EQ(KernelSendBufferBytes(two), 40'001u);
  const StepPrediction p = Run(profile, network, runtime);
  const double waited_ms = (p.tensor_times[kWorkers].done_s - p.tensor_times[kWorkers].ready_s) / kMsS;
  std::printf("urgent push_pull behind 4 loaded connections: %.1f ms\n", waited_ms);
  EXPECT_TRUE(waited_ms > 40 && waited_ms < 90);
}

// The byte credit returns when a push has left this worker (the engine's OnPushLeft), not when its
// sum is back. Worker 0 pushes two 10,000-byte tensors to worker 1 with a credit of one of them,
// when the backward pass starts (b); the kernel holds nothing, so a push leaves with its last byte:
//   push A b+0..b+10, A's sum b+10..b+20; push B b+10..b+20, B's sum b+20..b+30.
// A credit held until the sum came back would release B only at b+20: B done at b+40.
TEST(CreditReturnsWhenAPushLeavesNotWhenItsSumIsBack) {
  StepProfile profile;
  profile.layers = {{"only", 10 * kMs, 0}};
  profile.tensors = {Tensor(NameOwnedBy("A", 1, 2), 10'000, 2, 0, 0), Tensor(NameOwnedBy("B", 1, 2), 10'000, 1, 0, 0)};
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  runtime.credit_bytes = 10'000;
  const StepPrediction p = Run(profile, SlowNetwork(2), runtime);
  // From the step's begin: the backward pass starts after the 10 ms forward pass.
  EXPECT_NEAR(p.tensor_times[0].done_s, (10 + 20) * kMsS, 1e-6);
  EXPECT_NEAR(p.tensor_times[1].done_s, (10 + 30) * kMsS, 1e-6);
}

// bytescheduler: an owner's own partition returns its credit when its sum is complete there (a
// local transfer), and the engine asks the policy for the next partition at once (the engine pumps
// after every event: PushPull::SendScheduled -> FinishPartition -> PushCompleted runs inside the
// pump's loop, which pumps again; a push completing a sum is followed by the I/O loop's pump).
// Worker 1 owns X, Y and Z (10,000 bytes each, X most urgent) and the window holds one partition.
// From the backward pass's start b: both release X; worker 0's push arrives at b+10, worker 1's
// sum is complete and its window free, so it releases its own Y then (worker 1 sends no push
// and gets no sum back, so no other event would pump it before its stall timer, 1 s away);
// worker 0 gets X's sum at b+20 and pushes Y, which completes Y at b+30 (worker 1 releases its
// own Z), Y's sum is back at b+40, worker 0 pushes Z, Z's sum is back at b+60. Nothing waits long
// enough for a stall break: a simulator that let worker 1's freed window idle until its timer
// made worker 0 break its window (a full window, nothing back for longer than its threshold).
TEST(ByteschedulerOwnerReleasesItsNextPartitionWhenItsOwnSumCompletes) {
  StepProfile profile;
  profile.layers = {{"only", 10 * kMs, 0}};
  profile.tensors = {Tensor(NameOwnedBy("X", 1, 2), 10'000, 3, 0, 0), Tensor(NameOwnedBy("Y", 1, 2), 10'000, 2, 0, 0),
                     Tensor(NameOwnedBy("Z", 1, 2), 10'000, 1, 0, 0)};
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "bytescheduler";
  runtime.cross_barrier = false;
  runtime.credit_bytes = 10'000;
  SimulationOptions options;
  options.warmup_steps = 1;
  options.steps = 3;
  const StepPrediction p = Run(profile, SlowNetwork(2), runtime, options);
  EXPECT_EQ(p.stall_breaks, 0u);
  // From the step's begin: the backward pass starts after the 10 ms forward pass.
  EXPECT_NEAR(p.tensor_times[0].done_s, (10 + 20) * kMsS, 1e-6);
  EXPECT_NEAR(p.tensor_times[1].done_s, (10 + 40) * kMsS, 1e-6);
  EXPECT_NEAR(p.tensor_times[2].done_s, (10 + 60) * kMsS, 1e-6);
  EXPECT_NEAR(p.step_s, (10 + 60) * kMsS, 1e-6);
}

// Two layers: L0 (50 ms forward) owns g_first (1,000 bytes, owned by worker 1), L1 (10 ms) owns
// g_last (100,000 bytes, owned by worker 0), ready first. From the backward pass's start b:
//   1->0: worker 1 pushes g_last                     b+0   .. b+100
//   0->1: worker 0 pushes g_first                    b+1   .. b+2
//   1->0: worker 1's sum of g_first, behind the push b+100 .. b+101  (g_first done everywhere)
//   0->1: worker 0's sum of g_last                   b+100 .. b+200  (g_last done everywhere)
// Crossing: the step returns at b+1; L0 waits for g_first's update (b+101) and runs to b+151, L1
// waits for g_last's (b+200) and runs to b+210: 210 ms per step, 100 + 49 ms at the gates.
// Without crossing the step returns at b+200, then 60 ms of forward: 260 ms.
TEST(CrossingTheBarrierWaitsOnlyForEachLayersUpdate) {
  StepProfile profile;
  profile.layers = {{"L0", 50 * kMs, 0}, {"L1", 10 * kMs, 0}};
  profile.backward_ns = 1 * kMs;
  profile.tensors = {Tensor(NameOwnedBy("g_last", 0, 2), 100'000, 1, 1, 0),
                     Tensor(NameOwnedBy("g_first", 1, 2), 1'000, 2, 0, 1 * kMs)};
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = true;
  const StepPrediction cross = Run(profile, SlowNetwork(2), runtime);
  EXPECT_NEAR(cross.step_s, 210 * kMsS, 1e-6);
  EXPECT_NEAR(cross.gate_wait_s, 149 * kMsS, 1e-6);
  runtime.cross_barrier = false;
  const StepPrediction sync = Run(profile, SlowNetwork(2), runtime);
  EXPECT_NEAR(sync.step_s, 260 * kMsS, 1e-6);
  EXPECT_NEAR(sync.gate_wait_s, 0.0, 1e-12);
}

// Three workers; the other two push a 100,000-byte tensor to its owner at once. With ingress
// limits they share the owner's NIC (200 ms); egress-only links take 100 ms. The owner then sends
// the sum to both through its egress: 200 ms.
TEST(IngressLimitSlowsAnIncast) {
  StepProfile profile;
  profile.layers = {{"only", 10 * kMs, 0}};
  profile.tensors = {Tensor("grad/incast", 100'000, 1, 0, 0)};
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "fifo";
  runtime.cross_barrier = false;
  NetworkModel network = SlowNetwork(3);
  EXPECT_NEAR(Run(profile, network, runtime).step_s, (10 + 200 + 200) * kMsS, 1e-6);
  network.ingress_limited = false;
  EXPECT_NEAR(Run(profile, network, runtime).step_s, (10 + 100 + 200) * kMsS, 1e-6);
}

// mwms on three workers: 90,000 bytes of gradients in 3 chunks of 30,000; 2(N-1) = 4 rounds of
// 30 ms after the backward pass (10 ms forward + 1 ms backward), then the update (5 ms).
TEST(MwmsRingAllReduceAfterTheBackwardPass) {
  StepProfile profile;
  profile.layers = {{"only", 10 * kMs, 0}};
  profile.backward_ns = 1 * kMs;
  profile.tensors = {Tensor("grad/a", 60'000, 2, 0, 0), Tensor("grad/b", 30'000, 1, 0, 1 * kMs)};
  profile.tensors[0].apply_ns = 5 * kMs;
  RuntimeModel runtime;
  runtime.schedule = "mwms";
  const StepPrediction p = Run(profile, SlowNetwork(3), runtime);
  EXPECT_NEAR(p.step_s, (10 + 1 + 120 + 5) * kMsS, 1e-6);
  EXPECT_NEAR(p.tensor_times[0].done_s, (10 + 1 + 120) * kMsS, 1e-6);
  EXPECT_NEAR(p.tensor_times[0].applied_s, (10 + 1 + 120 + 5) * kMsS, 1e-6);
  // Subdivisions: chunks of at most 10,000 bytes would need 3 per worker; at most 2 are allowed,
  // so 6 chunks of 15,000 bytes: the same bytes per round, the same time.
  runtime.ring_chunk_bytes = 10'000;
  EXPECT_NEAR(Run(profile, SlowNetwork(3), runtime).step_s, (10 + 1 + 120 + 5) * kMsS, 1e-6);
}

TEST(ProphetPlansAfterItsProfileAndFinishes) {
  // A stepwise backward pass over 8 layers; the prophet policy must plan (it needs a warm-up
  // step, a profiled step and a bandwidth sample) and every schedule must finish every step.
  StepProfile profile;
  for (int i = 0; i < 8; ++i) profile.layers.push_back({"L" + std::to_string(i), 5 * kMs, 10 * kMs});
  profile.backward_ns = 80 * kMs;
  for (int i = 0; i < 8; ++i) {
    // Layer 7 is ready first; stage gaps of 10 ms.
    profile.tensors.push_back(Tensor("grad/L" + std::to_string(i), 400'000, 8 - i, i, (7 - i) * 10 * kMs));
  }
  NetworkModel network = SlowNetwork(2);
  network.link_Bps = 20e6;
  RuntimeModel runtime;
  runtime.partition_bytes = 100'000;
  runtime.schedule = "prophet";
  const StepPrediction p = Run(profile, network, runtime);
  EXPECT_TRUE(p.policy.find("blocks") != std::string::npos);
  EXPECT_TRUE(p.step_s > 0.12);  // at least the compute: 8 x (5 + 10) ms
  for (const char* schedule : {"fifo", "priority"}) {
    runtime.schedule = schedule;
    EXPECT_TRUE(Run(profile, network, runtime).step_s > 0.12);
  }
}

TEST(CompressedGradientsTravelInHalfTheBytes) {
  // OneTensor's gradient as bf16: the push and the sum carry 50,000 bytes each (50 ms), so every
  // step takes 10 + 50 + 50 ms; worker 0 sends 50,000 bytes per step.
  StepProfile profile = OneTensor();
  profile.tensors.push_back(Tensor("metrics/loss", 8, kControlPriority, -1, 0));
  profile.tensors.push_back(Tensor("grad/half", 100, 0, 0, 0));
  profile.tensors.back().element_size = 2;  // float16 already travels in 16 bits
  CompressGradients(Encoding::kBFloat16, &profile);
  EXPECT_TRUE(profile.tensors[0].encoding == Encoding::kBFloat16);
  EXPECT_TRUE(profile.tensors[1].encoding == Encoding::kNone);  // control: exact
  EXPECT_TRUE(profile.tensors[2].encoding == Encoding::kNone);
  profile.tensors.resize(1);
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  const StepPrediction p = Run(profile, SlowNetwork(2), runtime);
  EXPECT_NEAR(p.step_s, 110 * kMsS, 1e-6);
  EXPECT_NEAR(p.wire_bytes_per_step, 50'000, 1e-6);
  EXPECT_NEAR(p.comm_s, 50 * kMsS, 1e-6);
  CompressGradients(Encoding::kNone, &profile);
  EXPECT_NEAR(Run(profile, SlowNetwork(2), runtime).step_s, 210 * kMsS, 1e-6);
}

TEST(SyntheticTimelineHasTheRuntimesTracks) {
  const std::string path = "/tmp/prophet_simulator_test_{rank}.json";
  SimulationOptions options;
  options.timeline_path = path;
  options.steps = 2;
  options.warmup_steps = 1;
  RuntimeModel runtime;
  runtime.schedule = "priority";
  Run(OneTensor(), SlowNetwork(2), runtime, options);
  for (int rank = 0; rank < 2; ++rank) {
    std::ifstream in("/tmp/prophet_simulator_test_" + std::to_string(rank) + ".json");
    std::stringstream text;
    text << in.rdbuf();
    const std::string trace = text.str();
    EXPECT_TRUE(trace.find("predicted worker " + std::to_string(rank)) != std::string::npos);
    for (const char* track : {"\"step\"", "\"forward\"", "\"ready\"", "\"op\"", "\"gate\""}) {
      EXPECT_TRUE(trace.find(track) != std::string::npos);
    }
    EXPECT_TRUE(trace.rfind("]}") != std::string::npos);
    std::remove(("/tmp/prophet_simulator_test_" + std::to_string(rank) + ".json").c_str());
  }
}

// Twelve layers of varied sizes and backward times (found by a random search over such models);
// `ms` scales every compute time. With a credit of 1 MiB, four or more workers running prophet
// stopped for good: each worker's credit held pushes whose sums needed pushes the other workers'
// plans held back (every worker pushes different bytes per tensor, so plans differ), while those
// workers' credit held pushes this worker held back.
StepProfile TwelveVariedLayers(double ms) {
  const uint64_t kKiB = 1024;
  const uint64_t bytes[12] = {2048 * kKiB, 2048 * kKiB, 64 * kKiB,   1024 * kKiB, 4096 * kKiB, 2048 * kKiB,
                              2048 * kKiB, 1024 * kKiB, 2048 * kKiB, 1024 * kKiB, 4096 * kKiB, 256 * kKiB};
  const int backward_units[12] = {4, 1, 2, 1, 1, 4, 2, 4, 4, 4, 1, 2};  // x ms
  StepProfile profile;
  int64_t ready[12];
  int64_t t = 0;
  for (int i = 11; i >= 0; --i) {  // the backward pass runs from the last layer to the first
    t += static_cast<int64_t>(backward_units[i] * ms * kMs);
    ready[i] = t;
  }
  for (int i = 0; i < 12; ++i) {
    const int64_t backward = static_cast<int64_t>(backward_units[i] * ms * kMs);
    profile.layers.push_back({"L" + std::to_string(i), backward / 2, backward});
    profile.tensors.push_back(Tensor("grad/L" + std::to_string(i) + "/k", bytes[i], 12 - i, i, ready[i]));
  }
  profile.backward_ns = t;
  profile.tail_ns = kMs;
  profile.gap_ns = kMs;
  return profile;
}

TEST(ProphetDoesNotDeadlockWhenWorkersPlanApart) {
  NetworkModel network;
  network.link_Bps = 1e9 / 8;
  RuntimeModel runtime;
  runtime.schedule = "prophet";
  runtime.partition_bytes = 256 << 10;
  runtime.credit_bytes = 1 << 20;
  SimulationOptions options;
  options.warmup_steps = 4;
  options.steps = 6;
  // (compute scale, workers): each of these stalled for good before.
  const std::pair<double, int> settings[] = {{2.0, 4}, {10.0, 8}, {2.0, 8}};
  for (const auto& setting : settings) {
    network.workers = setting.second;
    StepPrediction p;
    const Status s = Simulate(TwelveVariedLayers(setting.first), network, runtime, options, &p);
    if (!s.ok()) std::fprintf(stderr, "%d workers, x%.0f: %s\n", setting.second, setting.first, s.message().c_str());
    EXPECT_TRUE(s.ok());
    EXPECT_TRUE(p.step_s > 0);
  }
}

// VGG16's shape on a slow device: the last layer's large gradient is ready first, then small
// ones 1.5 s apart (more than any pause a step of a fast device has), the first layer's last.
StepProfile LargeLastLayerThenSlowLayers() {
  StepProfile profile;
  const int kLayers = 6;
  int64_t t = 0;
  for (int i = kLayers - 1; i >= 0; --i) {
    profile.layers.insert(profile.layers.begin(), {"L" + std::to_string(i), 500 * kMs, 1500 * kMs});
    const uint64_t bytes = i == kLayers - 1 ? 4'000'000 : 64'000;
    profile.tensors.push_back(Tensor("grad/L" + std::to_string(i), bytes, kLayers - i, i, t));
    t += 1500 * kMs;
  }
  profile.backward_ns = t;
  return profile;
}

TEST(ProphetFollowsASlowBackwardPassWithPausesOfSeconds) {
  // Each step must stay one step to the profiler. When a pause split it, the tensors of each
  // later piece were a new profile every step, and what the earlier piece left queued was sent
  // before the more urgent gradients of the later one: 7.8% behind priority order here, where
  // the byte credit holds back most of the large gradient (the policy's order decides).
  NetworkModel network;
  network.workers = 4;
  network.link_Bps = 0.5e6;
  RuntimeModel runtime;
  runtime.partition_bytes = 64'000;
  runtime.credit_bytes = 128'000;
  SimulationOptions options;
  options.warmup_steps = 3;
  options.steps = 4;
  const StepProfile profile = LargeLastLayerThenSlowLayers();
  runtime.schedule = "prophet";
  const StepPrediction prophet = Run(profile, network, runtime, options);
  runtime.schedule = "priority";
  const StepPrediction priority = Run(profile, network, runtime, options);
  EXPECT_TRUE(prophet.policy.find("tensors changed") == std::string::npos);
  EXPECT_TRUE(prophet.step_s <= 1.01 * priority.step_s);
  EXPECT_TRUE(prophet.step_s > 11.9);  // at least the compute: 6 x (0.5 + 1.5) s
}

TEST(ProphetSendsCompressedGradientsInHalfTheBytes) {
  // Through the prophet policy (prophet_policy_test checks that it plans with the bytes that
  // travel): every push and sum carries half the bytes, and the steps get no longer.
  StepProfile profile = TwelveVariedLayers(2.0);
  NetworkModel network = SlowNetwork(2);
  network.link_Bps = 50e6;
  RuntimeModel runtime;
  runtime.partition_bytes = 256 << 10;
  runtime.schedule = "prophet";
  const StepPrediction plain = Run(profile, network, runtime);
  CompressGradients(Encoding::kFloat16, &profile);
  const StepPrediction half = Run(profile, network, runtime);
  EXPECT_NEAR(half.wire_bytes_per_step, plain.wire_bytes_per_step / 2, 1e-6);
  EXPECT_TRUE(half.step_s < plain.step_s);
}

// Two workers on one host: the push and the sum go over loopback (1 GB/s: 0.1 ms each), never
// over the (very slow) NIC.
TEST(WorkersOfOneHostTalkOverLoopback) {
  NetworkModel network = SlowNetwork(2);
  network.workers_per_host = 2;
  network.loopback_Bps = 1e9;
  const StepPrediction p = Run(OneTensor(), network, OwnerPath());
  EXPECT_NEAR(p.step_s, 10.2 * kMsS, 1e-9);
  EXPECT_NEAR(p.wire_bytes_per_step, 0, 1e-9);
}

// Four workers on two hosts, one tensor of 100,000 bytes (one partition), 1 MB/s NICs, loopback
// at 1 TB/s (0.1 us per frame). Flat: the owner's host takes three pushes through one ingress,
// two of them from the other host and one over loopback, and sends the sum to three peers, two
// of them through its egress: 10 + 200 + 200 ms. Two-level: each host's leader sums its host
// first, one push crosses the network (100 ms) and one sum comes back (100 ms).
TEST(TwoLevelPathCrossesTheNetworkOncePerHost) {
  NetworkModel network = SlowNetwork(4);
  network.workers_per_host = 2;
  network.loopback_Bps = 1e12;
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.hierarchical = Hierarchy::kOff;
  const StepPrediction flat = Run(OneTensor(), network, runtime);
  runtime.hierarchical = Hierarchy::kOn;
  const StepPrediction two_level = Run(OneTensor(), network, runtime);
  EXPECT_NEAR(two_level.step_s, 210.0 * kMsS, 0.001 * kMsS);
  EXPECT_NEAR(flat.step_s, 410.0 * kMsS, 0.001 * kMsS);
  // auto decides as the engine's probe does (hosts.h, ChooseTwoLevel): two hosts of two workers
  // take the two-level path here. It is the runtime's default, and so the model's.
  runtime.hierarchical = Hierarchy::kAuto;
  EXPECT_NEAR(Run(OneTensor(), network, runtime).step_s, 210.0 * kMsS, 0.001 * kMsS);
  {
    // Where loopback is the slow part (0.1 MB/s), the two-level path's local stages cost more
    // than the network saves: auto predicts the flat path.
    NetworkModel slow_loopback = network;
    slow_loopback.loopback_Bps = 1e5;
    RuntimeModel each = runtime;
    each.hierarchical = Hierarchy::kOff;
    const double off = Run(OneTensor(), slow_loopback, each).step_s;
    each.hierarchical = Hierarchy::kOn;
    const double on = Run(OneTensor(), slow_loopback, each).step_s;
    EXPECT_TRUE(!ChooseTwoLevel(on, off));
    EXPECT_NEAR(Run(OneTensor(), slow_loopback, runtime).step_s, off, 1e-12);
  }
  EXPECT_TRUE(RuntimeModel().hierarchical == Hierarchy::kAuto && EngineOptions().hierarchical == Hierarchy::kAuto);
  runtime.hierarchical = Hierarchy::kOn;
  runtime.schedule = "mwms";
  StepPrediction p;
  EXPECT_TRUE(!Simulate(OneTensor(), network, runtime, SimulationOptions(), &p).ok());
  runtime.hierarchical = Hierarchy::kAuto;  // auto keeps mwms's ring
  EXPECT_TRUE(Simulate(OneTensor(), network, runtime, SimulationOptions(), &p).ok());
  runtime.hierarchical = Hierarchy::kOn;
  network.workers = 5;  // not a multiple of 2
  runtime.schedule = "priority";
  const Status s = Simulate(OneTensor(), network, runtime, SimulationOptions(), &p);
  EXPECT_TRUE(!s.ok() && s.message().find("multiple of workers_per_host") != std::string::npos);
}

// N = 256 completes (no deadlock, within the event budget) for every schedule, flat and two-level,
// and no step beats the ideal bound: a small model, so that it takes a fraction of a second.
TEST(TwoHundredFiftySixWorkersFinishAboveTheIdealBound) {
  StepProfile profile = TwelveVariedLayers(1.0);
  for (ModelTensor& t : profile.tensors) t.bytes /= 64;  // 1 - 64 KiB: one partition, N-1 pushes each
  NetworkModel network;
  network.workers = 256;
  network.link_Bps = 100e9 / 8;
  network.latency_ns = 25'000;
  SimulationOptions options;
  options.warmup_steps = 3;
  options.steps = 2;
  for (int per_host : {1, 8}) {
    network.workers_per_host = per_host;
    IdealBound bound;
    EXPECT_TRUE(ComputeIdealBound(profile, network, &bound).ok());
    for (const char* schedule : {"prophet", "priority", "fifo", "mwms"}) {
      for (bool hierarchical : {false, true}) {
        if (hierarchical && (per_host == 1 || std::string(schedule) == "mwms")) continue;
        RuntimeModel runtime;
        runtime.schedule = schedule;
        runtime.hierarchical = hierarchical ? Hierarchy::kOn : Hierarchy::kOff;
        StepPrediction p;
        const Status s = Simulate(profile, network, runtime, options, &p);
        if (!s.ok()) std::fprintf(stderr, "%s, %d per host: %s\n", schedule, per_host, s.message().c_str());
        EXPECT_TRUE(s.ok());
        EXPECT_TRUE(p.step_s >= bound.step_s * (1 - 1e-9));
        EXPECT_TRUE(p.step_s < 100 * bound.step_s);  // sane: not stuck behind a lost event
      }
    }
  }
}

// A model with what makes round trips a poor measure of the link: 40 small biases (fused into
// small buckets), 8 kernels of 4 MiB and 32 of 256 KiB, and an exchanged control collective; a
// backward pass about as long as the link needs for the gradients (comm/comp about 1 at N = 2 and
// 1 Gbit/s).
StepProfile SmallBucketsAndLargeTensors() {
  const uint64_t kKiB = 1024;
  StepProfile profile;
  const int layers = 40;
  for (int i = 0; i < layers; ++i) {
    profile.layers.push_back({"L" + std::to_string(i), 3 * kMs, 7 * kMs});
    const int64_t ready = static_cast<int64_t>(layers - i) * 15 * kMs / 2;
    const uint64_t kernel = i % 5 == 0 ? 4096 * kKiB : 256 * kKiB;
    profile.tensors.push_back(Tensor("grad/L" + std::to_string(i) + "/kernel", kernel, 2 * (layers - i), i, ready));
    profile.tensors.push_back(Tensor("grad/L" + std::to_string(i) + "/bias", 4 * kKiB, 2 * (layers - i) - 1, i, ready));
  }
  profile.backward_ns = layers * 15 * kMs / 2;
  ModelTensor loss = Tensor("loss", 4, kControlPriority, -1, profile.backward_ns);
  profile.tensors.push_back(loss);
  profile.tail_ns = kMs;
  profile.gap_ns = kMs;
  return profile;
}

// The runtime's bandwidth estimate is the link's payload rate (bandwidth.h: what the NIC sent
// while a socket was full), with fusion's small buckets, large tensors, an exchanged control
// collective, N = 2 to 16, and long fat links; and it holds still from step to step (no swing for
// the planner to follow). Round trips measured 3-40% of the link on such runs. Not here: a link
// so fast for its N that no socket ever fills (N = 8 at 10 Gbit/s: 1.5 MB per socket holds every
// push), where the estimate stays the round trips' goodput (bandwidth.h).
TEST(TheBandwidthEstimateIsTheLinksPayloadRate) {
  struct Setting {
    int workers;
    double link_bps;
    int64_t latency_ns;
  };
  for (const Setting& setting : {Setting{2, 1e9, 0}, Setting{8, 1e9, 0}, Setting{2, 1e9, 50'000},
                                 Setting{2, 10e9, 20 * kMs}, Setting{8, 2.5e9, 20 * kMs}, Setting{16, 1e9, 0}}) {
    NetworkModel network;
    network.workers = setting.workers;
    network.link_Bps = setting.link_bps / 8;
    network.latency_ns = setting.latency_ns;
    RuntimeModel runtime;
    runtime.fusion_bytes = kFusionAuto;
    SimulationOptions options;
    options.warmup_steps = 5;
    options.steps = 10;
    const StepPrediction p = Run(SmallBucketsAndLargeTensors(), network, runtime, options);
    const double link_Bps = network.link_Bps * network.payload_efficiency;
    double low = p.bandwidth_Bps, high = p.bandwidth_Bps;
    for (double b : p.bandwidth_samples_Bps) {
      low = std::min(low, b);
      high = std::max(high, b);
    }
    std::printf("N=%d, %.1f Gbit/s, latency %.2f ms: estimate %.1f MB/s (steps %.1f..%.1f), link %.1f MB/s; %s\n",
                setting.workers, setting.link_bps / 1e9, static_cast<double>(setting.latency_ns) / 1e6,
                p.bandwidth_Bps / 1e6, low / 1e6, high / 1e6, link_Bps / 1e6, p.policy.c_str());
    EXPECT_EQ(p.bandwidth_samples_Bps.size(), static_cast<size_t>(options.steps));
    EXPECT_NEAR(p.bandwidth_Bps / link_Bps, 1.0, 0.15);
    EXPECT_TRUE(high <= 1.1 * low);
  }
}

// By exchange (small_allreduce.h) two workers send their 100,000 bytes to each other at once:
// 100 ms instead of a push and a sum (200 ms). With a per-message cost (1 ms to send, 2 ms to
// receive a frame on the worker's I/O thread) each frame on the way costs 3 ms more: the exchange
// has one frame on its way, the owner path two.
TEST(SmallTensorByExchangeAndThePerMessageCost) {
  StepProfile control = OneTensor();  // a control collective (only those go by exchange)
  control.tensors[0].priority = kControlPriority;
  control.tensors[0].layer = -1;
  RuntimeModel exchange;
  exchange.schedule = "priority";
  exchange.cross_barrier = false;
  exchange.small_allreduce = EngineOptions::kSmallAllreduceAuto;
  RuntimeModel owners = exchange;
  owners.small_allreduce = EngineOptions::kSmallAllreduceNever;
  NetworkModel network = SlowNetwork(2);
  EXPECT_NEAR(Run(control, network, exchange).step_s, 110 * kMsS, 1e-6);
  EXPECT_NEAR(Run(control, network, exchange).wire_bytes_per_step, 100'000, 1e-6);
  // Worker 0 owns no push here: the exchange's stages are what measure its link, as in the engine.
  EXPECT_TRUE(Run(control, network, exchange).bandwidth_Bps > 0);
  EXPECT_NEAR(Run(control, network, owners).step_s, 210 * kMsS, 1e-6);
  EXPECT_NEAR(Run(OneTensor(), network, exchange).step_s, 210 * kMsS, 1e-6);  // a gradient: by owners
  network.message_send_ns = 1 * kMs;
  network.message_receive_ns = 2 * kMs;
  EXPECT_NEAR(Run(control, network, exchange).step_s, 113 * kMsS, 1e-6);
  EXPECT_NEAR(Run(control, network, owners).step_s, 216 * kMsS, 1e-6);
}

// Worker 0's frames per step: log2(N) per small tensor by exchange where the engine's rule takes
// it (a folded rank of a non-power-of-two N sends 1; at N = 6 the rule keeps the owners), against N-1 sums for the tensors it owns and one push for the
// others by owners. The step with a per-message cost: the exchange's log2(N) stages beat the
// owner's 2(N-1) frames at N = 16 for one control collective. (Several small tensors at once,
// owned by different workers, spread the owners' frames; fusion packs those.)
TEST(ExchangeSendsLog2NMessagesPerWorker) {
  StepProfile profile;
  profile.layers = {{"only", 1 * kMs, 0}};
  profile.backward_ns = 1 * kMs;
  const int kTensors = 6;
  for (int i = 0; i < kTensors; ++i)
    profile.tensors.push_back(Tensor("small/" + std::to_string(i), 64, kControlPriority + i, -1, 0));
  profile.tensors.push_back(Tensor("metrics/loss", 8, kControlPriority, -1, 0));
  for (int n : {2, 6, 8, 16}) {
    NetworkModel network;
    network.workers = n;
    network.link_Bps = 1.25e9;
    RuntimeModel exchange;
    exchange.schedule = "priority";
    exchange.cross_barrier = false;  // every frame of a step inside it
    exchange.small_allreduce = EngineOptions::kSmallAllreduceAuto;
    RuntimeModel owners = exchange;
    owners.small_allreduce = EngineOptions::kSmallAllreduceNever;
    int sends = 0;
    for (const ExchangeStep& step : ExchangePlan(0, n)) sends += step.send_to >= 0;
    double owned_frames = 0, chosen_frames = 0;
    for (const ModelTensor& t : profile.tensors) {
      const uint64_t partition_bytes = ResolvePartitionBytes(EngineOptions().partition_bytes, "prophet");
      const int by_owner = MakePartitions(t.name, t.bytes, 4, n, partition_bytes)[0].owner == 0 ? n - 1 : 1;
      owned_frames += by_owner;
      // The engine's rule: by exchange at 2, 8 and 16 workers, by owners at 6.
      const bool exchanged = SmallAllreduceApplies(t.bytes, n, partition_bytes, Encoding::kNone);
      EXPECT_TRUE(exchanged == (n != 6));
      chosen_frames += exchanged ? sends : by_owner;
    }
    const StepPrediction by_exchange = Run(profile, network, exchange);
    const StepPrediction by_owners = Run(profile, network, owners);
    std::printf("N=%d: worker 0 sends %.0f frames per step by the engine's choice, %.0f by owners\n", n,
                by_exchange.messages_per_step, by_owners.messages_per_step);
    EXPECT_NEAR(by_exchange.messages_per_step, chosen_frames, 1e-9);
    if (n != 6) EXPECT_NEAR(by_exchange.messages_per_step, (kTensors + 1) * sends, 1e-9);
    EXPECT_NEAR(by_owners.messages_per_step, owned_frames, 1e-9);
    if (n == 16) {
      // One control collective right after the forward pass (nothing to hide it behind).
      StepProfile loss;
      loss.layers = {{"only", 1 * kMs, 0}};
      loss.tensors = {Tensor("metrics/loss", 8, kControlPriority, -1, 0)};
      const double plain_s = Run(loss, network, owners).step_s;
      network.message_send_ns = 10'000;
      network.message_receive_ns = 10'000;
      const double exchange_s = Run(loss, network, exchange).step_s, owners_s = Run(loss, network, owners).step_s;
      std::printf("N=16 with 10+10 us per frame: %.3f ms by exchange, %.3f ms by owners\n", exchange_s * 1e3,
                  owners_s * 1e3);
      EXPECT_TRUE(exchange_s < owners_s);
      EXPECT_TRUE(owners_s > plain_s);
    }
  }
}

// The CPU charged per byte on the I/O threads (NetworkModel's byte costs), one 100,000-byte tensor
// on two workers over 1 MB/s links (210 ms per step free: a push and its sum of 100 ms each):
//  - receiving at 2 us per byte, twice the link's time: the thread started on each frame when its
//    first byte could be in, so each of the two transfers ends 100 ms after its last byte: 410 ms;
//  - adding the push into the sum at 2 us per byte: only the owner's push pays it: 310 ms;
//  - sending at 3 us per byte: each frame leaves (3 - 1) us x 100,000 later: 610 ms;
//  - receiving at 0.5 us per byte, faster than the link: the thread keeps pace and has one
//    receive's worth (64 KiB) left after the last byte of each frame: 210 + 2 x 32.768 ms.
// The I/O thread's busy time per step is what worker 0 received (or sent) times the cost.
TEST(CpuPerByteLengthensTheStepByWhatTheThreadCannotHide) {
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  const NetworkModel base = SlowNetwork(2);
  EXPECT_NEAR(Run(OneTensor(), base, runtime).step_s, 210 * kMsS, 1e-6);
  EXPECT_NEAR(Run(OneTensor(), base, runtime).io_busy_s, 0.0, 1e-12);
  NetworkModel receive = base;
  receive.receive_byte_ns = 2000;
  EXPECT_NEAR(Run(OneTensor(), receive, runtime).step_s, 410 * kMsS, 1e-6);
  EXPECT_NEAR(Run(OneTensor(), receive, runtime).io_busy_s, 200 * kMsS, 1e-6);
  NetworkModel sum = base;
  sum.sum_byte_ns = 2000;
  EXPECT_NEAR(Run(OneTensor(), sum, runtime).step_s, 310 * kMsS, 1e-6);
  NetworkModel send = base;
  send.send_byte_ns = 3000;
  EXPECT_NEAR(Run(OneTensor(), send, runtime).step_s, 610 * kMsS, 1e-6);
  EXPECT_NEAR(Run(OneTensor(), send, runtime).io_busy_s, 300 * kMsS, 1e-6);
  NetworkModel fast = base;
  fast.receive_byte_ns = 500;
  EXPECT_NEAR(Run(OneTensor(), fast, runtime).step_s, 210 * kMsS + 2 * 65536 * 500e-9, 1e-6);
  // A message cost on top adds its 1 + 2 ms per frame on the way (two frames).
  fast.message_send_ns = 1 * kMs;
  fast.message_receive_ns = 2 * kMs;
  EXPECT_NEAR(Run(OneTensor(), fast, runtime).step_s, 216 * kMsS + 2 * 65536 * 500e-9, 1e-6);
}

// Compressed (fp16): every frame carries 50,000 bytes (50 ms on the link), and the values are
// converted at 1 us per float32 byte: the push encoded before it is written (100 ms), decoded at
// the owner as it arrives (100 ms of work from its first byte: 50 ms after the last), the sum
// encoded once (100 ms) and decoded at the other worker (50 ms after the last byte again):
// 10 + 100 + 50 + 50 + 100 + 50 + 50 = 410 ms.
TEST(CompressionChargesItsConversions) {
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  StepProfile profile = OneTensor();
  CompressGradients(Encoding::kFloat16, &profile);
  NetworkModel network = SlowNetwork(2);
  EXPECT_NEAR(Run(profile, network, runtime).step_s, 110 * kMsS, 1e-6);
  network.cast_byte_ns = 1000;
  EXPECT_NEAR(Run(profile, network, runtime).step_s, 410 * kMsS, 1e-6);
}

// Shared cores (the replay's workers on one machine): four workers whose pushes to one owner each
// cost 10 ms to send. With a core each they send at once; on one shared core one after another.
TEST(SharedCoresSerialiseTheWorkersThreads) {
  StepProfile profile;
  profile.layers = {{"dense", 10 * kMs, 0}};
  profile.tensors = {Tensor(NameOwnedBy("t", 0, 4), 100, 1, 0, 0)};
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  NetworkModel network = SlowNetwork(4);
  network.link_Bps = 1e9;
  const double free_s = Run(profile, network, runtime).step_s;
  network.message_send_ns = 10 * kMs;
  const double own_s = Run(profile, network, runtime).step_s;
  network.shared_cores = 1;
  const double shared_s = Run(profile, network, runtime).step_s;
  // Own cores: the three pushes in parallel (10 ms), then the owner's three sums one after the
  // other on its thread (30 ms). One core: the pushes one after the other (30 ms), then the sums.
  EXPECT_NEAR(own_s - free_s, 40 * kMsS, 0.2 * kMsS);
  EXPECT_NEAR(shared_s - free_s, 60 * kMsS, 0.2 * kMsS);
}

TEST(SharedCoresAlsoRunTheUpdates) {
  // Two workers whose update takes 100 ms of CPU: on cores of their own both update at once; on
  // one shared core one update waits for the other, and the step is 100 ms longer.
  StepProfile profile;
  profile.layers = {{"dense", 10 * kMs, 0}};
  ModelTensor t = Tensor(NameOwnedBy("t", 0, 2), 100, 1, 0, 0);
  t.apply_ns = 100 * kMs;
  profile.tensors = {t};
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  NetworkModel network = SlowNetwork(2);
  network.link_Bps = 1e9;
  const double own_s = Run(profile, network, runtime).step_s;
  network.shared_cores = 1;
  const double shared_s = Run(profile, network, runtime).step_s;
  EXPECT_NEAR(shared_s - own_s, 100 * kMsS, 0.2 * kMsS);
  network.shared_cores = 2;
  EXPECT_NEAR(Run(profile, network, runtime).step_s, own_s, 0.2 * kMsS);
}

// Several I/O threads per worker (lanes, as the engine routes them): a push_pull of at least
// io_threads x 256 KiB travels in slices, one per lane, so its frames' CPU (10 ns per byte received,
// far slower than the link) is shared by the threads; a smaller tensor travels whole on one lane,
// and a second thread changes nothing for it.
TEST(IoThreadsShareAWorkersCpuWork) {
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.cross_barrier = false;
  runtime.partition_bytes = 1u << 20;
  NetworkModel network = SlowNetwork(2);
  network.link_Bps = 10e9;
  network.receive_byte_ns = 10;
  auto step_s = [&](uint64_t bytes, int threads) {
    StepProfile profile;
    profile.layers = {{"dense", 10 * kMs, 0}};
    profile.tensors = {Tensor("grad/dense", bytes, 1, 0, 0)};
    network.io_threads = threads;
    return Run(profile, network, runtime).step_s;
  };
  const double sliced_one = step_s(8u << 20, 1), sliced_two = step_s(8u << 20, 2);
  const double whole_one = step_s(256u << 10, 1), whole_two = step_s(256u << 10, 2);
  std::printf("8 MiB: %.1f ms on one thread, %.1f on two; 256 KiB: %.1f, %.1f\n", sliced_one * 1e3, sliced_two * 1e3,
              whole_one * 1e3, whole_two * 1e3);
  // 8 MiB: 4 MiB of pushes and 4 MiB of sums received per worker, 84 ms of receiving on one
  // thread; two share it.
  EXPECT_TRUE(sliced_one - sliced_two > 30 * kMsS);
  EXPECT_NEAR(whole_one, whole_two, 1e-9);
  network.io_threads = 0;
  StepPrediction p;
  StepProfile profile;
  profile.layers = {{"dense", 10 * kMs, 0}};
  profile.tensors = {Tensor("grad/dense", 100, 1, 0, 0)};
  const Status s = Simulate(profile, network, runtime, SimulationOptions(), &p);
  EXPECT_TRUE(!s.ok() && s.message().find("io_threads") != std::string::npos);
}

// A 3 MiB gradient of one layer, and how MakePartitions cuts it among `owners` (at 4 MiB
// partitions): whole, and as two lanes' halves cut on their own.
constexpr uint64_t kSlicedBytes = 3u << 20;
StepProfile SlicedProfile() {
  StepProfile profile;
  profile.layers = {{"dense", 10 * kMs, 0}};
  profile.tensors = {Tensor("grad/dense", kSlicedBytes, 1, 0, 0)};
  return profile;
}
size_t WholePartitions(int owners) { return MakePartitions("grad/dense", kSlicedBytes, 4, owners, 4u << 20).size(); }
size_t SlicedPartitions(int owners) {
  return 2 * MakePartitions("grad/dense", kSlicedBytes / 2, 4, owners, 4u << 20).size();
}

// With lanes, each lane's slice is cut on its own, as the engine cuts it (Engine::SubmitSliced,
// then PushPull): 3 MiB over 2 workers on 2 lanes is two slices of 1.5 MiB, each cut into 12
// partitions of 128 KiB, where the whole tensor would be cut into 16.
TEST(EachLanesSliceIsCutAsTheEngineCutsIt) {
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.partition_bytes = 4u << 20;
  NetworkModel network = SlowNetwork(2);
  network.link_Bps = 10e9;
  const StepProfile profile = SlicedProfile();
  const size_t sliced = SlicedPartitions(2), whole = WholePartitions(2);
  EXPECT_EQ(sliced, 24u);
  EXPECT_EQ(whole, 16u);
  for (const int lanes : {1, 2}) {
    network.io_threads = lanes;
    const StepPrediction p = Run(profile, network, runtime);
    // Each worker pushes the partitions it does not own and sends back the sums of those it
    // owns: one frame per partition with 2 workers.
    std::printf("%d lane(s): %.1f messages per worker and step\n", lanes, p.messages_per_step);
    EXPECT_NEAR(p.messages_per_step, lanes == 1 ? whole : sliced, 0.5);
  }
}

// On the two-level path too (TwoLevelPushPull on each lane): each slice is cut for the hosts on
// its own. 2 hosts x 2 workers: every partition costs the same frames (pushes to the leaders,
// the host sum to the owner, the results and their forwarding), so the messages scale with the
// partition count: 2 slices of 1.5 MiB cut for 2 hosts against the whole 3 MiB.
TEST(OnTheTwoLevelPathEachLanesSliceIsCutForTheHosts) {
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.partition_bytes = 4u << 20;
  runtime.hierarchical = Hierarchy::kOn;
  NetworkModel network = SlowNetwork(4);
  network.workers_per_host = 2;
  network.loopback_Bps = 1e10;
  network.link_Bps = 10e9;
  const StepProfile profile = SlicedProfile();
  const size_t sliced = SlicedPartitions(2), whole = WholePartitions(2);  // for the 2 hosts
  EXPECT_TRUE(sliced != whole);
  network.io_threads = 1;
  const double one = Run(profile, network, runtime).messages_per_step;
  network.io_threads = 2;
  const double two = Run(profile, network, runtime).messages_per_step;
  std::printf("two-level: %.2f messages per worker and step on one lane (%zu partitions), %.2f on two (%zu)\n", one,
              whole, two, sliced);
  EXPECT_NEAR(two / one, static_cast<double>(sliced) / static_cast<double>(whole), 1e-9);
}

// Heartbeats (the engine's heartbeat_s): every heartbeat_s / 4 each lane of each worker sends a
// frame to every peer (Failures::Heartbeat). They add (N - 1) x lanes x 4 / heartbeat_s frames per
// second to each worker's messages, and their per-message CPU barely moves the step.
TEST(HeartbeatsAreFramesToEveryPeerOnEveryLane) {
  RuntimeModel runtime = OwnerPath();
  runtime.schedule = "priority";
  runtime.partition_bytes = 4u << 20;
  constexpr int kWorkers = 4;
  NetworkModel network = SlowNetwork(kWorkers);
  network.link_Bps = 10e9;
  network.message_send_ns = 20'000;
  network.message_receive_ns = 20'000;
  const StepProfile profile = SlicedProfile();
  SimulationOptions options;
  for (const int lanes : {1, 2}) {
    network.io_threads = lanes;
    runtime.heartbeat_ns = 0;
    const StepPrediction off = Run(profile, network, runtime, options);
    runtime.heartbeat_ns = static_cast<int64_t>(off.step_s * 1e9 * 1.5);  // beats every 3/8 of a step
    const StepPrediction on = Run(profile, network, runtime, options);
    const double beats = (kWorkers - 1) * lanes * 4 * on.step_s / (static_cast<double>(runtime.heartbeat_ns) / 1e9);
    std::printf("%d lane(s): %.2f messages per worker and step without heartbeats, %.2f with (%.2f beats expected); "
                "step %.3f / %.3f ms\n",
                lanes, off.messages_per_step, on.messages_per_step, beats, off.step_s * 1e3, on.step_s * 1e3);
    // Whole periods fall into the measured steps: at most one period's frames more or fewer.
    EXPECT_NEAR(on.messages_per_step - off.messages_per_step, beats,
                (kWorkers - 1) * lanes / static_cast<double>(options.steps) + 1e-9);
    EXPECT_NEAR(on.step_s / off.step_s, 1.0, 0.05);
  }
}

TEST(BadInputIsRejectedWithTheReason) {
  StepPrediction p;
  RuntimeModel runtime;
  NetworkModel network = SlowNetwork(2);
  StepProfile profile = OneTensor();
  profile.tensors[0].bytes = 10;
  profile.tensors[0].element_size = 4;
  Status s = Simulate(profile, network, runtime, SimulationOptions(), &p);
  EXPECT_TRUE(!s.ok() && s.message().find("multiple of its element size") != std::string::npos);
  runtime.schedule = "lifo";
  s = Simulate(OneTensor(), network, runtime, SimulationOptions(), &p);
  EXPECT_TRUE(!s.ok() && s.message().find("lifo") != std::string::npos);
  runtime.schedule = "priority";
  network.link_Bps = 0;
  s = Simulate(OneTensor(), network, runtime, SimulationOptions(), &p);
  EXPECT_TRUE(!s.ok() && s.message().find("link rate") != std::string::npos);
  network = SlowNetwork(2);
  profile = OneTensor();
  profile.tensors[0].element_size = 2;
  profile.tensors[0].encoding = Encoding::kFloat16;
  s = Simulate(profile, network, runtime, SimulationOptions(), &p);
  EXPECT_TRUE(!s.ok() && s.message().find("encodes float32") != std::string::npos);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
