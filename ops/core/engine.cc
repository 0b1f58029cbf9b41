#include "ops/core/engine.h"

#include <sys/epoll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <sstream>

#include "ops/core/collective.h"
#include "ops/core/collectives.h"
#include "ops/core/connection.h"
#include "ops/core/early_frames.h"
#include "ops/core/failures.h"
#include "ops/core/fuser.h"
#include "ops/core/hosts.h"
#include "ops/core/output_pool.h"
#include "ops/core/policies.h"
#include "ops/core/schedule_traits.h"
#include "ops/core/timeouts.h"
#include "ops/core/transport.h"
#include "ops/core/wire.h"

namespace prophet {

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kPushPull: return "push_pull";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kAllgather: return "allgather";
  }
  return "?";
}

namespace {

constexpr int64_t kTimeoutCheckNs = 100 * 1000 * 1000;
constexpr uint64_t kWakeTag = ~0ull;  // epoll tag of the eventfd; connections use their peer rank
// What one connection may read per turn of the I/O thread before the thread starts what was
// submitted meanwhile and sends what the bytes read completed (sums). Draining the socket first
// (it may hold a peer's whole tensor) kept an operation submitted meanwhile waiting, its frames
// held as early frames, and its sums unsent until the last byte was read. Each receive still
// takes as much of a payload as the kernel has.
constexpr uint64_t kReadTurnBytes = 1 << 20;

}  // namespace

