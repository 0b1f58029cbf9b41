#include "ops/sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <memory>
#include <queue>
#include <unordered_map>
#include <utility>

#include "ops/core/connection.h"
#include "ops/core/engine_options.h"
#include "ops/core/partition.h"
#include "ops/core/policies.h"
#include "ops/core/schedule_traits.h"
#include "ops/core/scheduler.h"
#include "ops/core/small_allreduce.h"
#include "ops/core/timeline.h"
#include "ops/core/wire.h"
#include "ops/sim/link_model.h"

namespace prophet {

namespace {

// The engine sums a push in chunks of this size as it arrives (connection.cc, kStageBytes): when
// the last contribution's last byte is in, one chunk is left to add.
constexpr uint64_t kSumChunkBytes = 256 * 1024;
// With CPU costs per byte (NetworkModel), what is left to read and add once a payload's last byte
// is in, where the I/O thread handles bytes faster than they arrive (it keeps pace, waiting):
// one receive's worth (the kernel hands over about 64 KiB at a time, GRO's size).
constexpr uint64_t kReceiveTailBytes = 64 * 1024;
constexpr uint64_t kMaxEvents = uint64_t{2} << 30;

enum class EventKind : uint8_t {
  kStepBegin,
  kForwardStart,
  kForwardDone,
  kTensorReady,
  kBackwardDone,
  kStepReturn,
  kArrive,
  kSumDone,
  kApplyDone,
  kWakeup,
  kSendFrame,     // the sender's I/O thread has spent message_send_ns on the frame (`tag`)
  kFrameArrived,  // its last byte is at the receiver, whose I/O thread takes message_receive_ns
  kHeartbeat,     // every worker's heartbeats (one event for all: it ends when nothing else happens)
};

struct Event {
  int64_t time_ns;
  uint64_t seq;
  EventKind kind;
  int worker;
  int step;
  int index;     // layer, tensor or partition
  uint64_t tag;  // frame id, op key
  bool operator>(const Event& other) const {
    return time_ns != other.time_ns ? time_ns > other.time_ns : seq > other.seq;
  }
};

// kLocalPush / kLocalResult: the two-level path's frames between the workers of one host.
// kExchange: a stage of a small push_pull's exchange (`partition`: the stage).
enum class FrameKind : uint8_t { kPush, kResult, kRing, kLocalPush, kLocalResult, kExchange, kHeartbeat };

struct FrameInfo {
  FrameKind kind = FrameKind::kPush;
  int step = 0;
  int tensor = 0;     // kRing: which ring of the step (0 gradients, 1 control)
  int partition = 0;  // kRing: subdivision; kHeartbeat: the lane
  int round = 0;      // kRing only
  uint64_t bytes = 0;
  int src = 0, dst = 0;  // kSendFrame: where it goes once its sender's thread has sent it
  int64_t priority = 0;
};

uint64_t OpKey(int step, int tensor) {
  return (static_cast<uint64_t>(step) << 32) | static_cast<uint32_t>(tensor);
}
int KeyStep(uint64_t key) { return static_cast<int>(key >> 32); }
int KeyTensor(uint64_t key) { return static_cast<int>(key & 0xffffffffu); }

// One partition of a push_pull on one worker.
struct PartState {
  int contributions = 0;      // owned (or led, two-level) partitions: contributions added, own included
  int results_unwritten = 0;  // sums not yet written to sockets (owner; two-level: the host's leader too)
  int64_t push_sent_ns = 0;
  // An owned partition the policy schedules (SchedulerPolicy::schedules_owned_partitions): the own
  // contribution counts once the policy released it, and its sum reports back as a local transfer.
  bool local_task = false;
};

// One push_pull of one tensor in one step, on one worker.
struct Op {
  uint64_t request = 0;  // the engine's request id of this worker's submission
  int64_t submit_ns = 0;
  int parts_left = 0;
  std::vector<PartState> parts;
  // By exchange (small_allreduce.h): the worker's ExchangePlan step to run next, whether its
  // frame is sent, when this worker last sent, and by step when its partner's frame arrived
  // (-1: not yet).
  bool submitted = false;
  size_t exchange_next = 0;
  bool exchange_sent = false;
  int64_t exchange_sent_ns = -1;
  std::vector<int64_t> exchange_arrived_ns;
};

// MultiWorkerMirroredStrategy's ring all-reduce of one step on one worker.
struct Ring {
  bool started = false;
  int64_t start_ns = 0;
  int subdivs = 0;
  uint64_t chunk_bytes = 0;
  std::vector<int> sent;      // per subdivision: rounds sent
  std::vector<int> received;  // per subdivision: rounds received
  int subdivs_done = 0;
};

struct ApplyJob {
  int step;
  int tensor;
};

struct StepState {
  int64_t begin_ns = -1;
  int64_t backward_start_ns = 0;
  int outstanding = 0;  // what the train function still waits for
  int applies_left = 0;  // mwms: updates after the all-reduce
};

struct Worker {
  std::unique_ptr<SchedulerPolicy> policy;
  uint64_t unsent_push_bytes = 0;  // released pushes not yet written to their socket: the credit
  uint64_t enqueue_seq = 0;
  uint64_t next_request = 1;
  std::unordered_map<uint64_t, Op> ops;                  // by OpKey
  std::unordered_map<uint64_t, uint64_t> op_of_request;  // request id -> OpKey
  std::unordered_map<uint64_t, Ring> rings;              // by OpKey(step, which ring)
  std::vector<StepState> steps;
  std::vector<int> updates_pending;  // per layer: updates its next forward pass waits for
  int waiting_layer = -1;            // the forward pass waits for this layer's updates
  int waiting_step = 0;
  int64_t waiting_since_ns = 0;
  int64_t gate_wait_ns = 0;          // in measured steps
  std::deque<ApplyJob> apply_queue;
  int applies_running = 0;
  int64_t wakeup_ns = -1;
  std::unique_ptr<Timeline> timeline;
  // Per I/O thread (NetworkModel::io_threads): busy with frames until then (CPU costs).
  std::vector<int64_t> io_free_ns;
  int64_t io_busy_ns = 0;    // the CPU work charged to those threads so far
  uint64_t frames_sent = 0;  // every kind
  std::vector<ExchangeStep> exchange_plan;  // ExchangePlan(w, N)
};

class Simulation {
 public:
  Simulation(const StepProfile& profile, const NetworkModel& network, const RuntimeModel& runtime,
             const SimulationOptions& options)
      : profile_(profile), network_(network), runtime_(runtime), options_(options),
        n_(network.workers), link_(MakeLinkOptions(network)),
        two_level_(runtime.schedule != "mwms" &&
                   UseTwoLevel(runtime.hierarchical, UniformLayout(network.workers, network.workers_per_host))) {}

  Status Run(StepPrediction* prediction);

 private:
  static LinkOptions MakeLinkOptions(const NetworkModel& network) {
    LinkOptions o;
    o.workers = network.workers;
    o.workers_per_host = network.workers_per_host;
    o.loopback_Bps = network.loopback_Bps;
    o.egress_Bps = network.link_Bps;
    o.ingress_Bps = network.ingress_limited ? network.link_Bps : 0;
    o.payload_efficiency = network.payload_efficiency;
    o.frame_overhead_bytes = network.frame_overhead_bytes;
    o.socket_window_bytes = KernelSendBufferBytes(network);
    return o;
  }
  bool mwms() const { return runtime_.schedule == "mwms"; }
  // The two-level path (RuntimeModel::hierarchical): partitions are owned by hosts; on each host
  // one worker, the partition's leader, sums the host's contributions and exchanges them.
  bool two_level() const { return two_level_; }
  int per_host() const { return link_.options().workers_per_host; }
  int Leader(int host, int tensor, int partition) const {
    return host * per_host() + leader_rank_[tensor][partition];
  }
  // The worker that sums partition `partition` of `tensor` over every worker (two-level: over
  // every host) and sends the sum back.
  int Owner(int tensor, int partition) const {
    const int owner = partitions_[tensor][partition].owner;
    return two_level() ? Leader(owner, tensor, partition) : owner;
  }
  // Contributions worker `w` sums for the partition before it pushes (a host's leader) or sends
  // the sum back (the owner).
  int ContributionsNeeded(int w, int tensor, int partition) const {
    if (!two_level()) return n_;
    const int k = per_host();
    return Owner(tensor, partition) == w ? k + link_.hosts() - 1 : k;
  }
  bool crossing() const { return runtime_.cross_barrier && !mwms(); }
  bool IsControl(int tensor) const { return profile_.tensors[tensor].priority >= kControlPriority; }
  int total_steps() const { return options_.warmup_steps + options_.steps + 1; }
  bool measured(int step) const {
    return step >= options_.warmup_steps && step < options_.warmup_steps + options_.steps;
  }

  void Push(int64_t time_ns, EventKind kind, int worker, int step = 0, int index = 0, uint64_t tag = 0) {
    events_.push({time_ns, seq_++, kind, worker, step, index, tag});
  }
  void Handle(const Event& e);
  void HandleLink(const LinkEvent& e);

