// When does each gradient become ready, relative to the start of its training step?
//
// Prophet plans communication around the stepwise pattern in which the backward pass produces
// gradients: bursts separated by gaps. The profiler learns that pattern online from the
// TensorReady events the engine already sees, and keeps following it (slower compute, another
// batch size, a tensor that appears or disappears), instead of the original's single pre-run
// iteration and hard-coded stage tables.
//
// Time origin of a step: the engine cannot see the backward pass start (that happens inside
// TensorFlow), so a step's origin is the ready time of its first tensor. Offsets are therefore
// "time since the first gradient of the step", which is all the planner needs: it only uses gaps
// and intervals between stages.
//
// Step boundaries: tensors of one training step share the same `round` (the engine's per-name
// counter). An event whose round is larger than the open step's closes it and opens a new one.
// An event with a smaller round (a tensor that skipped some steps, so its counter lags, or a tensor
// seen for the first time, round 0) is attributed to the open step. A lagging tensor that happens
// to be the first of a step would be attributed to the previous step; it then shows up as a large
// offset in one step, which the rolling median ignores (a tensor that lags for good and is always
// first keeps an offset of about a step: the plan then sends it in the credit phase). A pause
// between two gradients does not end a step: the backward pass of a large model on a slow device
// pauses for seconds between layers, and longer between fusion buckets (each is ready with its
// last member). The exception is a name the profiler does not know, after a long pause: another
// model (see max_ready_gap_ns).
#ifndef PROPHET_OPS_CORE_PROFILER_H_
#define PROPHET_OPS_CORE_PROFILER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "ops/core/scheduler.h"

namespace prophet {

struct ProfilerOptions {
  // A tensor's ready offset is the median of its last `window_steps` observations: robust to one
  // slow step (GC, checkpoint), and it follows a lasting change within about window_steps / 2 steps.
  int window_steps = 5;
  // Steps discarded at the start: the first step includes tracing and allocation.
  int warmup_steps = 1;
  // Observed (non-warm-up) steps needed before has_profile().
  int min_steps = 1;
  // A tensor not seen for this many steps leaves the profile (0: 2 * window_steps).
  int forget_after_steps = 0;
  // Stage boundary: a gap between consecutive ready offsets larger than stage_gap_factor times the
  // mean gap (the paper uses 2) and larger than min_stage_gap_ns (0 keeps the paper's rule).
  double stage_gap_factor = 2.0;
  int64_t min_stage_gap_ns = 0;
  // A tensor the statistics do not know (a name forgotten after forget_after_steps counts as
  // new), ready this long after the open step's previous one, opens a new step. Rounds alone
  // cannot tell steps apart when another model trains (its names start again at round 0): its
  // gradients would join the last step of the previous model with offsets of seconds, and a plan
  // made from them would hold pushes back for that long. Known names do not split a step by a
  // pause (a slow backward pass has pauses this long between its own gradients), nor does any
  // name before the warm-up steps have closed; so the first step of a second, slow model is split
  // at its pauses once, which the rolling median outvotes.
  int64_t max_ready_gap_ns = 1'000'000'000;
};

struct ProfiledTensor {
  std::string name;
  int64_t priority = 0;
  uint64_t bytes = 0;
  int64_t ready_offset_ns = 0;  // rolling median of the offset from the step's origin
  int stage = 0;                // index into Profile::stages
};

struct ProfileStage {
  int64_t start_offset_ns = 0;  // ready offset of its first member
  int64_t interval_ns = 0;      // until the next stage's start; 0 for the last stage
  std::vector<int> members;     // indices into Profile::tensors, in ready order
};

struct Profile {
  std::vector<ProfiledTensor> tensors;  // ordered by ready offset (ties: higher priority first)
  std::vector<ProfileStage> stages;
  uint64_t steps_observed = 0;          // non-warm-up steps folded into the statistics
  uint64_t version = 0;                 // bumped every time the profile is recomputed

  // Index into tensors, or -1.
  int Find(const std::string& name) const;
};

// Splits tensors (already sorted by ready offset) into stages and fills ProfiledTensor::stage.
// Exposed so that tests and the planner's callers can build profiles from synthetic traces.
void DetectStages(const ProfilerOptions& options, Profile* profile);

class ReadyTimeProfiler {
 public:
  explicit ReadyTimeProfiler(const ProfilerOptions& options = ProfilerOptions());

  // Returns true when this event opened a new step (after closing the previous one, which may
  // have updated the profile).
  bool OnTensorReady(const TensorReady& ready);
  // Closes the open step now (when the caller knows it ended, e.g. at shutdown or in tests).
  void EndStep();

  bool has_profile() const { return has_profile_; }
  const Profile& profile() const { return profile_; }
  // Origin of the open step (ready time of its first tensor), or -1 before the first event.
  int64_t step_origin_ns() const { return step_open_ ? step_origin_ns_ : -1; }
  // Steps opened so far, counting the open one: the open step's index is steps_started() - 1.
  uint64_t steps_started() const { return steps_started_; }

 private:
  struct Observation {
    int64_t priority = 0;
    uint64_t bytes = 0;
    int64_t offset_ns = 0;
  };
  struct TensorStats {
    int64_t priority = 0;
    uint64_t bytes = 0;
    std::deque<int64_t> recent_offsets_ns;  // newest last, at most window_steps
    uint64_t last_seen_step = 0;
  };

  void CloseStep();
  void Recompute();

  ProfilerOptions options_;
  bool step_open_ = false;
  uint64_t step_round_ = 0;
  int64_t step_origin_ns_ = 0;
  int64_t step_last_ready_ns_ = 0;
  uint64_t steps_started_ = 0;
  uint64_t steps_closed_ = 0;
  std::map<std::string, Observation> open_step_;  // first observation of each name in the step
  std::map<std::string, TensorStats> stats_;      // ordered: deterministic profiles
  bool has_profile_ = false;
  Profile profile_;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_PROFILER_H_