struct Engine::Impl : public Connection::Handler,
                      public CollectiveHost,
                      public FailuresHost,
                      public TimeoutsHost {
  // Early PUSHes arrive from every peer that is ahead; a credit and a partition per peer is
  // worth keeping warm (the credit as set: the automatic one, which grows with N, counts as
  // kMinCreditBytes here, so the pool does not grow with N squared).
  Impl(const EngineOptions& o, uint64_t credit_setting, Timeline& shared_timeline, int lane_index)
      : options_(o),
        lane(lane_index),
        early(o),
        failures(this, o.world_size),
        timeouts(this),
        buffers(static_cast<uint64_t>(std::max(o.world_size - 1, 0)) *
                ((credit_setting == kCreditAuto ? kMinCreditBytes : credit_setting) + o.partition_bytes)),
        timeline(shared_timeline) {}

  EngineOptions options_;
  const int lane;
  std::atomic<uint64_t> credit_share{0};  // of options_.credit_bytes (Engine::SetActiveLanes)
  int epoll_fd = -1;
  int wake_fd = -1;
  std::thread thread;
  std::atomic<bool> stop{false};
  std::atomic<bool> vanish{false};  // StopWithoutNotice

  // Shared with submitting threads.
  mutable std::mutex mu;
  std::vector<std::pair<OpRequest, uint64_t>> submitted;  // with its round
  std::unordered_map<std::string, uint64_t> rounds;
  // Set when the engine thread stops: every later request fails with it at once. (After a lost
  // peer the thread still runs: it completes what the frames already here complete.)
  std::string stopped;
  std::string requested_schedule;                         // SetSchedule, not yet seen
  std::vector<std::promise<std::string>> state_requests;  // SchedulerStateJson callers
  // Slices of a push_pull whose slice on another lane failed (Engine::SubmitSliced): they fail
  // everywhere with the same status, instead of waiting for peers that may never send them.
  struct Cancel {
    std::string name;
    uint64_t round = 0;
    Status status;
  };
  std::vector<Cancel> cancels;
  // DeclareFusion calls, applied where they came among the submissions (`at`: submitted.size()).
  struct Declaration {
    size_t at = 0;
    std::string group;
    std::vector<FusionDeclaration> tensors;
    uint64_t bucket_bytes = 0;
    std::function<void(const Status&)> done;
    bool dealt = false;                    // `buckets` are the lane's dealt buckets (FusionByLane)
    std::vector<std::vector<int>> buckets;
  };
  std::vector<Declaration> declarations;
  std::string schedule_name;                              // the policy in use, for StatsJson

  // Owned by the engine thread (the connections and the policy are made before it starts).
  std::vector<std::unique_ptr<Connection>> conns;  // by peer rank; null for this rank
  std::unordered_map<std::string, std::unique_ptr<Collective>> ops;  // by key
  std::unordered_map<uint64_t, Collective*> ops_by_id;
  EarlyFrames early;  // frames of operations not submitted here yet
  Failures failures;  // failed operations' keys, lost and departed peers, heartbeats
  Timeouts timeouts;  // operations past their deadline
  Fuser fuser;        // declared tensors held for their fused bucket
  std::unordered_map<std::string, uint64_t> fused_rounds;  // per fused tensor: its rounds so far (trace only)
  // The hosts when push_pulls take the two-level path (EngineOptions::hierarchical), else null.
  std::unique_ptr<HostLayout> two_level;
  std::unique_ptr<SchedulerPolicy> policy;
  std::string next_schedule;  // switch to it once no partition is queued
  uint64_t next_op_id = 1;
  uint64_t enqueue_seq = 0;
  // Bytes of released pushes that have not left this worker: what the byte credit bounds.
  uint64_t unsent_push_bytes = 0;
  bool credit_returned = false;  // since the last Pump
  int64_t next_timeout_check = 0;
  BufferPool buffers;  // payloads held in memory (early frames, staged contributions)
  Timeline& timeline;  // the engine's, shared by its lanes

  // Statistics (read by StatsJson from other threads).
  std::atomic<uint64_t> ops_done{0}, ops_failed{0};
  std::atomic<uint64_t> fused_submitted{0};  // push_pulls held for a fused bucket
  std::atomic<uint64_t> fusion_questions{0};  // fusion check questions asked (fuser.h)

  // --- the thread ------------------------------------------------------------------------------
  // Takes the lane's connections (fds[r]: to rank r, -1 for none).
  void Open(const std::vector<int>& fds);
  void Run();
  // Asks the thread to stop (it runs Shutdown); JoinThread waits for it. Apart, so that every lane
  // shuts down at once.
  void RequestStop() {
    if (!thread.joinable()) return;
    stop.store(true);
    Wake();
  }
  void JoinThread() {
    if (thread.joinable()) thread.join();
  }
  // CPU time of the thread so far (0 unless it runs).
  double ThreadCpuSeconds() const {
    std::lock_guard<std::mutex> lock(mu);
    if (!stopped.empty() || !thread.joinable()) return 0;
    clockid_t clock;
    timespec t{};
    if (pthread_getcpuclockid(const_cast<std::thread&>(thread).native_handle(), &clock) != 0 ||
        clock_gettime(clock, &t) != 0)
      return 0;
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
  }
  void Shutdown();
  // Registers and starts an operation; returns its id, or 0 when it completed at once (failed).
  // The caller then applies its early frames (ReplayEarly) and failures.OnStarted.
  uint64_t StartOperation(OpRequest req, uint64_t round);
  // Frames that arrived before this worker submitted `op`.
  void ReplayEarly(Collective* op);
  // A request as submitted: started, or held for its fused bucket (which then starts); returns
  // the ids of what started.
  void Route(OpRequest request, uint64_t round, std::vector<uint64_t>* started);
  // Ends requests that never became operations (fusion's refusals, held ones at shutdown).
  void Refuse(std::vector<Fuser::Refusal> refused) {
    for (auto& [request, status] : refused) {
      ops_failed.fetch_add(1);
      PROPHET_INFO("push_pull '%s' failed: %s", request.name.c_str(), status.message().c_str());
      request.done(status, nullptr);
    }
  }
  // Fusion's check frames (fuser.h) go out; a disagreement they proved fails fused operations.
  void SendChecks(std::vector<Fuser::CheckFrame> frames) {
    for (Fuser::CheckFrame& f : frames) {
      if (f.kind == FusionCheckKind::kQuery) fusion_questions.fetch_add(1);
      FrameMeta meta;
      meta.type = FrameType::kFusionCheck;
      meta.name = f.name;
      meta.round = f.round;
      meta.partition = static_cast<uint32_t>(f.kind);
      meta.offset = f.digest;
      meta.payload_bytes = f.payload.size();
      Send(f.peer, MakeOwnedFrame(meta, std::move(f.payload), kUrgentPriority));
    }
  }
  void OnFusionCheck(int peer, const FrameMeta& meta, const ByteBuffer& data);
  uint64_t NextRound(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu);
    return rounds[name]++;
  }
  // The scheduler releases PUSHes under the byte credit (Pump).
  void Pump();
  // Pump, then write what every connection has queued, again while that returns credit.
  void SendQueued();
  void SwitchPolicy();
  void Wake() {
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd, &one, sizeof(one));
    (void)ignored;
  }
  // A frame held in memory (early, or an error notice) is applied or kept.
  void HandleWholeFrame(int peer, const FrameMeta& meta, ByteBuffer data);
  // Hands a held frame to its operation, then recycles what the operation did not keep.
  void ApplyWholeFrame(Collective* op, int peer, const FrameMeta& meta, ByteBuffer* data) {
    op->OnWholeFrame(peer, meta, data);
    buffers.Give(std::move(*data));
  }

  // --- Connection::Handler: routing frames to operations by name#round --------------------------
  PayloadSink OnFrame(Connection& c, const FrameMeta& meta) override;
  void OnFrameDone(Connection& c, const FrameMeta& meta, PayloadSink::Kind sink, uint64_t tag,
                   ByteBuffer* buffered) override;
  void OnClosed(Connection& c, const std::string& why) override {
    early.Received(c.peer());
    failures.OnClosed(c, why);
  }
  void OnFlushed(Connection& /*c*/, uint64_t bytes, bool was_full, bool full) override {
    BandwidthMonitor* monitor = policy->bandwidth();
    // A clock reading only while a socket is (or becomes, or stops being) full.
    if (was_full || full || monitor->saturated()) monitor->OnSocketWrite(bytes, was_full, full, NowNs());
  }

  // --- CollectiveHost, FailuresHost, TimeoutsHost ------------------------------------------------
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  const EngineOptions& options() const override { return options_; }
  const HostLayout* two_level_hosts() const override { return two_level.get(); }
  void Send(int peer, OutFrame frame) override {
    if (conns[peer]) conns[peer]->Queue(std::move(frame));
  }
  bool Alive(uint64_t op_id) const override { return ops_by_id.count(op_id) != 0; }
  void Finish(Collective* op, const Status& status) override;
  // A mismatch seen here fails the operation on every worker, with the same message.
  void FailEverywhere(Collective* op, const std::string& message) override {
    failures.FailEverywhere(op, Status(Code::kInvalidArgument, message));
  }
  void FailEverywhere(Collective* op, const Status& status) override { failures.FailEverywhere(op, status); }
  void Refuse(Collective* op, int peer, const std::string& message) override {
    FailEverywhere(op, message);
    if (conns[peer]) conns[peer]->Refuse(message);
  }
  void Announce(const TensorReady& ready) override { policy->OnTensorReady(ready); }
  void Schedule(SendTask task) override {
    task.enqueue_seq = enqueue_seq++;
    policy->Enqueue(task);
  }
  bool SchedulesOwnedPartitions() const override { return policy->schedules_owned_partitions(); }
  void PushLeft(const SendTask& task) override {
    unsent_push_bytes -= task.bytes;
    credit_returned = true;
    policy->OnPushLeft(task);
  }
  void PushCompleted(const TransferDone& done) override;
  ByteBuffer TakeBuffer(size_t bytes) override { return buffers.Take(bytes); }
  void GiveBuffer(ByteBuffer buffer) override { buffers.Give(std::move(buffer)); }
  Connection* connection(int peer) override { return conns[peer].get(); }
  Collective* Find(const std::string& key) override {
    auto it = ops.find(key);
    return it == ops.end() ? nullptr : it->second.get();
  }
  bool Submitted(const std::string& name, uint64_t round) override {
    std::lock_guard<std::mutex> lock(mu);
    auto it = rounds.find(name);
    return it != rounds.end() && it->second > round;
  }
  void DrainSubmissions() override;
  std::vector<Collective*> Running() override {
    std::vector<Collective*> running;
    for (auto& kv : ops) running.push_back(kv.second.get());
    return running;
  }
  bool Reachable(int peer) override { return conns[peer] && conns[peer]->open() && !failures.departed(peer); }
};

// ------------------------------------------------------------------------------------------------
// Lifecycle

namespace {

// The schedule's partitions and credit where the options leave them to it (schedule_traits.h).
EngineOptions Resolved(EngineOptions options) {
  options.partition_bytes = ResolvePartitionBytes(options.partition_bytes, options.schedule);
  options.credit_bytes =
      ResolveScheduleCreditBytes(options.credit_bytes, options.schedule, options.world_size, options.partition_bytes);
  return options;
}

// Lanes multiply the sockets: 8 lanes at N = 256 need 2,040, beyond the usual soft limit of
// 1,024 open files. Raises the soft limit towards the hard one where
// the sockets need it; start-up names the limit if it still falls short (EMFILE).
void RaiseOpenFileLimit(uint64_t sockets) {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return;
  const rlim_t wanted = static_cast<rlim_t>(sockets + 1024);
  if (limit.rlim_cur >= wanted) return;
  const rlim_t old = limit.rlim_cur;
  limit.rlim_cur = limit.rlim_max == RLIM_INFINITY ? wanted : std::min(wanted, limit.rlim_max);
  if (::setrlimit(RLIMIT_NOFILE, &limit) == 0)
    PROPHET_INFO("raised the open-file limit from %llu to %llu for %llu sockets", static_cast<unsigned long long>(old),
                 static_cast<unsigned long long>(limit.rlim_cur), static_cast<unsigned long long>(sockets));
}

}  // namespace

