#include "ops/replay/replay.h"

#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <thread>

#include "ops/core/engine.h"
#include "ops/core/fusion.h"
#include "ops/core/schedule_traits.h"
#include "ops/core/scheduler.h"
#include "ops/sim/simulation_request.h"

namespace prophet {

namespace {

// The probe of prophet_tf/_link_probe.py: rounds, tensor, and the share of it each owner takes.
constexpr int kProbeRounds = 6;
constexpr int kFlatProbeRounds = 3;
constexpr int kPathTimedRounds = 2;
constexpr uint64_t kProbeBytes = 4u << 20;
constexpr uint64_t kProbeSpreadBytesPerWorker = 64u << 10;
// A scaled probe is cut as the full one is, over every owner (or host) and never by exchange: as
// one full bucket of its size (OpRequest::fusion_bucket_bytes, BucketPartitions). As a control
// push_pull of its scaled size it would sit on one owner below N x 64 KiB, and a small one would
// go by exchange on either path, leaving the path choice nothing to compare.
constexpr uint64_t kMinProbeBytes = 4u << 10;
// Elements of each sum compared with the exact sum when not every one is.
constexpr int kSampledElements = 16;

// Submits `q` and waits for it; an allgather's float64 result lands in `gathered`, rank after rank.
Status SubmitAndWait(Engine& engine, OpRequest q, std::vector<double>* gathered = nullptr) {
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> answer = done->get_future();
  const size_t per_rank = q.bytes / sizeof(double);
  q.done = [done, gathered, per_rank](const Status& s, const GatherResult* gather) {
    if (s.ok() && gather && gathered) {
      gathered->assign(gather->data.size() * per_rank, 0.0);
      for (size_t r = 0; r < gather->data.size(); ++r)
        gather->CopyOut(r, reinterpret_cast<char*>(&(*gathered)[r * per_rank]));
    }
    done->set_value(s);
  };
  engine.Submit(std::move(q));
  return answer.get();
}

void SleepUntil(int64_t deadline_ns) {
  // NowNs is steady_clock, CLOCK_MONOTONIC on Linux.
  timespec t{};
  t.tv_sec = static_cast<time_t>(deadline_ns / 1000000000);
  t.tv_nsec = static_cast<long>(deadline_ns % 1000000000);
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, nullptr) == EINTR) {
  }
}

double RealtimeSeconds() {
  timespec t{};
  clock_gettime(CLOCK_REALTIME, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

double ProcessCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

uint64_t PeakRssBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::strtoull(line.c_str() + 6, nullptr, 10) * 1024;
  }
  return 0;
}

// A number from Engine::StatsJson's flat object.
uint64_t StatField(const std::string& json, const std::string& key) {
  const size_t at = json.find("\"" + key + "\": ");
  if (at == std::string::npos) return 0;
  return std::strtoull(json.c_str() + at + key.size() + 4, nullptr, 10);
}

struct Counters {
  uint64_t frames_sent = 0, frames_received = 0, bytes_sent = 0, bytes_received = 0;
  double cpu_s = 0;
  int64_t now_ns = 0;
};

Counters Snapshot(const Engine& engine) {
  const std::string stats = engine.StatsJson();
  Counters c;
  c.frames_sent = StatField(stats, "frames_sent");
  c.frames_received = StatField(stats, "frames_received");
  c.bytes_sent = StatField(stats, "bytes_sent");
  c.bytes_received = StatField(stats, "bytes_received");
  c.cpu_s = ProcessCpuSeconds();
  c.now_ns = NowNs();
  return c;
}

