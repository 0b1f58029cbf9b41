// Ready-time profiling from TensorReady events: steps, stages, rolling adaptation, robustness.
#include "ops/core/profiler.h"

#include <string>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

constexpr int64_t kMs = 1'000'000;

struct Event {
  std::string name;
  int64_t priority;
  int64_t offset_ns;
};

// Backward order of a 6-layer model: {g5, g4} at 0, {g3, g2} at `stage1`, {g1, g0} at `stage2`.
std::vector<Event> Trace(int64_t stage1 = 10 * kMs, int64_t stage2 = 20 * kMs) {
  return {{"g5", 0, 0},      {"g4", 1, kMs / 10},      {"g3", 2, stage1},
          {"g2", 3, stage1 + kMs / 10}, {"g1", 4, stage2}, {"g0", 5, stage2 + kMs / 10}};
}

// Feeds one step; `round` is the step index, steps are 100 ms apart in absolute time.
void FeedStep(ReadyTimeProfiler* profiler, uint64_t round, const std::vector<Event>& events,
              uint64_t round_override_for_first = UINT64_MAX) {
  const int64_t origin = 1'000 * kMs + static_cast<int64_t>(round) * 100 * kMs;
  bool first = true;
  for (const Event& e : events) {
    TensorReady ready;
    ready.name = &e.name;
    ready.round = first && round_override_for_first != UINT64_MAX ? round_override_for_first : round;
    ready.priority = e.priority;
    ready.bytes = 1000;
    ready.ready_ns = origin + e.offset_ns;
    profiler->OnTensorReady(ready);
    first = false;
  }
}

int64_t OffsetOf(const Profile& profile, const std::string& name) {
  const int i = profile.Find(name);
  return i < 0 ? -1 : profile.tensors[i].ready_offset_ns;
}

ProfilerOptions NoWarmup() {
  ProfilerOptions options;
  options.warmup_steps = 0;
  return options;
}

TEST(NoProfileBeforeAStepIsComplete) {
  ReadyTimeProfiler profiler;  // default: the first step is warm-up
  EXPECT_TRUE(!profiler.has_profile());
  EXPECT_EQ(profiler.step_origin_ns(), -1);
  FeedStep(&profiler, 0, Trace());
  EXPECT_TRUE(!profiler.has_profile());  // step 0 still open
  FeedStep(&profiler, 1, Trace());
  EXPECT_TRUE(!profiler.has_profile());  // step 0 closed but discarded as warm-up
  FeedStep(&profiler, 2, Trace());
  EXPECT_TRUE(profiler.has_profile());   // step 1 closed when step 2 opened
  EXPECT_EQ(profiler.profile().steps_observed, 1u);
  EXPECT_EQ(profiler.steps_started(), 3u);
}

TEST(DetectsStagesAndOrdersByReadyTime) {
  ReadyTimeProfiler profiler(NoWarmup());
  FeedStep(&profiler, 0, Trace());
  profiler.EndStep();
  EXPECT_TRUE(profiler.has_profile());
  const Profile& profile = profiler.profile();
  EXPECT_EQ(profile.tensors.size(), 6u);
  EXPECT_EQ(profile.stages.size(), 3u);
  if (profile.stages.size() != 3) return;
  EXPECT_EQ(profile.tensors[0].name, std::string("g5"));
  EXPECT_EQ(profile.tensors[5].name, std::string("g0"));
  EXPECT_EQ(profile.stages[0].start_offset_ns, 0);
  EXPECT_EQ(profile.stages[1].start_offset_ns, 10 * kMs);
  EXPECT_EQ(profile.stages[2].start_offset_ns, 20 * kMs);
  EXPECT_EQ(profile.stages[0].interval_ns, 10 * kMs);
  EXPECT_EQ(profile.stages[1].interval_ns, 10 * kMs);
  EXPECT_EQ(profile.stages[2].interval_ns, 0);
  EXPECT_EQ(profile.tensors[profile.Find("g2")].stage, 1);
  EXPECT_EQ(profile.stages[1].members.size(), 2u);
  EXPECT_EQ(profile.tensors[profile.Find("g1")].priority, 4);
  EXPECT_EQ(profile.tensors[profile.Find("g1")].bytes, 1000u);
}

