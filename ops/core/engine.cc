#include "ops/core/engine.h"

#include <errno.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <sstream>

#include "ops/core/bandwidth.h"
#include "ops/core/partition.h"
#include "ops/core/reduce.h"
#include "ops/core/timeline.h"
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

Status ParseEngineOptions(const std::string& text, EngineOptions* o) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) return Status(Code::kInvalidArgument, "bad option line '" + line + "'");
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    try {
      if (key == "rank") o->rank = std::stoi(value);
      else if (key == "world_size") o->world_size = std::stoi(value);
      else if (key == "addresses") {
        o->addresses.clear();
        std::istringstream parts(value);
        std::string a;
        while (std::getline(parts, a, ',')) o->addresses.push_back(a);
      } else if (key == "token") o->token = value;
      else if (key == "schedule") o->schedule = value;
      else if (key == "partition_bytes") o->partition_bytes = std::stoull(value);
      else if (key == "credit_bytes") o->credit_bytes = std::stoull(value);
      else if (key == "timeout_s") o->timeout_s = std::stod(value);
      else if (key == "replan_threshold") o->replan_threshold = std::stod(value);
      else if (key == "connect_timeout_s") o->connect_timeout_s = std::stod(value);
      else if (key == "socket_buffer_bytes") o->socket_buffer_bytes = std::stoi(value);
      else if (key == "timeline_path") o->timeline_path = value;
      else return Status(Code::kInvalidArgument, "unknown runtime option '" + key + "'");
    } catch (const std::exception&) {
      return Status(Code::kInvalidArgument, "runtime option " + key + " has an invalid value '" + value + "'");
    }
  }
  if (o->world_size < 1) return Status(Code::kInvalidArgument, "world_size must be at least 1");
  if (o->rank < 0 || o->rank >= o->world_size)
    return Status(Code::kInvalidArgument, "rank " + std::to_string(o->rank) + " outside [0, " +
                                              std::to_string(o->world_size) + ")");
  if (o->world_size > 1 && static_cast<int>(o->addresses.size()) != o->world_size)
    return Status(Code::kInvalidArgument, std::to_string(o->addresses.size()) + " addresses for " +
                                              std::to_string(o->world_size) + " workers");
  if (o->partition_bytes < 64) return Status(Code::kInvalidArgument, "partition_bytes must be at least 64");
  if (o->credit_bytes < 1) return Status(Code::kInvalidArgument, "credit_bytes must be positive");
  if (o->timeout_s <= 0) return Status(Code::kInvalidArgument, "timeout_s must be positive");
  return Status::OK();
}

namespace {

constexpr size_t kInboxBytes = 64 * 1024;
constexpr size_t kSumChunkBytes = 256 * 1024;
constexpr int64_t kTimeoutCheckNs = 100 * 1000 * 1000;

enum class PartState : uint8_t { kQueued, kPushed, kDone };

struct Op {
  uint64_t id = 0;
  OpRequest req;
  uint64_t round = 0;
  std::string key;
  size_t elem = 0;
  std::vector<Partition> parts;
  std::vector<PartState> part_state;        // push_pull, partitions owned by others
  std::vector<int64_t> push_sent_ns;
  std::vector<std::vector<bool>> contributed;  // owned partitions: which ranks have added theirs
  std::vector<int> contributions;
  std::vector<int> result_sends_left;
  // Owned partitions: output bytes [0, seeded) already hold the local values plus some
  // contributions; beyond that the output is not written yet. Contributions stream in from
  // offset 0 in order, so the one furthest ahead extends this prefix with out = in + received
  // (one pass, no separate copy of the local values) and every other adds into it.
  std::vector<uint64_t> seeded;
  int pending = 0;  // events left before done
  int64_t submit_ns = 0;
  int64_t deadline_ns = 0;
  int receivers_busy = 0;  // connections currently streaming a payload into this op's buffers
  // allgather
  std::vector<std::vector<char>> gathered;
  std::vector<std::vector<int64_t>> gathered_shapes;
  std::vector<bool> got;
};

struct OutFrame {
  std::string head;
  const char* payload = nullptr;
  uint64_t payload_len = 0;
  uint64_t written = 0;  // of head + payload
  uint64_t op_id = 0;    // 0: not tied to an op's buffers
  std::string owned;     // the payload, copied, when the op it came from was failed mid-send
  std::function<void()> on_sent;
  // Frames wait on a connection in priority order (larger first, FIFO among equals), so that a
  // sum the next step's first layer needs never queues behind a large low-priority frame.
  int64_t priority = 0;
  uint64_t total() const { return head.size() + payload_len; }
};

// Error notices jump every queue.
constexpr int64_t kUrgentPriority = INT64_MAX;

// A frame whose operation has not been submitted on this worker yet.
struct EarlyFrame {
  int peer = 0;
  FrameMeta meta;
  std::vector<char> data;
};

enum class Sink { kNone, kDirect, kSum, kBuffer, kDiscard };

struct Conn {
  int fd = -1;
  int peer = 0;
  bool open = false;
  bool want_write = false;
  std::deque<OutFrame> out;
  // receive state
  std::vector<char> inbox = std::vector<char>(kInboxBytes);
  size_t inbox_begin = 0, inbox_end = 0;
  enum Stage { kHeader, kTail, kPayload } stage = kHeader;
  FrameHeader header{};
  size_t header_got = 0;
  std::string tail;
  size_t tail_got = 0;
  FrameMeta meta;
  Sink sink = Sink::kNone;
  uint64_t payload_got = 0;
  char* direct = nullptr;        // kDirect destination
  Op* target = nullptr;          // op whose buffer a kDirect/kSum sink writes into
  std::vector<char> chunk;       // kSum staging
  size_t chunk_fill = 0;
  uint64_t summed = 0;           // payload bytes already added
  EarlyFrame* early = nullptr;   // kBuffer destination
  std::unique_ptr<EarlyFrame> early_owned;
};

}  // namespace

struct Engine::Impl {
  explicit Impl(const EngineOptions& o) : options(o) {}

  EngineOptions options;
  int epoll_fd = -1;
  int wake_fd = -1;
  std::thread thread;
  std::atomic<bool> stop{false};