// Memory for one tensor's values, aligned for the summation kernels.
struct Buffer {
  char* data = nullptr;
  uint64_t bytes = 0;
  explicit Buffer(uint64_t n) : bytes(n) {
    data = static_cast<char*>(std::aligned_alloc(64, std::max<uint64_t>(64, (n + 63) / 64 * 64)));
  }
  ~Buffer() { std::free(data); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

class Replay {
 public:
  explicit Replay(const ReplayConfig& config) : config_(config), profile_(config.profile) {}
  Status Run(ReplayResult* result);

 private:
  struct Tensor {
    const ModelTensor* model = nullptr;
    int index = 0;
    DataType dtype = DataType::kFloat32;
    uint64_t elements = 0;
    std::unique_ptr<Buffer> input, output;
    std::vector<uint64_t> sample;  // elements checked (kSampledElements)
    bool control = false;
    // Guarded by mu_: the round in flight (-1: none) and when it was submitted.
    int open_step = -1;
    int64_t submitted_ns = 0;
  };
  struct Done {
    int tensor;
    int step;
    int64_t done_ns;
    Status status;
  };

  Status Prepare();
  Status Probe(double scale, ReplayResult* result);
  Status DeclareFusion(double link_Bps, ReplayResult* result);
  Status Step(int step, int64_t* begin_ns);
  // The push_pull of `t` (without its callback), as submitted and as declared for fusion.
  OpRequest Request(const Tensor& t) const;
  void Submit(Tensor& t, int step);
  void OnDone(int tensor, int step, const Status& status);
  // A round is over (its update applied at `end`): the gates, what the step waits for, errors.
  void Finish(const Done& job, const Status& s, int64_t end);
  void ApplyLoop();
  Status Check(const Tensor& t, int step);
  // Waits (on mu_) until `ready` holds, failing after the operation timeout plus a margin.
  Status WaitFor(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready, const std::string& what);
  Status Failed();

  const ReplayConfig& config_;
  const StepProfile& profile_;
  std::unique_ptr<Engine> engine_;
  std::vector<Tensor> tensors_;
  std::vector<int> order_;  // tensors by ready offset (the backward pass's order)

  std::mutex mu_;
  std::condition_variable cv_;        // the step's thread waits on it
  std::condition_variable apply_cv_;  // the appliers wait on it
  std::vector<int> pending_updates_;   // per layer: updates its next forward pass waits for
  std::vector<int64_t> gate_open_ns_;  // per layer: when its last pending update was applied
  std::vector<int> step_left_;         // per step: what the train function still waits for
  std::vector<int64_t> step_done_ns_;  // per step: when the last of those finished
  int open_ops_ = 0;
  int64_t longest_op_ns_ = 0;          // the longest round, submission to completion
  std::deque<Done> apply_queue_;
  bool stop_ = false;
  std::string error_;
  uint64_t ops_failed_ = 0;
  uint64_t sums_checked_ = 0;
  std::vector<std::thread> appliers_;
};

Status Replay::Failed() {
  return error_.empty() ? Status::OK() : Status(Code::kInternal, error_);
}

Status Replay::WaitFor(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready,
                       const std::string& what) {
  const auto limit = std::chrono::duration<double>(config_.engine.timeout_s + 30.0);
  if (!cv_.wait_for(lock, limit, [&] { return ready() || !error_.empty(); })) {
    return Status(Code::kDeadlineExceeded, "rank " + std::to_string(config_.engine.rank) + ": " + what +
                                               " did not happen within the operation timeout (" +
                                               SecondsString(config_.engine.timeout_s) + ") + 30 s");
  }
  return Failed();
}

Status Replay::Prepare() {
  const int n = config_.engine.world_size, rank = config_.engine.rank;
  tensors_.resize(profile_.tensors.size());
  for (size_t i = 0; i < profile_.tensors.size(); ++i) {
    const ModelTensor& m = profile_.tensors[i];
    Tensor& t = tensors_[i];
    t.model = &m;
    t.index = static_cast<int>(i);
    t.control = m.priority >= kControlPriority;
    if (m.element_size == 4) {
      t.dtype = DataType::kFloat32;
    } else if (m.element_size == 8) {
      t.dtype = DataType::kFloat64;
    } else {
      return Status(Code::kInvalidArgument, "tensor '" + m.name + "' has " + std::to_string(m.element_size) +
                                                "-byte elements; the replay sums float32 (4) or float64 (8) values");
    }
    if (m.bytes == 0 || m.bytes % m.element_size != 0) {
      return Status(Code::kInvalidArgument, "tensor '" + m.name + "' has " + std::to_string(m.bytes) +
                                                " bytes, not a positive multiple of its element size");
    }
    t.elements = m.bytes / m.element_size;
    t.input = std::make_unique<Buffer>(m.bytes);
    t.output = std::make_unique<Buffer>(m.bytes);
    for (uint64_t e = 0; e < t.elements; ++e) {
      const double v = ReplayValue(rank, t.index, e);
      if (t.dtype == DataType::kFloat32) {
        reinterpret_cast<float*>(t.input->data)[e] = static_cast<float>(v);
      } else {
        reinterpret_cast<double*>(t.input->data)[e] = v;
      }
    }
    std::memset(t.output->data, 0, m.bytes);
    // The first and last elements, and others spread over the tensor (a multiplicative hash, so
    // that they fall in different partitions).
    t.sample.push_back(0);
    t.sample.push_back(t.elements - 1);
    for (int k = 1; static_cast<int>(t.sample.size()) < kSampledElements && static_cast<uint64_t>(k) < t.elements; ++k) {
      t.sample.push_back((static_cast<uint64_t>(k) * 2654435761u) % t.elements);
    }
    order_.push_back(static_cast<int>(i));
  }
  // The backward pass hands tensors over by their ready offsets; ties in profile order.
  std::stable_sort(order_.begin(), order_.end(), [this](int a, int b) {
    return profile_.tensors[a].ready_ns < profile_.tensors[b].ready_ns;
  });
  const int total = config_.warmup_steps + config_.steps + 1;
  pending_updates_.assign(profile_.layers.size(), 0);
  gate_open_ns_.assign(profile_.layers.size(), 0);
  step_left_.assign(total, 0);
  step_done_ns_.assign(total, 0);
  (void)n;
  return Status::OK();
}

Status Replay::Probe(double scale, ReplayResult* result) {
  const int n = config_.engine.world_size;
  const uint64_t full = std::max<uint64_t>(kProbeBytes, static_cast<uint64_t>(n) * kProbeSpreadBytesPerWorker);
  const uint64_t bytes = std::max<uint64_t>(kMinProbeBytes, static_cast<uint64_t>(std::llround(static_cast<double>(full) * scale / 4)) * 4);
  Buffer payload(bytes), out(bytes);
  std::memset(payload.data, 0, bytes);
  const int64_t start = NowNs();
  // Where hierarchical auto allows two paths, the two-level rounds are followed by
  // kFlatProbeRounds on the flat path and the faster is kept, as prophet_tf/_link_probe.py does.
  const bool choose = engine_->PathChoosable();
  const int paths = choose ? 2 : 1;
  double best[2] = {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity()};
  std::vector<int64_t> ends[2];
  for (int path = 0; path < paths; ++path) {
    if (choose) {
      const Status set = engine_->SetTwoLevel(path == 0);
      if (!set.ok()) return set;
    }
    for (int k = 0; k < (path == 1 ? kFlatProbeRounds : kProbeRounds); ++k) {
      OpRequest q;
      q.kind = OpKind::kPushPull;
      q.name = (path == 1 ? "fusion_probe/flat/" : "fusion_probe/") + std::to_string(k);
      q.dtype = DataType::kFloat32;
      q.shape = {static_cast<int64_t>(bytes / 4)};
      q.input = payload.data;
      q.output = out.data;
      q.bytes = bytes;
      q.priority = kControlPriority;
      if (bytes < full) q.fusion_bucket_bytes = bytes;
      const int64_t t0 = NowNs();
      const Status s = SubmitAndWait(*engine_, std::move(q));
      if (!s.ok()) return s;
      ends[path].push_back(NowNs());
      best[path] = std::min(best[path], static_cast<double>(ends[path].back() - t0) / 1e9);
    }
  }
  // Each path's round in lockstep, as prophet_tf/_link_probe.py times it for the choice: the
  // period of its last kPathTimedRounds rounds' ends.
  double mine[4] = {best[0], best[1], 0, 0};
  for (int path = 0; choose && path < 2; ++path) {
    const std::vector<int64_t>& e = ends[path];
    mine[2 + path] = static_cast<double>(e.back() - e[e.size() - 1 - kPathTimedRounds]) / 1e9 / kPathTimedRounds;
  }
  // Every worker's rounds, gathered: the slowest worker's on each path decide.
  OpRequest q;
  q.kind = OpKind::kAllgather;
  q.name = "fusion_probe/rates";
  q.dtype = DataType::kFloat64;
  q.shape = {4};
  q.input = mine;
  q.bytes = sizeof(mine);
  q.priority = kControlPriority;
  std::vector<double> rounds;
  const Status gathered = SubmitAndWait(*engine_, std::move(q), &rounds);
  if (!gathered.ok()) return gathered;
  double slowest[4] = {mine[0], mine[1], mine[2], mine[3]};
  for (size_t i = 0; i < rounds.size(); ++i) slowest[i % 4] = std::max(slowest[i % 4], rounds[i]);
  int chosen = 0;
  if (choose) {
    const bool two_level = ChooseTwoLevel(slowest[2], slowest[3]);
    chosen = two_level ? 0 : 1;
    const Status set = engine_->SetTwoLevel(two_level);
    if (!set.ok()) return set;
    result->probe_two_level = two_level ? 1 : 0;
    result->probe_two_level_round_s = slowest[2];
    result->probe_flat_round_s = slowest[3];
  }
  const double measured = 2.0 * (n - 1) / n * static_cast<double>(bytes) / best[chosen];
  const double agreed = 2.0 * (n - 1) / n * static_cast<double>(bytes) / slowest[chosen];
  result->probe_s = static_cast<double>(NowNs() - start) / 1e9;
  result->probe_measured_Bps = measured;
  result->probe_agreed_Bps = agreed;
  result->probe_bytes = bytes;
  return Status::OK();
}

Status Replay::DeclareFusion(double link_Bps, ReplayResult* result) {
  const int n = config_.engine.world_size;
  uint64_t bucket = ResolveFusionBytes(config_.fusion_bytes, n, link_Bps);
  if (config_.fusion_bytes == kFusionAuto) {
    bucket = static_cast<uint64_t>(std::llround(static_cast<double>(bucket) * config_.fusion_scale));
  }
  result->fusion_link_Bps = link_Bps;
  result->fusion_bucket_bytes = bucket;
  if (bucket == 0) return Status::OK();
  std::vector<FusionDeclaration> declared;
  for (const Tensor& t : tensors_) {
    if (t.control) continue;  // the strategy never fuses control collectives
    const OpRequest q = Request(t);
    declared.push_back({q.name, q.dtype, q.shape, q.bytes, q.priority, q.average, q.compression});
  }
  auto done = std::make_shared<std::promise<Status>>();
  std::future<Status> answer = done->get_future();
  engine_->DeclareFusion("gradients", std::move(declared), bucket, [done](const Status& s) { done->set_value(s); });
  if (answer.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return Status(Code::kDeadlineExceeded, "the engine did not apply the fusion declaration within 60 s");
  }
  return answer.get();
}

OpRequest Replay::Request(const Tensor& t) const {
  OpRequest q;
  q.kind = OpKind::kPushPull;
  q.name = t.model->name;
  q.dtype = t.dtype;
  q.shape = {static_cast<int64_t>(t.elements)};
  q.input = t.input->data;
  q.output = t.output->data;
  q.bytes = t.model->bytes;
  q.priority = t.model->priority;
  q.compression = t.model->encoding;
  return q;
}

void Replay::Submit(Tensor& t, int step) {
  if (config_.check_all) {
    std::memset(t.output->data, 0xff, t.model->bytes);  // NaN in both float types
  } else {
    for (const uint64_t e : t.sample) {
      if (t.dtype == DataType::kFloat32) {
        reinterpret_cast<float*>(t.output->data)[e] = std::numeric_limits<float>::quiet_NaN();
      } else {
        reinterpret_cast<double*>(t.output->data)[e] = std::numeric_limits<double>::quiet_NaN();
      }
    }
  }
  OpRequest q = Request(t);
  const int index = t.index;
  q.done = [this, index, step](const Status& s, const GatherResult*) { OnDone(index, step, s); };
  engine_->Submit(std::move(q));
}

void Replay::OnDone(int tensor, int step, const Status& status) {
  // On the engine's thread, which must stay cheap: a sampled check and the bookkeeping of an
  // update that takes no time are; a whole tensor's check or an update's time go to the
  // appliers (a thread hop less per tensor matters with 64 workers on 2 cores).
  const Done job{tensor, step, NowNs(), status};
  Tensor& t = tensors_[tensor];
  if (!config_.check_all && (t.control || t.model->apply_ns <= 0)) {
    Finish(job, status.ok() ? Check(t, step) : status, job.done_ns);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  apply_queue_.push_back(job);
  apply_cv_.notify_one();
}

void Replay::Finish(const Done& job, const Status& s, int64_t end) {
  Tensor& t = tensors_[job.tensor];
  std::lock_guard<std::mutex> lock(mu_);
  if (!s.ok()) {
    ++ops_failed_;
    if (error_.empty()) error_ = s.message();
  }
  longest_op_ns_ = std::max(longest_op_ns_, job.done_ns - t.submitted_ns);
  t.open_step = -1;
  --open_ops_;
  const int layer = t.model->layer;
  if (!t.control && config_.cross_barrier && layer >= 0) {
    gate_open_ns_[layer] = std::max(gate_open_ns_[layer], end);
    --pending_updates_[layer];
  }
  if (t.control || !config_.cross_barrier) {
    step_done_ns_[job.step] = std::max(step_done_ns_[job.step], end);
    --step_left_[job.step];
  }
  cv_.notify_all();
}

Status Replay::Check(const Tensor& t, int step) {
  const int n = config_.engine.world_size;
  // Compressed sums are rounded (codec.h): each contribution and the sum once more.
  const double tolerance = t.model->encoding == Encoding::kNone ? 0.0
                           : t.model->encoding == Encoding::kBFloat16 ? std::ldexp(1.0, -6)
                                                                      : std::ldexp(1.0, -9);
  auto check = [&](uint64_t e) -> bool {
    const double got = t.dtype == DataType::kFloat32 ? reinterpret_cast<const float*>(t.output->data)[e]
                                                     : reinterpret_cast<const double*>(t.output->data)[e];
    const double want = ReplaySum(n, t.index, e);
    return std::fabs(got - want) <= tolerance * want;
  };
  uint64_t bad = std::numeric_limits<uint64_t>::max();
  uint64_t checked = 0;
  if (config_.check_all) {
    for (uint64_t e = 0; e < t.elements && bad == std::numeric_limits<uint64_t>::max(); ++e, ++checked)
      if (!check(e)) bad = e;
  } else {
    for (const uint64_t e : t.sample) {
      ++checked;
      if (!check(e)) {
        bad = e;
        break;
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    sums_checked_ += checked;
  }
  if (bad == std::numeric_limits<uint64_t>::max()) return Status::OK();
  const double got = t.dtype == DataType::kFloat32 ? reinterpret_cast<const float*>(t.output->data)[bad]
                                                   : reinterpret_cast<const double*>(t.output->data)[bad];
  return Status(Code::kInternal, "rank " + std::to_string(config_.engine.rank) + ": wrong sum of '" + t.model->name +
                                     "' in step " + std::to_string(step) + " at element " + std::to_string(bad) +
                                     ": " + std::to_string(got) + ", expected " + std::to_string(ReplaySum(n, t.index, bad)));
}

void Replay::ApplyLoop() {
  int64_t free_ns = 0;  // this thread's virtual time: when its last update ended
  while (true) {
    Done job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      apply_cv_.wait(lock, [this] { return stop_ || !apply_queue_.empty(); });
      if (apply_queue_.empty()) return;
      job = std::move(apply_queue_.front());
      apply_queue_.pop_front();
    }
    Tensor& t = tensors_[job.tensor];
    Status s = job.status;
    if (s.ok()) s = Check(t, job.step);
    int64_t end = job.done_ns;
    if (s.ok() && !t.control && t.model->apply_ns > 0) {
      end = std::max(end, free_ns) + t.model->apply_ns;
      SleepUntil(end);
      free_ns = end;
    }
    Finish(job, s, end);
  }
}

Status Replay::Step(int step, int64_t* begin_ns) {
  int64_t t = *begin_ns + profile_.launch_ns;
  // The forward pass: layer k starts when layer k-1 ended and its gate opened (when its last
  // update was applied, whenever this thread learns of it). A gate open now stays open until
  // this step's backward pass, so the thread waits only where one is closed, and sleeps once,
  // to the pass's end.
  for (size_t k = 0; k < profile_.layers.size(); ++k) {
    if (config_.cross_barrier) {
      std::unique_lock<std::mutex> lock(mu_);
      Status s = WaitFor(lock, [&] { return pending_updates_[k] == 0; },
                         "step " + std::to_string(step) + ": the gate of layer '" + profile_.layers[k].name + "'");
      if (!s.ok()) return s;
      t = std::max(t, gate_open_ns_[k]);
    }
    t += profile_.layers[k].forward_ns;
  }
  SleepUntil(t);
  const int64_t backward_start = t;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const Tensor& tensor : tensors_) step_left_[step] += tensor.control || !config_.cross_barrier ? 1 : 0;
    step_done_ns_[step] = backward_start + profile_.backward_ns;
  }
  for (const int index : order_) {
    Tensor& tensor = tensors_[index];
    SleepUntil(backward_start + std::min(tensor.model->ready_ns, profile_.backward_ns));
    {
      std::unique_lock<std::mutex> lock(mu_);
      // A tensor no layer reads may still be in flight from the last step; its output is reused.
      Status s = WaitFor(lock, [&] { return tensor.open_step < 0; },
                         "step " + std::to_string(step) + ": the last round of '" + tensor.model->name + "'");
      if (!s.ok()) return s;
      if (!tensor.control && config_.cross_barrier && tensor.model->layer >= 0) ++pending_updates_[tensor.model->layer];
      tensor.open_step = step;
      tensor.submitted_ns = NowNs();
      ++open_ops_;
    }
    Submit(tensor, step);
  }
  t = backward_start + profile_.backward_ns;
  SleepUntil(t);
  {
    std::unique_lock<std::mutex> lock(mu_);
    Status s = WaitFor(lock, [&] { return step_left_[step] == 0; },
                       "step " + std::to_string(step) + ": what the train function waits for");
    if (!s.ok()) return s;
    t = std::max(t, step_done_ns_[step]);
  }
  t += profile_.tail_ns + profile_.gap_ns;
  SleepUntil(t);
  *begin_ns = t;
  return Failed();
}

Status Replay::Run(ReplayResult* result) {
  const double launched = config_.launched_at_s > 0 ? config_.launched_at_s : RealtimeSeconds();
  result->rank = config_.engine.rank;
  result->world_size = config_.engine.world_size;
  result->partition_bytes = config_.engine.partition_bytes;
  result->credit_bytes = ResolveCreditBytes(config_.engine.credit_bytes, config_.engine.world_size,
                                            config_.engine.partition_bytes);
  result->socket_unsent_bytes = static_cast<uint64_t>(std::max(0, config_.engine.socket_unsent_bytes));
  for (const ModelTensor& m : profile_.tensors)
    if (m.priority < kControlPriority) result->gradient_bytes += m.bytes;
  Status s = Prepare();
  if (!s.ok()) return s;
  s = Engine::Start(config_.engine, &engine_);
  if (!s.ok()) return s;
  result->connect_s = RealtimeSeconds() - launched;
  result->connections = config_.engine.world_size - 1;
  double link_Bps = config_.link_Bps;
  const bool needs_rate = config_.fusion_bytes == kFusionAuto && !(link_Bps > 0);
  // The strategy probes wherever the path is to be chosen, too.
  if ((needs_rate || config_.probe || engine_->PathChoosable()) && config_.engine.world_size > 1) {
    s = Probe(needs_rate ? 1.0 : config_.probe_scale, result);
    if (!s.ok()) return s;
    if (needs_rate) link_Bps = QuantizeLinkGbps(result->probe_agreed_Bps * 8 / 1e9) * 1e9 / 8;
  }
  s = DeclareFusion(link_Bps, result);
  if (!s.ok()) return s;
  result->startup_s = RealtimeSeconds() - launched;

  for (int i = 0; i < std::max(1, config_.apply_threads); ++i) appliers_.emplace_back([this] { ApplyLoop(); });
  const int total = config_.warmup_steps + config_.steps;
  int64_t begin = NowNs();
  std::vector<int64_t> begins;
  Counters first, last;
  for (int step = 0; step <= total && s.ok(); ++step) {
    begins.push_back(begin);
    if (step == config_.warmup_steps) first = Snapshot(*engine_);
    if (step == total) {
      last = Snapshot(*engine_);
      break;
    }
    s = Step(step, &begin);
  }
  if (s.ok()) {
    // Every round this worker started must end before it leaves: its peers' sums need its pushes.
    std::unique_lock<std::mutex> lock(mu_);
    s = WaitFor(lock, [this] { return open_ops_ == 0 && apply_queue_.empty(); }, "the last rounds");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    apply_cv_.notify_all();
  }
  for (std::thread& th : appliers_) th.join();
  if (s.ok()) s = Failed();
  for (int step = config_.warmup_steps; step < total && step + 1 < static_cast<int>(begins.size()); ++step) {
    result->periods_s.push_back(static_cast<double>(begins[step + 1] - begins[step]) / 1e9);
  }
  result->longest_op_s = static_cast<double>(longest_op_ns_) / 1e9;
  result->frames_sent = last.frames_sent - first.frames_sent;
  result->frames_received = last.frames_received - first.frames_received;
  result->bytes_sent = last.bytes_sent - first.bytes_sent;
  result->bytes_received = last.bytes_received - first.bytes_received;
  result->cpu_s = last.cpu_s - first.cpu_s;
  result->wall_s = static_cast<double>(last.now_ns - first.now_ns) / 1e9;
  result->ops_failed = ops_failed_;
  result->sums_checked = sums_checked_;
  result->engine_stats = engine_->StatsJson();
  result->peak_rss_bytes = PeakRssBytes();
  engine_.reset();
  return s;
}

void AppendNumber(const char* key, double value, std::string* out) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.9g", value);
  out->append(", \"");
  out->append(key);
  out->append("\": ");
  out->append(std::isfinite(value) ? buffer : "null");
}

}  // namespace

