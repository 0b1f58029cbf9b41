#include "ops/core/engine.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <sstream>

#include "ops/core/collective.h"
#include "ops/core/connection.h"
#include "ops/core/straggler.h"
#include "ops/core/transport.h"

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
constexpr size_t kRememberedFailures = 4096;

// A frame whose operation has not been submitted on this worker yet.
struct EarlyFrame {
  int peer = 0;
  FrameMeta meta;
  ByteBuffer data;
  uint64_t footprint = 0;  // what it counts against max_early_bytes
};

// Memory an early frame holds: its payload and its bookkeeping (so that many empty frames count).
uint64_t EarlyFootprint(const FrameMeta& meta) {
  return meta.payload_bytes + meta.name.size() + 8 * meta.shape.size() + sizeof(EarlyFrame) + 64;
}

}  // namespace

struct Engine::Impl : public Connection::Handler, public CollectiveHost {
  // Early PUSHes from one peer are bounded by that peer's credit (their results cannot come
  // back before this worker submits), so that much per peer is worth keeping warm.
  explicit Impl(const EngineOptions& o)
      : options_(o),
        buffers(static_cast<uint64_t>(std::max(o.world_size - 1, 0)) * (o.credit_bytes + o.partition_bytes)) {}

  EngineOptions options_;
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
  std::string schedule_name;                              // the policy in use, for StatsJson

  // Owned by the engine thread (the connections and the policy are made before it starts).
  std::vector<std::unique_ptr<Connection>> conns;  // by peer rank; null for this rank
  std::unordered_map<std::string, std::unique_ptr<Collective>> ops;  // by key
  std::unordered_map<uint64_t, Collective*> ops_by_id;
  std::unordered_map<std::string, std::vector<EarlyFrame>> early;  // by key
  uint64_t early_bytes = 0;               // footprints of `early` and of early frames being received
  std::vector<uint64_t> early_receiving;  // by peer: the footprint of the early frame it is sending
  // Keys of failed operations with their error, so that frames still on their way are dropped
  // and a worker that submits one later fails at once with the same error (bounded memory).
  std::unordered_map<std::string, Status> failed_keys;
  std::deque<std::string> failed_order;
  std::unique_ptr<SchedulerPolicy> policy;
  std::string next_schedule;  // switch to it once no partition is queued
  uint64_t next_op_id = 1;
  uint64_t enqueue_seq = 0;
  uint64_t in_flight = 0;  // bytes of pushed partitions whose result has not come back
  int64_t next_timeout_check = 0;
  StragglerProbe stragglers;  // timed-out operations whose peers are being asked who is behind
  int64_t next_heartbeat = 0;
  // By peer: the last error it reported for an operation that had already completed here (a
  // broadcast root finishes when its data is sent). Told again if that peer is lost, so that this
  // worker's error names the conflict, not only the lost connection.
  std::vector<std::string> peer_reports;
  // By peer: the lost worker it reported (kPeerLost) and who saw that loss first. A worker leaves
  // soon after it loses a peer (its program fails), so when its own connection closes, the loss
  // it reported is the cause to name, not its leaving.
  struct LossReport {
    int observer = -1;
    std::string message;
  };
  std::vector<LossReport> loss_reports;
  // The first loss of a peer this worker knew of, in the words every worker uses for it; once set,
  // every later closed connection is a consequence of it.
  std::string first_loss;
  // By peer: it said kLeaving (its program finished). Its EOF is then a departure, not a loss.
  std::vector<bool> departed;
  std::string unresponsive_reason;  // set while the heartbeat closes a connection
  Timeline timeline;
  BufferPool buffers;  // payloads held in memory (early frames)

  // Statistics (read by StatsJson from other threads).
  std::atomic<uint64_t> ops_done{0}, ops_failed{0};

