// Plans for synthetic ready-time traces, compared with plans computed by hand.
#include "ops/core/planner.h"

#include <algorithm>
#include <string>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;
constexpr uint64_t kMB = 1'000'000;

struct TraceTensor {
  const char* name;
  int64_t priority;
  uint64_t bytes;
  int64_t offset_ns;
};

// The profile the profiler would produce for a steady trace (offsets in ready order).
Profile ProfileOf(const std::vector<TraceTensor>& trace) {
  Profile profile;
  for (const TraceTensor& t : trace) {
    ProfiledTensor tensor;
    tensor.name = t.name;
    tensor.priority = t.priority;
    tensor.bytes = t.bytes;
    tensor.ready_offset_ns = t.offset_ns;
    profile.tensors.push_back(tensor);
  }
  DetectStages(ProfilerOptions(), &profile);
  profile.version = 1;
  return profile;
}

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ",") + name;
  return out;
}

// An 8-layer model: the backward pass produces L7 first; L0 (the first layer) is most urgent.
// Stage 0 = {L7, L6, L5} at 0-0.2 ms, stage 1 = {L4, L3} at 10 ms, stage 2 = {L2, L1, L0} at 20 ms.
std::vector<TraceTensor> ThreeStageTrace() {
  return {
      {"L7", 0, 4 * kMB, 0},          {"L6", 1, 2 * kMB, kMs / 10},
      {"L5", 2, 1 * kMB, 2 * kMs / 10}, {"L4", 3, 1 * kMB, 10 * kMs},
      {"L3", 4, 3 * kMB, 10 * kMs + kMs / 10}, {"L2", 5, 1 * kMB, 20 * kMs},
      {"L1", 6, 1 * kMB, 20 * kMs + kMs / 10}, {"L0", 7, 1 * kMB, 20 * kMs + 2 * kMs / 10},
  };
}

TEST(StagesOfThreeStageTrace) {
  const Profile profile = ProfileOf(ThreeStageTrace());
  // Mean gap = 20.2 ms / 7 = 2.89 ms; the two 9.8/9.9 ms gaps exceed twice that, 0.1 ms gaps don't.
  EXPECT_EQ(profile.stages.size(), 3u);
  if (profile.stages.size() != 3) return;
  EXPECT_EQ(profile.stages[0].members.size(), 3u);
  EXPECT_EQ(profile.stages[1].members.size(), 2u);
  EXPECT_EQ(profile.stages[2].members.size(), 3u);
  EXPECT_EQ(profile.stages[0].interval_ns, 10 * kMs);
  EXPECT_EQ(profile.stages[1].interval_ns, 10 * kMs);
  EXPECT_EQ(profile.stages[2].interval_ns, 0);
}

TEST(ThreeStagesExactBlocks) {
  // 350 MB/s x 10 ms = 3.5 MB per block.
  // Block 0 (ready: L7 4MB p0, L6 2MB p1, L5 1MB p2): L5 + L6 = 3 MB, L7 would make 7 MB.
  // Block 1 (ready and left: L3 3MB p4, L4 1MB p3, L7): L3 = 3 MB, L4 would make 4 MB.
  // Stage 2 holds L0 (the first layer): L4, L7 and stage 2 go in the credit phase.
  const Plan plan = MakePlan(ProfileOf(ThreeStageTrace()), 350e6);
  EXPECT_EQ(plan.blocks.size(), 2u);
  if (plan.blocks.size() != 2) return;
  EXPECT_EQ(Join(plan.blocks[0].members), std::string("L5,L6"));
  EXPECT_EQ(Join(plan.blocks[1].members), std::string("L3"));
  EXPECT_EQ(plan.blocks[0].budget_bytes, 3'500'000u);
  EXPECT_EQ(plan.blocks[0].bytes, 3 * kMB);
  EXPECT_EQ(plan.blocks[1].bytes, 3 * kMB);
  EXPECT_EQ(plan.blocks[0].start_offset_ns, 0);
  EXPECT_EQ(plan.blocks[1].start_offset_ns, 10 * kMs);
  EXPECT_EQ(plan.top_tensor, std::string("L0"));
  EXPECT_EQ(plan.top_stage, 2);
  EXPECT_EQ(plan.BlockOf("L4"), -1);
  EXPECT_EQ(plan.BlockOf("L7"), -1);
  EXPECT_EQ(plan.BlockOf("L0"), -1);
  EXPECT_EQ(plan.BlockOf("L3"), 1);
}

