// The replay worker (replay.h): real engines in one process over loopback, every element of every
// sum checked against the exact sum, the step's shape on the virtual clock, and the counters.
#include <cmath>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/engine_testing.h"
#include "ops/core/scheduler.h"
#include "ops/core/testing.h"
#include "ops/replay/replay.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1000000;

// Three layers: a 1.5 MiB first-layer gradient (cut into partitions, ready last), small ones that
// fuse, a float64 control collective the step waits for.
StepProfile SmallModel() {
  StepProfile p;
  for (int i = 0; i < 3; ++i) {
    ModelLayer l;
    l.name = "layer" + std::to_string(i);
    l.forward_ns = 2 * kMs;
    l.backward_ns = 4 * kMs;
    p.layers.push_back(l);
  }
  const uint64_t bytes[] = {1536 * 1024, 40 * 1024, 12 * 1024, 4 * 1024};
  const int layer[] = {0, 1, 2, 2};
  const int64_t ready[] = {12 * kMs, 8 * kMs, 4 * kMs, 4 * kMs};
  for (int i = 0; i < 4; ++i) {
    ModelTensor t;
    t.name = "grad/" + std::to_string(i);
    t.bytes = bytes[i];
    t.priority = 4 - i;
    t.layer = layer[i];
    t.ready_ns = ready[i];
    t.apply_ns = i == 0 ? 1 * kMs : 0;
    p.tensors.push_back(t);
  }
  ModelTensor loss;
  loss.name = "loss";
  loss.bytes = 16;
  loss.element_size = 8;
  loss.priority = kControlPriority;
  loss.ready_ns = 12 * kMs;
  p.tensors.push_back(loss);
  p.launch_ns = 1 * kMs;
  p.backward_ns = 12 * kMs;
  p.tail_ns = 1 * kMs;
  p.gap_ns = 1 * kMs;
  return p;
}

std::vector<ReplayResult> RunJob(int n, const std::string& schedule, double link_Bps, Status* failed,
                                 bool check_all = true, const std::function<void(ReplayConfig*)>& tweak = {}) {
  std::vector<EngineOptions> engines = testing::ClusterOptions(n, 30.0, "replay-test");
  std::vector<ReplayConfig> configs(n);
  std::vector<ReplayResult> results(n);
  std::vector<Status> statuses(n);
  for (int r = 0; r < n; ++r) {
    configs[r].engine = engines[r];
    configs[r].engine.schedule = schedule;
    configs[r].engine.heartbeat_s = 1.0;
    configs[r].profile = SmallModel();
    configs[r].link_Bps = link_Bps;
    configs[r].warmup_steps = 2;
    configs[r].steps = 3;
    configs[r].check_all = check_all;
    if (tweak) tweak(&configs[r]);
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { statuses[r] = RunReplay(configs[r], &results[r]); });
  for (std::thread& t : threads) t.join();
  *failed = Status::OK();
  for (const Status& s : statuses)
    if (!s.ok() && failed->ok()) *failed = s;
  return results;
}

void ExpectGoodRun(const std::vector<ReplayResult>& results, const StepProfile& profile, bool check_all = true) {
  const double compute_s = static_cast<double>(profile.launch_ns + 6 * kMs + profile.backward_ns + profile.tail_ns +
                                               profile.gap_ns) / 1e9;
  for (const ReplayResult& r : results) {
    EXPECT_EQ(r.periods_s.size(), static_cast<size_t>(3));
    // The virtual clock plays the profile: no step is shorter than the compute.
    for (double p : r.periods_s) EXPECT_TRUE(p >= compute_s - 1e-6);
    EXPECT_EQ(r.connections, r.world_size - 1);
    EXPECT_EQ(r.ops_failed, static_cast<uint64_t>(0));
    EXPECT_TRUE(r.longest_op_s > 0);
    EXPECT_TRUE(r.frames_sent > 0 && r.frames_received > 0);
    EXPECT_TRUE(r.bytes_sent > 3 * 1536 * 1024 / 2);  // 3 steps of at least the large tensor's shares
    EXPECT_EQ(r.gradient_bytes, static_cast<uint64_t>((1536 + 40 + 12 + 4) * 1024));
    // Every element of every sum in the 5 steps (the probe's are not counted), or the sample:
    // 16 elements of each gradient, and the loss's 2 (3 samples: the first, the last, one more).
    const uint64_t elements = check_all ? (1536 + 40 + 12 + 4) * 1024 / 4 + 2 : 4 * 16 + 3;
    EXPECT_EQ(r.sums_checked, 5 * elements);
    EXPECT_TRUE(r.peak_rss_bytes > 0);
    EXPECT_TRUE(r.startup_s >= r.connect_s);
  }
}

TEST(SumsAreExactAndStepsFollowTheProfile) {
  for (const char* schedule : {"prophet", "priority", "fifo"}) {
    Status s;
    const std::vector<ReplayResult> results = RunJob(3, schedule, 1.25e9, &s);
    if (!s.ok()) FAIL(std::string(schedule) + ": " + s.message());
    ExpectGoodRun(results, SmallModel());
    // Fused: the small gradients share buckets of the size every worker computed alike.
    for (const ReplayResult& r : results) EXPECT_EQ(r.fusion_bucket_bytes, results[0].fusion_bucket_bytes);
    EXPECT_TRUE(results[0].fusion_bucket_bytes > 0);
  }
}