  // --- the thread ------------------------------------------------------------------------------
  void Run();
  void Shutdown();
  void DrainSubmissions();
  void StartOperation(OpRequest req, uint64_t round);
  void ReplayEarly(Collective* op);
  // Removes the early frames of `key` (and their footprint).
  std::vector<EarlyFrame> TakeEarly(const std::string& key);
  // Why an early frame from `peer` cannot be held, or "".
  std::string EarlyProblem(int peer, const FrameMeta& meta, uint64_t footprint) const;
  // Fails name#round everywhere with `message` and drops `c`, whose peer sent the frame.
  void RefuseEarly(Connection& c, const FrameMeta& meta, const std::string& message);
  void Pump();
  void SwitchPolicy();
  void CheckTimeouts(int64_t now);
  void DecideStall(Collective* op, const StragglerProbe::Verdict& verdict);
  void AnswerProbe(int peer, const FrameMeta& meta);
  // Whether this worker has submitted round `round` of `name` (it may have finished since).
  bool Submitted(const std::string& name, uint64_t round);
  void Heartbeat(int64_t now);
  // The job lost a peer: `message` (as `observer` saw it) fails everything pending, unless an
  // earlier loss already did; every peer hears of the first loss before this worker can leave.
  void LosePeer(int observer, const std::string& message);
  void FailAll(const std::string& message);
  // `peer` finished its program: operations still waiting for its data fail, the others go on.
  void OnPeerLeaving(int peer);
  // Fails `op` if it waits for data from a worker that has left; returns whether it did.
  bool FailIfWaitingForDeparted(Collective* op);
  // Fails `op` here and on every worker with `status` (its message says the whole story).
  void FailEverywhere(Collective* op, const Status& status);
  void RememberFailure(const std::string& key, const Status& status);
  void Wake() {
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd, &one, sizeof(one));
    (void)ignored;
  }
  Collective* Find(const std::string& key) {
    auto it = ops.find(key);
    return it == ops.end() ? nullptr : it->second.get();
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
  void OnClosed(Connection& c, const std::string& why) override;

  // --- CollectiveHost ----------------------------------------------------------------------------
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  const EngineOptions& options() const override { return options_; }
  void Send(int peer, OutFrame frame) override {
    if (conns[peer]) conns[peer]->Queue(std::move(frame));
  }
  bool Alive(uint64_t op_id) const override { return ops_by_id.count(op_id) != 0; }
  void Finish(Collective* op, const Status& status) override;
  void FailEverywhere(Collective* op, const std::string& message) override;
  void Refuse(Collective* op, int peer, const std::string& message) override;
  void Announce(const TensorReady& ready) override { policy->OnTensorReady(ready); }
  void Schedule(SendTask task) override {
    task.enqueue_seq = enqueue_seq++;
    policy->Enqueue(task);
  }
  void PushCompleted(const TransferDone& done) override;
  void ReturnCredit(uint64_t bytes) override { in_flight -= bytes; }
};

// ------------------------------------------------------------------------------------------------
// Lifecycle

Engine::Engine(const EngineOptions& options) : options_(options), impl_(new Impl(options)) {}