int ResolveLanes(const EngineOptions& options) {
  if (options.io_threads != kIoThreadsAuto) return std::max(options.io_threads, 1);
  if (options.world_size < 2) return 1;
  std::vector<std::string> labels;
  if (!HostLabels(options.hosts, options.addresses, options.world_size, &labels).ok()) return 1;  // Start says why
  return LayoutFromLabels(labels).hosts() > 1 ? kAutoLanes : 1;
}

Engine::Engine(const EngineOptions& options) : options_(Resolved(options)) {
  const int lanes = ResolveLanes(options_);
  for (int l = 0; l < lanes; ++l) lanes_.emplace_back(new Impl(options_, options.credit_bytes, timeline_, l));
  SetActiveLanes(options_.io_threads == kIoThreadsAuto ? 1 : lanes);
}

Status Engine::SetActiveLanes(int lanes) {
  const int connected = static_cast<int>(lanes_.size());
  if (lanes < 1 || lanes > connected)
    return Status(Code::kInvalidArgument, "cannot use " + std::to_string(lanes) + " I/O threads (lanes): " +
                                              std::to_string(connected) + " are connected (io_threads)");
  // The active lanes share the byte credit, so that together they hold back what one would.
  const uint64_t share = std::max(options_.credit_bytes / static_cast<uint64_t>(lanes), options_.partition_bytes);
  for (auto& lane : lanes_) lane->credit_share.store(share);
  active_lanes_.store(lanes);
  return Status::OK();
}

Status Engine::Start(const EngineOptions& options, std::unique_ptr<Engine>* out) {
  std::unique_ptr<Engine> engine(new Engine(options));
  SetLogRank(options.rank);
  std::string error;
  if (!options.timeline_path.empty() && !engine->timeline_.Open(options.timeline_path, options.rank, &error))
    return Status(Code::kInvalidArgument, "cannot write the timeline: " + error);
  std::unique_ptr<HostLayout> two_level;
  if (options.hierarchical != Hierarchy::kOff) {
    std::vector<std::string> labels;
    const Status s = HostLabels(options.hosts, options.addresses, options.world_size, &labels);
    if (!s.ok()) return s;
    HostLayout layout = LayoutFromLabels(labels);
    if (UseTwoLevel(options.hierarchical, layout)) two_level = std::make_unique<HostLayout>(std::move(layout));
  }
  for (auto& lane : engine->lanes_) {
    Impl& m = *lane;
    SchedulerOptions sched;
    sched.policy = options.schedule;
    sched.replan_threshold = options.replan_threshold;
    sched.credit_bytes = m.credit_share.load();
    m.policy = MakePolicy(sched, &error);
    if (!m.policy) return Status(Code::kInvalidArgument, error);
    m.schedule_name = m.policy->name();
    if (two_level) m.two_level = std::make_unique<HostLayout>(*two_level);
  }
  engine->two_level_on_.store(two_level != nullptr);
  const int n = options.world_size;
  const int lanes = static_cast<int>(engine->lanes_.size());
  std::vector<int> fds(static_cast<size_t>(n) * lanes, -1);
  if (n > 1) {
    BootstrapOptions b;
    b.rank = options.rank;
    b.world_size = n;
    b.addresses = options.addresses;
    b.token = options.token;
    b.bind_host = options.bind_host;
    b.connect_timeout_s = options.connect_timeout_s;
    b.heartbeat_s = options.heartbeat_s;
    b.send_buffer_bytes = SendBufferRequest(options.socket_buffer_bytes, n, KernelMaxSendBufferBytes());
    b.receive_buffer_bytes = std::max(options.socket_buffer_bytes, 0);
    b.socket_unsent_bytes = options.socket_unsent_bytes;
    b.path_tag = two_level ? PathTag(true, *two_level, options.hierarchical == Hierarchy::kAuto) : 0;
    b.lanes = lanes;
    RaiseOpenFileLimit(static_cast<uint64_t>(lanes) * (n - 1));
    int listen_fd = -1;
    Status s = Listen(b, &listen_fd);
    if (s.ok()) s = ConnectAll(b, listen_fd, &fds);
    if (!s.ok()) return s;
  }
  for (int l = 0; l < lanes; ++l)
    engine->lanes_[l]->Open(std::vector<int>(fds.begin() + static_cast<size_t>(l) * n,
                                             fds.begin() + static_cast<size_t>(l + 1) * n));
  const Impl& first = *engine->lanes_.front();
  PROPHET_INFO("runtime started: %d workers, schedule %s, partitions of %llu bytes, credit %llu bytes%s", n,
               first.policy->name(), static_cast<unsigned long long>(engine->options_.partition_bytes),
               static_cast<unsigned long long>(engine->options_.credit_bytes),
               lanes > 1 ? (", " + std::to_string(lanes) + " I/O threads (lanes) connected, " +
                            std::to_string(engine->active_lanes()) + " in use")
                               .c_str()
                         : "");
  if (two_level) PROPHET_INFO("push_pulls take the two-level path over %s", two_level->Describe().c_str());
  for (auto& lane : engine->lanes_) {
    Impl* m = lane.get();
    m->thread = std::thread([m] { m->Run(); });
  }
  *out = std::move(engine);
  return Status::OK();
}

void Engine::Impl::Open(const std::vector<int>& fds) {
  epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeTag;
  ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, wake_fd, &ev);
  conns.resize(fds.size());
  for (size_t r = 0; r < fds.size(); ++r) {
    if (fds[r] < 0) continue;
    conns[r] = std::make_unique<Connection>(static_cast<int>(r), fds[r], epoll_fd, this, &buffers);
    ev.events = EPOLLIN;
    ev.data.u64 = static_cast<uint64_t>(r);
    ::epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fds[r], &ev);
  }
}

void Engine::StopWithoutNotice() {
  for (auto& m : lanes_) {
    m->vanish.store(true);
    m->stop.store(true);  // every lane before any wakes: a lane shutting down fails slices on the others
  }
  for (auto& m : lanes_) m->RequestStop();
  for (auto& m : lanes_) {
    m->JoinThread();
    m->conns.clear();  // closes the sockets
  }
}