  // Compute.
  void StepBegin(int w, int step);
  void ForwardStart(int w, int step, int layer);
  void ForwardDone(int w, int step, int layer);
  void Ready(int w, int step, int tensor);
  void BackwardDone(int w, int step);
  void StepWorkDone(int w, int step);  // one thing the train function waits for is done
  void StepReturn(int w, int step);
  // Updates.
  void QueueApply(int w, int step, int tensor);
  void StartApplies(int w);
  void ApplyDone(int w, int step, int tensor);
  // The runtime.
  void Submit(int w, int step, int tensor);
  void Pump(int w);
  // `extra_work_ns`: CPU the sender spends on the frame before writing it, beyond its own
  // costs (an owner's encoding of a compressed sum, once for all its frames).
  void SendFrame(int src, int dst, int64_t priority, const FrameInfo& info, int64_t extra_work_ns = 0);
  void EnqueuePush(int w, int step, int tensor, int partition, int owner);
  void MaybeSum(int owner, uint64_t key, int partition);
  void SendLocalResults(int leader, uint64_t key, int partition);
  void SumDone(int owner, uint64_t key, int partition);
  void PartitionDone(int w, uint64_t key);
  void OpDone(int w, int step, int unit);          // every member of the unit is summed
  void TensorDone(int w, int step, int tensor);
  void Arrive(int dst, int src, uint64_t frame);
  // Hands a frame to the link (after the sender's CPU work on it, if any).
  void QueueOnLink(uint64_t frame);
  // Charges `work_ns` of CPU to worker w's I/O thread of `lane` (and, with shared cores, one of
  // the pool's cores), starting no earlier than `earliest_ns`; returns when the work starts.
  int64_t IoWork(int w, int lane, int64_t earliest_ns, int64_t work_ns);
  // When worker w's I/O thread of `lane` is free.
  int64_t& IoThread(int w, int lane);
  // The lane (I/O thread) whose connections carry a frame, as the engine routes (engine.h).
  int Lane(const FrameInfo& info) const;
  // With NetworkModel::shared_cores: takes the first core free at or after `earliest_ns` for
  // `work_ns` and returns when the work starts; else `earliest_ns` (a core of its own).
  int64_t SharedCore(int64_t earliest_ns, int64_t work_ns);
  // The fastest a frame between these workers can move its bytes (the link's payload rate, or
  // loopback), bytes per ns.
  double FrameRate(int src, int dst) const;
  // Whether a frame's values travel encoded (compression: half the bytes of its tensor's).
  bool Encoded(const FrameInfo& info) const {
    return info.kind != FrameKind::kRing && info.kind != FrameKind::kExchange && info.kind != FrameKind::kHeartbeat &&
           units_[info.tensor].encoding != Encoding::kNone;
  }
  // The receiver's I/O thread takes the frame (after its message cost, if any).
  void Received(int dst, int src, uint64_t frame);
  // Every worker's heartbeat frames of this period (RuntimeModel::heartbeat_ns), then the next.
  void Heartbeats();
  // By exchange: runs worker w's plan as far as the frames here allow; the last step completes
  // the op.
  void ExchangeAdvance(int w, uint64_t key);
  // A push's sum, or an exchange stage's partner frame, came back: the policy's bandwidth
  // monitor and the timeline hear of it, as in the engine (Engine::Impl::PushCompleted).
  void TransferCompleted(int w, const TransferDone& done);
  // mwms.
  void RingStart(int w, int step, int which);
  void RingAdvance(int w, int step, int which);
  void RingDone(int w, int step, int which);
  uint64_t RingBytes(int which) const;

  Op& OpAt(int w, uint64_t key);
  // units_ and their members from the fusion plan (PlanFusion, as the engine plans).
  void PlanUnits();
  // The scheduler's task for worker `w`'s push `info` to `owner`.
  const SendTask& PushTask(int w, int owner, const FrameInfo& info);
  // Worker 0's first measured step: one tensor's milestones, for StepPrediction::tensor_times.
  double* Milestone(int w, int step, int tensor, double TensorTiming::*field) {
    if (w != 0 || step != options_.warmup_steps) return nullptr;
    return &(timings_[tensor].*field);
  }
  void Note(int w, int step, int tensor, double TensorTiming::*field) {
    if (double* at = Milestone(w, step, tensor, field)) {
      *at = static_cast<double>(now_ns_ - workers_[0].steps[step].begin_ns) / 1e9;
    }
  }