Status Engine::Start(const EngineOptions& options, std::unique_ptr<Engine>* out) {
  std::unique_ptr<Engine> engine(new Engine(options));
  Impl& m = *engine->impl_;
  SetLogRank(options.rank);
  std::string error;
  SchedulerOptions sched;
  sched.policy = options.schedule;
  sched.replan_threshold = options.replan_threshold;
  m.policy = MakePolicy(sched, &error);
  if (!m.policy) return Status(Code::kInvalidArgument, error);
  m.schedule_name = m.policy->name();
  if (!options.timeline_path.empty() && !m.timeline.Open(options.timeline_path, options.rank, &error))
    return Status(Code::kInvalidArgument, "cannot write the timeline: " + error);

  std::vector<int> fds(options.world_size, -1);
  if (options.world_size > 1) {
    BootstrapOptions b;
    b.rank = options.rank;
    b.world_size = options.world_size;
    b.addresses = options.addresses;
    b.token = options.token;
    b.bind_host = options.bind_host;
    b.connect_timeout_s = options.connect_timeout_s;
    b.heartbeat_s = options.heartbeat_s;
    b.socket_buffer_bytes = options.socket_buffer_bytes;
    int listen_fd = -1;
    Status s = Listen(b, &listen_fd);
    if (s.ok()) s = ConnectAll(b, listen_fd, &fds);
    if (!s.ok()) return s;
  }
  m.epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  m.wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kWakeTag;
  ::epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, m.wake_fd, &ev);
  m.conns.resize(options.world_size);
  m.early_receiving.assign(options.world_size, 0);
  m.peer_reports.resize(options.world_size);
  m.loss_reports.resize(options.world_size);
  m.departed.assign(options.world_size, false);
  for (int r = 0; r < options.world_size; ++r) {
    if (fds[r] < 0) continue;
    m.conns[r] = std::make_unique<Connection>(r, fds[r], m.epoll_fd, &m, &m.buffers);
    ev.events = EPOLLIN;
    ev.data.u64 = static_cast<uint64_t>(r);
    ::epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, fds[r], &ev);
  }
  PROPHET_INFO("runtime started: %d workers, schedule %s, partitions of %llu bytes, credit %llu bytes",
               options.world_size, m.policy->name(), static_cast<unsigned long long>(options.partition_bytes),
               static_cast<unsigned long long>(options.credit_bytes));
  m.thread = std::thread([&m] { m.Run(); });
  *out = std::move(engine);
  return Status::OK();
}

void Engine::StopWithoutNotice() {
  Impl& m = *impl_;
  m.vanish.store(true);
  if (m.thread.joinable()) {
    m.stop.store(true);
    m.Wake();
    m.thread.join();
  }
  m.conns.clear();  // closes the sockets
}

Engine::~Engine() {
  Impl& m = *impl_;
  if (m.thread.joinable()) {
    m.stop.store(true);
    m.Wake();
    m.thread.join();
  }
  m.timeline.Close();
  m.conns.clear();
  if (m.epoll_fd >= 0) ::close(m.epoll_fd);
  if (m.wake_fd >= 0) ::close(m.wake_fd);
}

void Engine::Submit(OpRequest request) {
  Impl& m = *impl_;
  std::string stopped;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    stopped = m.stopped;
    if (stopped.empty()) {
      const uint64_t round = m.rounds[request.name]++;
      m.submitted.emplace_back(std::move(request), round);
    }
  }
  if (!stopped.empty()) {
    request.done(Status(Code::kUnavailable, std::string(OpKindName(request.kind)) + " '" + request.name +
                                                "' failed: " + stopped),
                 nullptr);
    return;
  }
  m.Wake();
}

Timeline& Engine::timeline() { return impl_->timeline; }

Status Engine::SetSchedule(const std::string& schedule) {
  SchedulerOptions check;
  check.policy = schedule;
  std::string error;
  if (!MakePolicy(check, &error)) return Status(Code::kInvalidArgument, error);
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    m.requested_schedule = schedule;
  }
  m.Wake();
  return Status::OK();
}

std::string Engine::SchedulerStateJson() {
  Impl& m = *impl_;
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

std::string Engine::StatsJson() const {
  const Impl& m = *impl_;
  uint64_t sent = 0, received = 0;
  for (const auto& c : m.conns) {
    if (!c) continue;
    sent += c->bytes_sent();
    received += c->bytes_received();
  }
  std::string schedule;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    schedule = m.schedule_name;
  }
  std::ostringstream os;
  os << "{\"rank\": " << m.rank() << ", \"world_size\": " << m.world_size() << ", \"schedule\": \""
     << schedule << "\", \"bytes_sent\": " << sent << ", \"bytes_received\": " << received
     << ", \"ops_done\": " << m.ops_done.load() << ", \"ops_failed\": " << m.ops_failed.load() << "}";
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
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) c.OnReadable();
      if (c.open() && (events[i].events & EPOLLOUT)) c.Flush();
    }
    if (stop.load()) break;
    DrainSubmissions();
    Pump();
    for (auto& c : conns)
      if (c && c->open() && !c->idle() && !c->awaiting_room()) c->Flush();
    now = NowNs();
    if (now >= next_timeout_check) {
      CheckTimeouts(now);
      Heartbeat(now);
      next_timeout_check = now + kTimeoutCheckNs;
    }
  }
  Shutdown();
}