  // Shared with submitting threads.
  std::mutex mu;
  std::vector<OpRequest> submitted;
  std::vector<uint64_t> submitted_rounds;
  std::unordered_map<std::string, uint64_t> rounds;
  std::string broken;  // once set, every new request fails with it

  // Owned by the engine thread.
  std::vector<Conn> conns;
  std::unordered_map<std::string, std::unique_ptr<Op>> ops;  // by key
  std::unordered_map<uint64_t, Op*> ops_by_id;
  std::unordered_map<std::string, std::vector<std::unique_ptr<EarlyFrame>>> early;
  std::unordered_map<std::string, std::string> failed_keys;
  std::deque<std::string> failed_order;
  std::unique_ptr<SchedulerPolicy> policy;
  uint64_t next_op_id = 1;
  uint64_t enqueue_seq = 0;
  uint64_t in_flight = 0;
  int64_t next_timeout_check = 0;
  Timeline timeline;
  BandwidthMonitor bandwidth;  // goodput of completed pushes, for the timeline

  // Statistics (read by StatsJson from other threads).
  std::atomic<uint64_t> bytes_sent{0}, bytes_received{0}, ops_done{0}, ops_failed{0};

  int rank() const { return options.rank; }
  int n() const { return options.world_size; }

  // --- thread entry -------------------------------------------------------------------------
  void Run();
  void DrainSubmissions();
  void Start(OpRequest req, uint64_t round);
  void StartPushPull(Op* op);
  void StartBroadcast(Op* op);
  void StartAllgather(Op* op);
  void ReplayEarly(Op* op);

  // --- per-partition progress -----------------------------------------------------------------
  Status AcceptPush(Op* op, int peer, const FrameMeta& meta);
  void AddContribution(Op* op, uint32_t part, int peer, const char* data);
  void Accumulate(Op* op, uint32_t part, uint64_t at, const char* data, uint64_t len);
  void MaybeFinishPartition(Op* op, uint32_t part);
  void PartitionDone(Op* op);
  void Finish(Op* op, const Status& status);
  void FailEverywhere(Op* op, const std::string& message);
  void FailAll(const std::string& message);
  // Keys of failed operations, so that frames still on their way are dropped (bounded memory).
  void RememberFailure(const std::string& key, const std::string& message) {
    if (failed_keys.emplace(key, message).second) failed_order.push_back(key);
    if (failed_order.size() > 4096) {
      failed_keys.erase(failed_order.front());
      failed_order.pop_front();
    }
  }

  // --- network ------------------------------------------------------------------------------
  void Pump();
  void QueueFrame(int peer, OutFrame frame);
  void Flush(Conn& c);
  void OnReadable(Conn& c);
  bool ConsumeHeader(Conn& c);
  void BeginPayload(Conn& c);
  void FinishPayload(Conn& c);
  void HandleBuffered(std::unique_ptr<EarlyFrame> frame);
  void SumStaged(Conn& c);
  void PeerLost(Conn& c, const std::string& why);
  void UpdateWriteInterest(Conn& c);
  void CheckTimeouts(int64_t now);
  void Wake() {
    uint64_t one = 1;
    ssize_t ignored = ::write(wake_fd, &one, sizeof(one));
    (void)ignored;
  }
  std::string Describe(const Op* op) const {
    return std::string(OpKindName(op->req.kind)) + " '" + op->req.name + "' (round " + std::to_string(op->round) + ")";
  }
};

// ------------------------------------------------------------------------------------------------
// Engine lifecycle

Engine::Engine(const EngineOptions& options) : options_(options), impl_(new Impl(options)) {}

Status Engine::Start(const EngineOptions& options, std::unique_ptr<Engine>* out) {
  std::unique_ptr<Engine> engine(new Engine(options));
  Impl& m = *engine->impl_;
  SetLogRank(options.rank);
  std::string error;
  SchedulerOptions sched;
  sched.policy = options.schedule;
  sched.credit_bytes = options.credit_bytes;
  sched.replan_threshold = options.replan_threshold;
  m.policy = MakePolicy(sched, &error);
  if (!m.policy) return Status(Code::kInvalidArgument, error);
  if (!options.timeline_path.empty() && !m.timeline.Open(options.timeline_path, options.rank, &error))
    return Status(Code::kInvalidArgument, "cannot write the timeline: " + error);

  std::vector<int> fds(options.world_size, -1);
  if (options.world_size > 1) {
    BootstrapOptions b;
    b.rank = options.rank;
    b.world_size = options.world_size;
    b.addresses = options.addresses;
    b.token = options.token;
    b.connect_timeout_s = options.connect_timeout_s;
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
  ev.data.u64 = ~0ull;
  ::epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, m.wake_fd, &ev);
  m.conns.resize(options.world_size);
  for (int r = 0; r < options.world_size; ++r) {
    Conn& c = m.conns[r];
    c.peer = r;
    c.fd = fds[r];
    if (c.fd < 0) continue;
    c.open = true;
    ev.events = EPOLLIN;
    ev.data.u64 = static_cast<uint64_t>(r);
    ::epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, c.fd, &ev);
  }
  PROPHET_INFO("runtime started: %d workers, schedule %s, partitions of %llu bytes, credit %llu bytes",
               options.world_size, m.policy->name(), static_cast<unsigned long long>(options.partition_bytes),
               static_cast<unsigned long long>(options.credit_bytes));
  m.thread = std::thread([&m] { m.Run(); });
  *out = std::move(engine);
  return Status::OK();
}

Engine::~Engine() {
  Impl& m = *impl_;
  if (m.thread.joinable()) {
    m.stop.store(true);
    m.Wake();
    m.thread.join();
  }
  m.timeline.Close();
  if (m.epoll_fd >= 0) ::close(m.epoll_fd);
  if (m.wake_fd >= 0) ::close(m.wake_fd);
}

void Engine::Submit(OpRequest request) {
  Impl& m = *impl_;
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(m.mu);
    broken = m.broken;
    if (broken.empty()) {
      const uint64_t round = m.rounds[request.name]++;
      m.submitted.push_back(std::move(request));
      m.submitted_rounds.push_back(round);
    }
  }
  if (!broken.empty()) {
    request.done(Status(Code::kUnavailable, broken), nullptr);
    return;
  }
  m.Wake();
}

Timeline& Engine::timeline() { return impl_->timeline; }