  const StepProfile& profile_;
  const NetworkModel& network_;
  const RuntimeModel& runtime_;
  const SimulationOptions& options_;
  const int n_;
  LinkModel link_;
  const bool two_level_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t seq_ = 0;
  int64_t now_ns_ = 0;
  std::vector<Worker> workers_;
  const bool charges_cpu_ = ChargesCpu(network_);
  // With NetworkModel::shared_cores: when each core of the pool is next free.
  std::priority_queue<int64_t, std::vector<int64_t>, std::greater<int64_t>> cores_;
  int64_t io_busy_begin_ns_ = 0, io_busy_end_ns_ = 0;
  // What travels: one unit per fusion bucket (fusion.h), a lone tensor as itself. Ops, frames
  // and partitions are per unit; FrameInfo::tensor and OpKey's tensor index a unit.
  std::vector<ModelTensor> units_;
  std::vector<std::vector<int>> unit_members_;      // tensors of each unit
  std::vector<int> unit_lane_;                      // the lane a bucket was dealt to (Lane); -1: not a bucket
  std::vector<int> unit_of_;                        // per tensor
  std::vector<std::unordered_map<uint64_t, size_t>> unit_ready_;  // per worker, by OpKey(step, unit)
  std::vector<std::vector<Partition>> partitions_;  // per unit (two-level: owners are hosts)
  // Per unit that travels in slices, one per lane (flat path), each partition's lane; else empty.
  std::vector<std::vector<int>> partition_lanes_;
  std::vector<std::vector<int>> leader_rank_;       // two-level: per unit and partition, the leader's rank on its host
  std::vector<bool> exchanged_;                     // per unit: by exchange (SmallAllreduceApplies)
  std::vector<FrameInfo> frames_;
  std::vector<uint64_t> free_frames_;
  int controls_ = 0;
  int gradients_ = 0;
  int64_t forward_ns_ = 0;
  int64_t measure_begin_ns_ = -1, measure_end_ns_ = -1;
  int64_t busy_begin_ns_ = 0, busy_end_ns_ = 0;
  double wire_begin_ = 0, wire_end_ = 0;
  uint64_t frames_begin_ = 0, frames_end_ = 0;
  std::vector<TensorTiming> timings_;
  std::vector<double> bandwidth_samples_;
  SendTask scratch_task_;              // PushTask's
  TransferDone scratch_done_;          // Arrive's
  std::vector<SendTask> released_;     // Pump's  // worker 0's estimate as each measured step begins
};

Op& Simulation::OpAt(int w, uint64_t key) {
  auto it = workers_[w].ops.find(key);
  if (it != workers_[w].ops.end()) return it->second;
  Op& op = workers_[w].ops[key];
  const std::vector<Partition>& parts = partitions_[KeyTensor(key)];
  op.parts_left = static_cast<int>(parts.size());
  op.parts.assign(parts.size(), PartState());
  return op;
}

const SendTask& Simulation::PushTask(int w, int owner, const FrameInfo& info) {
  const ModelTensor& t = units_[info.tensor];
  const Op& op = OpAt(w, OpKey(info.step, info.tensor));
  // One task rebuilt in place: assigning the name reuses its buffer (no allocation per push).
  SendTask& task = scratch_task_;
  task.name = t.name;
  task.round = static_cast<uint64_t>(info.step);
  task.request_id = op.request;
  task.partition = info.partition;
  task.peer = owner;
  task.priority = t.priority;
  task.bytes = info.bytes;
  task.ready_ns = op.submit_ns;
  task.enqueue_seq = 0;
  return task;
}

// ------------------------------------------------------------------------------------------------
// Compute

void Simulation::StepBegin(int w, int step) {
  Worker& worker = workers_[w];
  StepState& s = worker.steps[step];
  s.begin_ns = now_ns_;
  s.outstanding = 1 + (mwms() ? 0 : controls_) + (crossing() || mwms() ? 0 : gradients_);
  if (w == 0 && measured(step)) bandwidth_samples_.push_back(worker.policy->bandwidth()->estimate_Bps());
  if (w == 0 && step == options_.warmup_steps) {
    measure_begin_ns_ = now_ns_;
    busy_begin_ns_ = link_.egress_busy_ns(0, now_ns_);
    wire_begin_ = link_.sent_wire_bytes(0);
    frames_begin_ = worker.frames_sent;
    io_busy_begin_ns_ = worker.io_busy_ns;
  }
  if (w == 0 && step == options_.warmup_steps + options_.steps) {
    measure_end_ns_ = now_ns_;
    busy_end_ns_ = link_.egress_busy_ns(0, now_ns_);
    wire_end_ = link_.sent_wire_bytes(0);
    frames_end_ = worker.frames_sent;
    io_busy_end_ns_ = worker.io_busy_ns;
  }
  Push(now_ns_ + profile_.launch_ns, EventKind::kForwardStart, w, step, 0);
}

void Simulation::ForwardStart(int w, int step, int layer) {
  Worker& worker = workers_[w];
  if (crossing() && worker.updates_pending[layer] > 0) {
    worker.waiting_layer = layer;  // the layer's gate: its variables' pending updates
    worker.waiting_step = step;
    worker.waiting_since_ns = now_ns_;
    return;
  }
  Push(now_ns_ + profile_.layers[layer].forward_ns, EventKind::kForwardDone, w, step, layer);
}

void Simulation::ForwardDone(int w, int step, int layer) {
  Worker& worker = workers_[w];
  const ModelLayer& l = profile_.layers[layer];
  if (worker.timeline) worker.timeline->Complete("forward", l.name, now_ns_ - l.forward_ns, now_ns_);
  if (layer + 1 < static_cast<int>(profile_.layers.size())) {
    ForwardStart(w, step, layer + 1);
    return;
  }
  worker.steps[step].backward_start_ns = now_ns_;
  for (size_t t = 0; t < profile_.tensors.size(); ++t) {
    Push(now_ns_ + std::max<int64_t>(0, profile_.tensors[t].ready_ns), EventKind::kTensorReady, w, step,
         static_cast<int>(t));
  }
  Push(now_ns_ + profile_.backward_ns, EventKind::kBackwardDone, w, step);
}

void Simulation::Ready(int w, int step, int tensor) {
  Worker& worker = workers_[w];
  const ModelTensor& t = profile_.tensors[tensor];
  Note(w, step, tensor, &TensorTiming::ready_s);
  if (mwms()) return;  // the all-reduce packs every gradient after the backward pass
  if (worker.timeline) worker.timeline->Instant("ready", t.name, now_ns_);
  if (crossing() && t.layer >= 0 && !IsControl(tensor)) ++worker.updates_pending[t.layer];
  const int unit = unit_of_[tensor];
  if (unit_members_[unit].size() > 1) {  // a fused bucket goes once its last member is ready
    auto it = unit_ready_[w].emplace(OpKey(step, unit), 0).first;
    if (++it->second < unit_members_[unit].size()) return;
    unit_ready_[w].erase(it);
  }
  Submit(w, step, unit);
}

void Simulation::BackwardDone(int w, int step) {
  Worker& worker = workers_[w];
  if (worker.timeline) {
    // Drawn from the layers' profiled backward times, last layer first.
    int64_t at = worker.steps[step].backward_start_ns;
    for (auto it = profile_.layers.rbegin(); it != profile_.layers.rend(); ++it) {
      if (it->backward_ns <= 0) continue;
      worker.timeline->Complete("backward", it->name, at, at + it->backward_ns);
      at += it->backward_ns;
    }
  }
  if (mwms()) {
    RingStart(w, step, 0);
    return;
  }
  StepWorkDone(w, step);
}

void Simulation::StepWorkDone(int w, int step) {
  if (--workers_[w].steps[step].outstanding == 0) Push(now_ns_ + profile_.tail_ns, EventKind::kStepReturn, w, step);
}

void Simulation::StepReturn(int w, int step) {
  Worker& worker = workers_[w];
  if (worker.timeline) {
    worker.timeline->Complete("step", "step " + std::to_string(step), worker.steps[step].begin_ns, now_ns_);
  }
  if (step + 1 < total_steps()) Push(now_ns_ + profile_.gap_ns, EventKind::kStepBegin, w, step + 1);
}

// ------------------------------------------------------------------------------------------------
// Updates: a pool of apply_threads threads, first come first served

void Simulation::QueueApply(int w, int step, int tensor) {
  workers_[w].apply_queue.push_back({step, tensor});
  StartApplies(w);
}

void Simulation::StartApplies(int w) {
  Worker& worker = workers_[w];
  while (!worker.apply_queue.empty() && worker.applies_running < std::max(1, runtime_.apply_threads)) {
    const ApplyJob job = worker.apply_queue.front();
    worker.apply_queue.pop_front();
    ++worker.applies_running;
    const int64_t work_ns = profile_.tensors[job.tensor].apply_ns;
    // An update is the framework's CPU work: on shared cores it waits for one, as the I/O
    // threads do (the profile timed it on a machine of its own).
    const int64_t start = work_ns > 0 ? SharedCore(now_ns_, work_ns) : now_ns_;
    Push(start + work_ns, EventKind::kApplyDone, w, job.step, job.tensor);
  }
}

void Simulation::ApplyDone(int w, int step, int tensor) {
  Worker& worker = workers_[w];
  const ModelTensor& t = profile_.tensors[tensor];
  --worker.applies_running;
  Note(w, step, tensor, &TensorTiming::applied_s);
  if (worker.timeline && t.apply_ns > 0) worker.timeline->Complete("apply", t.name, now_ns_ - t.apply_ns, now_ns_);
  StartApplies(w);
  if (mwms()) {
    if (--worker.steps[step].applies_left == 0) {
      if (controls_ > 0) {
        RingStart(w, step, 1);
      } else {
        StepWorkDone(w, step);
      }
    }
    return;
  }
  if (!crossing()) {
    StepWorkDone(w, step);
    return;
  }
  if (t.layer < 0) return;
  if (--worker.updates_pending[t.layer] == 0 && worker.waiting_layer == t.layer) {
    worker.waiting_layer = -1;
    if (worker.timeline) worker.timeline->Complete("gate", profile_.layers[t.layer].name, worker.waiting_since_ns, now_ns_);
    if (measured(worker.waiting_step)) worker.gate_wait_ns += now_ns_ - worker.waiting_since_ns;
    ForwardStart(w, worker.waiting_step, t.layer);
  }
}

// ------------------------------------------------------------------------------------------------
// The runtime: push_pull through the policy, owners' sums, results

void Simulation::Submit(int w, int step, int tensor) {
  Worker& worker = workers_[w];
  const ModelTensor& t = units_[tensor];
  if (n_ == 1) {  // the engine's one-worker path: the sum of one contribution is the input
    OpDone(w, step, tensor);
    return;
  }
  const uint64_t key = OpKey(step, tensor);
  Op& op = OpAt(w, key);
  op.submit_ns = now_ns_;
  // A fused bucket's members are packed into it on the I/O thread before its frames go.
  if (charges_cpu_ && unit_members_[tensor].size() > 1) {
    IoWork(w, unit_lane_[tensor], now_ns_, static_cast<int64_t>(static_cast<double>(t.bytes) * network_.copy_byte_ns));
  }
  TensorReady ready;
  ready.name = &t.name;
  ready.round = static_cast<uint64_t>(step);
  ready.priority = t.priority;
  ready.bytes = t.bytes;
  ready.ready_ns = now_ns_;
  worker.policy->OnTensorReady(ready);
  const uint64_t request = worker.next_request++;
  worker.op_of_request[request] = key;
  op.request = request;
  op.submitted = true;
  if (exchanged_[tensor]) {
    ExchangeAdvance(w, key);
    return;
  }
  const std::vector<Partition>& parts = partitions_[tensor];
  if (two_level()) {
    // Every partition goes to its leader on this host first; leaders push later (HostSumDone).
    const int host = link_.host_of(w);
    for (size_t p = 0; p < parts.size(); ++p) {
      const int leader = Leader(host, tensor, static_cast<int>(p));
      if (leader == w) {
        ++op.parts[p].contributions;
        MaybeSum(w, key, static_cast<int>(p));
        continue;
      }
      FrameInfo info;
      info.kind = FrameKind::kLocalPush;
      info.step = step;
      info.tensor = tensor;
      info.partition = static_cast<int>(p);
      info.bytes = t.WireBytes(parts[p].bytes);
      SendFrame(w, leader, t.priority, info);
    }
    Pump(w);
    return;
  }
  const bool schedule_owned = worker.policy->schedules_owned_partitions();
  for (size_t p = 0; p < parts.size(); ++p) {
    if (parts[p].owner == w && !schedule_owned) {
      ++op.parts[p].contributions;
      continue;
    }
    op.parts[p].local_task = parts[p].owner == w;
    EnqueuePush(w, step, tensor, static_cast<int>(p), parts[p].owner);
  }
  for (size_t p = 0; p < parts.size(); ++p) {
    if (parts[p].owner == w) MaybeSum(w, key, static_cast<int>(p));
  }
  Pump(w);
}

void Simulation::EnqueuePush(int w, int step, int tensor, int partition, int owner) {
  Worker& worker = workers_[w];
  const ModelTensor& t = units_[tensor];
  SendTask& task = scratch_task_;  // the policy copies it; the name's buffer is reused
  task.name = t.name;
  task.round = static_cast<uint64_t>(step);
  task.request_id = OpAt(w, OpKey(step, tensor)).request;
  task.partition = partition;
  task.peer = owner;
  task.priority = t.priority;
  task.bytes = t.WireBytes(partitions_[tensor][partition].bytes);  // what travels: the credit and the planner count it
  task.ready_ns = now_ns_;
  task.enqueue_seq = worker.enqueue_seq++;
  worker.policy->Enqueue(task);
}

void Simulation::Pump(int w) {
  Worker& worker = workers_[w];
  if (worker.policy->queued() > 0) {
    const uint64_t credit = ResolveScheduleCreditBytes(runtime_.credit_bytes, runtime_.schedule, n_, runtime_.partition_bytes);
    std::vector<SendTask>& tasks = released_;
    tasks.clear();
    worker.policy->Dequeue(worker.unsent_push_bytes < credit ? credit - worker.unsent_push_bytes : 0, now_ns_, &tasks);
    for (const PolicySpan& span : worker.policy->TakeSpans()) {
      if (worker.timeline) {
        worker.timeline->Complete("block", span.label, span.start_ns, span.end_ns,
                                  "{\"tasks\": " + std::to_string(span.tasks) + ", \"bytes\": " +
                                      std::to_string(span.bytes) + "}");
      }
    }
    bool owned_released = false;
    for (const SendTask& task : tasks) {
      const uint64_t key = worker.op_of_request[task.request_id];
      Op& op = OpAt(w, key);
      op.parts[task.partition].push_sent_ns = now_ns_;
      if (task.peer == w) {  // an owned partition: nothing travels, its own contribution counts
        ++op.parts[task.partition].contributions;
        worker.policy->OnPushLeft(task);
        MaybeSum(w, key, task.partition);
        owned_released = true;
        continue;
      }
      worker.unsent_push_bytes += task.bytes;
      FrameInfo info;
      info.kind = FrameKind::kPush;
      info.step = KeyStep(key);
      info.tensor = KeyTensor(key);
      info.partition = task.partition;
      info.bytes = task.bytes;
      SendFrame(w, task.peer, task.priority, info);
    }
    // Released owned partitions took credit for a moment only, as in the engine's pump loop.
    if (owned_released && worker.policy->queued() > 0) {
      Pump(w);
      return;
    }
  }
  const int64_t wake = worker.policy->NextWakeupNs();
  // A deadline already passed was seen by this Dequeue; the next event pumps again.
  if (wake > now_ns_ && (worker.wakeup_ns < 0 || wake < worker.wakeup_ns)) {
    worker.wakeup_ns = wake;
    Push(wake, EventKind::kWakeup, w);
  }
}

int64_t Simulation::SharedCore(int64_t earliest_ns, int64_t work_ns) {
  if (network_.shared_cores <= 0) return earliest_ns;
  const int64_t start = std::max(earliest_ns, cores_.top());
  cores_.pop();
  cores_.push(start + work_ns);
  return start;
}

int64_t& Simulation::IoThread(int w, int lane) { return workers_[w].io_free_ns[static_cast<size_t>(lane)]; }

int Simulation::Lane(const FrameInfo& info) const {
  const uint64_t lanes = workers_.front().io_free_ns.size();
  if (lanes == 1) return 0;
  // The ring's chunks: by subdivision (the ring is not the engine's; its threads are TF's).
  if (info.kind == FrameKind::kRing) return static_cast<int>(static_cast<uint64_t>(info.partition) % lanes);
  if (info.kind == FrameKind::kHeartbeat) return info.partition;
  const ModelTensor& t = units_[info.tensor];
  if (unit_lane_[info.tensor] >= 0) return unit_lane_[info.tensor];  // a bucket: where it was dealt
  const std::vector<int>& sliced = partition_lanes_[info.tensor];
  if (!sliced.empty()) return sliced[static_cast<size_t>(info.partition)];
  return static_cast<int>(HashString(t.name) % lanes);
}

int64_t Simulation::IoWork(int w, int lane, int64_t earliest_ns, int64_t work_ns) {
  Worker& worker = workers_[w];
  int64_t& free_ns = IoThread(w, lane);
  const int64_t start = SharedCore(std::max(earliest_ns, free_ns), work_ns);
  free_ns = start + work_ns;
  worker.io_busy_ns += work_ns;
  return start;
}

double Simulation::FrameRate(int src, int dst) const {
  if (link_.host_of(src) == link_.host_of(dst)) return network_.loopback_Bps / 1e9;
  return network_.link_Bps * network_.payload_efficiency / 1e9;
}

void Simulation::SendFrame(int src, int dst, int64_t priority, const FrameInfo& info, int64_t extra_work_ns) {
  uint64_t id;
  if (!free_frames_.empty()) {
    id = free_frames_.back();
    free_frames_.pop_back();
    frames_[id] = info;
  } else {
    id = frames_.size();
    frames_.push_back(info);
  }
  FrameInfo& f = frames_[id];
  f.src = src;
  f.dst = dst;
  f.priority = priority;
  ++workers_[src].frames_sent;
  if (!charges_cpu_) {
    QueueOnLink(id);
    return;
  }
  // The header and system call, the values' encoding (a compressed push), then the payload's
  // copy into the socket, which holds the frame back only where it is slower than the link.
  const double wire = static_cast<double>(info.bytes);
  const bool encodes = Encoded(info) && (info.kind == FrameKind::kPush || info.kind == FrameKind::kLocalPush);
  const int64_t before = network_.message_send_ns + extra_work_ns +
                         (encodes ? static_cast<int64_t>(2 * wire * network_.cast_byte_ns) : 0);
  const double copy_ns = wire * network_.send_byte_ns;
  const int64_t start = IoWork(src, Lane(info), now_ns_, before + static_cast<int64_t>(copy_ns));
  const int64_t held_ns = static_cast<int64_t>(std::max(0.0, copy_ns - wire / FrameRate(src, dst)));
  Push(start + before + held_ns, EventKind::kSendFrame, src, 0, 0, id);
}

void Simulation::QueueOnLink(uint64_t id) {
  const FrameInfo& info = frames_[id];
  LinkFrame frame;
  frame.src = info.src;
  frame.dst = info.dst;
  frame.payload_bytes = info.bytes;
  frame.priority = info.priority;
  frame.tag = id;
  link_.Queue(now_ns_, frame);
}

void Simulation::Received(int dst, int src, uint64_t frame) {
  if (!charges_cpu_) {
    Arrive(dst, src, frame);
    return;
  }
  const FrameInfo& info = frames_[frame];
  const double wire = static_cast<double>(info.bytes);
  const double values = Encoded(info) ? 2 * wire : wire;  // float32 bytes of the sum
  const bool sums = info.kind == FrameKind::kPush || info.kind == FrameKind::kLocalPush ||
                    info.kind == FrameKind::kExchange || (info.kind == FrameKind::kRing && info.round < n_ - 1);
  const double per_byte = network_.receive_byte_ns + (sums ? values / wire * network_.sum_byte_ns : 0) +
                          (Encoded(info) ? values / wire * network_.cast_byte_ns : 0);
  const double payload_ns = wire * per_byte;
  // The thread reads and sums a payload as it arrives: it may have started on it as soon as its
  // first bytes could be in, and, where it is faster than the link (it waits for the bytes), has
  // one receive's work left once the last one is.
  const double rate = FrameRate(src, dst);
  const int64_t first_bytes_ns = now_ns_ - static_cast<int64_t>(wire / rate);
  const int lane = Lane(info);
  const int64_t start = IoWork(dst, lane, first_bytes_ns, network_.message_receive_ns + static_cast<int64_t>(payload_ns));
  const double tail_ns = per_byte * rate < 1 ? std::min(wire, static_cast<double>(kReceiveTailBytes)) * per_byte : 0;
  const int64_t end = std::max(start + network_.message_receive_ns + static_cast<int64_t>(payload_ns),
                               now_ns_ + network_.message_receive_ns + static_cast<int64_t>(tail_ns));
  int64_t& thread = IoThread(dst, lane);
  thread = std::max(thread, end);
  Push(end, EventKind::kArrive, dst, 0, src, frame);
}

void Simulation::MaybeSum(int owner, uint64_t key, int partition) {
  Op& op = OpAt(owner, key);
  const int needed = ContributionsNeeded(owner, KeyTensor(key), partition);
  if (op.parts[partition].contributions != needed) return;
  op.parts[partition].contributions = needed + 1;  // summed: never again
  const Partition& p = partitions_[KeyTensor(key)][partition];
  int64_t delay = 0;
  if (network_.sum_Bps > 0) {
    delay = static_cast<int64_t>(static_cast<double>(std::min(p.bytes, kSumChunkBytes)) / network_.sum_Bps * 1e9);
  }
  Push(now_ns_ + delay, EventKind::kSumDone, owner, 0, partition, key);
}

void Simulation::SumDone(int owner, uint64_t key, int partition) {
  const int tensor = KeyTensor(key), step = KeyStep(key);
  if (two_level() && Owner(tensor, partition) != owner) {
    // A host's leader has its host's sum: it pushes it to the partition's owner, through its
    // policy and under its credit, as any push.
    EnqueuePush(owner, step, tensor, partition, Owner(tensor, partition));
    Pump(owner);
    return;
  }
  FrameInfo info;
  info.kind = FrameKind::kResult;
  info.step = step;
  info.tensor = tensor;
  info.partition = partition;
  info.bytes = units_[tensor].WireBytes(partitions_[tensor][partition].bytes);
  const int64_t priority = units_[tensor].priority;
  // A compressed sum is encoded once, before its first frame.
  int64_t encode_ns = Encoded(info) ? static_cast<int64_t>(2.0 * static_cast<double>(info.bytes) * network_.cast_byte_ns) : 0;
  if (!two_level()) {
    PartState& part = OpAt(owner, key).parts[partition];
    const bool local_task = part.local_task;
    if (local_task) {
      TransferDone& done = scratch_done_;
      done.task = PushTask(owner, owner, info);
      done.sent_ns = part.push_sent_ns;
      done.done_ns = now_ns_;
      done.exchange = false;
      done.local = true;
      TransferCompleted(owner, done);
      done.local = false;
    }
    part.results_unwritten = n_ - 1;
    for (int peer = 0; peer < n_; ++peer) {
      if (peer != owner) SendFrame(owner, peer, priority, info, std::exchange(encode_ns, 0));
    }
    // The local transfer returned the partition's credit (bytescheduler's window): the engine asks
    // the policy again at once (PushPull::FinishPartition's PushCompleted runs inside the pump's
    // loop or an I/O turn, and both pump after it), after the sum went to the connections. Without
    // this an owner whose window freed this way waited for an unrelated event, at worst its stall
    // timer, while its peers' windows waited on its next release.
    if (local_task) Pump(owner);
    return;
  }
  // Two-level: the sum goes to the other hosts' leaders, then to this host's other workers.
  const int hosts = link_.hosts(), host = link_.host_of(owner);
  OpAt(owner, key).parts[partition].results_unwritten = hosts - 1 + per_host() - 1;
  for (int h = 0; h < hosts; ++h) {
    if (h != host) SendFrame(owner, Leader(h, tensor, partition), priority, info, std::exchange(encode_ns, 0));
  }
  SendLocalResults(owner, key, partition);
}

void Simulation::SendLocalResults(int leader, uint64_t key, int partition) {
  const int tensor = KeyTensor(key);
  FrameInfo info;
  info.kind = FrameKind::kLocalResult;
  info.step = KeyStep(key);
  info.tensor = tensor;
  info.partition = partition;
  info.bytes = units_[tensor].WireBytes(partitions_[tensor][partition].bytes);
  const int first = link_.host_of(leader) * per_host();
  for (int peer = first; peer < first + per_host() && peer < n_; ++peer) {
    if (peer != leader) SendFrame(leader, peer, units_[tensor].priority, info);
  }
}

void Simulation::PartitionDone(int w, uint64_t key) {
  Op& op = OpAt(w, key);
  if (--op.parts_left > 0) return;
  const int step = KeyStep(key), tensor = KeyTensor(key);
  Worker& worker = workers_[w];
  if (worker.timeline) {
    const ModelTensor& t = units_[tensor];
    worker.timeline->Complete("op", t.name, op.submit_ns, now_ns_,
                              "{\"round\": " + std::to_string(step) + ", \"bytes\": " + std::to_string(t.bytes) +
                                  ", \"priority\": " + std::to_string(t.priority) + ", \"ok\": true}");
    // The members of a bucket (of one too) keep "op" spans of their own, as the engine writes them.
    const std::vector<int>& members = unit_members_[tensor];
    for (size_t m = 0; unit_lane_[tensor] >= 0 && m < members.size(); ++m) {
      const ModelTensor& member = profile_.tensors[members[m]];
      worker.timeline->Complete("op", member.name, op.submit_ns, now_ns_,
                                "{\"round\": " + std::to_string(step) + ", \"bytes\": " +
                                    std::to_string(member.bytes) + ", \"priority\": " +
                                    std::to_string(member.priority) + ", \"fused\": true, \"ok\": true}");
    }
  }
  worker.op_of_request.erase(op.request);
  worker.ops.erase(key);
  OpDone(w, step, tensor);
}

void Simulation::OpDone(int w, int step, int unit) {
  // ... and their sums copied back out of it.
  if (charges_cpu_ && unit_members_[unit].size() > 1) {
    IoWork(w, unit_lane_[unit], now_ns_, static_cast<int64_t>(static_cast<double>(units_[unit].bytes) * network_.copy_byte_ns));
  }
  for (const int tensor : unit_members_[unit]) TensorDone(w, step, tensor);
}

void Simulation::TensorDone(int w, int step, int tensor) {
  Note(w, step, tensor, &TensorTiming::done_s);
  if (IsControl(tensor)) {
    StepWorkDone(w, step);
    return;
  }
  QueueApply(w, step, tensor);
}

void Simulation::Arrive(int dst, int src, uint64_t frame) {
  const FrameInfo info = frames_[frame];
  free_frames_.push_back(frame);
  if (info.kind == FrameKind::kHeartbeat) return;  // proof of life only
  if (info.kind == FrameKind::kRing) {
    Ring& ring = workers_[dst].rings[OpKey(info.step, info.tensor)];
    if (static_cast<int>(ring.received.size()) <= info.partition) ring.received.resize(info.partition + 1, 0);
    ++ring.received[info.partition];
    if (ring.started) RingAdvance(dst, info.step, info.tensor);
    return;
  }
  const uint64_t key = OpKey(info.step, info.tensor);
  if (info.kind == FrameKind::kExchange) {
    Op& op = OpAt(dst, key);
    const std::vector<ExchangeStep>& plan = workers_[dst].exchange_plan;
    if (op.exchange_arrived_ns.empty()) op.exchange_arrived_ns.assign(plan.size(), -1);
    for (size_t i = 0; i < plan.size(); ++i)
      if (plan[i].stage == info.partition && plan[i].receive_from == src) op.exchange_arrived_ns[i] = now_ns_;
    ExchangeAdvance(dst, key);
    return;
  }
  if (info.kind == FrameKind::kPush || info.kind == FrameKind::kLocalPush) {
    ++OpAt(dst, key).parts[info.partition].contributions;
    MaybeSum(dst, key, info.partition);
    return;
  }
  if (info.kind == FrameKind::kLocalResult) {  // two-level: the host's leader passed the sum on
    PartitionDone(dst, key);
    return;
  }
  // A result: this worker's push of the partition is done.
  Op& op = OpAt(dst, key);
  TransferDone& done = scratch_done_;  // assigned in place, as PushTask's task
  done.task = PushTask(dst, src, info);
  done.sent_ns = op.parts[info.partition].push_sent_ns;
  done.done_ns = now_ns_;
  done.exchange = false;
  TransferCompleted(dst, done);
  if (two_level() && per_host() > 1) {
    // The host's leader is done once it has passed the sum to the host's other workers.
    op.parts[info.partition].results_unwritten = per_host() - 1;
    SendLocalResults(dst, key, info.partition);
  } else {
    PartitionDone(dst, key);
  }
  Pump(dst);
}

void Simulation::TransferCompleted(int w, const TransferDone& done) {
  Worker& worker = workers_[w];
  worker.policy->OnTransferDone(done);
  const std::vector<BandwidthSample> samples = worker.policy->bandwidth()->TakeSamples();
  if (!worker.timeline || done.local) return;
  worker.timeline->Complete(done.exchange ? "exchange" : "push", done.task.name, done.sent_ns, done.done_ns);
  for (const BandwidthSample& b : samples) worker.timeline->Counter("bandwidth_MBps", b.ts_ns, b.estimate_Bps / 1e6);
}

void Simulation::ExchangeAdvance(int w, uint64_t key) {
  Op& op = OpAt(w, key);
  if (!op.submitted) return;  // frames that came early wait for the submission
  const std::vector<ExchangeStep>& plan = workers_[w].exchange_plan;
  if (op.exchange_arrived_ns.empty()) op.exchange_arrived_ns.assign(plan.size(), -1);
  const int unit = KeyTensor(key);
  for (; op.exchange_next < plan.size(); ++op.exchange_next, op.exchange_sent = false) {
    const ExchangeStep& step = plan[op.exchange_next];
    if (!op.exchange_sent && step.send_to >= 0) {
      FrameInfo info;
      info.kind = FrameKind::kExchange;
      info.step = KeyStep(key);
      info.tensor = unit;
      info.partition = step.stage;
      info.bytes = units_[unit].bytes;
      SendFrame(w, step.send_to, units_[unit].priority, info);
      op.exchange_sent_ns = now_ns_;
    }
    op.exchange_sent = true;
    if (step.receive_from < 0) continue;
    const int64_t arrived_ns = op.exchange_arrived_ns[op.exchange_next];
    if (arrived_ns < 0) return;
    if (op.exchange_sent_ns >= 0 && arrived_ns > op.exchange_sent_ns) {
      // The engine's SmallAllreduce::MaybeReportTransfer: a round trip (the monitor's estimate
      // until a socket fills).
      TransferDone& done = scratch_done_;
      done.task = SendTask();
      done.task.name = units_[unit].name;
      done.task.round = static_cast<uint64_t>(KeyStep(key));
      done.task.request_id = op.request;
      done.task.partition = step.stage;
      done.task.peer = step.receive_from;
      done.task.priority = units_[unit].priority;
      done.task.bytes = units_[unit].bytes;
      done.task.ready_ns = op.submit_ns;
      done.sent_ns = op.exchange_sent_ns;
      done.done_ns = arrived_ns;
      done.exchange = true;
      TransferCompleted(w, done);
    }
  }
  op.parts_left = 1;  // the whole tensor is summed
  PartitionDone(w, key);
}

// ------------------------------------------------------------------------------------------------
// mwms: TensorFlow's ring all-reduce (ring_reducer.cc): the packed tensor is cut into N x S
// chunks (S subdivisions of at most ring_chunk_bytes, at most ring_max_subdivs); in each of the
// 2(N-1) rounds every worker sends one chunk per subdivision to the next worker, the one it
// received (and, in the first N-1 rounds, added to) in the previous round.

uint64_t Simulation::RingBytes(int which) const {
  uint64_t bytes = 0;
  for (size_t t = 0; t < profile_.tensors.size(); ++t) {
    if (IsControl(static_cast<int>(t)) == (which == 1)) bytes += profile_.tensors[t].bytes;
  }
  return bytes;
}

void Simulation::RingStart(int w, int step, int which) {
  Worker& worker = workers_[w];
  Ring& ring = worker.rings[OpKey(step, which)];
  ring.started = true;
  ring.start_ns = now_ns_;
  const uint64_t bytes = RingBytes(which);
  int subdivs = 0;
  uint64_t chunk = 0;
  do {
    ++subdivs;
    chunk = (bytes + static_cast<uint64_t>(n_) * subdivs - 1) / (static_cast<uint64_t>(n_) * subdivs);
  } while (chunk > runtime_.ring_chunk_bytes && subdivs < std::max(1, runtime_.ring_max_subdivs));
  ring.subdivs = subdivs;
  ring.chunk_bytes = chunk;
  ring.sent.assign(subdivs, 0);
  if (static_cast<int>(ring.received.size()) < subdivs) ring.received.resize(subdivs, 0);
  if (n_ == 1) {
    RingDone(w, step, which);
    return;
  }
  RingAdvance(w, step, which);
}

void Simulation::RingAdvance(int w, int step, int which) {
  Ring& ring = workers_[w].rings[OpKey(step, which)];
  const int rounds = 2 * (n_ - 1);
  for (int s = 0; s < ring.subdivs; ++s) {
    // Round r goes out once rounds 0..r-1 came in.
    while (ring.sent[s] < rounds && ring.sent[s] <= ring.received[s]) {
      FrameInfo info;
      info.kind = FrameKind::kRing;
      info.step = step;
      info.tensor = which;
      info.partition = s;
      info.round = ring.sent[s];
      info.bytes = ring.chunk_bytes;
      SendFrame(w, (w + 1) % n_, 0, info);
      ++ring.sent[s];
    }
    if (ring.received[s] == rounds && ring.sent[s] == rounds) {
      ring.received[s] = rounds + 1;  // counted once
      if (++ring.subdivs_done == ring.subdivs) {
        RingDone(w, step, which);
        return;
      }
    }
  }
}

void Simulation::RingDone(int w, int step, int which) {
  Worker& worker = workers_[w];
  const uint64_t key = OpKey(step, which);
  if (worker.timeline) {
    worker.timeline->Complete("allreduce", which == 0 ? "gradients" : "control", worker.rings[key].start_ns,
                              now_ns_, "{\"bytes\": " + std::to_string(RingBytes(which)) + "}");
  }
  worker.rings.erase(key);
  if (which == 1) {
    for (size_t t = 0; t < profile_.tensors.size(); ++t) {
      if (IsControl(static_cast<int>(t))) Note(w, step, static_cast<int>(t), &TensorTiming::done_s);
    }
    StepWorkDone(w, step);
    return;
  }
  worker.steps[step].applies_left = gradients_;
  if (gradients_ == 0) {
    if (controls_ > 0) RingStart(w, step, 1); else StepWorkDone(w, step);
    return;
  }
  for (size_t t = 0; t < profile_.tensors.size(); ++t) {
    if (IsControl(static_cast<int>(t))) continue;
    Note(w, step, static_cast<int>(t), &TensorTiming::done_s);
    QueueApply(w, step, static_cast<int>(t));
  }
}

// ------------------------------------------------------------------------------------------------
// Fusion: the engine's plan over the profile's tensors

void Simulation::PlanUnits() {
  std::vector<FusionInput> inputs;
  for (size_t t = 0; t < profile_.tensors.size(); ++t) {
    const ModelTensor& tensor = profile_.tensors[t];
    FusionInput in;
    in.name = tensor.name;
    in.bytes = tensor.bytes;
    in.element_size = tensor.element_size;
    in.priority = tensor.priority;
    in.fuse_key = static_cast<uint64_t>(tensor.encoding);
    in.fusable = !mwms() && !IsControl(static_cast<int>(t));
    inputs.push_back(in);
  }
  const uint64_t bucket_bytes = ResolveFusionBytes(runtime_.fusion_bytes, n_, network_.link_Bps);
  EngineOptions exchange_options;  // what ExchangesThis reads
  exchange_options.small_allreduce = runtime_.small_allreduce;
  exchange_options.partition_bytes = runtime_.partition_bytes;
  if (!mwms()) exchange_options.schedule = runtime_.schedule;  // its cut of the owner path
  unit_of_.assign(profile_.tensors.size(), -1);
  const std::vector<FusionBucket> plan = PlanFusion(inputs, n_, bucket_bytes);
  // Buckets are dealt over the lanes as the engine deals them (FusionByLane); the rest go on the
  // lane their name hashes to (Lane).
  const int lanes = std::max(1, network_.io_threads);
  const std::vector<int> bucket_lane = DealBucketsToLanes(plan, lanes);
  for (size_t bi = 0; bi < plan.size(); ++bi) {
    const FusionBucket& b = plan[bi];
    const ModelTensor& first = profile_.tensors[b.members.front()];
    ModelTensor unit = first;
    unit.name = b.name;
    unit.bytes = b.bytes;
    unit.priority = b.priority;
    for (const int m : b.members) unit_of_[m] = static_cast<int>(units_.size());
    // As the engine's ExchangesThis chooses (before the two-level path, with the model every
    // worker assumes: the choice, not the time it takes, which the network model gives).
    OpRequest probe;
    probe.bytes = unit.bytes;
    probe.priority = unit.priority;
    probe.compression = unit.encoding;
    exchanged_.push_back(!mwms() && ExchangesThis(probe, n_, exchange_options));
    units_.push_back(unit);
    unit_members_.push_back(b.members);
    unit_lane_.push_back(bucket_lane[bi]);
    partition_lanes_.emplace_back();
    const uint64_t element = unit.element_size;
    if (!b.fused() && !mwms() && !exchanged_.back() && TravelsInSlices(unit.bytes, element, lanes, n_)) {
      // As Engine::SubmitSliced: equal element counts per lane, each slice cut on its own, for
      // the workers or (two-level) for the hosts, its partitions' leaders counted from the slice's
      // first (TwoLevelPushPull::Start on each lane).
      std::vector<Partition> parts;
      std::vector<int> ranks;
      const uint64_t elements = unit.bytes / element, start = HashString(unit.name);
      for (int l = 0; l < lanes; ++l) {
        const uint64_t first = LaneSliceStart(elements, l, lanes), end = LaneSliceStart(elements, l + 1, lanes);
        const std::vector<Partition> slice =
            MakePartitions(unit.name, (end - first) * element, element, two_level() ? link_.hosts() : n_,
                           runtime_.partition_bytes, PartitionMinSplitBytes(runtime_.schedule));
        for (size_t k = 0; k < slice.size(); ++k) {
          Partition p = slice[k];
          p.offset += first * element;
          parts.push_back(p);
          partition_lanes_.back().push_back(l);
          if (two_level()) ranks.push_back(static_cast<int>((start + k) % static_cast<uint64_t>(per_host())));
        }
      }
      partitions_.push_back(std::move(parts));
      if (two_level()) leader_rank_.push_back(std::move(ranks));
      continue;
    }
    if (!two_level()) {
      partitions_.push_back(PlanPartitions(b, n_, runtime_.partition_bytes, bucket_bytes, PartitionMinSplitBytes(runtime_.schedule)));
      continue;
    }
    // Two-level: cut for the hosts, owned by hosts (a bucket keeps each owner's share of bytes);
    // each partition's leader rank spreads a host's partitions over its workers, starting where
    // the unit's name's hash points.
    const int hosts = link_.hosts();
    partitions_.push_back(PlanPartitions(b, hosts, runtime_.partition_bytes,
                                         bucket_bytes / static_cast<uint64_t>(n_) * static_cast<uint64_t>(hosts),
                                         PartitionMinSplitBytes(runtime_.schedule)));
    const uint64_t start = HashString(unit.name);
    std::vector<int> ranks(partitions_.back().size());
    for (size_t p = 0; p < ranks.size(); ++p) ranks[p] = static_cast<int>((start + p) % static_cast<uint64_t>(per_host()));
    leader_rank_.push_back(std::move(ranks));
  }
}

// ------------------------------------------------------------------------------------------------
// The event loop

void Simulation::HandleLink(const LinkEvent& e) {
  if (e.kind == LinkEvent::kDrained) {
    // The engine's Connection::Flush: a full socket took these bytes (the link's rate).
    workers_[e.frame.src].policy->bandwidth()->OnDrained(static_cast<uint64_t>(e.drained_bytes + 0.5),
                                                          e.drained_since_ns, e.time_ns);
    return;
  }
  const FrameInfo& info = frames_[e.frame.tag];
  if (e.kind == LinkEvent::kWritten) {
    // An owner is done with a partition once its sum is written to every peer's socket.
    if (info.kind == FrameKind::kResult || info.kind == FrameKind::kLocalResult) {
      const uint64_t key = OpKey(info.step, info.tensor);
      Op& op = OpAt(e.frame.src, key);
      if (--op.parts[info.partition].results_unwritten == 0) PartitionDone(e.frame.src, key);
    }
    // A push written to its socket has left this worker: its credit returns.
    if (info.kind == FrameKind::kPush) {
      Worker& worker = workers_[e.frame.src];
      worker.unsent_push_bytes -= info.bytes;
      worker.policy->OnPushLeft(PushTask(e.frame.src, e.frame.dst, info));
      Pump(e.frame.src);
    }
    return;
  }
  const int64_t extra = info.kind == FrameKind::kRing ? runtime_.ring_message_ns : 0;
  // kArrive (kFrameArrived) carries the sender in `index` and the frame id in `tag`.
  Push(e.time_ns + network_.latency_ns + extra,
       charges_cpu_ ? EventKind::kFrameArrived : EventKind::kArrive, e.frame.dst, 0, e.frame.src,
       e.frame.tag);
}

void Simulation::Handle(const Event& e) {
  switch (e.kind) {
    case EventKind::kStepBegin: StepBegin(e.worker, e.step); break;
    case EventKind::kForwardStart: ForwardStart(e.worker, e.step, e.index); break;
    case EventKind::kForwardDone: ForwardDone(e.worker, e.step, e.index); break;
    case EventKind::kTensorReady: Ready(e.worker, e.step, e.index); break;
    case EventKind::kBackwardDone: BackwardDone(e.worker, e.step); break;
    case EventKind::kStepReturn: StepReturn(e.worker, e.step); break;
    case EventKind::kArrive: Arrive(e.worker, e.index, e.tag); break;
    case EventKind::kSumDone: SumDone(e.worker, e.tag, e.index); break;
    case EventKind::kApplyDone: ApplyDone(e.worker, e.step, e.index); break;
    case EventKind::kWakeup:
      if (workers_[e.worker].wakeup_ns == e.time_ns) workers_[e.worker].wakeup_ns = -1;
      Pump(e.worker);
      break;
    case EventKind::kSendFrame: QueueOnLink(e.tag); break;
    case EventKind::kFrameArrived: Received(e.worker, e.index, e.tag); break;
    case EventKind::kHeartbeat: Heartbeats(); break;
  }
}

void Simulation::Heartbeats() {
  // The run is over, or only the heartbeats would go on (a deadlock, reported as such).
  bool running = false;
  for (const Worker& worker : workers_) running = running || worker.steps.back().begin_ns < 0;
  if (!running || (events_.empty() && link_.NextEventNs() == std::numeric_limits<int64_t>::max())) return;
  for (int w = 0; w < n_; ++w) {
    for (size_t lane = 0; lane < workers_[w].io_free_ns.size(); ++lane) {
      for (int peer = 0; peer < n_; ++peer) {
        if (peer == w) continue;
        FrameInfo info;
        info.kind = FrameKind::kHeartbeat;
        info.partition = static_cast<int>(lane);
        SendFrame(w, peer, kUrgentPriority, info);
      }
    }
  }
  Push(now_ns_ + runtime_.heartbeat_ns / 4, EventKind::kHeartbeat, 0);
}

Status Simulation::Run(StepPrediction* prediction) {
  for (const ModelLayer& layer : profile_.layers) forward_ns_ += layer.forward_ns;
  for (size_t t = 0; t < profile_.tensors.size(); ++t) {
    if (IsControl(static_cast<int>(t))) ++controls_; else ++gradients_;
  }
  PlanUnits();
  unit_ready_.resize(n_);
  workers_.resize(n_);
  timings_.resize(profile_.tensors.size());
  for (size_t t = 0; t < profile_.tensors.size(); ++t) timings_[t].name = profile_.tensors[t].name;
  for (int c = 0; c < network_.shared_cores; ++c) cores_.push(0);
  SchedulerOptions scheduler;
  scheduler.policy = mwms() ? "fifo" : runtime_.schedule;  // mwms never asks its policy
  scheduler.replan_threshold = runtime_.replan_threshold;
  scheduler.credit_bytes = ResolveScheduleCreditBytes(runtime_.credit_bytes, runtime_.schedule, n_, runtime_.partition_bytes);
  for (int w = 0; w < n_; ++w) {
    Worker& worker = workers_[w];
    std::string error;
    worker.policy = MakePolicy(scheduler, &error);
    if (!worker.policy) return Status(Code::kInvalidArgument, error);
    worker.steps.resize(total_steps());
    worker.updates_pending.assign(profile_.layers.size(), 0);
    worker.exchange_plan = ExchangePlan(w, n_);
    worker.io_free_ns.assign(static_cast<size_t>(std::max(1, network_.io_threads)), 0);
    if (!options_.timeline_path.empty() && w < options_.timeline_workers) {
      std::string path = options_.timeline_path;
      const size_t at = path.find("{rank}");
      if (at != std::string::npos) path.replace(at, 6, std::to_string(w));
      worker.timeline = std::make_unique<Timeline>();
      if (!worker.timeline->Open(path, w, &error, "predicted worker")) return Status(Code::kInvalidArgument, error);
    }
    Push(0, EventKind::kStepBegin, w, 0);
  }
  // Failures::Heartbeat sends its first beats at once, then every heartbeat_s / 4.
  if (runtime_.heartbeat_ns > 0 && n_ > 1 && !mwms()) Push(0, EventKind::kHeartbeat, 0);

  std::vector<LinkEvent> link_events;
  uint64_t handled = 0;
  while (true) {
    const int64_t next_link = link_.NextEventNs();
    const int64_t next_event = events_.empty() ? std::numeric_limits<int64_t>::max() : events_.top().time_ns;
    if (next_link == std::numeric_limits<int64_t>::max() && events_.empty()) break;
    if (++handled > kMaxEvents) {
      return Status(Code::kInternal, "the simulation did not finish within " + std::to_string(kMaxEvents) + " events");
    }
    if (next_link <= next_event) {
      link_events.clear();
      link_.AdvanceTo(next_link, &link_events);
      now_ns_ = std::max(now_ns_, next_link);
      for (const LinkEvent& e : link_events) HandleLink(e);
      continue;
    }
    const Event e = events_.top();
    events_.pop();
    now_ns_ = e.time_ns;
    Handle(e);
  }

  for (int w = 0; w < n_; ++w) {
    if (workers_[w].timeline) workers_[w].timeline->Close();
  }
  // Nothing left to happen but a worker has steps to go: the runtime would wait forever (the
  // engine's timeout would fail the step). Say where every worker stands.
  bool stalled = false;
  for (const Worker& worker : workers_) stalled = stalled || worker.steps.back().begin_ns < 0;
  if (stalled) {
    std::string state = "the simulated runtime deadlocked at " + std::to_string(now_ns_ / 1000) + " us";
    for (int w = 0; w < n_ && w < 4; ++w) {
      const Worker& worker = workers_[w];
      int reached = 0;
      while (reached + 1 < total_steps() && worker.steps[reached + 1].begin_ns >= 0) ++reached;
      state += "; worker " + std::to_string(w) + ": step " + std::to_string(reached);
      if (worker.waiting_layer >= 0) state += ", forward waiting for layer '" + profile_.layers[worker.waiting_layer].name + "'";
      state += ", " + std::to_string(worker.ops.size()) + " push_pulls open, " +
               std::to_string(worker.policy->queued()) + " partitions queued, " +
               std::to_string(worker.unsent_push_bytes) + " bytes released and unsent, " + worker.policy->Describe();
    }
    return Status(Code::kFailedPrecondition, state);
  }
  StepPrediction& p = *prediction;
  p = StepPrediction();
  const Worker& first = workers_[0];
  for (int s = options_.warmup_steps; s < options_.warmup_steps + options_.steps; ++s) {
    p.periods_s.push_back(static_cast<double>(first.steps[s + 1].begin_ns - first.steps[s].begin_ns) / 1e9);
  }
  std::vector<double> sorted = p.periods_s;
  std::sort(sorted.begin(), sorted.end());
  const size_t mid = sorted.size() / 2;
  p.step_s = sorted.size() % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
  p.compute_s = static_cast<double>(forward_ns_ + profile_.backward_ns) / 1e9;
  p.single_step_s = static_cast<double>(profile_.launch_ns + forward_ns_ + profile_.backward_ns + profile_.tail_ns +
                                        profile_.gap_ns) / 1e9;
  const double steps = static_cast<double>(options_.steps);
  p.comm_s = static_cast<double>(busy_end_ns_ - busy_begin_ns_) / 1e9 / steps;
  p.wire_bytes_per_step = (wire_end_ - wire_begin_) / steps;
  p.messages_per_step = static_cast<double>(frames_end_ - frames_begin_) / steps;
  p.io_busy_s = static_cast<double>(io_busy_end_ns_ - io_busy_begin_ns_) / 1e9 / steps;
  p.exchanged_per_step = static_cast<double>(std::count(exchanged_.begin(), exchanged_.end(), true));
  const double mean_step = static_cast<double>(measure_end_ns_ - measure_begin_ns_) / 1e9 / steps;
  if (p.comm_s > 0) p.overlap = std::min(1.0, std::max(0.0, (p.single_step_s + p.comm_s - mean_step) / p.comm_s));
  p.gate_wait_s = static_cast<double>(first.gate_wait_ns) / 1e9 / steps;
  p.bandwidth_samples_Bps = bandwidth_samples_;
  if (!bandwidth_samples_.empty()) {
    std::vector<double> b = bandwidth_samples_;
    std::nth_element(b.begin(), b.begin() + b.size() / 2, b.end());
    p.bandwidth_Bps = b[b.size() / 2];
  }
  if (mwms()) {
    p.policy = "mwms: one ring all-reduce of every gradient after the backward pass";
  } else {
    p.policy = first.policy->Describe();
    // Summed over the workers: the first whose timer fires opens a deadlock for all, so worker 0's
    // own count misses rounds in which another broke first.
    for (const Worker& w : workers_) p.stall_breaks += w.policy->stall_breaks();
  }
  p.tensor_times = timings_;
  return Status::OK();
}

}  // namespace

bool ChargesCpu(const NetworkModel& network) {
  return network.message_send_ns > 0 || network.message_receive_ns > 0 || network.send_byte_ns > 0 ||
         network.receive_byte_ns > 0 || network.sum_byte_ns > 0 || network.cast_byte_ns > 0 ||
         network.copy_byte_ns > 0;
}

uint64_t KernelSendBufferBytes(const NetworkModel& network) {
  uint64_t buffer = network.autotuned_socket_buffer_bytes;
  const uint64_t cap = network.max_socket_buffer_bytes > 0 ? network.max_socket_buffer_bytes
                                                            : std::numeric_limits<uint64_t>::max() / 4;
  const int requested = SendBufferRequest(network.socket_buffer_bytes, network.workers, static_cast<int64_t>(cap));
  if (requested > 0) buffer = 2 * std::min<uint64_t>(static_cast<uint64_t>(requested), cap);
  if (network.socket_unsent_bytes == 0) return buffer;
  // TCP small queues let each socket keep about 1 ms of its own pacing rate below it, and a
  // connection's rate is its share of the host's egress: with every connection leaving a host
  // busy (the backlog in which an urgent frame waits), each holds 1/C of sender_queue_s at the
  // link rate, C = workers per host x workers on other hosts. Counting the whole link rate for
  // each of them put (N-1) ms of the link in front of every urgent frame (5 ms of every step of
  // ResNet50 at N = 8 and 100 Gbit/s: each push and each sum behind 7 x 4 MiB).
  const int per_host = std::max(1, std::min(network.workers_per_host, network.workers));
  const double leaving = std::max(1.0, static_cast<double>(per_host) * static_cast<double>(network.workers - per_host));
  const double queued = std::max(0.0, network.link_Bps * network.sender_queue_s / leaving);
  return std::min(buffer, network.socket_unsent_bytes + static_cast<uint64_t>(queued));
}

void CompressGradients(Encoding compression, StepProfile* profile) {
  for (ModelTensor& t : profile->tensors) {
    t.encoding = t.priority < kControlPriority && t.element_size == 4 ? compression : Encoding::kNone;
  }
}

Status Simulate(const StepProfile& profile, const NetworkModel& network, const RuntimeModel& runtime,
                const SimulationOptions& options, StepPrediction* prediction) {
  if (network.workers < 1) return Status(Code::kInvalidArgument, "workers must be at least 1, got " + std::to_string(network.workers));
  if (network.workers > 1 && !(network.link_Bps > 0)) {
    return Status(Code::kInvalidArgument, "the link rate must be positive for more than one worker");
  }
  if (network.workers_per_host < 1 || network.workers % network.workers_per_host != 0) {
    return Status(Code::kInvalidArgument, "workers (" + std::to_string(network.workers) +
                                              ") must be a positive multiple of workers_per_host (" +
                                              std::to_string(network.workers_per_host) + ")");
  }
  if (network.workers_per_host > 1 && !(network.loopback_Bps > 0)) {
    return Status(Code::kInvalidArgument, "loopback_Bps must be positive with several workers per host");
  }
  if (runtime.hierarchical == Hierarchy::kOn && runtime.schedule == "mwms") {
    return Status(Code::kInvalidArgument, "the two-level path (hierarchical) applies to the runtime's schedules, not mwms");
  }
  for (const double cost : {network.send_byte_ns, network.receive_byte_ns, network.sum_byte_ns, network.cast_byte_ns,
                            network.copy_byte_ns}) {
    if (!(cost >= 0) || !std::isfinite(cost)) {
      return Status(Code::kInvalidArgument, "a CPU cost per byte must be a finite number of ns >= 0, got " + std::to_string(cost));
    }
  }
  if (network.message_send_ns < 0 || network.message_receive_ns < 0 || network.shared_cores < 0) {
    return Status(Code::kInvalidArgument, "message costs and shared_cores must not be negative");
  }
  if (network.io_threads < 1) {
    return Status(Code::kInvalidArgument, "io_threads must be at least 1, got " + std::to_string(network.io_threads));
  }
  if (options.warmup_steps < 0 || options.steps < 1) {
    return Status(Code::kInvalidArgument, "need at least one measured step and no negative warm-up");
  }
  if (profile.layers.empty()) return Status(Code::kInvalidArgument, "the profile has no layer");
  if (runtime.partition_bytes != kPartitionAuto && runtime.partition_bytes < 64) {
    return Status(Code::kInvalidArgument, "partition_bytes must be 0 (the schedule's) or at least 64");
  }
  if (runtime.schedule != "mwms") {
    std::string error;
    SchedulerOptions scheduler;
    scheduler.policy = runtime.schedule;
    if (!MakePolicy(scheduler, &error)) return Status(Code::kInvalidArgument, error + " or mwms");
  }
  for (const ModelTensor& t : profile.tensors) {
    if (t.element_size == 0 || t.bytes % t.element_size != 0) {
      return Status(Code::kInvalidArgument, "tensor '" + t.name + "': " + std::to_string(t.bytes) +
                                                " bytes is not a multiple of its element size " +
                                                std::to_string(t.element_size));
    }
    if (t.encoding != Encoding::kNone && t.element_size != 4) {
      return Status(Code::kInvalidArgument, "tensor '" + t.name + "' travels as " + EncodingName(t.encoding) +
                                                ", which encodes float32 values, but its elements have " +
                                                std::to_string(t.element_size) + " bytes");
    }
    if (t.layer >= static_cast<int>(profile.layers.size())) {
      return Status(Code::kInvalidArgument, "tensor '" + t.name + "' names layer " + std::to_string(t.layer) +
                                                " but the profile has " + std::to_string(profile.layers.size()));
    }
    if (t.ready_ns > profile.backward_ns) {
      return Status(Code::kInvalidArgument, "tensor '" + t.name + "' is ready after the backward pass ends (" +
                                                std::to_string(t.ready_ns) + " > " +
                                                std::to_string(profile.backward_ns) + " ns)");
    }
  }
  for (const ModelLayer& l : profile.layers) {
    if (l.forward_ns < 0 || l.backward_ns < 0) return Status(Code::kInvalidArgument, "layer '" + l.name + "' has a negative time");
  }
  // The schedule's partitions and fusion where the options leave them to it (schedule_traits.h), as
  // the engine and ProphetStrategy resolve them.
  RuntimeModel resolved = runtime;
  resolved.partition_bytes = ResolvePartitionBytes(runtime.partition_bytes, runtime.schedule);
  const ScheduleTraits* traits = FindScheduleTraits(runtime.schedule);
  if (resolved.fusion_bytes == kFusionAuto && traits != nullptr && !traits->automatic_fusion) resolved.fusion_bytes = 0;
  if (resolved.hierarchical == Hierarchy::kAuto && resolved.schedule != "mwms" &&
      UseTwoLevel(Hierarchy::kAuto, UniformLayout(network.workers, network.workers_per_host))) {
    // The engine starts on the two-level path and its start-up probe keeps the flat one where
    // that is faster (prophet_tf/_link_probe.py, choose_two_level); predicted here by the same
    // rule on the two paths' whole steps (the probe times rounds of one tensor).
    RuntimeModel two_level = resolved, flat = resolved;
    two_level.hierarchical = Hierarchy::kOn;
    flat.hierarchical = Hierarchy::kOff;
    SimulationOptions quiet = options;
    quiet.timeline_path.clear();
    StepPrediction on, off;
    Status s = Simulation(profile, network, two_level, quiet).Run(&on);
    if (!s.ok()) return s;
    // A flat path the simulation cannot finish (a simulated deadlock) is not the faster one.
    const bool keep = !Simulation(profile, network, flat, quiet).Run(&off).ok() || ChooseTwoLevel(on.step_s, off.step_s);
    if (!options.timeline_path.empty()) return Simulation(profile, network, keep ? two_level : flat, options).Run(prediction);
    *prediction = keep ? std::move(on) : std::move(off);
    return Status::OK();
  }
  Simulation simulation(profile, network, resolved, options);
  return simulation.Run(prediction);
}

}  // namespace prophet