// Fails what is left, then closes so that peers read EOF rather than a reset.
void Engine::Impl::Shutdown() {
  {  // first, so that no request can arrive after the last drain and never be answered
    std::lock_guard<std::mutex> lock(mu);
    stopped = "the prophet_tf runtime was shut down";
  }
  DrainSubmissions();
  std::vector<Collective*> left;
  for (auto& kv : ops) left.push_back(kv.second.get());
  for (Collective* op : left)
    Finish(op, Status(Code::kAborted, "the prophet_tf runtime was shut down before " + op->Describe() + " finished"));
  if (vanish) return;  // as a killed process: the sockets close with nothing more sent
  // Every operation that completed here has handed its last frame to a connection (an owner
  // completes once its results are sent), so what is queued is all the peers still need. The
  // departure notice goes last: a peer that reads it knows the EOF after it is not a crash. Not
  // after a lost peer: the survivors must go on naming that loss (kPeerLost), not this exit.
  FrameMeta leaving;
  leaving.type = FrameType::kLeaving;
  if (first_loss.empty())
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
  {
    std::lock_guard<std::mutex> lock(mu);
    batch.swap(submitted);
    questions.swap(state_requests);
    if (!requested_schedule.empty()) next_schedule = std::move(requested_schedule);
    requested_schedule.clear();
  }
  for (auto& [request, round] : batch) StartOperation(std::move(request), round);
  if (!questions.empty()) {
    const std::string state = PolicyStateJson(*policy);
    for (auto& question : questions) question.set_value(state);
  }
}

void Engine::Impl::StartOperation(OpRequest req, uint64_t round) {
  std::unique_ptr<Collective> owned = Collective::Make(this, next_op_id++, std::move(req), round);
  Collective* op = owned.get();
  if (timeline.enabled()) timeline.Instant("ready", op->request().name, op->submit_ns());
  auto failed = failed_keys.find(op->key());
  if (failed != failed_keys.end()) {
    op->Complete(failed->second);
    ops_failed.fetch_add(1);
    return;
  }
  if (ops.count(op->key())) {
    op->Complete(Status(Code::kInternal, "duplicate operation " + op->key()));
    return;
  }
  const uint64_t id = op->id();
  ops_by_id[id] = op;
  ops[op->key()] = std::move(owned);
  op->Start();
  if (Alive(id)) ReplayEarly(op);
  // After a lost peer, an operation completes only if the frames already here complete it (a
  // broadcast whose root sent everything, then left); anything else fails at once, everywhere.
  if (Alive(id) && !first_loss.empty())
    FailEverywhere(op, Status(Code::kUnavailable, op->Describe() + " failed: " + first_loss));
  else if (Alive(id))
    FailIfWaitingForDeparted(op);
}

std::vector<EarlyFrame> Engine::Impl::TakeEarly(const std::string& key) {
  auto it = early.find(key);
  if (it == early.end()) return {};
  std::vector<EarlyFrame> frames = std::move(it->second);
  early.erase(it);
  for (const EarlyFrame& e : frames) early_bytes -= e.footprint;
  return frames;
}

// Frames that arrived before this worker submitted the operation.
void Engine::Impl::ReplayEarly(Collective* op) {
  std::vector<EarlyFrame> frames = TakeEarly(op->key());
  const uint64_t id = op->id();
  for (EarlyFrame& e : frames) {
    if (!Alive(id)) return;  // failed by an earlier frame
    ApplyWholeFrame(op, e.peer, e.meta, &e.data);
  }
}

void Engine::Impl::Finish(Collective* op, const Status& status) {
  const uint64_t id = op->id();
  stragglers.Forget(op->key());
  // Frames and receives still using this operation's tensors (the done callback may free them).
  for (auto& c : conns)
    if (c) c->Abandon(id);
  if (timeline.enabled())
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
}

// A mismatch seen here fails the operation on every worker, with the same message.
void Engine::Impl::FailEverywhere(Collective* op, const std::string& message) {
  FailEverywhere(op, Status(Code::kInvalidArgument, message));
}

