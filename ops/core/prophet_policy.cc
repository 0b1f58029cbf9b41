#include "ops/core/prophet_policy.h"

#include <algorithm>
#include <cstdio>
#include <iterator>

namespace prophet {

ProphetPolicy::ProphetPolicy(const ProphetOptions& options)
    : SchedulerPolicy(options.bandwidth), options_(options), profiler_(options.profiler) {
  if (!(options_.replan_threshold >= 0)) options_.replan_threshold = kDefaultReplanThreshold;
}

void ProphetPolicy::OnTensorReady(const TensorReady& ready) {
  if (ready.priority >= kControlPriority) return;  // not a gradient: never profiled
  const std::string name = ready.name != nullptr ? *ready.name : std::string();
  if (profiler_.OnTensorReady(ready)) StartStep(ready.ready_ns);
  wire_bytes_this_step_.emplace(name, 0);  // a tensor with no remote partition pushes 0 bytes

  if (!blocks_active_) return;
  if (ready_this_step_.insert(name).second) {
    const int block = plan_.BlockOf(name);
    if (block >= 0) --block_missing_[block];
  }
  // The first layer is ready: after the block in flight, everything goes in priority order.
  if (name == plan_.top_tensor || ready.priority > plan_.top_priority) credit_phase_ = true;
}

void ProphetPolicy::StartStep(int64_t origin_ns) {
  EndPhaseSpan(origin_ns);
  // Whatever the previous step left queued is sent first (see Dequeue).
  for (PriorityTaskQueue& queue : block_queues_) queue.MoveAllTo(&overdue_queue_);
  late_queue_.MoveAllTo(&overdue_queue_);
  credit_queue_.MoveAllTo(&overdue_queue_);

  // Pushes of the previous step that have not left still keep the link busy, but belong to no
  // block of this one.
  for (auto& entry : unsent_) entry.second = -1;

  wire_bytes_last_step_.swap(wire_bytes_this_step_);
  wire_bytes_this_step_.clear();

  step_origin_ns_ = origin_ns;
  const uint64_t replans_before = replans_;
  MaybeReplan();
  if (replans_ != replans_before) {
    // The timeline marks where the plan changed and why (e.g. the link rate moved).
    PhaseSpan replanned;
    replanned.label = "re-plan: " + last_replan_reason_ + " -> " + plan_.Summary();
    replanned.start_ns = replanned.end_ns = origin_ns;
    replanned.instant = true;
    finished_spans_.push_back(std::move(replanned));
    if (finished_spans_.size() > 1024) finished_spans_.erase(finished_spans_.begin());
  }
  blocks_active_ = has_plan_ && !plan_.blocks.empty();
  credit_phase_ = !blocks_active_;
  open_block_ = 0;
  ready_this_step_.clear();
  block_queues_.assign(plan_.blocks.size(), PriorityTaskQueue());
  block_unsent_.assign(plan_.blocks.size(), 0);
  block_missing_.clear();
  for (const PlanBlock& block : plan_.blocks) {
    block_missing_.push_back(static_cast<int>(block.members.size()));
  }
}

void ProphetPolicy::MaybeReplan() {
  if (!profiler_.has_profile() || !bandwidth()->has_estimate()) return;
  // Plan with the bytes this worker actually pushed per tensor (partitions it owns stay local).
  Profile profile = profiler_.profile();
  for (ProfiledTensor& tensor : profile.tensors) {
    auto it = wire_bytes_last_step_.find(tensor.name);
    if (it != wire_bytes_last_step_.end()) tensor.bytes = it->second;
  }
  const double bandwidth_Bps = bandwidth()->estimate_Bps();
  if (!has_plan_) {
    plan_ = MakePlan(profile, bandwidth_Bps);
    has_plan_ = true;
    bandwidth_moved_before_ = 0;
    return;
  }
  // A bandwidth change counts once two step starts in a row see it in the same direction: the
  // estimate of a link shared with other workers' pushes and results, on a busy CPU, swings by
  // +-40% from one step to the next around a steady rate, while a real change lasts. Until then
  // the plan is judged (and made) at its own bandwidth; everything else counts at once.
  const int bandwidth_moved = BandwidthMoved(plan_, bandwidth_Bps, options_.replan_threshold);
  const bool confirmed = bandwidth_moved != 0 && bandwidth_moved == bandwidth_moved_before_;
  bandwidth_moved_before_ = bandwidth_moved;
  const double judged_Bps = bandwidth_moved != 0 && !confirmed ? plan_.bandwidth_Bps
                                                               : bandwidth_Bps;
  std::string reason = ReplanReason(plan_, profile, judged_Bps, options_.replan_threshold);
  if (reason.empty()) return;
  plan_ = MakePlan(profile, judged_Bps);
  bandwidth_moved_before_ = 0;
  ++replans_;
  last_replan_reason_ = std::move(reason);
}

void ProphetPolicy::Enqueue(const SendTask& task) {
  if (task.priority >= kControlPriority) {
    overdue_queue_.Push(task);  // drained before blocks and credit phase alike
    return;
  }
  const std::string& name = task.name;
  const bool earlier_step = profiler_.steps_started() > 0 && task.ready_ns < step_origin_ns_;
  if (!earlier_step) wire_bytes_this_step_[name] += task.bytes;

  if (earlier_step) {
    overdue_queue_.Push(task);
    return;
  }
  if (credit_phase_) {
    credit_queue_.Push(task);
    return;
  }
  const int block = plan_.BlockOf(name);
  const int blocks = static_cast<int>(block_queues_.size());
  if (block < 0) {
    credit_queue_.Push(task);  // fits in no block, or unknown to the profile
  } else if (block >= open_block_) {
    block_queues_[block].Push(task);
  } else if (open_block_ < blocks) {
    block_queues_[open_block_].Push(task);  // late member of a closed block joins the open one
  } else {
    late_queue_.Push(task);
  }
}

bool ProphetPolicy::LaterBlockQueued() const {
  for (size_t b = static_cast<size_t>(open_block_) + 1; b < block_queues_.size(); ++b) {
    if (!block_queues_[b].empty()) return true;
  }
  return false;
}

void ProphetPolicy::NoteReleased(const std::vector<SendTask>& out, size_t from, int64_t now_ns,
                                 int block) {
  if (out.size() == from) return;
  if (span_open_ && open_span_block_ != block) EndPhaseSpan(now_ns);  // another phase begins
  if (!span_open_) {
    open_span_block_ = block;
    span_open_ = true;
    open_span_ = PhaseSpan();
    open_span_.label = block >= 0 ? BlockLabel(block) : block == -1 ? "credit phase" : "idle-link fill";
    open_span_.start_ns = now_ns;
  }
  for (size_t i = from; i < out.size(); ++i) {
    ++open_span_.tasks;
    open_span_.bytes += out[i].bytes;
  }
  open_span_.end_ns = now_ns;
}

void ProphetPolicy::EndPhaseSpan(int64_t now_ns) {
  if (!span_open_) return;
  span_open_ = false;
  open_span_.end_ns = std::max(open_span_.end_ns, now_ns);
  finished_spans_.push_back(std::move(open_span_));
  if (finished_spans_.size() > 1024) finished_spans_.erase(finished_spans_.begin());
}

std::vector<ProphetPolicy::PhaseSpan> ProphetPolicy::TakeSpans() {
  std::vector<PhaseSpan> out;
  out.swap(finished_spans_);
  return out;
}

void ProphetPolicy::EndBlocks() {
  for (PriorityTaskQueue& queue : block_queues_) queue.MoveAllTo(&credit_queue_);
  late_queue_.MoveAllTo(&credit_queue_);
  open_block_ = static_cast<int>(block_queues_.size());
}

int64_t ProphetPolicy::CreditDeadlineNs() const {
  return step_origin_ns_ + static_cast<int64_t>(static_cast<double>(plan_.top_ready_offset_ns) *
                                                (1.0 + options_.replan_threshold));
}

void ProphetPolicy::Dequeue(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) {
  ReleasePlanned(credit_bytes, now_ns, out);
}

void ProphetPolicy::ReleasePlanned(uint64_t credit_bytes, int64_t now_ns, std::vector<SendTask>* out) {
  CreditWindow window(credit_bytes);
  size_t released_before = out->size();
  const bool overdue_drained = window.Release(&overdue_queue_, out);
  TrackUnsent(*out, released_before, -1);
  if (!overdue_drained) return;
  if (!blocks_active_) {
    released_before = out->size();
    window.Release(&credit_queue_, out);
    TrackUnsent(*out, released_before, -1);
    return;
  }
  if (!credit_phase_ && now_ns >= CreditDeadlineNs()) credit_phase_ = true;

  const int blocks = static_cast<int>(block_queues_.size());
  while (open_block_ < blocks) {
    // No preemption: the open block's queued partitions go before anything else.
    released_before = out->size();
    const bool drained = window.Release(&block_queues_[open_block_], out);
    NoteReleased(*out, released_before, now_ns, open_block_);
    TrackUnsent(*out, released_before, open_block_);
    if (!drained) return;
    if (credit_phase_) {
      EndPhaseSpan(now_ns);
      EndBlocks();
      break;
    }
    const bool complete = block_missing_[open_block_] <= 0;
    // Its members are not ready yet and no later block has data: rather than idle the link until
    // they are, send what the plan holds for the credit phase (see FillIdleLink).
    if (!complete && !LaterBlockQueued()) return FillIdleLink(&window, now_ns, out);
    // The next block opens once this one has left this worker.
    if (BlockUnsent(open_block_)) return;
    EndPhaseSpan(now_ns);
    ++open_block_;
  }
  if (!credit_phase_) {
    released_before = out->size();
    const bool late_drained = window.Release(&late_queue_, out);
    TrackUnsent(*out, released_before, -1);
    if (!late_drained) return;
    return FillIdleLink(&window, now_ns, out);  // every block ended before the first layer is ready
  }
  EndBlocks();
  released_before = out->size();
  const bool drained = window.Release(&credit_queue_, out);
  NoteReleased(*out, released_before, now_ns, /*block=*/-1);
  TrackUnsent(*out, released_before, -1);
  if (drained) EndPhaseSpan(now_ns);
}

void ProphetPolicy::FillIdleLink(CreditWindow* window, int64_t now_ns, std::vector<SendTask>* out) {
  // Released pushes that have not left keep the link busy (the kernel holds little beyond them).
  if (!unsent_.empty()) return;
  const size_t released_before = out->size();
  window->Release(&credit_queue_, out);
  // Counted in the open block's span, or in a span of its own.
  NoteReleased(*out, released_before, now_ns, /*block=*/-2);
  TrackUnsent(*out, released_before, -1);
}

void ProphetPolicy::TrackUnsent(const std::vector<SendTask>& out, size_t from, int block) {
  for (size_t i = from; i < out.size(); ++i) {
    const SendTask& task = out[i];
    if (task.priority >= kControlPriority) continue;  // never held back, never holds back
    unsent_[std::make_tuple(task.name, task.round, task.partition)] = block;
    if (block >= 0) ++block_unsent_[block];
  }
}

void ProphetPolicy::OnPushLeft(const SendTask& task) {
  // Pushes released by a policy this one replaced are not tracked here.
  auto it = unsent_.find(std::make_tuple(task.name, task.round, task.partition));
  if (it == unsent_.end()) return;
  if (it->second >= 0) --block_unsent_[it->second];
  unsent_.erase(it);
}

std::string ProphetPolicy::BlockLabel(int block) const {
  const PlanBlock& planned = plan_.blocks[block];
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), "block %d/%zu (%zu tensors, %.2fMB planned)", block + 1,
                plan_.blocks.size(), planned.members.size(),
                static_cast<double>(planned.bytes) / 1e6);
  return buffer;
}