double ReplayValue(int rank, int tensor, uint64_t i) {
  return static_cast<double>(rank + 1) + 128.0 * static_cast<double>((i + static_cast<uint64_t>(tensor)) % 13);
}

double ReplaySum(int world_size, int tensor, uint64_t i) {
  const double n = world_size;
  return n * (n + 1) / 2 + n * 128.0 * static_cast<double>((i + static_cast<uint64_t>(tensor)) % 13);
}

double QuantizeLinkGbps(double gbps) {
  if (!(gbps > 0) || std::isinf(gbps)) return kProbeMinGbps;
  const int exponent = static_cast<int>(std::floor(std::log10(gbps / kProbePayloadAllowance)));
  double best = kProbeMinGbps;
  for (int e = exponent - 1; e <= exponent + 1; ++e) {  // log10's rounding at a decade's edge
    for (const int mantissa : {1, 2, 5}) {
      const double value = e >= 0 ? mantissa * std::pow(10.0, e) : mantissa / std::pow(10.0, -e);
      if (value * kProbePayloadAllowance <= gbps) best = std::max(best, value);
    }
  }
  return best;
}

Status ReplayConfigFromRequest(const std::string& request_text, ReplayConfig* config) {
  SimulationRequest request;
  Status s = ParseSimulationRequest(request_text, &request);
  if (!s.ok()) return s;
  if (request.runtime.schedule == "mwms") {
    return Status(Code::kInvalidArgument, "the replay runs the runtime's engine; mwms is TensorFlow's ring");
  }
  CompressGradients(request.compression, &request.profile);
  config->profile = request.profile;
  config->compression = request.compression;
  config->cross_barrier = request.runtime.cross_barrier;
  config->apply_threads = request.runtime.apply_threads;
  config->fusion_bytes = request.runtime.fusion_bytes;
  config->warmup_steps = request.options.warmup_steps;
  config->steps = request.options.steps;
  EngineOptions& e = config->engine;
  e.schedule = request.runtime.schedule;
  e.partition_bytes = request.runtime.partition_bytes;
  e.credit_bytes = request.runtime.credit_bytes;
  e.replan_threshold = request.runtime.replan_threshold;
  e.hierarchical = request.runtime.hierarchical;
  e.small_allreduce = request.runtime.small_allreduce;
  e.socket_buffer_bytes = request.network.socket_buffer_bytes;
  e.socket_unsent_bytes = static_cast<int>(request.network.socket_unsent_bytes);
  // The lanes the prediction beside it models (1 unless the request says), not io_threads auto:
  // the replay has no strategy to size them from its probe.
  e.io_threads = request.network.io_threads;
  return Status::OK();
}