std::string Engine::StatsJson() const {
  const Impl& m = *impl_;
  std::ostringstream os;
  os << "{\"rank\": " << m.rank() << ", \"world_size\": " << m.n() << ", \"schedule\": \"" << m.policy->name()
     << "\", \"bytes_sent\": " << m.bytes_sent.load() << ", \"bytes_received\": " << m.bytes_received.load()
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
      if (tag == ~0ull) {
        uint64_t value;
        while (::read(wake_fd, &value, sizeof(value)) > 0) {
        }
        continue;
      }
      Conn& c = conns[tag];
      if (!c.open) continue;
      if (events[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) OnReadable(c);
      if (c.open && (events[i].events & EPOLLOUT)) Flush(c);
    }
    if (stop.load()) break;
    DrainSubmissions();
    Pump();
    for (Conn& c : conns)
      if (c.open && !c.out.empty() && !c.want_write) Flush(c);
    now = NowNs();
    if (now >= next_timeout_check) {
      CheckTimeouts(now);
      next_timeout_check = now + kTimeoutCheckNs;
    }
  }
  // Shutdown: fail what is left, then close so that peers read EOF rather than a reset.
  DrainSubmissions();
  std::vector<Op*> left;
  for (auto& kv : ops) left.push_back(kv.second.get());
  for (Op* op : left) Finish(op, Status(Code::kAborted, "the prophet_tf runtime was shut down before " + Describe(op) + " finished"));
  {
    std::lock_guard<std::mutex> lock(mu);
    broken = "the prophet_tf runtime was shut down";
  }
  for (Conn& c : conns) {
    if (!c.open) continue;
    // Give queued frames a moment to leave, then half-close and wait briefly for the peer's EOF.
    const int64_t deadline = NowNs() + int64_t{2000000000};
    while (!c.out.empty() && c.open && NowNs() < deadline) {
      Flush(c);
      if (!c.out.empty()) ::usleep(1000);
    }
    ::shutdown(c.fd, SHUT_WR);
  }
  const int64_t deadline = NowNs() + int64_t{1000000000};
  for (Conn& c : conns) {
    if (!c.open) continue;
    char sink[4096];
    while (NowNs() < deadline) {
      const ssize_t r = ::recv(c.fd, sink, sizeof(sink), 0);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) break;
      if (r < 0) ::usleep(1000);
    }
    ::close(c.fd);
    c.open = false;
  }
}

void Engine::Impl::DrainSubmissions() {
  std::vector<OpRequest> batch;
  std::vector<uint64_t> rounds_batch;
  {
    std::lock_guard<std::mutex> lock(mu);
    batch.swap(submitted);
    rounds_batch.swap(submitted_rounds);
  }
  for (size_t i = 0; i < batch.size(); ++i) Start(std::move(batch[i]), rounds_batch[i]);
}

void Engine::Impl::Start(OpRequest req, uint64_t round) {
  auto op_owned = std::make_unique<Op>();
  Op* op = op_owned.get();
  op->id = next_op_id++;
  op->round = round;
  op->key = req.name + "#" + std::to_string(round);
  op->elem = DataTypeSize(req.dtype);
  op->submit_ns = NowNs();
  op->deadline_ns = op->submit_ns + static_cast<int64_t>(options.timeout_s * 1e9);
  op->req = std::move(req);
  if (timeline.enabled()) timeline.Instant("ready", op->req.name, op->submit_ns);

  auto failed = failed_keys.find(op->key);
  if (failed != failed_keys.end()) {
    const std::string message = failed->second;
    op->req.done(Status(Code::kInvalidArgument, message), nullptr);
    ops_failed.fetch_add(1);
    return;
  }
  if (ops.count(op->key)) {
    op->req.done(Status(Code::kInternal, "duplicate operation " + op->key), nullptr);
    return;
  }
  ops_by_id[op->id] = op;
  ops[op->key] = std::move(op_owned);
  switch (op->req.kind) {
    case OpKind::kPushPull: StartPushPull(op); break;
    case OpKind::kBroadcast: StartBroadcast(op); break;
    case OpKind::kAllgather: StartAllgather(op); break;
  }
}

void Engine::Impl::StartPushPull(Op* op) {
  OpRequest& r = op->req;
  if (n() == 1) {
    if (r.output != r.input && r.bytes) std::memcpy(r.output, r.input, r.bytes);
    Finish(op, Status::OK());
    return;
  }
  op->parts = MakePartitions(r.name, r.bytes, op->elem, n(), options.partition_bytes);
  const size_t np = op->parts.size();
  op->pending = static_cast<int>(np);
  op->part_state.assign(np, PartState::kQueued);
  op->push_sent_ns.assign(np, 0);
  op->contributions.assign(np, 0);
  op->result_sends_left.assign(np, 0);
  op->contributed.assign(np, {});
  op->seeded.assign(np, 0);

  TensorReady ready;
  ready.name = &r.name;
  ready.round = op->round;
  ready.priority = r.priority;
  ready.bytes = r.bytes;
  ready.ready_ns = op->submit_ns;
  policy->OnTensorReady(ready);
  for (uint32_t p = 0; p < np; ++p) {
    if (op->parts[p].owner == rank()) {
      // In place (input forwarded to output): the local values are already there.
      if (r.output == r.input) op->seeded[p] = op->parts[p].bytes;
      op->contributed[p].assign(n(), false);
      op->contributed[p][rank()] = true;
      op->contributions[p] = 1;
      continue;
    }
    SendTask t;
    t.request_id = op->id;
    t.partition = static_cast<int>(p);
    t.peer = op->parts[p].owner;
    t.priority = r.priority;
    t.bytes = op->parts[p].bytes;
    t.ready_ns = op->submit_ns;
    t.enqueue_seq = enqueue_seq++;
    policy->Enqueue(t);
  }
  const uint64_t id = op->id;  // `op` may be freed below (finished or failed re-entrantly)
  ReplayEarly(op);
  for (uint32_t p = 0; p < np; ++p) {
    if (ops_by_id.count(id) == 0) return;  // finished or failed while replaying / sending
    if (op->parts[p].owner == rank()) MaybeFinishPartition(op, p);
  }
}