size_t ProphetPolicy::queued() const {
  size_t total = late_queue_.size() + credit_queue_.size() + overdue_queue_.size();
  for (const PriorityTaskQueue& queue : block_queues_) total += queue.size();
  return total;
}

int64_t ProphetPolicy::NextWakeupNs() const {
  // Only the credit-phase deadline can release tasks without a new event.
  if (!blocks_active_ || credit_phase_ || queued() == 0) return -1;
  return CreditDeadlineNs();
}

int ProphetPolicy::open_block() const {
  if (!blocks_active_ || open_block_ >= static_cast<int>(block_queues_.size())) return -1;
  return open_block_;
}

std::string ProphetPolicy::Describe() const {
  std::string out = "prophet: ";
  if (!has_plan_) {
    out += profiler_.has_profile() ? "priority order (no bandwidth estimate yet)"
                                   : "priority order (no profile yet)";
    char buffer[64];
    std::snprintf(buffer, sizeof(buffer), ", %.1f MB/s", bandwidth()->estimate_Bps() / 1e6);
    return out + buffer;
  }
  out += plan_.Summary();
  out += ", replans " + std::to_string(replans_);
  if (!last_replan_reason_.empty()) out += " (last: " + last_replan_reason_ + ")";
  if (!blocks_active_) {
    out += ", priority order (plan has no block)";
  } else if (open_block() >= 0) {
    out += ", block " + std::to_string(open_block_ + 1) + "/" +
           std::to_string(block_queues_.size()) + " open";
  } else {
    out += credit_phase_ ? ", credit phase" : ", blocks done";
  }
  return out;
}

std::unique_ptr<SchedulerPolicy> MakeProphetPolicy(const SchedulerOptions& options) {
  // The byte credit is applied by the engine on every Dequeue call.
  ProphetOptions prophet;
  prophet.replan_threshold = options.replan_threshold;
  return std::make_unique<ProphetPolicy>(prophet);
}

}  // namespace prophet