void Engine::Impl::FailEverywhere(Collective* op, const Status& status) {
  for (int peer = 0; peer < world_size(); ++peer)
    if (conns[peer] && conns[peer]->open()) conns[peer]->Queue(op->ErrorFrame(status));
  RememberFailure(op->key(), status);
  Finish(op, status);
}

void Engine::Impl::Refuse(Collective* op, int peer, const std::string& message) {
  FailEverywhere(op, message);
  if (conns[peer]) conns[peer]->Refuse(message);
}

void Engine::Impl::RememberFailure(const std::string& key, const Status& status) {
  if (failed_keys.emplace(key, status).second) failed_order.push_back(key);
  if (failed_order.size() > kRememberedFailures) {
    failed_keys.erase(failed_order.front());
    failed_order.pop_front();
  }
}

// The first loss is told to every peer in a frame that leaves before this worker's own exit could
// close a connection, so a survivor that sees this worker leave before it sees the lost peer go
// names the lost peer, as this worker does.
void Engine::Impl::LosePeer(int observer, const std::string& message) {
  if (first_loss.empty()) {
    first_loss = observer == rank() ? message : message + " (rank " + std::to_string(observer) + " saw this first)";
    const std::string words = message.substr(0, kMaxErrorMessageBytes);
    FrameMeta lost;
    lost.type = FrameType::kPeerLost;
    lost.partition = static_cast<uint32_t>(observer);
    lost.payload_bytes = words.size();
    for (auto& c : conns)
      if (c && c->open()) c->Queue(MakeOwnedFrame(lost, words, kUrgentPriority));
  }
  FailAll(first_loss);
}

void Engine::Impl::OnPeerLeaving(int peer) {
  if (departed[peer]) return;
  departed[peer] = true;
  PROPHET_INFO("rank %d finished its program and left", peer);
  std::vector<Collective*> waiting;
  for (auto& kv : ops) waiting.push_back(kv.second.get());
  for (Collective* op : waiting) FailIfWaitingForDeparted(op);
}

// Told to every worker too: one that waits only for this worker's data (say a partition this
// worker owns) could not know otherwise.
bool Engine::Impl::FailIfWaitingForDeparted(Collective* op) {
  const std::vector<bool> missing = op->WaitingFor();
  std::vector<int> gone;
  for (int r = 0; r < world_size(); ++r)
    if (missing[r] && departed[r]) gone.push_back(r);
  if (gone.empty()) return false;
  std::string who, reports;
  for (int r : gone) {
    who += (who.empty() ? "" : ", ") + std::string("rank ") + std::to_string(r) + " (" + options_.addresses[r] + ")";
    if (!peer_reports[r].empty()) reports += ". Before that rank " + std::to_string(r) + " reported: " + peer_reports[r];
  }
  const Status status(Code::kUnavailable,
                      op->Describe() + " failed: " + who + " shut down its prophet_tf runtime before taking part in it " +
                          "(its program ended, or raised an error: see its log). If it ended normally, the workers ran " +
                          "different collectives: a different number of steps or batches, or a branch on the rank " +
                          "such as `if rank == 0: model.save(...)`; every worker must run the same ones" + reports);
  FailEverywhere(op, status);
  return true;
}

// A peer is lost: every pending operation fails, here and (through error notices that arrive
// before this worker's own exit could) on every other worker, so that all of them give the cause
// rather than "lost the connection" to a survivor that failed first.
void Engine::Impl::FailAll(const std::string& message) {
  DrainSubmissions();
  std::vector<Collective*> left;
  for (auto& kv : ops) left.push_back(kv.second.get());
  for (Collective* op : left) FailEverywhere(op, Status(Code::kUnavailable, op->Describe() + " failed: " + message));
}