void Engine::Impl::StartBroadcast(Op* op) {
  OpRequest& r = op->req;
  if (r.root_rank < 0 || r.root_rank >= n()) {
    Finish(op, Status(Code::kInvalidArgument, "broadcast '" + r.name + "': root_rank " + std::to_string(r.root_rank) +
                                                  " outside [0, " + std::to_string(n()) + ")"));
    return;
  }
  op->parts = MakePartitions(r.name, r.bytes, op->elem, 1, options.partition_bytes);
  if (rank() == r.root_rank) {
    if (r.output != r.input && r.bytes) std::memcpy(r.output, r.input, r.bytes);
    op->pending = (n() - 1) * static_cast<int>(op->parts.size());
    if (op->pending == 0) {
      Finish(op, Status::OK());
      return;
    }
    for (int peer = 0; peer < n(); ++peer) {
      if (peer == rank()) continue;
      for (uint32_t p = 0; p < op->parts.size(); ++p) {
        FrameMeta meta;
        meta.type = FrameType::kBroadcast;
        meta.dtype = r.dtype;
        meta.name = r.name;
        meta.round = op->round;
        meta.shape = r.shape;
        meta.partition = p;
        meta.num_partitions = static_cast<uint32_t>(op->parts.size());
        meta.offset = op->parts[p].offset;
        meta.payload_bytes = op->parts[p].bytes;
        OutFrame f;
        f.priority = op->req.priority;
        EncodeFrameMeta(meta, &f.head);
        f.payload = static_cast<const char*>(r.input) + meta.offset;
        f.payload_len = meta.payload_bytes;
        f.op_id = op->id;
        const uint64_t id = op->id;
        f.on_sent = [this, id] {
          auto it = ops_by_id.find(id);
          if (it != ops_by_id.end()) PartitionDone(it->second);
        };
        QueueFrame(peer, std::move(f));
      }
    }
    return;
  }
  op->pending = static_cast<int>(op->parts.size());
  ReplayEarly(op);
}

void Engine::Impl::StartAllgather(Op* op) {
  OpRequest& r = op->req;
  op->gathered.assign(n(), {});
  op->gathered_shapes.assign(n(), {});
  op->got.assign(n(), false);
  op->got[rank()] = true;
  op->pending = 2 * (n() - 1);
  if (op->pending == 0) {
    Finish(op, Status::OK());
    return;
  }
  for (int peer = 0; peer < n(); ++peer) {
    if (peer == rank()) continue;
    FrameMeta meta;
    meta.type = FrameType::kGather;
    meta.dtype = r.dtype;
    meta.name = r.name;
    meta.round = op->round;
    meta.shape = r.shape;
    meta.partition = 0;
    meta.num_partitions = 1;
    meta.offset = 0;
    meta.payload_bytes = r.bytes;
    OutFrame f;
    f.priority = op->req.priority;
    EncodeFrameMeta(meta, &f.head);
    f.payload = static_cast<const char*>(r.input);
    f.payload_len = r.bytes;
    f.op_id = op->id;
    const uint64_t id = op->id;
    f.on_sent = [this, id] {
      auto it = ops_by_id.find(id);
      if (it != ops_by_id.end()) PartitionDone(it->second);
    };
    QueueFrame(peer, std::move(f));
  }
  ReplayEarly(op);
}

// Frames that arrived before this worker submitted the operation.
void Engine::Impl::ReplayEarly(Op* op) {
  auto it = early.find(op->key);
  if (it == early.end()) return;
  std::vector<std::unique_ptr<EarlyFrame>> frames = std::move(it->second);
  early.erase(it);
  const uint64_t id = op->id;
  for (auto& e : frames) {
    if (ops_by_id.count(id) == 0) return;  // failed by an earlier frame
    const FrameMeta& meta = e->meta;
    switch (meta.type) {
      case FrameType::kPush: {
        Status s = AcceptPush(op, e->peer, meta);
        if (!s.ok()) {
          FailEverywhere(op, s.message());
          return;
        }
        AddContribution(op, meta.partition, e->peer, e->data.data());
        break;
      }
      default:
        HandleBuffered(std::move(e));
        break;
    }
  }
}

// Checks a PUSH against this worker's own request for the same key.
Status Engine::Impl::AcceptPush(Op* op, int peer, const FrameMeta& meta) {
  const OpRequest& r = op->req;
  if (r.kind != OpKind::kPushPull)
    return Status(Code::kInvalidArgument, "'" + r.name + "' (round " + std::to_string(op->round) +
                                              ") is a push_pull on rank " + std::to_string(peer) + " but a " +
                                              OpKindName(r.kind) + " on rank " + std::to_string(rank()));
  if (meta.dtype != r.dtype || meta.shape != r.shape)
    return Status(Code::kInvalidArgument,
                  "push_pull '" + r.name + "' (round " + std::to_string(op->round) + "): rank " +
                      std::to_string(rank()) + " has shape " + ShapeString(r.shape) + " " + DataTypeName(r.dtype) +
                      " but rank " + std::to_string(peer) + " has shape " + ShapeString(meta.shape) + " " +
                      DataTypeName(meta.dtype) + "; every worker must pass the same shape and dtype for the same name");
  if (meta.partition >= op->parts.size() || op->parts[meta.partition].owner != rank() ||
      op->parts[meta.partition].offset != meta.offset || op->parts[meta.partition].bytes != meta.payload_bytes)
    return Status(Code::kInvalidArgument, "push_pull '" + r.name + "': rank " + std::to_string(peer) +
                                              " partitioned the tensor differently (different partition_bytes?)");
  if (op->contributed[meta.partition][peer])
    return Status(Code::kInternal, "push_pull '" + r.name + "': rank " + std::to_string(peer) + " sent partition " +
                                       std::to_string(meta.partition) + " twice");
  return Status::OK();
}

void Engine::Impl::Accumulate(Op* op, uint32_t part, uint64_t at, const char* data, uint64_t len) {
  const Partition& p = op->parts[part];
  char* out = static_cast<char*>(op->req.output) + p.offset;
  const char* in = static_cast<const char*>(op->req.input) + p.offset;
  uint64_t& seeded = op->seeded[part];
  const uint64_t below = at < seeded ? std::min(len, seeded - at) : 0;
  if (below) SumInto(op->req.dtype, out + at, data, below / op->elem);
  if (below < len) {
    SumTo(op->req.dtype, out + at + below, in + at + below, data + below, (len - below) / op->elem);
    seeded = at + len;
  }
}