TEST(FasterLinkTakesMorePerBlock) {
  // 800 MB/s x 10 ms = 8 MB: block 0 takes all of stage 0 (7 MB); block 1 takes L3 + L4 (4 MB).
  const Plan plan = MakePlan(ProfileOf(ThreeStageTrace()), 800e6);
  EXPECT_EQ(plan.blocks.size(), 2u);
  if (plan.blocks.size() != 2) return;
  EXPECT_EQ(Join(plan.blocks[0].members), std::string("L5,L6,L7"));
  EXPECT_EQ(Join(plan.blocks[1].members), std::string("L3,L4"));
}

TEST(TensorBiggerThanBudgetJoinsNoBlock) {
  // 100 MB/s x 10 ms = 1 MB per block. Stage 0's most urgent tensor (L5, 1MB) fits exactly. In
  // stage 1 the most urgent (L3, 3 MB) alone exceeds the budget: it is held for the credit phase
  // (as a block of its own it would hold the link for 30 ms, no more urgent gradient overtaking
  // it), and the block takes the next one, L4.
  const Plan plan = MakePlan(ProfileOf(ThreeStageTrace()), 100e6);
  EXPECT_EQ(plan.blocks.size(), 2u);
  if (plan.blocks.size() != 2) return;
  EXPECT_EQ(Join(plan.blocks[0].members), std::string("L5"));
  EXPECT_EQ(Join(plan.blocks[1].members), std::string("L4"));
  EXPECT_EQ(plan.blocks[1].budget_bytes, 1'000'000u);
  EXPECT_EQ(plan.blocks[1].bytes, kMB);
  EXPECT_EQ(plan.BlockOf("L3"), -1);
}

// VGG16's shape: a big gradient of low priority (fc1's kernel) is ready early, in a stage of its
// own, and the more urgent small ones follow in later stages. Planned as a block of its own, it
// would hold the link until it had left, the small ones waiting behind it, and the first layer
// would go out late; held for the credit phase it fills the link while nothing planned is ready.
TEST(BigEarlyTensorDoesNotDelayTheFirstLayer) {
  const Profile profile = ProfileOf({{"fc", 0, 40 * kMB, 0},        {"c3", 1, kMB, 10 * kMs},
                                     {"c2", 2, kMB, 10 * kMs + kMs / 10},
                                     {"c1", 3, kMB, 10 * kMs + 2 * kMs / 10},
                                     {"cb", 4, kMB, 20 * kMs},      {"c0", 5, kMB, 20 * kMs + kMs / 10}});
  EXPECT_EQ(profile.stages.size(), 3u);
  // 100 MB/s: 1 MB per 10 ms stage; fc alone takes 400 ms.
  const Plan plan = MakePlan(profile, 100e6);
  EXPECT_EQ(plan.BlockOf("fc"), -1);
  EXPECT_EQ(plan.blocks.size(), 1u);
  if (plan.blocks.size() == 1) EXPECT_EQ(Join(plan.blocks[0].members), std::string("c1"));
  for (const PlanBlock& block : plan.blocks) EXPECT_TRUE(block.bytes <= block.budget_bytes);
  // The forecast sends fc whole (it models whole tensors): 0-400 ms, then c0 first (credit
  // phase): out at 410 ms. The old plan {fc}, {c1} forecasts the same here: what differs is that
  // the policy preempts a held tensor at the credit's granularity (prophet_policy_test
  // TensorBiggerThanItsBudgetDoesNotHoldBackMoreUrgentOnes), never a block.
  const StepForecast forecast = ForecastStep(plan, profile, 100e6);
  EXPECT_EQ(forecast.first_layer_sent_ns, 410 * kMs);
  EXPECT_EQ(forecast.all_sent_ns, 450 * kMs);
}

TEST(ZeroBandwidthPlansNoBlock) {
  // Every tensor is bigger than a budget of 0 bytes: no block, the policy sends in priority order.
  const Plan plan = MakePlan(ProfileOf(ThreeStageTrace()), 0.0);
  EXPECT_EQ(plan.blocks.size(), 0u);
  EXPECT_EQ(plan.top_tensor, std::string("L0"));
}