// An operation past its deadline: ask every peer whether it has submitted it, then fail it on
// every worker naming the ones that have not (straggler.h). Replies are urgent frames and come
// back at once; the grace only bounds peers that cannot answer.
void Engine::Impl::CheckTimeouts(int64_t now) {
  std::vector<Collective*> expired;
  for (auto& kv : ops)
    if (now > kv.second->deadline_ns() && !stragglers.Asking(kv.first)) expired.push_back(kv.second.get());
  const int64_t grace_ns = static_cast<int64_t>(std::min(10.0, std::max(1.0, options_.timeout_s / 4)) * 1e9);
  for (Collective* op : expired) {
    std::vector<int> asked;
    for (int peer = 0; peer < world_size(); ++peer) {
      if (!conns[peer] || !conns[peer]->open() || departed[peer]) continue;
      FrameMeta probe;
      probe.type = FrameType::kProbe;
      probe.name = op->request().name;
      probe.round = op->round();
      conns[peer]->Queue(MakeOwnedFrame(probe, "", kUrgentPriority));
      asked.push_back(peer);
    }
    stragglers.Begin(op->key(), asked, now + grace_ns);
  }
  for (const std::string& key : stragglers.Due(now)) {
    Collective* op = Find(key);
    const StragglerProbe::Verdict verdict = stragglers.Take(key);
    if (op != nullptr) DecideStall(op, verdict);
  }
}

void Engine::Impl::DecideStall(Collective* op, const StragglerProbe::Verdict& v) {
  // The message depends only on the answers, not on who asked: every survivor says the same.
  std::string why;
  if (!v.behind.empty())
    why = "rank(s) " + RankList(v.behind) +
          " did not reach it (every other worker did): a different code path, a crash, or a stall there";
  if (!v.silent.empty())
    why += (why.empty() ? "" : "; ") + std::string("rank(s) ") + RankList(v.silent) +
           " did not answer whether they reached it: stopped, hung or unreachable";
  if (why.empty()) {
    std::vector<int> waiting;
    const std::vector<bool> missing = op->WaitingFor();
    for (int r = 0; r < world_size(); ++r)
      if (missing[r]) waiting.push_back(r);
    why = "every worker reached it, but its data has not arrived from rank(s) " +
          (waiting.empty() ? std::string("?") : RankList(waiting)) + " (a slow or congested network?)";
  }
  FailEverywhere(op, Status(Code::kDeadlineExceeded, op->Describe() + " did not complete within " +
                                                         SecondsString(options_.timeout_s) + ": " + why +
                                                         ". Raise timeout_s if those workers are only slow"));
}

bool Engine::Impl::Submitted(const std::string& name, uint64_t round) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = rounds.find(name);
  return it != rounds.end() && it->second > round;
}

void Engine::Impl::AnswerProbe(int peer, const FrameMeta& meta) {
  const bool submitted = Submitted(meta.name, meta.round);
  FrameMeta reply;
  reply.type = FrameType::kProbeReply;
  reply.name = meta.name;
  reply.round = meta.round;
  reply.partition = submitted ? 1 : 0;
  if (conns[peer]) conns[peer]->Queue(MakeOwnedFrame(reply, "", kUrgentPriority));
}

// Liveness (heartbeat_s > 0): a frame to every peer several times per period, and a peer from
// which nothing at all arrived for a whole period is declared lost. A stalled program still
// answers (its engine thread runs); a stopped or frozen process does not.
void Engine::Impl::Heartbeat(int64_t now) {
  if (options_.heartbeat_s <= 0 || now < next_heartbeat) return;
  const int64_t period_ns = static_cast<int64_t>(options_.heartbeat_s * 1e9);
  next_heartbeat = now + period_ns / 4;
  FrameMeta beat;
  beat.type = FrameType::kHeartbeat;
  for (auto& c : conns) {
    if (!c || !c->open() || departed[c->peer()]) continue;
    if (now - c->last_receive_ns() > period_ns) {
      char silent[32];
      std::snprintf(silent, sizeof(silent), "%.1f s", (now - c->last_receive_ns()) / 1e9);
      unresponsive_reason = std::string("nothing arrived from it for ") + silent + " (heartbeat_s " +
                            SecondsString(options_.heartbeat_s) + "): that worker is stopped, frozen or unreachable";
      c->Close(unresponsive_reason);
      continue;
    }
    c->Queue(MakeOwnedFrame(beat, "", kUrgentPriority));
  }
}