void Engine::Impl::AddContribution(Op* op, uint32_t part, int peer, const char* data) {
  Accumulate(op, part, 0, data, op->parts[part].bytes);
  op->contributed[part][peer] = true;
  op->contributions[part]++;
  MaybeFinishPartition(op, part);
}

void Engine::Impl::MaybeFinishPartition(Op* op, uint32_t part) {
  if (op->contributions[part] != n()) return;
  op->contributions[part] = n() + 1;  // finished: never again
  const Partition& p = op->parts[part];
  char* out = static_cast<char*>(op->req.output) + p.offset;
  if (op->req.average) DivideBy(op->req.dtype, out, p.bytes / op->elem, n());
  op->result_sends_left[part] = n() - 1;
  const uint64_t id = op->id;
  for (int peer = 0; peer < n(); ++peer) {
    if (peer == rank()) continue;
    FrameMeta meta;
    meta.type = FrameType::kResult;
    meta.dtype = op->req.dtype;
    meta.name = op->req.name;
    meta.round = op->round;
    meta.shape = op->req.shape;
    meta.partition = part;
    meta.num_partitions = static_cast<uint32_t>(op->parts.size());
    meta.offset = p.offset;
    meta.payload_bytes = p.bytes;
    OutFrame f;
    f.priority = op->req.priority;
    EncodeFrameMeta(meta, &f.head);
    f.payload = out;
    f.payload_len = p.bytes;
    f.op_id = id;
    f.on_sent = [this, id, part] {
      auto it = ops_by_id.find(id);
      if (it == ops_by_id.end()) return;
      if (--it->second->result_sends_left[part] == 0) PartitionDone(it->second);
    };
    QueueFrame(peer, std::move(f));
  }
}

void Engine::Impl::PartitionDone(Op* op) {
  if (--op->pending == 0) Finish(op, Status::OK());
}

void Engine::Impl::Finish(Op* op, const Status& status) {
  const uint64_t id = op->id;
  // Return the credit of pushes still waiting for their result.
  for (size_t p = 0; p < op->part_state.size(); ++p)
    if (op->part_state[p] == PartState::kPushed) in_flight -= op->parts[p].bytes;
  if (op->receivers_busy > 0) {
    for (Conn& c : conns)
      if (c.target == op) {
        c.sink = Sink::kDiscard;
        c.target = nullptr;
      }
  }
  // Frames still referencing this op's tensors: drop the unsent ones, copy the rest of a frame
  // that is half on the wire (the stream must stay well-formed; the tensor may be freed by done).
  for (Conn& c : conns) {
    for (auto it = c.out.begin(); it != c.out.end();) {
      if (it->op_id != id) {
        ++it;
        continue;
      }
      if (it->written == 0) {
        it = c.out.erase(it);
        continue;
      }
      if (it->payload_len && it->owned.empty()) {
        it->owned.assign(it->payload, it->payload_len);
        it->payload = it->owned.data();
      }
      it->op_id = 0;
      it->on_sent = nullptr;
      ++it;
    }
  }
  if (timeline.enabled())
    timeline.Complete("op", op->req.name, op->submit_ns, NowNs(),
                      "{\"round\": " + std::to_string(op->round) + ", \"bytes\": " + std::to_string(op->req.bytes) +
                          ", \"ok\": " + (status.ok() ? "true" : "false") + "}");
  std::unique_ptr<Op> owned = std::move(ops[op->key]);
  ops.erase(op->key);
  ops_by_id.erase(id);
  if (status.ok()) {
    ops_done.fetch_add(1);
    if (owned->req.kind == OpKind::kAllgather) {
      GatherResult g;
      g.shapes.resize(n());
      g.data.resize(n());
      g.bytes.resize(n());
      for (int r = 0; r < n(); ++r) {
        if (r == rank()) {
          g.shapes[r] = owned->req.shape;
          g.data[r] = static_cast<const char*>(owned->req.input);
          g.bytes[r] = owned->req.bytes;
        } else {
          g.shapes[r] = owned->gathered_shapes[r];
          g.data[r] = owned->gathered[r].data();
          g.bytes[r] = owned->gathered[r].size();
        }
      }
      owned->req.done(status, &g);
      return;
    }
  } else {
    ops_failed.fetch_add(1);
    PROPHET_INFO("%s failed: %s", Describe(owned.get()).c_str(), status.message().c_str());
  }
  owned->req.done(status, nullptr);
}

// A mismatch seen here fails the operation on every worker, with the same message.
void Engine::Impl::FailEverywhere(Op* op, const std::string& message) {
  for (int peer = 0; peer < n(); ++peer) {
    if (peer == rank() || !conns[peer].open) continue;
    FrameMeta meta;
    meta.type = FrameType::kError;
    meta.name = op->req.name;
    meta.round = op->round;
    meta.payload_bytes = message.size();
    OutFrame f;
    f.priority = kUrgentPriority;
    EncodeFrameMeta(meta, &f.head);
    f.owned = message;
    f.payload = f.owned.data();
    f.payload_len = f.owned.size();
    QueueFrame(peer, std::move(f));
  }
  RememberFailure(op->key, message);
  Finish(op, Status(Code::kInvalidArgument, message));
}

void Engine::Impl::FailAll(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (broken.empty()) broken = message;
  }
  DrainSubmissions();
  std::vector<Op*> left;
  for (auto& kv : ops) left.push_back(kv.second.get());
  for (Op* op : left) Finish(op, Status(Code::kUnavailable, Describe(op) + " failed: " + message));
}