Engine::~Engine() {
  for (auto& m : lanes_) m->stop.store(true);  // every lane before any wakes (StopWithoutNotice)
  for (auto& m : lanes_) m->RequestStop();
  for (auto& m : lanes_) m->JoinThread();
  timeline_.Close();
  for (auto& m : lanes_) {
    m->conns.clear();
    if (m->epoll_fd >= 0) ::close(m->epoll_fd);
    if (m->wake_fd >= 0) ::close(m->wake_fd);
  }
}

int Engine::LaneOf(const OpRequest& request, int lanes) {
  if (lanes == 1) return 0;
  {
    std::lock_guard<std::mutex> lock(fused_mu_);
    const auto fused = fused_lanes_.find(request.name);
    if (fused != fused_lanes_.end()) return fused->second.first;
  }
  if (request.kind == OpKind::kPushPull && TravelsInSlices(request.bytes, DataTypeSize(request.dtype), lanes, world_size()))
    return -1;
  return static_cast<int>(HashString(request.name) % static_cast<uint64_t>(lanes));
}

bool Engine::PathChoosable() const {
  return options_.hierarchical == Hierarchy::kAuto && lanes_.front()->two_level != nullptr;
}

Status Engine::SetTwoLevel(bool on) {
  if (options_.hierarchical != Hierarchy::kAuto)
    return Status(Code::kFailedPrecondition, std::string("the push_pulls' path is fixed: hierarchical is '") +
                                                 HierarchyName(options_.hierarchical) + "', not 'auto'");
  if (!lanes_.front()->two_level)
    return Status(Code::kFailedPrecondition,
                  "the push_pulls' path is flat: the two-level path needs several hosts, one of them with several "
                  "workers");
  two_level_on_.store(on);
  path_chosen_.store(true);
  return Status::OK();
}

void Engine::Submit(OpRequest request) {
  request.two_level = two_level_on_.load();
  const int active = active_lanes_.load();  // once: the cut and the slices must agree
  const int lane = LaneOf(request, active);
  if (lane < 0) return SubmitSliced(std::move(request), active);
  SubmitToLane(lane, std::move(request));
}

void Engine::SubmitSliced(OpRequest request, int active) {
  // The slices' `done`s come on different lanes' threads; the last one answers for the request,
  // with the first failure if any (a failed slice's lane has named the tensor and the reason).
  struct Join {
    std::mutex mu;
    size_t left = 0;
    Status status;
    std::function<void(const Status&, const GatherResult*)> done;
    std::string name;
    std::string args;  // trace
    int64_t submit_ns = 0;
    std::vector<uint64_t> rounds;  // of each lane's slice
    size_t submitted = 0;          // slices submitted so far (their rounds are known)
  };
  auto join = std::make_shared<Join>();
  const size_t lanes = static_cast<size_t>(active);
  join->left = lanes;
  join->name = request.name;
  join->rounds.assign(lanes, 0);
  join->done = std::move(request.done);
  join->submit_ns = NowNs();
  if (timeline_.enabled()) {
    join->args = "{\"bytes\": " + std::to_string(request.bytes) + ", \"priority\": " + std::to_string(request.priority) +
                 ", \"lanes\": " + std::to_string(lanes) + ", \"ok\": ";
    timeline_.Instant("ready", request.name, join->submit_ns);
  }
  Timeline* timeline = &timeline_;
  // Slices are submitted under the join's lock, so that a slice that fails at once finds the
  // rounds of the others.
  std::unique_lock<std::mutex> submitting(join->mu);
  const uint64_t element = DataTypeSize(request.dtype);
  const uint64_t elements = request.bytes / element;
  for (size_t l = 0; l < lanes; ++l) {
    const uint64_t first = LaneSliceStart(elements, static_cast<int>(l), active),
                   end = LaneSliceStart(elements, static_cast<int>(l) + 1, active);
    OpRequest slice;
    slice.kind = request.kind;
    slice.name = request.name;
    slice.dtype = request.dtype;
    slice.shape = request.shape;  // the whole tensor's: peers check it as they would unsliced
    slice.input = static_cast<const char*>(request.input) + first * element;
    slice.output = static_cast<char*>(request.output) + first * element;
    slice.bytes = (end - first) * element;
    slice.priority = request.priority;
    slice.average = request.average;
    slice.compression = request.compression;
    slice.two_level = request.two_level;
    slice.lane_slice = true;
    slice.done = [this, join, timeline, l](const Status& status, const GatherResult*) {
      std::function<void(const Status&, const GatherResult*)> done;
      Status result;
      {
        std::lock_guard<std::mutex> lock(join->mu);
        if (!status.ok() && join->status.ok()) {
          join->status = status;
          // The other slices would wait for their peers, which may never send them (a worker
          // that did not slice this tensor): they fail now, everywhere, with this status.
          for (size_t other = 0; other < join->submitted; ++other)
            if (other != l) CancelOnLane(static_cast<int>(other), join->name, join->rounds[other], status);
        }
        if (--join->left > 0) return;
        done = std::move(join->done);
        result = join->status;
      }
      if (timeline->enabled())
        timeline->Complete("op", join->name, join->submit_ns, NowNs(), join->args + (result.ok() ? "true}" : "false}"));
      done(result, nullptr);
    };
    submitting.unlock();  // a slice refused at once calls `done` here
    const uint64_t round = SubmitToLane(static_cast<int>(l), std::move(slice));
    submitting.lock();
    join->rounds[l] = round;
    join->submitted = l + 1;
    if (!join->status.ok()) CancelOnLane(static_cast<int>(l), join->name, round, join->status);  // a sibling failed already
  }
}

void Engine::CancelOnLane(int lane, const std::string& name, uint64_t round, const Status& status) {
  Impl& m = *lanes_[lane];
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (!m.stopped.empty()) return;
    m.cancels.push_back({name, round, status});
  }
  m.Wake();
}

uint64_t Engine::SubmitToLane(int lane, OpRequest request) {
  Impl& m = *lanes_[lane];
  std::string stopped;
  uint64_t round = 0;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    stopped = m.stopped;
    if (stopped.empty()) {
      round = m.rounds[request.name]++;
      m.submitted.emplace_back(std::move(request), round);
    }
  }
  if (!stopped.empty()) {
    request.done(Status(Code::kUnavailable, std::string(OpKindName(request.kind)) + " '" + request.name +
                                                "' failed: " + stopped),
                 nullptr);
    return round;
  }
  m.Wake();
  return round;
}