// ------------------------------------------------------------------------------------------------
// Sending: the scheduler releases PUSHes under the byte credit

void Engine::Impl::Pump() {
  if (!next_schedule.empty() && policy->queued() == 0) SwitchPolicy();
  if (policy->queued() == 0) return;
  const uint64_t credit = options_.credit_bytes;
  std::vector<SendTask> tasks;
  policy->Dequeue(in_flight < credit ? credit - in_flight : 0, NowNs(), &tasks);
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
    if (it == ops_by_id.end()) continue;  // failed while queued
    in_flight += t.bytes;
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
  in_flight -= d.task.bytes;
  policy->OnTransferDone(d);
  const std::vector<BandwidthSample> samples = policy->bandwidth()->TakeSamples();
  if (!timeline.enabled()) return;
  timeline.Complete("push", d.task.name, d.sent_ns, d.done_ns);
  for (const BandwidthSample& b : samples) timeline.Counter("bandwidth_MBps", b.ts_ns, b.estimate_Bps / 1e6);
}

// ------------------------------------------------------------------------------------------------
// Receiving: frames find their operation by name#round

PayloadSink Engine::Impl::OnFrame(Connection& c, const FrameMeta& meta) {
  if (meta.type == FrameType::kError || meta.type == FrameType::kPeerLost) return PayloadSink::Buffer();
  if (IsControlFrame(meta.type)) return PayloadSink::Discard();  // no payload; handled when done
  const std::string key = OperationKey(meta.name, meta.round);
  Collective* op = Find(key);
  if (op != nullptr) return op->OnFrame(c.peer(), meta);
  // Not submitted here yet: keep it for later, unless it belongs to an operation that failed here
  // (or it is a RESULT, which only answers a PUSH of a live operation).
  if (meta.type == FrameType::kResult || failed_keys.count(key)) return PayloadSink::Discard();
  // Its size is checked before anything is allocated: the header alone may claim 256 GiB.
  const uint64_t footprint = EarlyFootprint(meta);
  const std::string problem = EarlyProblem(c.peer(), meta, footprint);
  if (!problem.empty()) {
    RefuseEarly(c, meta, problem);
    return PayloadSink::Discard();
  }
  early_bytes += footprint;
  early_receiving[c.peer()] = footprint;
  return PayloadSink::Buffer();
}

std::string Engine::Impl::EarlyProblem(int peer, const FrameMeta& meta, uint64_t footprint) const {
  const std::string what = std::string(CollectiveOfFrame(meta.type)) + " '" + meta.name + "' (round " +
                           std::to_string(meta.round) + "): rank " + std::to_string(peer) + " sent " +
                           std::to_string(meta.payload_bytes) + " bytes for it before this worker started it";
  // PUSH and BROADCAST frames carry one partition; an allgather frame the whole tensor.
  if (meta.type != FrameType::kGather && meta.payload_bytes > options_.partition_bytes)
    return what + ", but partitions are at most partition_bytes = " + std::to_string(options_.partition_bytes) +
           " bytes here: do all workers run with the same partition_bytes?";
  if (early_bytes + footprint <= options_.max_early_bytes) return "";
  const std::string held = early_bytes == 0 ? "" : "; with the " + std::to_string(early_bytes) + " bytes held already for " +
                                                       std::to_string(early.size()) + " operation(s) not started here,";
  return what + held + " that passes max_early_bytes = " + std::to_string(options_.max_early_bytes) +
         ". Raise max_early_bytes if workers legitimately run that far apart (e.g. a large broadcast to a worker "
         "that starts late)";
}

void Engine::Impl::RefuseEarly(Connection& c, const FrameMeta& meta, const std::string& message) {
  for (auto& conn : conns)
    if (conn && conn->open()) conn->Queue(ErrorNotice(meta.name, meta.round, Status(Code::kInvalidArgument, message)));
  const std::string key = OperationKey(meta.name, meta.round);
  TakeEarly(key);
  RememberFailure(key, Status(Code::kInvalidArgument, message));
  c.Refuse(message);
}