void Engine::Impl::CheckTimeouts(int64_t now) {
  std::vector<Op*> expired;
  for (auto& kv : ops)
    if (now > kv.second->deadline_ns) expired.push_back(kv.second.get());
  for (Op* op : expired) {
    std::string waiting;
    std::vector<bool> missing(n(), false);
    if (op->req.kind == OpKind::kPushPull) {
      for (size_t p = 0; p < op->parts.size(); ++p) {
        if (op->parts[p].owner == rank()) {
          if (op->contributions[p] <= n())
            for (int r = 0; r < n(); ++r)
              if (!op->contributed[p].empty() && !op->contributed[p][r]) missing[r] = true;
        } else if (op->part_state[p] != PartState::kDone) {
          missing[op->parts[p].owner] = true;
        }
      }
    } else if (op->req.kind == OpKind::kBroadcast) {
      missing[op->req.root_rank] = rank() != op->req.root_rank;
    } else {
      for (int r = 0; r < n(); ++r) missing[r] = !op->got[r];
    }
    for (int r = 0; r < n(); ++r)
      if (missing[r]) waiting += (waiting.empty() ? "" : ", ") + std::to_string(r);
    Finish(op, Status(Code::kDeadlineExceeded,
                      Describe(op) + " did not complete within " + SecondsString(options.timeout_s) +
                          "; still waiting for rank(s) " + (waiting.empty() ? "?" : waiting) +
                          ". Those workers did not reach this operation (a different code path, a crash, or a "
                          "stall); raise timeout_s if they are only slow"));
  }
}

// ------------------------------------------------------------------------------------------------
// Sending

void Engine::Impl::Pump() {
  if (policy->queued() == 0) return;
  const uint64_t credit = options.credit_bytes;
  std::vector<SendTask> tasks;
  policy->Dequeue(in_flight < credit ? credit - in_flight : 0, NowNs(), &tasks);
  if (timeline.enabled())
    for (const PolicySpan& span : policy->TakeSpans())
      timeline.Complete("block", span.label, span.start_ns, span.end_ns,
                        "{\"tasks\": " + std::to_string(span.tasks) + ", \"bytes\": " + std::to_string(span.bytes) + "}");
  for (const SendTask& t : tasks) {
    auto it = ops_by_id.find(t.request_id);
    if (it == ops_by_id.end()) continue;  // failed while queued
    Op* op = it->second;
    const Partition& p = op->parts[t.partition];
    op->part_state[t.partition] = PartState::kPushed;
    op->push_sent_ns[t.partition] = NowNs();
    in_flight += p.bytes;
    FrameMeta meta;
    meta.type = FrameType::kPush;
    meta.dtype = op->req.dtype;
    meta.name = op->req.name;
    meta.round = op->round;
    meta.shape = op->req.shape;
    meta.partition = static_cast<uint32_t>(t.partition);
    meta.num_partitions = static_cast<uint32_t>(op->parts.size());
    meta.offset = p.offset;
    meta.payload_bytes = p.bytes;
    OutFrame f;
    f.priority = t.priority;
    EncodeFrameMeta(meta, &f.head);
    f.payload = static_cast<const char*>(op->req.input) + p.offset;
    f.payload_len = p.bytes;
    f.op_id = op->id;
    QueueFrame(t.peer, std::move(f));
  }
}

void Engine::Impl::QueueFrame(int peer, OutFrame frame) {
  Conn& c = conns[peer];
  if (!c.open) return;
  // Insert after every queued frame at least as urgent; a frame already started keeps its place.
  auto at = c.out.end();
  while (at != c.out.begin()) {
    auto before = std::prev(at);
    if (before->priority >= frame.priority || before->written > 0) break;
    at = before;
  }
  c.out.insert(at, std::move(frame));
  // Not flushed here: Flush runs on_sent callbacks and PeerLost, which may finish (free) the op
  // the caller is still using. Run() flushes after every batch of work.
}

void Engine::Impl::Flush(Conn& c) {
  while (c.open && !c.out.empty()) {
    iovec iov[64];
    int n_iov = 0;
    for (auto it = c.out.begin(); it != c.out.end() && n_iov < 62; ++it) {
      uint64_t skip = it->written;
      if (skip < it->head.size()) {
        iov[n_iov++] = {const_cast<char*>(it->head.data()) + skip, it->head.size() - skip};
        skip = 0;
      } else {
        skip -= it->head.size();
      }
      // A copied payload lives in `owned` (possibly inside the string object itself, which moves
      // with the frame), so point at it afresh on every send.
      const char* payload = it->owned.empty() ? it->payload : it->owned.data();
      if (it->payload_len > skip) iov[n_iov++] = {const_cast<char*>(payload) + skip, it->payload_len - skip};
    }
    const ssize_t n = ::writev(c.fd, iov, n_iov);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      PeerLost(c, std::string("sending failed: ") + std::strerror(errno));
      return;
    }
    bytes_sent.fetch_add(static_cast<uint64_t>(n));
    // Account every byte before running callbacks: a callback may fail an operation, and that
    // edits the queue (dropping frames that have not started).
    uint64_t left = static_cast<uint64_t>(n);
    std::vector<std::function<void()>> sent;
    while (left > 0 && !c.out.empty()) {
      OutFrame& f = c.out.front();
      const uint64_t take = std::min(left, f.total() - f.written);
      f.written += take;
      left -= take;
      if (f.written < f.total()) break;
      if (f.on_sent) sent.push_back(std::move(f.on_sent));
      c.out.pop_front();
    }
    for (auto& cb : sent) cb();
  }
  UpdateWriteInterest(c);
}

void Engine::Impl::UpdateWriteInterest(Conn& c) {
  if (!c.open) return;
  const bool want = !c.out.empty();
  if (want == c.want_write) return;
  c.want_write = want;
  epoll_event ev{};
  ev.events = EPOLLIN | (want ? EPOLLOUT : 0);
  ev.data.u64 = static_cast<uint64_t>(c.peer);
  ::epoll_ctl(epoll_fd, EPOLL_CTL_MOD, c.fd, &ev);
}

// ------------------------------------------------------------------------------------------------
// Receiving

void Engine::Impl::PeerLost(Conn& c, const std::string& why) {
  if (!c.open) return;
  c.open = false;
  ::epoll_ctl(epoll_fd, EPOLL_CTL_DEL, c.fd, nullptr);
  ::close(c.fd);
  c.out.clear();
  const bool had_work = !ops.empty();
  const std::string message = "lost the connection to rank " + std::to_string(c.peer) + " (" +
                              options.addresses[c.peer] + "): " + why +
                              ". That worker exited, crashed or was killed; see its log";
  if (had_work) PROPHET_ERROR("%s", message.c_str());
  else PROPHET_INFO("%s", message.c_str());
  FailAll(message);
}