void Engine::DeclareFusion(const std::string& group, std::vector<FusionDeclaration> tensors, uint64_t bucket_bytes,
                           std::function<void(const Status&)> done) {
  if (lanes_.size() == 1) return DeclareOnLane(0, group, std::move(tensors), bucket_bytes, std::move(done));
  // A lane checks only its share: the whole declaration is checked here, as one engine would.
  const Status valid = ValidateDeclaration(group, tensors);
  if (!valid.ok()) {
    PROPHET_INFO("fusion declaration refused: %s", valid.message().c_str());
    if (done) done(valid);
    return;
  }
  // Each lane declares its share of the fused buckets (FusionByLane), and every lane declares, so
  // that a lane's earlier plan of this group ends too. A group that held one of these tensors is
  // replaced (as Fuser::Declare replaces it on one engine): declared empty on every lane first.
  auto fused_lane = std::make_shared<std::unordered_map<std::string, int>>();
  std::vector<std::vector<std::vector<int>>> buckets;
  std::vector<std::vector<FusionDeclaration>> shares =
      FusionByLane(tensors, options_.world_size, bucket_bytes, active_lanes_.load(), fused_lane.get(), &buckets);
  shares.resize(lanes_.size());
  buckets.resize(lanes_.size());
  std::vector<std::string> replaced;
  {
    std::lock_guard<std::mutex> lock(fused_mu_);
    for (const FusionDeclaration& t : tensors) {
      const auto it = fused_lanes_.find(t.name);
      if (it != fused_lanes_.end() && it->second.second != group &&
          std::find(replaced.begin(), replaced.end(), it->second.second) == replaced.end())
        replaced.push_back(it->second.second);
    }
  }
  struct Join {
    std::mutex mu;
    size_t left = 0;
    Status status;
  };
  auto join = std::make_shared<Join>();
  join->left = lanes_.size() * (1 + replaced.size());
  auto answered = [this, join, group, replaced, fused_lane, done = std::move(done)](const Status& status) {
    {
      std::lock_guard<std::mutex> lock(join->mu);
      if (!status.ok() && join->status.ok()) join->status = status;
      if (--join->left > 0) return;
    }
    if (join->status.ok()) {  // routing follows the new plans once every lane holds them
      std::lock_guard<std::mutex> lock(fused_mu_);
      for (auto it = fused_lanes_.begin(); it != fused_lanes_.end();)
        it = it->second.second == group ||
                     std::find(replaced.begin(), replaced.end(), it->second.second) != replaced.end()
                 ? fused_lanes_.erase(it)
                 : std::next(it);
      for (const auto& [name, lane] : *fused_lane) fused_lanes_[name] = {lane, group};
    }
    if (done) done(join->status);
  };
  for (const std::string& old : replaced)
    for (size_t l = 0; l < lanes_.size(); ++l) DeclareOnLane(static_cast<int>(l), old, {}, bucket_bytes, answered);
  for (size_t l = 0; l < lanes_.size(); ++l)
    DeclareOnLane(static_cast<int>(l), group, std::move(shares[l]), bucket_bytes, answered, &buckets[l]);
}

void Engine::DeclareOnLane(int lane, const std::string& group, std::vector<FusionDeclaration> tensors,
                           uint64_t bucket_bytes, std::function<void(const Status&)> done,
                           const std::vector<std::vector<int>>* buckets) {
  Impl& m = *lanes_[lane];
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (m.stopped.empty()) {
      m.declarations.push_back({m.submitted.size(), group, std::move(tensors), bucket_bytes, std::move(done),
                                buckets != nullptr, buckets ? *buckets : std::vector<std::vector<int>>()});
      done = nullptr;
    }
  }
  if (done) done(Status(Code::kUnavailable, "the fusion declaration came after the runtime stopped"));
  m.Wake();
}

Timeline& Engine::timeline() { return timeline_; }

Status Engine::SetSchedule(const std::string& schedule) {
  SchedulerOptions check;
  check.policy = schedule;
  std::string error;
  if (!MakePolicy(check, &error)) return Status(Code::kInvalidArgument, error);
  for (auto& lane : lanes_) {
    Impl& m = *lane;
    {
      std::lock_guard<std::mutex> lock(m.mu);
      m.requested_schedule = schedule;
    }
    m.Wake();
  }
  return Status::OK();
}

std::string Engine::SchedulerStateJson() {
  Impl& m = *lanes_.front();
  std::future<std::string> answer;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    if (!m.stopped.empty()) return "{}";
    m.state_requests.emplace_back();
    answer = m.state_requests.back().get_future();
  }
  m.Wake();
  if (answer.wait_for(std::chrono::seconds(10)) != std::future_status::ready) return "{}";
  try {
    return answer.get();
  } catch (const std::future_error&) {  // the engine stopped before answering
    return "{}";
  }
}

uint64_t Engine::BytesSent() const {
  uint64_t sent = 0;
  for (const auto& m : lanes_)
    for (const auto& c : m->conns)
      if (c) sent += c->bytes_sent();
  return sent;
}

// Every lane's counts added up (a push_pull in slices counts once per lane in ops_done), and the
// bytes each lane sent.
std::string Engine::StatsJson() const {
  uint64_t sent = 0, received = 0, frames_sent = 0, frames_received = 0;
  uint64_t done = 0, failed = 0, questions = 0, fused = 0;
  double io_cpu_s = 0;  // the lanes' threads
  std::string lane_sent;
  for (const auto& lane : lanes_) {
    const Impl& m = *lane;
    uint64_t lane_bytes = 0;
    for (const auto& c : m.conns) {
      if (!c) continue;
      lane_bytes += c->bytes_sent();
      sent += c->bytes_sent();
      received += c->bytes_received();
      frames_sent += c->frames_sent();
      frames_received += c->frames_received();
    }
    lane_sent += (lane_sent.empty() ? "" : ", ") + std::to_string(lane_bytes);
    io_cpu_s += m.ThreadCpuSeconds();
    done += m.ops_done.load();
    failed += m.ops_failed.load();
    questions += m.fusion_questions.load();
    fused += m.fused_submitted.load();
  }
  const Impl& first = *lanes_.front();
  std::string schedule;
  {
    std::lock_guard<std::mutex> lock(first.mu);
    schedule = first.schedule_name;
  }
  std::ostringstream os;
  os << "{\"rank\": " << first.rank() << ", \"world_size\": " << first.world_size() << ", \"schedule\": \""
     << schedule << "\", \"bytes_sent\": " << sent << ", \"bytes_received\": " << received
     << ", \"frames_sent\": " << frames_sent << ", \"frames_received\": " << frames_received
     << ", \"ops_done\": " << done << ", \"ops_failed\": " << failed << ", \"fusion_questions\": " << questions
     << ", \"fused_submitted\": " << fused << ", \"io_threads\": " << active_lanes_.load() << ", \"lanes\": " << lanes_.size()
     << ", \"io_cpu_s\": " << io_cpu_s << ", \"lane_bytes_sent\": [" << lane_sent << "]"
     << ", \"two_level_hosts\": " << (first.two_level && two_level_on_.load() ? first.two_level->hosts() : 0)
     << ", \"path_choosable\": " << (PathChoosable() ? "true" : "false")
     << ", \"path_chosen\": " << (path_chosen_.load() ? "true" : "false")
     << ", \"outputs_recycled\": " << GlobalOutputPool().reused() << "}";
  return os.str();
}