void Engine::Impl::OnFrameDone(Connection& c, const FrameMeta& meta, PayloadSink::Kind sink, uint64_t tag,
                               ByteBuffer* buffered) {
  if (sink == PayloadSink::Kind::kBuffer) {
    // An early frame's reservation ends here; HandleWholeFrame counts it again if it keeps it.
    early_bytes -= early_receiving[c.peer()];
    early_receiving[c.peer()] = 0;
    return HandleWholeFrame(c.peer(), meta, std::move(*buffered));
  }
  if (meta.type == FrameType::kProbe) return AnswerProbe(c.peer(), meta);
  if (meta.type == FrameType::kLeaving) return OnPeerLeaving(c.peer());
  if (meta.type == FrameType::kProbeReply)
    return stragglers.OnReply(OperationKey(meta.name, meta.round), c.peer(), meta.partition == 1);
  if (sink == PayloadSink::Kind::kDiscard) return;
  auto it = ops_by_id.find(tag);
  if (it != ops_by_id.end()) it->second->OnPayloadDone(c.peer(), meta);
}

void Engine::Impl::HandleWholeFrame(int peer, const FrameMeta& meta, ByteBuffer data) {
  if (meta.type == FrameType::kPeerLost) {
    // Kept until that peer's connection closes: what it saw then is the cause, its leaving the
    // consequence. Nothing fails yet: what the lost worker sent here may still complete operations.
    LossReport& report = loss_reports[peer];
    if (!report.message.empty()) return;
    const bool other = meta.partition < static_cast<uint32_t>(world_size()) && static_cast<int>(meta.partition) != rank();
    report.observer = other ? static_cast<int>(meta.partition) : peer;
    report.message.assign(data.data(), data.size());
    PROPHET_INFO("rank %d reports: %s", peer, report.message.c_str());
    return;
  }
  const std::string key = OperationKey(meta.name, meta.round);
  Collective* op = Find(key);
  if (meta.type == FrameType::kError) {
    const Status status = ErrorFrameStatus(meta, std::string(data.data(), data.size()));
    RememberFailure(key, status);
    if (op != nullptr) {
      Finish(op, status);
    } else if (Submitted(meta.name, meta.round)) {
      PROPHET_ERROR("rank %d failed an operation that completed here: %s", peer, status.message().c_str());
      peer_reports[peer] = status.message();
    }
    TakeEarly(key);
    return;
  }
  if (op != nullptr) return ApplyWholeFrame(op, peer, meta, &data);
  if (failed_keys.count(key)) return;
  const uint64_t footprint = EarlyFootprint(meta);
  early_bytes += footprint;
  early[key].push_back(EarlyFrame{peer, meta, std::move(data), footprint});
}

void Engine::Impl::OnClosed(Connection& c, const std::string& why) {
  early_bytes -= early_receiving[c.peer()];
  early_receiving[c.peer()] = 0;
  if (departed[c.peer()] && !c.refused()) {  // its EOF (or a reset after it) follows its notice
    PROPHET_INFO("rank %d closed its connection after leaving: %s", c.peer(), why.c_str());
    return;
  }
  const std::string who = "rank " + std::to_string(c.peer()) + " (" + options_.addresses[c.peer()] + ")";
  std::string message =
      c.refused() ? "dropped the connection to " + who + ", which broke the protocol: " + why
      : !unresponsive_reason.empty()
          ? who + " is unresponsive: " + unresponsive_reason
          : "lost the connection to " + who + ": " + why + ". That worker exited, crashed or was killed; see its log";
  unresponsive_reason.clear();
  if (!peer_reports[c.peer()].empty()) message += ". Before that it reported: " + peer_reports[c.peer()];
  if (!ops.empty()) PROPHET_ERROR("%s", message.c_str());
  else PROPHET_INFO("%s", message.c_str());
  const LossReport& report = loss_reports[c.peer()];
  if (!report.message.empty() && !c.refused()) return LosePeer(report.observer, report.message);
  LosePeer(rank(), message);
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