TEST(ZeroGapTraceIsOneStageWithoutBlocks) {
  // Everything ready at once (e.g. gradients produced by one fused op): nothing to plan, the
  // policy falls back to priority order.
  const Profile profile = ProfileOf({{"a", 2, kMB, 5 * kMs}, {"b", 1, kMB, 5 * kMs},
                                     {"c", 0, kMB, 5 * kMs}});
  EXPECT_EQ(profile.stages.size(), 1u);
  const Plan plan = MakePlan(profile, 100e6);
  EXPECT_EQ(plan.blocks.size(), 0u);
  EXPECT_EQ(plan.top_tensor, std::string("a"));
}

TEST(UniformGapsAreOneStage) {
  // Evenly spaced readiness has no gap larger than twice the mean.
  std::vector<TraceTensor> trace;
  const char* names[] = {"t0", "t1", "t2", "t3", "t4"};
  for (int i = 0; i < 5; ++i) trace.push_back({names[i], 4 - i, kMB, i * kMs});
  const Profile profile = ProfileOf(trace);
  EXPECT_EQ(profile.stages.size(), 1u);
  EXPECT_EQ(MakePlan(profile, 100e6).blocks.size(), 0u);
}

TEST(SingleTensorAndEmptyProfile) {
  const Profile one = ProfileOf({{"only", 0, kMB, 0}});
  EXPECT_EQ(one.stages.size(), 1u);
  EXPECT_EQ(MakePlan(one, 1e9).blocks.size(), 0u);
  const Plan empty = MakePlan(Profile(), 1e9);
  EXPECT_EQ(empty.blocks.size(), 0u);
  EXPECT_EQ(empty.top_stage, -1);
}

TEST(FirstLayerInMiddleStageStopsBlocksThere) {
  // The most urgent tensor is ready in stage 1 of 3: only stage 0 gets a block.
  const Profile profile = ProfileOf({{"a", 0, kMB, 0}, {"a2", 1, kMB, kMs / 10},
                                     {"b", 2, kMB, 10 * kMs}, {"top", 9, kMB, 10 * kMs + kMs / 10},
                                     {"c", 3, kMB, 20 * kMs}, {"c2", 4, kMB, 20 * kMs + kMs / 10}});
  EXPECT_EQ(profile.stages.size(), 3u);
  const Plan plan = MakePlan(profile, 1e9);
  EXPECT_EQ(plan.top_stage, 1);
  EXPECT_EQ(plan.blocks.size(), 1u);
  if (!plan.blocks.empty()) EXPECT_EQ(Join(plan.blocks[0].members), std::string("a2,a"));
}

TEST(ReplanOnlyBeyondThreshold) {
  const Profile profile = ProfileOf(ThreeStageTrace());
  const Plan plan = MakePlan(profile, 100e6);
  // Bandwidth: 10% either way keeps the plan, 25% either way re-plans.
  EXPECT_EQ(ReplanReason(plan, profile, 110e6, 0.2), std::string());
  EXPECT_EQ(ReplanReason(plan, profile, 90e6, 0.2), std::string());
  EXPECT_TRUE(!ReplanReason(plan, profile, 125e6, 0.2).empty());
  EXPECT_TRUE(!ReplanReason(plan, profile, 75e6, 0.2).empty());
  EXPECT_TRUE(ReplanReason(plan, profile, 125e6, 0.2).find("bandwidth") != std::string::npos);
  // The threshold is a parameter.
  EXPECT_EQ(ReplanReason(plan, profile, 125e6, 0.3), std::string());

  // Ready times stretched by 25% either way: a new plan would be the same, so the plan stays.
  auto stretched = [](double factor) {
    std::vector<TraceTensor> trace = ThreeStageTrace();
    for (TraceTensor& t : trace) t.offset_ns = static_cast<int64_t>(t.offset_ns * factor);
    return ProfileOf(trace);
  };
  EXPECT_EQ(ReplanReason(plan, stretched(1.25), 100e6, 0.2), std::string());
  EXPECT_EQ(ReplanReason(plan, stretched(0.75), 100e6, 0.2), std::string());
}