// ------------------------------------------------------------------------------------------------
// The I/O thread

void Engine::Impl::Run() {
  std::vector<epoll_event> events(64);
  while (true) {
    int64_t now = NowNs();
    int timeout_ms = 100;
    const int64_t wake = policy->NextWakeupNs();
    if (wake >= 0) timeout_ms = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(100, (wake - now) / 1000000)));
    const int n_events = ::epoll_wait(epoll_fd, events.data(), static_cast<int>(events.size()), timeout_ms);
    // Operations submitted meanwhile start before the sockets are read, so that their frames
    // land in their tensors rather than being held as early frames and copied again.
    DrainSubmissions();
    for (int i = 0; i < n_events; ++i) {
      const uint64_t tag = events[i].data.u64;
      if (tag == kWakeTag) {
        uint64_t value;
        while (::read(wake_fd, &value, sizeof(value)) > 0) {
        }
        continue;
      }
      Connection& c = *conns[tag];
      if (!c.open()) continue;
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) c.OnReadable(kReadTurnBytes);
      if (c.open() && (events[i].events & EPOLLOUT)) c.Flush();
    }
    if (stop.load()) break;
    SendQueued();
    now = NowNs();
    if (now >= next_timeout_check) {
      timeouts.Check(now);
      std::vector<Fuser::Refusal> late;
      fuser.Expire(now, static_cast<int64_t>(options_.timeout_s * 1e9), &late);
      Refuse(std::move(late));
      std::vector<Fuser::CheckFrame> questions;
      fuser.Check(now, rank(), world_size(),
                  [this](const std::string& name, uint64_t round) { return Find(OperationKey(name, round)) != nullptr; },
                  &questions);
      SendChecks(std::move(questions));
      failures.Heartbeat(now);
      next_timeout_check = now + kTimeoutCheckNs;
    }
  }
  Shutdown();
}

void Engine::Impl::SendQueued() {
  // Pushes that left while flushing return their credit, which may release the next ones at once:
  // the kernel holds only a little unsent data (transport.h), so waiting for the next turn would
  // let the link idle.
  do {
    credit_returned = false;
    Pump();
    for (auto& c : conns)
      if (c && c->open() && !c->idle() && !c->awaiting_room()) c->Flush();
  } while (credit_returned && policy->queued() > 0);
}

// Fails what is left, then closes so that peers read EOF rather than a reset.
void Engine::Impl::Shutdown() {
  {  // first, so that no request can arrive after the last drain and never be answered
    std::lock_guard<std::mutex> lock(mu);
    stopped = "the prophet_tf runtime was shut down";
  }
  DrainSubmissions();
  std::vector<OpRequest> held;
  fuser.TakeAll(&held);
  std::vector<Fuser::Refusal> aborted;
  for (OpRequest& r : held) {
    Status status(Code::kAborted, "the prophet_tf runtime was shut down while push_pull '" + r.name +
                                      "' waited for the rest of its fused bucket");
    aborted.emplace_back(std::move(r), std::move(status));
  }
  Refuse(std::move(aborted));
  for (Collective* op : Running())
    Finish(op, Status(Code::kAborted, "the prophet_tf runtime was shut down before " + op->Describe() + " finished"));
  if (vanish) return;  // as a killed process: the sockets close with nothing more sent
  // Every operation that completed here has handed its last frame to a connection (an owner
  // completes once its results are sent), so what is queued is all the peers still need. The
  // departure notice goes last: a peer that reads it knows the EOF after it is not a crash. Not
  // after a lost peer: the survivors must go on naming that loss (kPeerLost), not this exit.
  FrameMeta leaving;
  leaving.type = FrameType::kLeaving;
  if (!failures.peer_lost())
    for (auto& c : conns)
      if (c && c->open()) c->Queue(MakeOwnedFrame(leaving, "", kLastPriority));
  // Give queued frames a moment to leave, then half-close and wait briefly for the peer's EOF
  // (a peer closes its end when it reads the notice, so this is quick when the peer is alive).
  for (auto& c : conns)
    if (c) c->FinishSending(NowNs() + int64_t{2000000000});
  const int64_t deadline = NowNs() + int64_t{1000000000};
  for (auto& c : conns)
    if (c) c->AwaitEof(deadline);
}

void Engine::Impl::DrainSubmissions() {
  std::vector<std::pair<OpRequest, uint64_t>> batch;
  std::vector<std::promise<std::string>> questions;
  std::vector<Declaration> declared;
  std::vector<Cancel> cancelled;
  {
    std::lock_guard<std::mutex> lock(mu);
    batch.swap(submitted);
    cancelled.swap(cancels);
    questions.swap(state_requests);
    declared.swap(declarations);
    if (!requested_schedule.empty()) next_schedule = std::move(requested_schedule);
    requested_schedule.clear();
  }
  // Every operation of the batch starts (hands its pushes to the scheduler) before the frames that
  // arrived early are applied, and the pump queues the pushes first: the owners need them before
  // they can send their sums back, while the sums of the early frames, queued after them at the
  // same priority, only complete the peers' operations. A worker that submits late then starts
  // the round trip of its own contribution at once.
  std::vector<uint64_t> started;
  size_t next_declaration = 0;
  auto declare_up_to = [&](size_t at) {
    for (; next_declaration < declared.size() && declared[next_declaration].at <= at; ++next_declaration) {
      Declaration& d = declared[next_declaration];
      const Status s = fuser.Declare(d.group, d.tensors, world_size(), d.bucket_bytes, d.dealt ? &d.buckets : nullptr);
      if (!s.ok()) PROPHET_INFO("fusion declaration refused: %s", s.message().c_str());
      std::vector<Fuser::CheckFrame> digest;
      fuser.TellDigest(rank(), world_size(), &digest);
      SendChecks(std::move(digest));
      if (d.done) d.done(s);
    }
  };
  for (size_t i = 0; i < batch.size(); ++i) {
    declare_up_to(i);
    Route(std::move(batch[i].first), batch[i].second, &started);
  }
  declare_up_to(batch.size());
  if (!started.empty()) Pump();
  for (const uint64_t id : started) {
    auto it = ops_by_id.find(id);
    if (it == ops_by_id.end()) continue;  // finished or failed meanwhile
    Collective* op = it->second;
    ReplayEarly(op);
    if (Alive(id)) failures.OnStarted(op);
  }
  // Not while stopping: a sibling failed because its lane shuts down, and so does this one, which
  // fails its operations here without telling the peers (Shutdown).
  if (!stop.load())
    for (const Cancel& c : cancelled)
      if (Collective* op = Find(OperationKey(c.name, c.round))) FailEverywhere(op, c.status);
  if (!questions.empty()) {
    const std::string state = PolicyStateJson(*policy);
    for (auto& question : questions) question.set_value(state);
  }
}