TEST(ZeroGapTraceIsOneStage) {
  ReadyTimeProfiler profiler(NoWarmup());
  FeedStep(&profiler, 0, {{"a", 0, 0}, {"b", 1, 0}, {"c", 2, 0}});
  profiler.EndStep();
  EXPECT_EQ(profiler.profile().stages.size(), 1u);
  EXPECT_EQ(profiler.profile().stages[0].interval_ns, 0);
}

TEST(RollingMedianFollowsAShiftAndIgnoresOneOutlier) {
  ProfilerOptions options = NoWarmup();
  options.window_steps = 5;
  ReadyTimeProfiler profiler(options);
  uint64_t round = 0;
  for (; round < 5; ++round) FeedStep(&profiler, round, Trace());
  // One slow step (e.g. a checkpoint) must not move the profile.
  FeedStep(&profiler, round++, Trace(30 * kMs, 60 * kMs));
  FeedStep(&profiler, round++, Trace());
  EXPECT_EQ(OffsetOf(profiler.profile(), "g3"), 10 * kMs);  // window 10,10,10,10,30 -> 10

  // Compute gets slower for good (stage 1 at 15 ms, stage 2 at 30 ms).
  const uint64_t shift_start = round;
  FeedStep(&profiler, round++, Trace(15 * kMs, 30 * kMs));
  FeedStep(&profiler, round++, Trace(15 * kMs, 30 * kMs));  // closes the first shifted step
  EXPECT_EQ(OffsetOf(profiler.profile(), "g3"), 10 * kMs);
  while (round < shift_start + 4) FeedStep(&profiler, round++, Trace(15 * kMs, 30 * kMs));
  // Closed so far: 5 x normal, outlier, normal, 3 x shifted -> window 30,10,15,15,15 -> 15 ms.
  const Profile& profile = profiler.profile();
  EXPECT_EQ(OffsetOf(profile, "g3"), 15 * kMs);
  EXPECT_EQ(profile.stages.size(), 3u);
  if (profile.stages.size() == 3) {
    EXPECT_EQ(profile.stages[0].interval_ns, 15 * kMs);
    EXPECT_EQ(profile.stages[1].interval_ns, 15 * kMs);
  }
}

TEST(MissingTensorKeepsItsHistoryAndEventuallyLeaves) {
  ProfilerOptions options = NoWarmup();
  options.window_steps = 3;
  options.forget_after_steps = 4;
  ReadyTimeProfiler profiler(options);
  FeedStep(&profiler, 0, Trace());
  std::vector<Event> without_g3 = Trace();
  without_g3.erase(without_g3.begin() + 2);
  FeedStep(&profiler, 1, without_g3);
  FeedStep(&profiler, 2, without_g3);  // closes step 1
  EXPECT_EQ(OffsetOf(profiler.profile(), "g3"), 10 * kMs);
  EXPECT_EQ(profiler.profile().tensors.size(), 6u);
  for (uint64_t round = 3; round <= 5; ++round) FeedStep(&profiler, round, without_g3);
  // Last seen in step 0; steps 1-4 closed without it: forgotten.
  EXPECT_EQ(profiler.profile().Find("g3"), -1);
  EXPECT_EQ(profiler.profile().tensors.size(), 5u);
}

TEST(NewTensorWithRoundZeroJoinsTheOpenStep) {
  ReadyTimeProfiler profiler(NoWarmup());
  FeedStep(&profiler, 0, Trace());
  FeedStep(&profiler, 1, Trace());
  // Step 2 has an extra tensor seen for the first time: its per-name round is 0.
  std::vector<Event> step2 = Trace();
  const int64_t origin = 1'000 * kMs + 2 * 100 * kMs;
  FeedStep(&profiler, 2, step2);
  const std::string extra = "aux_loss_scale";
  TensorReady ready;
  ready.name = &extra;
  ready.round = 0;
  ready.priority = -1;
  ready.ready_ns = origin + 25 * kMs;
  EXPECT_TRUE(!profiler.OnTensorReady(ready));  // not a new step
  profiler.EndStep();
  EXPECT_EQ(OffsetOf(profiler.profile(), extra), 25 * kMs);
  EXPECT_EQ(profiler.profile().tensors.back().name, extra);
}

