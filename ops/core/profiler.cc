#include "ops/core/profiler.h"

#include <algorithm>

namespace prophet {

namespace {

int64_t Median(std::vector<int64_t> values) {
  // Even counts average the two middle values so that two observations give their mean.
  const size_t mid = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + mid, values.end());
  const int64_t upper = values[mid];
  if (values.size() % 2 == 1) return upper;
  const int64_t lower = *std::max_element(values.begin(), values.begin() + mid);
  return lower + (upper - lower) / 2;
}

}  // namespace

int Profile::Find(const std::string& name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

void DetectStages(const ProfilerOptions& options, Profile* profile) {
  profile->stages.clear();
  std::vector<ProfiledTensor>& tensors = profile->tensors;
  if (tensors.empty()) return;
  const size_t n = tensors.size();
  // Mean gap between consecutive ready offsets = span / (n - 1). A trace where everything is
  // ready at once (mean gap 0) is one stage.
  const double mean_gap =
      n > 1 ? static_cast<double>(tensors.back().ready_offset_ns - tensors.front().ready_offset_ns) /
                  static_cast<double>(n - 1)
            : 0.0;
  const double threshold = options.stage_gap_factor * mean_gap;

  profile->stages.emplace_back();
  profile->stages.back().start_offset_ns = tensors[0].ready_offset_ns;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) {
      const int64_t gap = tensors[i].ready_offset_ns - tensors[i - 1].ready_offset_ns;
      if (mean_gap > 0 && static_cast<double>(gap) > threshold && gap > options.min_stage_gap_ns) {
        profile->stages.emplace_back();
        profile->stages.back().start_offset_ns = tensors[i].ready_offset_ns;
      }
    }
    tensors[i].stage = static_cast<int>(profile->stages.size()) - 1;
    profile->stages.back().members.push_back(static_cast<int>(i));
  }
  for (size_t k = 0; k + 1 < profile->stages.size(); ++k) {
    profile->stages[k].interval_ns =
        profile->stages[k + 1].start_offset_ns - profile->stages[k].start_offset_ns;
  }
  profile->stages.back().interval_ns = 0;
}

ReadyTimeProfiler::ReadyTimeProfiler(const ProfilerOptions& options) : options_(options) {
  options_.window_steps = std::max(1, options_.window_steps);
  options_.warmup_steps = std::max(0, options_.warmup_steps);
  options_.min_steps = std::max(1, options_.min_steps);
  if (options_.forget_after_steps <= 0) options_.forget_after_steps = 2 * options_.window_steps;
}

bool ReadyTimeProfiler::OnTensorReady(const TensorReady& ready) {
  bool new_step = false;
  const std::string name = ready.name != nullptr ? *ready.name : std::string();
  // Only before a name the statistics do not know: another model (see max_ready_gap_ns). Before
  // the warm-up steps have closed, every name is unknown to them, so no pause counts then.
  const bool unknown = steps_closed_ > static_cast<uint64_t>(options_.warmup_steps) &&
                       open_step_.count(name) == 0 && stats_.count(name) == 0;
  const bool long_gap = step_open_ && unknown && options_.max_ready_gap_ns > 0 &&
                        ready.ready_ns - step_last_ready_ns_ > options_.max_ready_gap_ns;
  if (!step_open_ || ready.round > step_round_ || long_gap) {
    if (step_open_) CloseStep();
    step_open_ = true;
    step_round_ = ready.round;
    step_origin_ns_ = ready.ready_ns;
    ++steps_started_;
    new_step = true;
  }
  step_last_ready_ns_ = std::max(step_last_ready_ns_, ready.ready_ns);
  // A name seen twice in one step (its counter lagged, then caught up) keeps its first sighting.
  if (open_step_.count(name) == 0) {
    Observation& obs = open_step_[name];
    obs.priority = ready.priority;
    obs.bytes = ready.bytes;
    // Events should arrive in time order; clamp so a reordered one cannot produce a negative offset.
    obs.offset_ns = std::max<int64_t>(0, ready.ready_ns - step_origin_ns_);
  }
  return new_step;
}

void ReadyTimeProfiler::EndStep() {
  if (!step_open_) return;
  CloseStep();
  step_open_ = false;
}

void ReadyTimeProfiler::CloseStep() {
  const uint64_t step_index = steps_closed_++;
  std::map<std::string, Observation> observed;
  observed.swap(open_step_);
  if (step_index < static_cast<uint64_t>(options_.warmup_steps)) return;

  for (const auto& entry : observed) {
    TensorStats& stats = stats_[entry.first];
    stats.priority = entry.second.priority;
    stats.bytes = entry.second.bytes;
    stats.recent_offsets_ns.push_back(entry.second.offset_ns);
    while (stats.recent_offsets_ns.size() > static_cast<size_t>(options_.window_steps)) {
      stats.recent_offsets_ns.pop_front();
    }
    stats.last_seen_step = step_index;
  }
  // Tensors that stopped appearing (a model change, a conditional branch) leave the profile, so a
  // stale entry cannot keep a block waiting for a gradient that never comes.
  for (auto it = stats_.begin(); it != stats_.end();) {
    if (step_index - it->second.last_seen_step >= static_cast<uint64_t>(options_.forget_after_steps)) {
      it = stats_.erase(it);
    } else {
      ++it;
    }
  }
  ++profile_.steps_observed;
  if (profile_.steps_observed >= static_cast<uint64_t>(options_.min_steps)) Recompute();
}

void ReadyTimeProfiler::Recompute() {
  std::vector<ProfiledTensor> tensors;
  tensors.reserve(stats_.size());
  for (const auto& entry : stats_) {
    ProfiledTensor tensor;
    tensor.name = entry.first;
    tensor.priority = entry.second.priority;
    tensor.bytes = entry.second.bytes;
    tensor.ready_offset_ns = Median(std::vector<int64_t>(entry.second.recent_offsets_ns.begin(),
                                                         entry.second.recent_offsets_ns.end()));
    tensors.push_back(std::move(tensor));
  }
  std::stable_sort(tensors.begin(), tensors.end(),
                   [](const ProfiledTensor& a, const ProfiledTensor& b) {
                     if (a.ready_offset_ns != b.ready_offset_ns) {
                       return a.ready_offset_ns < b.ready_offset_ns;
                     }
                     return a.priority > b.priority;
                   });
  // Offsets are relative to the step's first tensor; after medians the earliest may not be 0.
  // Keep them as they are: intervals, which the planner uses, do not depend on the origin.
  profile_.tensors = std::move(tensors);
  DetectStages(options_, &profile_);
  ++profile_.version;
  has_profile_ = !profile_.tensors.empty();
}

}  // namespace prophet