void Engine::Impl::Route(OpRequest request, uint64_t round, std::vector<uint64_t>* started) {
  if (request.kind == OpKind::kPushPull) {
    fuser.Routed(request.name, round);
    Status differs;
    if (fuser.Refuses(request, &differs)) {  // the workers' fusion declarations differ
      failures.FailElsewhere(request.name, round, differs);  // a peer waiting for it fails too
      std::vector<Fuser::Refusal> refused;
      refused.emplace_back(std::move(request), std::move(differs));
      return Refuse(std::move(refused));
    }
  }
  if (!fuser.Fuses(request)) {
    if (const uint64_t id = StartOperation(std::move(request), round)) started->push_back(id);
    return;
  }
  fused_submitted.fetch_add(1);
  if (timeline.enabled()) {
    // A member keeps its own "ready" and "op" events, as if it travelled alone: users read a
    // tensor's wait in the trace, and a multi-worker trace read as a profile needs each
    // gradient's bytes. Its span ends when its bucket's sum is copied back.
    const int64_t held_ns = NowNs();
    timeline.Instant("ready", request.name, held_ns);
    const uint64_t member_round = fused_rounds[request.name]++;
    const std::string args = "{\"round\": " + std::to_string(member_round) + ", \"bytes\": " +
                             std::to_string(request.bytes) + ", \"priority\": " +
                             std::to_string(request.priority) + ", \"fused\": true, \"ok\": ";
    request.done = [this, done = std::move(request.done), name = request.name, args, held_ns](
                       const Status& status, const GatherResult* gather) {
      timeline.Complete("op", name, held_ns, NowNs(), args + (status.ok() ? "true}" : "false}"));
      done(status, gather);
    };
  }
  std::vector<OpRequest> ready;
  std::vector<Fuser::Refusal> refused;
  std::string notice;
  fuser.Hold(std::move(request), round, NowNs(), &ready, &refused, &notice);
  if (!notice.empty()) failures.FailElsewhere(notice, NextRound(notice), refused.front().second);
  Refuse(std::move(refused));
  for (OpRequest& bucket : ready) {
    const uint64_t bucket_round = NextRound(bucket.name);
    fuser.Started(bucket.name, bucket_round, NowNs());
    if (const uint64_t id = StartOperation(std::move(bucket), bucket_round)) started->push_back(id);
  }
}

uint64_t Engine::Impl::StartOperation(OpRequest req, uint64_t round) {
  std::unique_ptr<Collective> owned = MakeCollective(this, next_op_id++, std::move(req), round);
  Collective* op = owned.get();
  if (timeline.enabled() && !op->request().lane_slice) timeline.Instant("ready", op->request().name, op->submit_ns());
  if (const Status* failed = failures.FailedWith(op->key())) {
    op->Complete(*failed);
    ops_failed.fetch_add(1);
    return 0;
  }
  if (ops.count(op->key())) {
    op->Complete(Status(Code::kInternal, "duplicate operation " + op->key()));
    return 0;
  }
  const uint64_t id = op->id();
  ops_by_id[id] = op;
  ops[op->key()] = std::move(owned);
  op->Start();
  return id;
}

void Engine::Impl::ReplayEarly(Collective* op) {
  std::vector<EarlyFrame> frames = early.Take(op->key());
  const uint64_t id = op->id();
  for (EarlyFrame& e : frames) {
    if (!Alive(id)) return;  // failed by an earlier frame
    ApplyWholeFrame(op, e.peer, e.meta, &e.data);
  }
}

void Engine::Impl::Finish(Collective* op, const Status& status) {
  const uint64_t id = op->id();
  timeouts.Forget(op->key());
  // Frames and receives still using this operation's tensors (the done callback may free them).
  for (auto& c : conns)
    if (c) c->Abandon(id);
  if (timeline.enabled() && !op->request().lane_slice)
    timeline.Complete("op", op->request().name, op->submit_ns(), NowNs(),
                      "{\"round\": " + std::to_string(op->round()) + ", \"bytes\": " +
                          std::to_string(op->request().bytes) + ", \"priority\": " +
                          std::to_string(op->request().priority) + ", \"ok\": " + (status.ok() ? "true" : "false") + "}");
  std::unique_ptr<Collective> owned = std::move(ops[op->key()]);
  ops.erase(op->key());
  ops_by_id.erase(id);
  if (status.ok()) {
    ops_done.fetch_add(1);
  } else {
    ops_failed.fetch_add(1);
    PROPHET_INFO("%s failed: %s", owned->Describe().c_str(), status.message().c_str());
  }
  owned->Complete(status);
  policy->OnOperationEnded(id);
}

// ------------------------------------------------------------------------------------------------
// Sending: the scheduler releases PUSHes under the byte credit

void Engine::Impl::Pump() {
  if (!next_schedule.empty() && policy->queued() == 0) SwitchPolicy();
  if (policy->queued() == 0) return;
  const uint64_t credit = credit_share.load(std::memory_order_relaxed);
  std::vector<SendTask> tasks;
  policy->Dequeue(unsent_push_bytes < credit ? credit - unsent_push_bytes : 0, NowNs(), &tasks);
  if (timeline.enabled())
    for (const PolicySpan& span : policy->TakeSpans()) {
      if (span.instant) {
        timeline.Instant("block", span.label, span.start_ns);
        continue;
      }
      timeline.Complete("block", span.label, span.start_ns, span.end_ns,
                        "{\"tasks\": " + std::to_string(span.tasks) + ", \"bytes\": " + std::to_string(span.bytes) + "}");
    }
  for (const SendTask& t : tasks) {
    auto it = ops_by_id.find(t.request_id);
    if (it == ops_by_id.end()) {  // failed while queued: it will never leave
      policy->OnPushLeft(t);
      continue;
    }
    unsent_push_bytes += t.bytes;
    it->second->SendScheduled(t);
  }
}