void Engine::Impl::OnReadable(Conn& c) {
  // Read until the socket is empty, but yield after a budget so that one busy peer cannot starve
  // the others or the sends.
  uint64_t budget = 64ull << 20;
  while (c.open && budget > 0) {
    // Bytes already in the inbox are consumed first.
    if (c.inbox_begin < c.inbox_end) {
      if (c.stage != Conn::kPayload) {
        if (!ConsumeHeader(c)) return;
        continue;
      }
    }
    if (c.stage == Conn::kPayload) {
      const uint64_t want = c.meta.payload_bytes - c.payload_got;
      char* dst = nullptr;
      uint64_t room = 0;
      switch (c.sink) {
        case Sink::kDirect: dst = c.direct + c.payload_got; room = want; break;
        case Sink::kBuffer: dst = c.early->data.data() + c.payload_got; room = want; break;
        case Sink::kSum:
          dst = c.chunk.data() + c.chunk_fill;
          room = std::min<uint64_t>(want, c.chunk.size() - c.chunk_fill);
          break;
        default: break;
      }
      uint64_t got = 0;
      if (c.inbox_begin < c.inbox_end) {
        got = std::min<uint64_t>(want, c.inbox_end - c.inbox_begin);
        if (dst) {
          got = std::min(got, room);
          std::memcpy(dst, c.inbox.data() + c.inbox_begin, got);
        }
        c.inbox_begin += got;
      } else if (dst && room >= kInboxBytes / 4) {
        const ssize_t r = ::recv(c.fd, dst, room, 0);
        if (r == 0) return PeerLost(c, "the peer closed the connection");
        if (r < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return;
          return PeerLost(c, std::string("receiving failed: ") + std::strerror(errno));
        }
        got = static_cast<uint64_t>(r);
        bytes_received.fetch_add(got);
        budget -= std::min(budget, got);
      } else {
        const ssize_t r = ::recv(c.fd, c.inbox.data(), c.inbox.size(), 0);
        if (r == 0) return PeerLost(c, "the peer closed the connection");
        if (r < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return;
          return PeerLost(c, std::string("receiving failed: ") + std::strerror(errno));
        }
        c.inbox_begin = 0;
        c.inbox_end = static_cast<size_t>(r);
        bytes_received.fetch_add(static_cast<uint64_t>(r));
        budget -= std::min<uint64_t>(budget, static_cast<uint64_t>(r));
        continue;
      }
      c.payload_got += got;
      if (c.sink == Sink::kSum) {
        c.chunk_fill += got;
        if (c.chunk_fill == c.chunk.size() || c.payload_got == c.meta.payload_bytes) SumStaged(c);
      }
      if (c.payload_got == c.meta.payload_bytes) FinishPayload(c);
      continue;
    }
    // Header or tail needed and the inbox is empty: refill it.
    const ssize_t r = ::recv(c.fd, c.inbox.data(), c.inbox.size(), 0);
    if (r == 0) return PeerLost(c, "the peer closed the connection");
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      return PeerLost(c, std::string("receiving failed: ") + std::strerror(errno));
    }
    c.inbox_begin = 0;
    c.inbox_end = static_cast<size_t>(r);
    bytes_received.fetch_add(static_cast<uint64_t>(r));
    budget -= std::min<uint64_t>(budget, static_cast<uint64_t>(r));
  }
}

// Parses header and tail from the inbox. Returns false if the connection was dropped.
bool Engine::Impl::ConsumeHeader(Conn& c) {
  if (c.stage == Conn::kHeader) {
    const size_t take = std::min(sizeof(FrameHeader) - c.header_got, c.inbox_end - c.inbox_begin);
    std::memcpy(reinterpret_cast<char*>(&c.header) + c.header_got, c.inbox.data() + c.inbox_begin, take);
    c.inbox_begin += take;
    c.header_got += take;
    if (c.header_got < sizeof(FrameHeader)) return true;
    Status s = ValidateHeader(c.header);
    if (!s.ok()) {
      PeerLost(c, s.message());
      return false;
    }
    c.stage = Conn::kTail;
    c.tail.resize(MetaTailBytes(c.header));
    c.tail_got = 0;
  }
  const size_t take = std::min(c.tail.size() - c.tail_got, c.inbox_end - c.inbox_begin);
  std::memcpy(&c.tail[c.tail_got], c.inbox.data() + c.inbox_begin, take);
  c.inbox_begin += take;
  c.tail_got += take;
  if (c.tail_got < c.tail.size()) return true;
  Status s = DecodeFrameMeta(c.header, c.tail.data(), c.tail.size(), &c.meta);
  if (!s.ok()) {
    PeerLost(c, s.message());
    return false;
  }
  c.header_got = 0;
  c.stage = Conn::kPayload;
  c.payload_got = 0;
  BeginPayload(c);
  if (c.open && c.meta.payload_bytes == 0) FinishPayload(c);
  return c.open;
}

// Decides where the payload of the frame just parsed goes.
void Engine::Impl::BeginPayload(Conn& c) {
  const FrameMeta& m = c.meta;
  const std::string key = m.name + "#" + std::to_string(m.round);
  c.sink = Sink::kDiscard;
  c.target = nullptr;
  auto it = ops.find(key);
  Op* op = it == ops.end() ? nullptr : it->second.get();
  auto buffer = [&] {
    c.early_owned = std::make_unique<EarlyFrame>();
    c.early_owned->peer = c.peer;
    c.early_owned->meta = m;
    c.early_owned->data.resize(m.payload_bytes);
    c.early = c.early_owned.get();
    c.sink = Sink::kBuffer;
  };
  switch (m.type) {
    case FrameType::kError:
      buffer();
      return;
    case FrameType::kPush: {
      if (op == nullptr) {
        if (!failed_keys.count(key)) buffer();
        return;
      }
      Status s = AcceptPush(op, c.peer, m);
      if (!s.ok()) {
        FailEverywhere(op, s.message());
        return;
      }
      c.sink = Sink::kSum;
      c.target = op;
      op->receivers_busy++;
      if (c.chunk.size() != kSumChunkBytes) c.chunk.resize(kSumChunkBytes);
      c.chunk_fill = 0;
      c.summed = 0;
      return;
    }
    case FrameType::kResult: {
      if (op == nullptr || op->req.kind != OpKind::kPushPull || m.partition >= op->parts.size() ||
          op->parts[m.partition].owner != c.peer || op->parts[m.partition].offset != m.offset ||
          op->parts[m.partition].bytes != m.payload_bytes || op->part_state[m.partition] != PartState::kPushed)
        return;  // an operation that failed here: drop the bytes
      c.sink = Sink::kDirect;
      c.direct = static_cast<char*>(op->req.output) + m.offset;
      c.target = op;
      op->receivers_busy++;
      return;
    }
    case FrameType::kBroadcast: {
      if (op == nullptr) {
        if (!failed_keys.count(key)) buffer();
        return;
      }
      // Checked in FinishPayload through the buffered path when the shapes disagree.
      if (op->req.kind == OpKind::kBroadcast && m.dtype == op->req.dtype && m.shape == op->req.shape &&
          c.peer == op->req.root_rank && m.partition < op->parts.size()) {
        c.sink = Sink::kDirect;
        c.direct = static_cast<char*>(op->req.output) + m.offset;
        c.target = op;
        op->receivers_busy++;
        return;
      }
      buffer();
      return;
    }
    case FrameType::kGather: {
      if (op == nullptr && failed_keys.count(key)) return;
      buffer();
      return;
    }
  }
}