// The plan of ThreeStageTrace at 100 MB/s: block 0 = {L5} (1 MB budget), block 1 = {L4} (L3, 3 MB,
// is bigger than the budget: held), credit phase from L0's ready time (20.2 ms).
TEST(ForecastOfAStepByHand) {
  const Profile profile = ProfileOf(ThreeStageTrace());
  const Plan plan = MakePlan(profile, 100e6);
  EXPECT_EQ(plan.blocks.size(), 2u);
  // L7 (held: in no block) is ready at 0 and nothing planned is: it takes the link, 0-40 ms
  // (rather than the link idling until L5 at 0.2 ms). By 40 ms the first layer is ready (20.2):
  // everything in priority order, L0 40-50, then L1, L2, L3, L4, L5, L6 until 140.
  const StepForecast forecast = ForecastStep(plan, profile, 100e6);
  EXPECT_EQ(forecast.first_layer_sent_ns, 50 * kMs);
  EXPECT_EQ(forecast.all_sent_ns, 140 * kMs);
  // Without blocks everything goes in priority order as soon as it is ready.
  Plan no_blocks = plan;
  no_blocks.blocks.clear();
  no_blocks.block_of.clear();
  // L7 0-40 ms; by then everything is ready: L0 40-50, then L1, L2, L3, L4, L5, L6 until 140.
  const StepForecast priority = ForecastStep(no_blocks, profile, 100e6);
  EXPECT_EQ(priority.first_layer_sent_ns, 50 * kMs);
  EXPECT_EQ(priority.all_sent_ns, 140 * kMs);
}

// Ready times jitter when the CPU delays the backward ops: L4 ready at 5 ms instead of 10 merges
// stages 0 and 1 (gaps of 4.8 and 5.1 ms, below twice the mean gap). The plan made for three
// stages ({L5}, {L4}) still sends this step as well as a plan for two stages ({L4, L5}) would, so
// it is kept: re-planning on any change of the stage count would re-plan whenever jitter moves a
// boundary.
TEST(JitterThatMovesStageBoundariesKeepsThePlan) {
  const Plan plan = MakePlan(ProfileOf(ThreeStageTrace()), 100e6);
  std::vector<TraceTensor> trace = ThreeStageTrace();
  trace[3].offset_ns = 5 * kMs;
  const Profile jittered = ProfileOf(trace);
  EXPECT_EQ(jittered.stages.size(), 2u);
  const StepForecast kept = ForecastStep(plan, jittered, 100e6);
  const StepForecast renewed = ForecastStep(MakePlan(jittered, 100e6), jittered, 100e6);
  EXPECT_TRUE(kept.all_sent_ns <= renewed.all_sent_ns);
  EXPECT_EQ(ReplanReason(plan, jittered, 100e6, 0.2), std::string());
  // A bandwidth change is followed at once, jitter or not.
  EXPECT_TRUE(ReplanReason(plan, jittered, 50e6, 0.2).find("bandwidth") == 0);
}

// The backward pass becomes 2x faster (e.g. a faster accelerator) on a 500 MB/s link (2 ms per
// MB). The plan for 10 ms stages ({L5, L6}, {L3, L4}; L7 held) sends L7 to fill the idle link
// (0-8 ms), then block {L5, L6} (8-14), which is not preempted when the first layer becomes ready at
// 10.1 ms: L0 goes 14-16. A new plan for 5 ms stages ({L5}, {L4}; L3 is bigger than its 2.5 MB
// budget: held) sends L5 (8-10) and L4 (10-12), then the credit phase: L0 goes 12-14, 2 ms (7% of
// the 28 ms to send everything) sooner: re-plan, and say why.
TEST(RealChangeOfReadyTimesReplans) {
  const Plan plan = MakePlan(ProfileOf(ThreeStageTrace()), 500e6);
  EXPECT_EQ(plan.blocks.size(), 2u);
  std::vector<TraceTensor> trace = ThreeStageTrace();
  for (TraceTensor& t : trace) t.offset_ns /= 2;
  const Profile faster = ProfileOf(trace);
  EXPECT_EQ(ForecastStep(plan, faster, 500e6).first_layer_sent_ns, 16 * kMs);
  EXPECT_EQ(ForecastStep(plan, faster, 500e6).all_sent_ns, 28 * kMs);
  const Plan fresh = MakePlan(faster, 500e6);
  EXPECT_EQ(fresh.blocks.size(), 2u);
  if (fresh.blocks.size() == 2) {
    EXPECT_EQ(Join(fresh.blocks[0].members), std::string("L5"));
    EXPECT_EQ(Join(fresh.blocks[1].members), std::string("L4"));
  }
  EXPECT_EQ(ForecastStep(fresh, faster, 500e6).first_layer_sent_ns, 14 * kMs);
  EXPECT_EQ(ForecastStep(fresh, faster, 500e6).all_sent_ns, 28 * kMs);
  const std::string reason = ReplanReason(plan, faster, 500e6, 0.2);
  EXPECT_TRUE(reason.find("interval") != std::string::npos);
  EXPECT_TRUE(reason.find("new plan") != std::string::npos);
}