void ScaleRuntimeBytes(double byte_scale, EngineOptions* o) {
  auto scaled = [byte_scale](uint64_t bytes) {
    return std::max<uint64_t>(kMinScaledBytes, static_cast<uint64_t>(std::llround(static_cast<double>(bytes) * byte_scale)));
  };
  // Resolved first: kPartitionAuto (0) scaled is the 4 KiB floor, not the schedule's partition
  // size times the scale, and the credit follows from the resolved partition size.
  const uint64_t partition = ResolvePartitionBytes(o->partition_bytes, o->schedule);
  const uint64_t credit = ResolveScheduleCreditBytes(o->credit_bytes, o->schedule, o->world_size, partition);
  o->partition_bytes = scaled(partition);
  o->credit_bytes = std::max(o->partition_bytes, scaled(credit));
  if (o->socket_unsent_bytes > 0) o->socket_unsent_bytes = static_cast<int>(scaled(static_cast<uint64_t>(o->socket_unsent_bytes)));
}

Status RunReplay(const ReplayConfig& config, ReplayResult* result) {
  *result = ReplayResult();
  Replay replay(config);
  return replay.Run(result);
}

std::string ReplayResultJson(const ReplayResult& r) {
  std::string out = "{\"rank\": " + std::to_string(r.rank) + ", \"world_size\": " + std::to_string(r.world_size);
  out += ", \"periods_s\": [";
  for (size_t i = 0; i < r.periods_s.size(); ++i) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), "%.9g", r.periods_s[i]);
    out += (i ? ", " : "") + std::string(buffer);
  }
  out += "]";
  AppendNumber("connect_s", r.connect_s, &out);
  AppendNumber("startup_s", r.startup_s, &out);
  AppendNumber("probe_s", r.probe_s, &out);
  AppendNumber("probe_measured_Bps", r.probe_measured_Bps, &out);
  AppendNumber("probe_agreed_Bps", r.probe_agreed_Bps, &out);
  AppendNumber("probe_bytes", static_cast<double>(r.probe_bytes), &out);
  AppendNumber("probe_two_level", r.probe_two_level, &out);
  AppendNumber("probe_two_level_round_s", r.probe_two_level_round_s, &out);
  AppendNumber("probe_flat_round_s", r.probe_flat_round_s, &out);
  AppendNumber("fusion_link_Bps", r.fusion_link_Bps, &out);
  AppendNumber("fusion_bucket_bytes", static_cast<double>(r.fusion_bucket_bytes), &out);
  AppendNumber("partition_bytes", static_cast<double>(r.partition_bytes), &out);
  AppendNumber("credit_bytes", static_cast<double>(r.credit_bytes), &out);
  AppendNumber("socket_unsent_bytes", static_cast<double>(r.socket_unsent_bytes), &out);
  AppendNumber("connections", r.connections, &out);
  AppendNumber("frames_sent", static_cast<double>(r.frames_sent), &out);
  AppendNumber("frames_received", static_cast<double>(r.frames_received), &out);
  AppendNumber("bytes_sent", static_cast<double>(r.bytes_sent), &out);
  AppendNumber("bytes_received", static_cast<double>(r.bytes_received), &out);
  AppendNumber("cpu_s", r.cpu_s, &out);
  AppendNumber("wall_s", r.wall_s, &out);
  AppendNumber("peak_rss_bytes", static_cast<double>(r.peak_rss_bytes), &out);
  AppendNumber("gradient_bytes", static_cast<double>(r.gradient_bytes), &out);
  AppendNumber("sums_checked", static_cast<double>(r.sums_checked), &out);
  AppendNumber("ops_failed", static_cast<double>(r.ops_failed), &out);
  AppendNumber("longest_op_s", r.longest_op_s, &out);
  out += ", \"engine\": " + (r.engine_stats.empty() ? std::string("{}") : r.engine_stats) + "}";
  return out;
}

}  // namespace prophet