// Nothing is queued, so no partition changes hands; pushes in flight report to the new policy.
void Engine::Impl::SwitchPolicy() {
  std::string next;
  next.swap(next_schedule);
  if (next == policy->name()) return;
  SchedulerOptions options;
  options.policy = next;
  options.replan_threshold = options_.replan_threshold;
  options.credit_bytes = options_.credit_bytes;
  std::string error;
  std::unique_ptr<SchedulerPolicy> fresh = MakePolicy(options, &error);
  if (!fresh) return;  // SetSchedule checked the name
  *fresh->bandwidth() = *policy->bandwidth();
  PROPHET_INFO("schedule %s -> %s", policy->name(), fresh->name());
  if (timeline.enabled()) timeline.Instant("block", std::string("schedule ") + fresh->name(), NowNs());
  policy = std::move(fresh);
  std::lock_guard<std::mutex> lock(mu);
  schedule_name = policy->name();
}

void Engine::Impl::PushCompleted(const TransferDone& d) {
  policy->OnTransferDone(d);
  const std::vector<BandwidthSample> samples = policy->bandwidth()->TakeSamples();
  if (!timeline.enabled()) return;
  if (!d.local) timeline.Complete(d.exchange ? "exchange" : "push", d.task.name, d.sent_ns, d.done_ns);
  if (lane > 0) return;  // one lane's estimate stands for the trace's counter
  for (const BandwidthSample& b : samples) timeline.Counter("bandwidth_MBps", b.ts_ns, b.estimate_Bps / 1e6);
}

// ------------------------------------------------------------------------------------------------
// Receiving: frames find their operation by name#round

PayloadSink Engine::Impl::OnFrame(Connection& c, const FrameMeta& meta) {
  if (meta.type == FrameType::kError || meta.type == FrameType::kPeerLost || meta.type == FrameType::kFusionCheck)
    return PayloadSink::Buffer();
  if (IsControlFrame(meta.type)) return PayloadSink::Discard();  // no payload; handled when done
  const std::string key = OperationKey(meta.name, meta.round);
  Collective* op = Find(key);
  if (op != nullptr) return op->OnFrame(c.peer(), meta);
  // Not submitted here yet: keep it for later, unless it belongs to an operation that failed here
  // (or it is a RESULT, which only answers a PUSH of a live operation).
  if (meta.type == FrameType::kResult || failures.FailedWith(key)) return PayloadSink::Discard();
  const std::string problem = early.Admit(c.peer(), meta);
  if (problem.empty()) return PayloadSink::Buffer();
  // A frame no worker sends: its operation fails everywhere, and the connection is dropped.
  failures.FailElsewhere(meta.name, meta.round, Status(Code::kInvalidArgument, problem));
  early.Take(key);
  c.Refuse(problem);
  return PayloadSink::Discard();
}

void Engine::Impl::OnFrameDone(Connection& c, const FrameMeta& meta, PayloadSink::Kind sink, uint64_t tag,
                               ByteBuffer* buffered) {
  if (sink == PayloadSink::Kind::kBuffer) {
    // An early frame's reservation ends here; HandleWholeFrame counts it again if it keeps it.
    early.Received(c.peer());
    return HandleWholeFrame(c.peer(), meta, std::move(*buffered));
  }
  if (meta.type == FrameType::kProbe) return timeouts.OnProbe(c.peer(), meta);
  if (meta.type == FrameType::kProbeReply) return timeouts.OnProbeReply(c.peer(), meta);
  if (meta.type == FrameType::kLeaving) return failures.OnLeaving(c.peer());
  if (sink == PayloadSink::Kind::kDiscard) return;
  auto it = ops_by_id.find(tag);
  if (it != ops_by_id.end()) it->second->OnPayloadDone(c.peer(), meta);
}

void Engine::Impl::HandleWholeFrame(int peer, const FrameMeta& meta, ByteBuffer data) {
  if (meta.type == FrameType::kPeerLost) return failures.OnLossReport(peer, meta, data);
  if (meta.type == FrameType::kFusionCheck) return OnFusionCheck(peer, meta, data);
  if (meta.type == FrameType::kError) {
    failures.OnErrorNotice(peer, meta, data);
    early.Take(OperationKey(meta.name, meta.round));
    return;
  }
  const std::string key = OperationKey(meta.name, meta.round);
  if (Collective* op = Find(key)) return ApplyWholeFrame(op, peer, meta, &data);
  if (failures.FailedWith(key)) return;
  early.Keep(peer, meta, std::move(data));
}

void Engine::Impl::OnFusionCheck(int peer, const FrameMeta& meta, const ByteBuffer& data) {
  std::vector<Fuser::CheckFrame> answers;
  std::vector<Fuser::Refusal> held;
  const Status error = fuser.OnCheck(rank(), peer, static_cast<FusionCheckKind>(meta.partition), meta.name, meta.round,
                                     meta.offset, std::string(data.data(), data.size()), &answers, &held);
  SendChecks(std::move(answers));
  if (error.ok()) return;
  // The declarations differ: the fused operations running here fail, and so do the push_pulls of
  // the tensors either worker declared (a peer may hold one in a bucket that this worker sends
  // alone), on every worker (error notices).
  PROPHET_INFO("%s", error.message().c_str());
  Refuse(std::move(held));
  std::vector<uint64_t> failing;  // ids: failing one operation may end others
  for (Collective* op : Running()) {
    Status ignored;
    if (op->request().name.rfind(kFusedPrefix, 0) == 0 || fuser.Refuses(op->request(), &ignored))
      failing.push_back(op->id());
  }
  for (const uint64_t id : failing) {
    const auto it = ops_by_id.find(id);
    if (it != ops_by_id.end()) failures.FailEverywhere(it->second, error);
  }
}

// ------------------------------------------------------------------------------------------------
// The process-wide engine

namespace {
std::mutex g_engine_mu;
Engine* g_engine = nullptr;  // leaked on purpose at exit: Python's atexit shuts it down first
}  // namespace

Status InitGlobalEngine(const EngineOptions& options) {
  std::lock_guard<std::mutex> lock(g_engine_mu);
  if (g_engine != nullptr)
    return Status(Code::kAlreadyExists, "the prophet_tf runtime is already initialised; call shutdown() first");
  std::unique_ptr<Engine> engine;
  Status s = Engine::Start(options, &engine);
  if (s.ok()) g_engine = engine.release();
  return s;
}

void ShutdownGlobalEngine() {
  Engine* engine;
  {
    std::lock_guard<std::mutex> lock(g_engine_mu);
    engine = g_engine;
    g_engine = nullptr;
  }
  delete engine;
}

Engine* GlobalEngine() {
  std::lock_guard<std::mutex> lock(g_engine_mu);
  return g_engine;
}

}  // namespace prophet