TEST(ReplanOnStructureChange) {
  const Profile profile = ProfileOf(ThreeStageTrace());
  const Plan plan = MakePlan(profile, 100e6);
  std::vector<TraceTensor> trace = ThreeStageTrace();
  trace.push_back({"L_new", -1, kMB, 20 * kMs + 3 * kMs / 10});
  EXPECT_TRUE(!ReplanReason(plan, ProfileOf(trace), 100e6, 0.2).empty());
  trace = ThreeStageTrace();
  trace.erase(trace.begin() + 3);  // L4 gone
  EXPECT_TRUE(!ReplanReason(plan, ProfileOf(trace), 100e6, 0.2).empty());
  const Profile one_stage = ProfileOf({{"a", 0, kMB, 0}});
  EXPECT_EQ(ReplanReason(plan, one_stage, 100e6, 0.2), std::string("tensors changed"));
}

// The forecast's rules written out directly, one tensor at a time over all tensors (quadratic):
// the reference for ForecastStep's queues.
StepForecast ReferenceForecast(const Plan& plan, const Profile& profile, double bandwidth_Bps) {
  StepForecast forecast;
  const std::vector<ProfiledTensor>& tensors = profile.tensors;
  const size_t n = tensors.size();
  int first_layer = 0;
  for (size_t i = 1; i < n; ++i) {
    if (tensors[i].priority >= tensors[first_layer].priority) first_layer = static_cast<int>(i);
  }
  double credit_start = static_cast<double>(plan.top_ready_offset_ns);
  bool seen = false;
  for (const ProfiledTensor& t : tensors) {
    if (t.name != plan.top_tensor && t.priority <= plan.top_priority) continue;
    credit_start = seen ? std::min(credit_start, static_cast<double>(t.ready_offset_ns))
                        : static_cast<double>(t.ready_offset_ns);
    seen = true;
  }
  std::vector<bool> sent(n, false);
  int open_block = 0;
  double now = 0;
  for (size_t left = n; left > 0;) {
    const bool credit = plan.blocks.empty() || now >= credit_start;
    int best = -1, best_rank = 0;
    int best_held = -1;  // the most urgent ready tensor in no block (before the credit phase)
    double next_event = -1;
    for (size_t i = 0; i < n; ++i) {
      if (sent[i]) continue;
      const double ready = static_cast<double>(tensors[i].ready_offset_ns);
      const int block = plan.BlockOf(tensors[i].name);
      const bool held = !credit && block < 0;
      if (held && ready <= now &&
          (best_held < 0 || tensors[i].priority > tensors[best_held].priority)) {
        best_held = static_cast<int>(i);
      }
      if (ready > now || held) {
        // A held tensor is due once ready too: it fills the link when nothing planned is ready.
        if (ready > now && (next_event < 0 || ready < next_event)) next_event = ready;
        continue;
      }
      const int rank = credit ? 0 : std::max(block, open_block);
      if (best < 0 || rank < best_rank ||
          (rank == best_rank && tensors[i].priority > tensors[best].priority)) {
        best = static_cast<int>(i);
        best_rank = rank;
      }
    }
    if (best < 0 && best_held >= 0) {
      best = best_held;  // nothing planned is ready: the link takes a held tensor, no block opens
    } else if (best < 0) {
      now = next_event;
      continue;
    } else if (!credit) {
      open_block = best_rank;
    }
    now += static_cast<double>(tensors[best].bytes) * 1e9 / bandwidth_Bps;
    sent[best] = true;
    --left;
    if (best == first_layer) forecast.first_layer_sent_ns = static_cast<int64_t>(now);
    forecast.all_sent_ns = static_cast<int64_t>(now);
  }
  return forecast;
}