// Sampled checks run on the engine's thread as rounds complete (no applier in between).
TEST(SampledSumsAreCheckedAsRoundsComplete) {
  Status s;
  const std::vector<ReplayResult> results = RunJob(3, "prophet", 1.25e9, &s, false);
  if (!s.ok()) FAIL(s.message());
  ExpectGoodRun(results, SmallModel(), false);
}

TEST(TheProbeAgreesOnOneRateEverywhere) {
  Status s;
  const std::vector<ReplayResult> results = RunJob(4, "prophet", 0, &s);
  if (!s.ok()) FAIL(s.message());
  ExpectGoodRun(results, SmallModel());
  for (const ReplayResult& r : results) {
    EXPECT_TRUE(r.probe_measured_Bps > 0);
    EXPECT_TRUE(r.probe_agreed_Bps <= r.probe_measured_Bps);
    EXPECT_EQ(r.probe_agreed_Bps, results[0].probe_agreed_Bps);
    EXPECT_EQ(r.fusion_link_Bps, QuantizeLinkGbps(results[0].probe_agreed_Bps * 8 / 1e9) * 1e9 / 8);
  }
}

TEST(AScaledProbeMovesItsShareOfTheBytesUnlessFusionNeedsItsRate) {
  for (double link_Bps : {1.25e9, 0.0}) {
    Status s;
    const std::vector<ReplayResult> results = RunJob(3, "prophet", link_Bps, &s, true, [](ReplayConfig* c) {
      c->probe = true;
      c->probe_scale = 0.01;
    });
    if (!s.ok()) FAIL(s.message());
    ExpectGoodRun(results, SmallModel());
    // 4 MiB x 0.01 in whole float32 elements; fusion sized from the rate: the whole 4 MiB.
    for (const ReplayResult& r : results) {
      EXPECT_EQ(r.probe_bytes, link_Bps > 0 ? uint64_t{41944} : uint64_t{4} << 20);
      EXPECT_TRUE(r.probe_agreed_Bps > 0);
    }
  }
}

// hierarchical auto over hosts a, a, b: the probe times both paths and every worker keeps the
// same one (ChooseTwoLevel of the same gathered rounds); the sums stay exact on it.
TEST(UnderAutoTheProbeChoosesThePathAlike) {
  Status s;
  const std::vector<ReplayResult> results = RunJob(3, "prophet", 1.25e9, &s, true, [](ReplayConfig* c) {
    c->probe = true;
    c->probe_scale = 0.1;
    c->engine.hierarchical = Hierarchy::kAuto;
    c->engine.hosts = {"a", "a", "b"};
  });
  if (!s.ok()) FAIL(s.message());
  ExpectGoodRun(results, SmallModel());
  const ReplayResult& first = results.front();
  EXPECT_TRUE(first.probe_two_level == 0 || first.probe_two_level == 1);
  EXPECT_TRUE(first.probe_two_level_round_s > 0 && first.probe_flat_round_s > 0);
  EXPECT_EQ(first.probe_two_level == 1, ChooseTwoLevel(first.probe_two_level_round_s, first.probe_flat_round_s));
  for (const ReplayResult& r : results) {
    EXPECT_EQ(r.probe_two_level, first.probe_two_level);
    EXPECT_EQ(r.probe_flat_round_s, first.probe_flat_round_s);
  }
  EXPECT_TRUE(ChooseTwoLevel(0.010, 0.0099) && !ChooseTwoLevel(0.010, 0.009));
}

TEST(ScaledSizesAreTheScheduleSizesTimesTheScale) {
  EngineOptions o;
  o.world_size = 16;
  o.schedule = "prophet";
  ScaleRuntimeBytes(0.012, &o);   // partition and credit left automatic: the runtime's sizes
  EXPECT_EQ(o.partition_bytes, uint64_t{50332});            // 4 MiB x 0.012
  EXPECT_EQ(o.credit_bytes, uint64_t{754975});              // 15 peers x 4 MiB x 0.012
  EngineOptions set;
  set.world_size = 16;
  set.schedule = "prophet";
  set.partition_bytes = 1u << 20;
  set.credit_bytes = 64u << 20;
  ScaleRuntimeBytes(0.001, &set);
  EXPECT_EQ(set.partition_bytes, kMinScaledBytes);          // 1049 bytes: the floor
  EXPECT_EQ(set.credit_bytes, uint64_t{67109});
}

TEST(ExactSumsOfTheContributions) {
  for (int n : {1, 2, 7, 64, 4096}) {
    for (int t : {0, 5}) {
      for (uint64_t i : {uint64_t{0}, uint64_t{12}, uint64_t{1} << 33}) {
        double sum = 0;
        for (int r = 0; r < n; ++r) sum += static_cast<double>(static_cast<float>(ReplayValue(r, t, i)));
        EXPECT_EQ(sum, ReplaySum(n, t, i));
        EXPECT_TRUE(ReplaySum(n, t, i) < 16777216.0);  // exact in float32
      }
    }
  }
}

TEST(TheProbeRoundsAsTheStrategyDoes) {
  // prophet_tf/_link_probe.py's quantize_gbps on the rates its documentation names.
  const double cases[][2] = {{0.96, 1}, {0.48, 0.5}, {2.35, 2}, {6.5, 5}, {7.9, 10}, {10.0, 10},
                             {0.05, 0.1}, {0.14, 0.2}, {0.69, 0.5}, {70, 100}};
  for (const auto& c : cases) EXPECT_EQ(QuantizeLinkGbps(c[0]), c[1]);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