TEST(LaggingRoundIsAttributedToTheOpenStep) {
  ReadyTimeProfiler profiler(NoWarmup());
  FeedStep(&profiler, 0, Trace());
  // In step 1, g0's counter lags (it was skipped once before): round 0 after others' round 1.
  std::vector<Event> step1 = Trace();
  const int64_t origin = 1'000 * kMs + 100 * kMs;
  std::vector<Event> head(step1.begin(), step1.end() - 1);
  FeedStep(&profiler, 1, head);
  TensorReady ready;
  ready.name = &step1.back().name;
  ready.round = 0;
  ready.priority = step1.back().priority;
  ready.ready_ns = origin + step1.back().offset_ns;
  EXPECT_TRUE(!profiler.OnTensorReady(ready));
  profiler.EndStep();
  EXPECT_EQ(OffsetOf(profiler.profile(), "g0"), 20 * kMs + kMs / 10);
  EXPECT_EQ(profiler.profile().steps_observed, 2u);
}

TEST(AnotherModelAfterALongGapOpensANewStep) {
  ReadyTimeProfiler profiler(NoWarmup());
  for (uint64_t round = 0; round < 8; ++round) FeedStep(&profiler, round, Trace());
  // A second model trains 4 s later: its names start at round 0, below the open step's round 7.
  const std::vector<Event> other = {{"b1", 1, 0}, {"b0", 2, kMs}};
  const int64_t origin = 1'000 * kMs + 7 * 100 * kMs + 4'000 * kMs;
  bool opened = false;
  for (const Event& e : other) {
    TensorReady ready;
    ready.name = &e.name;
    ready.round = 0;
    ready.priority = e.priority;
    ready.ready_ns = origin + e.offset_ns;
    opened = profiler.OnTensorReady(ready) || opened;
  }
  EXPECT_TRUE(opened);
  EXPECT_EQ(profiler.step_origin_ns(), origin);
  profiler.EndStep();
  EXPECT_EQ(OffsetOf(profiler.profile(), "b0"), kMs);  // not 4 s after the other model's step
}

TEST(PausesOfSecondsInsideABackwardPassDoNotSplitTheStep) {
  // A large model on a slow device (or fusion buckets, each ready with its last member): seconds
  // between one known gradient and the next, within one step. With a warm-up step (the default)
  // no statistics hold the warm-up step, so the step after it must not split either.
  const int64_t second = 1'000 * kMs;
  const std::vector<Event> slow = Trace(3 * second, 6 * second);
  for (const ProfilerOptions& options : {NoWarmup(), ProfilerOptions()}) {
    ReadyTimeProfiler profiler(options);
    uint64_t opened = 0;
    for (uint64_t round = 0; round < 4; ++round) {
      const int64_t origin = 1'000 * kMs + static_cast<int64_t>(round) * 10 * second;
      for (const Event& e : slow) {
        TensorReady ready;
        ready.name = &e.name;
        ready.round = round;
        ready.priority = e.priority;
        ready.bytes = 1000;
        ready.ready_ns = origin + e.offset_ns;
        if (profiler.OnTensorReady(ready)) ++opened;
      }
    }
    EXPECT_EQ(opened, 4u);
    profiler.EndStep();
    EXPECT_EQ(OffsetOf(profiler.profile(), "g3"), 3 * second);
    EXPECT_EQ(OffsetOf(profiler.profile(), "g0"), 6 * second + kMs / 10);
    EXPECT_EQ(profiler.profile().stages.size(), 3u);
  }
}

TEST(StepOriginIsTheFirstReadyTensor) {
  ReadyTimeProfiler profiler(NoWarmup());
  std::vector<Event> late_start = Trace();
  for (Event& e : late_start) e.offset_ns += 7 * kMs;  // backward started 7 ms before: invisible
  FeedStep(&profiler, 0, late_start);
  EXPECT_EQ(profiler.step_origin_ns(), 1'000 * kMs + 7 * kMs);
  profiler.EndStep();
  EXPECT_EQ(OffsetOf(profiler.profile(), "g5"), 0);
  EXPECT_EQ(OffsetOf(profiler.profile(), "g0"), 20 * kMs + kMs / 10);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