// Random bursty profiles, plans made for them and for jittered copies of them (late members,
// held tensors, blocks closed early): ForecastStep agrees with the direct transcription.
TEST(ForecastAgreesWithTheRulesWrittenOut) {
  uint64_t seed = 99;
  auto next = [&seed]() {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return seed >> 33;
  };
  for (int round = 0; round < 40; ++round) {
    const int n = 20 + static_cast<int>(next() % 100);
    std::vector<std::string> names;
    for (int i = 0; i < n; ++i) names.push_back("t" + std::to_string(i));
    // Priorities: the backward order (the usual case) or shuffled (any model).
    std::vector<int64_t> priority(n);
    for (int i = 0; i < n; ++i) priority[i] = i;
    if (round % 2 == 1) {
      for (int i = n - 1; i > 0; --i) std::swap(priority[i], priority[next() % (i + 1)]);
    }
    auto make_trace = [&](int64_t jitter_ns) {
      std::vector<TraceTensor> trace;
      int64_t t = 0;
      for (int i = 0; i < n; ++i) {
        t += (i % 7 == 6) ? 2 * kMs + static_cast<int64_t>(next() % (3 * kMs)) : 30'000;
        const int64_t jitter = jitter_ns > 0 ? static_cast<int64_t>(next() % jitter_ns) : 0;
        trace.push_back({names[i].c_str(), priority[i], 1000 + next() % (2 * kMB), t + jitter});
      }
      std::stable_sort(trace.begin(), trace.end(), [](const TraceTensor& a, const TraceTensor& b) {
        return a.offset_ns < b.offset_ns;
      });
      return ProfileOf(trace);
    };
    const Profile planned_for = make_trace(0);
    const Profile seen = make_trace(4 * kMs);
    const double bandwidth = 2e8 + static_cast<double>(next() % 1000) * 1e6;
    for (const Profile* profile : {&planned_for, &seen}) {
      const Plan plan = MakePlan(planned_for, bandwidth);
      const StepForecast fast = ForecastStep(plan, *profile, bandwidth);
      const StepForecast reference = ReferenceForecast(plan, *profile, bandwidth);
      EXPECT_EQ(fast.first_layer_sent_ns, reference.first_layer_sent_ns);
      EXPECT_EQ(fast.all_sent_ns, reference.all_sent_ns);
    }
  }
}

TEST(InvariantsOnAGeneratedModel) {
  // 160 gradients in 12 uneven bursts, sizes from 4 kB to 9 MB: the plan must be a valid Prophet
  // plan whatever the numbers.
  std::vector<std::string> names;
  std::vector<TraceTensor> trace;
  const int n = 160;
  names.reserve(n);
  uint64_t seed = 12345;
  auto next = [&seed]() {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return seed >> 33;
  };
  int64_t t = 0;
  for (int i = 0; i < n; ++i) {
    names.push_back("grad_" + std::to_string(n - 1 - i));
    t += (i % 13 == 12) ? 3 * kMs + static_cast<int64_t>(next() % (5 * kMs)) : 20'000;
    trace.push_back({nullptr, i, 4096 + next() % (9 * kMB), t});  // ready last = most urgent
  }
  for (int i = 0; i < n; ++i) trace[i].name = names[i].c_str();
  const Profile profile = ProfileOf(trace);
  EXPECT_TRUE(profile.stages.size() > 5);
  const Plan plan = MakePlan(profile, 1.25e9);
  EXPECT_EQ(plan.top_tensor, std::string("grad_0"));
  EXPECT_TRUE(plan.blocks.size() >= 5);
  std::vector<int> seen(n, 0);
  int64_t previous_start = -1;
  for (size_t b = 0; b < plan.blocks.size(); ++b) {
    const PlanBlock& block = plan.blocks[b];
    EXPECT_TRUE(!block.members.empty());
    EXPECT_TRUE(block.bytes <= block.budget_bytes);  // a bigger tensor joins no block
    EXPECT_TRUE(block.start_offset_ns > previous_start);
    previous_start = block.start_offset_ns;
    int64_t last_priority = INT64_MAX;
    for (const std::string& name : block.members) {
      const ProfiledTensor& tensor = profile.tensors[profile.Find(name)];
      EXPECT_TRUE(tensor.priority < last_priority);  // priority order inside a block
      last_priority = tensor.priority;
      EXPECT_TRUE(tensor.stage <= block.stage);      // ready by the block's stage
      EXPECT_TRUE(tensor.stage < plan.top_stage);
      ++seen[tensor.priority];
    }
  }
  for (int count : seen) EXPECT_TRUE(count <= 1);  // no tensor planned twice
  EXPECT_TRUE(!plan.Summary().empty());
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