void Engine::Impl::SumStaged(Conn& c) {
  Op* op = c.target;
  if (op != nullptr && c.sink == Sink::kSum) Accumulate(op, c.meta.partition, c.summed, c.chunk.data(), c.chunk_fill);
  c.summed += c.chunk_fill;
  c.chunk_fill = 0;
}

void Engine::Impl::FinishPayload(Conn& c) {
  const FrameMeta& m = c.meta;
  const Sink sink = c.sink;
  Op* op = c.target;
  c.stage = Conn::kHeader;
  c.sink = Sink::kNone;
  c.target = nullptr;
  if (op != nullptr) op->receivers_busy--;

  if (sink == Sink::kSum && op != nullptr) {
    op->contributed[m.partition][c.peer] = true;
    op->contributions[m.partition]++;
    MaybeFinishPartition(op, m.partition);
    return;
  }
  if (sink == Sink::kDirect && op != nullptr) {
    if (m.type == FrameType::kResult) {
      op->part_state[m.partition] = PartState::kDone;
      in_flight -= m.payload_bytes;
      TransferDone d;
      d.task.request_id = op->id;
      d.task.partition = static_cast<int>(m.partition);
      d.task.peer = c.peer;
      d.task.priority = op->req.priority;
      d.task.bytes = m.payload_bytes;
      d.task.ready_ns = op->submit_ns;
      d.sent_ns = op->push_sent_ns[m.partition];
      d.done_ns = NowNs();
      policy->OnTransferDone(d);
      if (timeline.enabled()) {
        timeline.Complete("push", op->req.name, d.sent_ns, d.done_ns);
        bandwidth.OnTransfer(d.task.bytes, d.sent_ns, d.done_ns);
        for (const BandwidthSample& b : bandwidth.TakeSamples())
          timeline.Counter("bandwidth_MBps", b.ts_ns, b.estimate_Bps / 1e6);
      }
    }
    PartitionDone(op);
    return;
  }
  if (sink != Sink::kBuffer) return;
  c.early = nullptr;
  HandleBuffered(std::move(c.early_owned));
}

// A frame held in memory: its operation was not submitted here when it arrived (or it is an
// error notice). Applies it to the operation if that exists now, or keeps it for later.
void Engine::Impl::HandleBuffered(std::unique_ptr<EarlyFrame> frame) {
  const FrameMeta& m = frame->meta;
  const std::string key = m.name + "#" + std::to_string(m.round);
  auto it = ops.find(key);
  Op* target = it == ops.end() ? nullptr : it->second.get();
  if (m.type == FrameType::kError) {
    const std::string message(frame->data.begin(), frame->data.end());
    if (target != nullptr) {
      Finish(target, Status(Code::kInvalidArgument, message));
    } else {
      RememberFailure(key, message);
    }
    early.erase(key);
    return;
  }
  if (target == nullptr) {
    if (!failed_keys.count(key)) early[key].push_back(std::move(frame));
    return;
  }
  if (m.type == FrameType::kPush) {  // arrived while this worker submitted the operation
    Status s = AcceptPush(target, frame->peer, m);
    if (!s.ok()) return FailEverywhere(target, s.message());
    AddContribution(target, m.partition, frame->peer, frame->data.data());
    return;
  }
  if (m.type == FrameType::kBroadcast) {
    const OpRequest& r = target->req;
    if (r.kind != OpKind::kBroadcast || m.dtype != r.dtype || m.shape != r.shape || frame->peer != r.root_rank) {
      FailEverywhere(target, "broadcast '" + r.name + "' (round " + std::to_string(target->round) + "): rank " +
                                 std::to_string(frame->peer) + " sent shape " + ShapeString(m.shape) + " " +
                                 DataTypeName(m.dtype) + " but rank " + std::to_string(rank()) + " expects " +
                                 ShapeString(r.shape) + " " + DataTypeName(r.dtype) + " from root " +
                                 std::to_string(r.root_rank));
      return;
    }
    if (!frame->data.empty()) std::memcpy(static_cast<char*>(r.output) + m.offset, frame->data.data(), frame->data.size());
    PartitionDone(target);
    return;
  }
  if (m.type == FrameType::kGather) {
    const OpRequest& r = target->req;
    const bool tail_match = m.shape.size() == r.shape.size() && !m.shape.empty() &&
                            std::equal(m.shape.begin() + 1, m.shape.end(), r.shape.begin() + 1);
    if (r.kind != OpKind::kAllgather || m.dtype != r.dtype || !tail_match) {
      FailEverywhere(target, "allgather '" + r.name + "' (round " + std::to_string(target->round) + "): rank " +
                                 std::to_string(frame->peer) + " has shape " + ShapeString(m.shape) + " " +
                                 DataTypeName(m.dtype) + " but rank " + std::to_string(rank()) + " has " +
                                 ShapeString(r.shape) + " " + DataTypeName(r.dtype) +
                                 "; only the first dimension may differ");
      return;
    }
    target->gathered[frame->peer] = std::move(frame->data);
    target->gathered_shapes[frame->peer] = m.shape;
    target->got[frame->peer] = true;
    PartitionDone(target);
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
