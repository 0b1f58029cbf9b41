// Fuzzes the engine's receive path: bytes from an authenticated peer's socket into a real Engine.
//
//   bazel run --config=asan //ops/core/fuzz:engine_fuzz_test -- --frames=1000000 --seed=1
//
// Each session starts an Engine as rank 1 of a 2-worker job and plays rank 0 itself (FakePeer,
// through the real bootstrap), submits a few operations on the engine (push_pull, broadcast,
// allgather; some only after their frames arrived, so they are held as early frames) and sends
// the frames rank 0 would send for them, answering the engine's PUSHes with RESULTs like a real
// owner (some float32 push_pulls and allgathers compressed). In a clean session everything is
// well-formed and every result is checked exactly. In a hostile session the stream also carries
// mutated frames (frames.h) and well-formed but wrong ones (early frames for unknown names,
// duplicates, error notices, other shapes); then every operation must still end exactly once,
// promptly, with any status, and the engine must keep sending only well-formed frames. Crashes and sanitizer reports end the process.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "ops/core/engine.h"
#include "ops/core/float16_reference.h"
#include "ops/core/fuzz/fake_peer.h"
#include "ops/core/fuzz/flags.h"
#include "ops/core/fuzz/frames.h"
#include "ops/core/fuzz/memory_cap.h"
#include "ops/core/partition.h"
#include "ops/core/small_allreduce.h"
#include "ops/core/socket_testing.h"

namespace prophet {
namespace fuzz {
namespace {

constexpr int kEngineRank = 1, kPeerRank = 0;

// One operation of the session, as both workers see it.
struct Plan {
  OpKind kind = OpKind::kPushPull;
  std::string name;
  uint64_t round = 0;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;       // the engine's
  std::vector<int64_t> peer_shape;  // the fake peer's (allgather: the first dimension may differ)
  int root = 0;
  Encoding compression = Encoding::kNone;  // float32 push_pull and allgather only
  int64_t priority = 0;  // kControlPriority: a small push_pull goes by exchange
  bool late = false;  // submitted only after its frames arrived
  std::vector<char> input, output, peer_data;
  std::atomic<int> done_calls{0};
  Status status;
  std::vector<char> gathered;
  std::vector<std::vector<int64_t>> gathered_shapes;

  uint64_t bytes() const { return input.size(); }
};

uint64_t Elements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

// Sums that do not share code with the engine's kernels (float values are small integers, so
// float sums are exact; integers wrap).
void ReferenceSum(DataType dtype, const char* a, const char* b, char* out, uint64_t bytes) {
  auto add = [&](auto zero) {
    using T = decltype(zero);
    for (uint64_t i = 0; i < bytes / sizeof(T); ++i) {
      T x, y;
      std::memcpy(&x, a + i * sizeof(T), sizeof(T));
      std::memcpy(&y, b + i * sizeof(T), sizeof(T));
      T z;
      if constexpr (std::is_integral_v<T>) {
        using U = std::make_unsigned_t<T>;
        z = static_cast<T>(static_cast<U>(x) + static_cast<U>(y));
      } else {
        z = x + y;
      }
      std::memcpy(out + i * sizeof(T), &z, sizeof(T));
    }
  };
  switch (dtype) {
    case DataType::kFloat32: add(0.0f); break;
    case DataType::kFloat64: add(0.0); break;
    case DataType::kInt32: add(int32_t{0}); break;
    case DataType::kInt64: add(int64_t{0}); break;
    default: std::abort();  // sessions sum only the dtypes above
  }
}

// The 16-bit codes of float32 values (small integers: exact in both formats), written with the
// reference conversions (no code shared with the engine's codec), at scale 1.
std::string EncodeReference(Encoding encoding, const char* values, uint64_t bytes) {
  std::string codes(bytes / 2, '\0');
  for (uint64_t i = 0; i < bytes / 4; ++i) {
    float v;
    std::memcpy(&v, values + 4 * i, 4);
    const uint16_t c = encoding == Encoding::kFloat16 ? reference::RefFloatToHalf(v) : reference::RefFloatToBFloat16(v);
    std::memcpy(&codes[2 * i], &c, 2);
  }
  return codes;
}

// float32 values of 16-bit codes sent with scale exponent k.
std::string DecodeReference(Encoding encoding, int k, const char* codes, uint64_t bytes) {
  std::string values(bytes * 2, '\0');
  for (uint64_t i = 0; i < bytes / 2; ++i) {
    uint16_t c;
    std::memcpy(&c, codes + 2 * i, 2);
    const float v = std::ldexp(encoding == Encoding::kFloat16 ? reference::RefHalfToFloat(c)
                                                             : reference::BitsFloat(static_cast<uint32_t>(c) << 16),
                               -k);
    std::memcpy(&values[4 * i], &v, 4);
  }
  return values;
}

struct Totals {
  uint64_t sessions = 0, clean = 0, hostile = 0, frames = 0, mutated = 0, wrong_but_well_formed = 0;
  uint64_t dropped_by_engine = 0, ops = 0, ops_ok = 0, engine_frames = 0, violations = 0;
};

class Session {
 public:
  Session(FrameMutator& mutator, Totals& totals, uint64_t index) : mut_(mutator), totals_(totals), index_(index) {}

  void Run() {
    clean_ = mut_.Chance(0.25);
    const uint64_t partition_choices[] = {256, 4096, 65536, 1 << 20};
    options_.partition_bytes = partition_choices[mut_.Uniform(4)];
    const char* schedules[] = {"fifo", "priority", "prophet"};
    options_.schedule = schedules[mut_.Uniform(3)];
    options_.world_size = 2;
    options_.rank = kEngineRank;
    options_.addresses = testing::LoopbackAddresses(2);
    options_.token = "engine-fuzz";
    options_.timeout_s = 30;
    options_.connect_timeout_s = 10;
    options_.socket_buffer_bytes = 256 << 10;
    options_.max_early_bytes = 64 << 20;  // well above what a session holds legitimately
    MakePlans();

    std::unique_ptr<Engine> engine;
    if (!Bootstrap(&engine)) return;

    for (auto& p : plans_)
      if (!p->late) Submit(engine.get(), *p);
    std::vector<std::string> stream = BuildStream();
    uint64_t sent_bytes = 0;
    for (const std::string& frame : stream) {
      if (!peer_->Send(frame)) {
        if (clean_ && !peer_->closed_by_engine()) Violation("the peer could not write its frames for 10 s");
        break;
      }
      ++totals_.frames;
      sent_bytes += frame.size();
    }
    // Late operations are submitted once their frames are in (held as early frames).
    WaitUntil([&] { return peer_->closed_by_engine() || BytesReceived(*engine) >= sent_bytes; }, 2.0);
    for (auto& p : plans_)
      if (p->late) Submit(engine.get(), *p);

    if (clean_) {
      if (!WaitUntil([&] { return AllDone(); }, 30.0))
        Violation("a clean session did not complete within 30 s; pending: " + Pending() + "; schedule " + options_.schedule +
                  ", partitions of " + std::to_string(options_.partition_bytes) + " B; engine: " + engine->StatsJson());
      if (peer_->closed_by_engine()) Violation("the engine closed a clean session's connection");
    }
    if (peer_->closed_by_engine()) ++totals_.dropped_by_engine;
    if (!peer_->FinishAndAwaitClose(10.0)) Violation("the engine did not close after the peer's EOF within 10 s");
    if (!WaitUntil([&] { return AllDone(); }, 10.0)) Violation("operations still pending 10 s after the peer left");
    engine.reset();
    totals_.engine_frames += peer_->frames_received();
    if (!peer_->protocol_error().empty()) Violation(peer_->protocol_error());
    peer_.reset();
    Check();
  }

 private:
  void Violation(const std::string& what) {  // also from the peer's reader thread
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    if (++totals_.violations <= 20)
      std::fprintf(stderr, "VIOLATION in session %llu (%s): %s\n", static_cast<unsigned long long>(index_),
                   clean_ ? "clean" : "hostile", what.c_str());
  }

  // Starts the engine and the fake peer on free loopback ports. A port found free can be taken
  // by another process's connection before it is bound again (tests beside this one open many):
  // that is not what this fuzzer looks for, so the bootstrap then runs again on other ports.
  bool Bootstrap(std::unique_ptr<Engine>* engine) {
    for (int attempt = 1;; ++attempt) {
      BootstrapOptions b;
      b.rank = kPeerRank;
      b.world_size = 2;
      b.addresses = options_.addresses;
      b.token = options_.token;
      b.connect_timeout_s = 10;
      b.send_buffer_bytes = b.receive_buffer_bytes = options_.socket_buffer_bytes;
      Status joined = FakePeer::Listen(b, &peer_), started;
      if (joined.ok()) {
        std::thread starter([&] { started = Engine::Start(options_, engine); });
        joined = peer_->Join([this](const FrameMeta& meta, const char* payload) { OnEngineFrame(meta, payload); });
        starter.join();
        if (joined.ok() && started.ok()) return true;
      }
      const std::string why = joined.message() + " / " + started.message();
      if (why.find("already in use") == std::string::npos || attempt == 3) {
        Violation("bootstrap failed: " + why);
        return false;
      }
      engine->reset();
      peer_.reset();
      options_.addresses = testing::LoopbackAddresses(2);
    }
  }

  static uint64_t BytesReceived(const Engine& engine) {
    const std::string json = engine.StatsJson();
    const size_t at = json.find("\"bytes_received\": ");
    return at == std::string::npos ? 0 : std::strtoull(json.c_str() + at + 18, nullptr, 10);
  }

  static bool WaitUntil(const std::function<bool()>& condition, double seconds) {
    const int64_t deadline = NowNs() + static_cast<int64_t>(seconds * 1e9);
    while (!condition()) {
      if (NowNs() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
  }

  std::string Pending() const {
    std::string out;
    for (const auto& p : plans_)
      if (p->done_calls.load() == 0)
        out += std::string(out.empty() ? "" : ", ") + OpKindName(p->kind) + " " + p->name + "#" + std::to_string(p->round) +
               " (" + std::to_string(p->bytes()) + " B, " + (p->late ? "late" : "on time") + ", priority " +
               std::to_string(p->priority) + ", encoding " + std::to_string(static_cast<int>(p->compression)) + ")";
    return out;
  }

  bool AllDone() const {
    for (const auto& p : plans_)
      if (p->done_calls.load() == 0) return false;
    return true;
  }

  std::vector<char> Values(DataType dtype, uint64_t elements) {
    std::vector<char> v(elements * DataTypeSize(dtype));
    for (uint64_t i = 0; i < elements; ++i) {
      const int64_t small = static_cast<int64_t>(mut_.Uniform(201)) - 100;
      switch (dtype) {
        case DataType::kFloat32: { const float f = static_cast<float>(small); std::memcpy(&v[4 * i], &f, 4); break; }
        case DataType::kFloat64: { const double d = static_cast<double>(small); std::memcpy(&v[8 * i], &d, 8); break; }
        default: {
          const size_t e = DataTypeSize(dtype);
          const uint64_t r = mut_.rng()();
          std::memcpy(&v[e * i], &r, e);
          if (dtype == DataType::kBool) v[i] &= 1;
        }
      }
    }
    return v;
  }

  void MakePlans() {
    const int count = 1 + static_cast<int>(mut_.Uniform(4));
    const DataType summable[] = {DataType::kFloat32, DataType::kFloat64, DataType::kInt32, DataType::kInt64};
    const DataType any[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64,
                            DataType::kInt32,   DataType::kInt64,    DataType::kUInt8,   DataType::kBool};
    for (int i = 0; i < count; ++i) {
      auto p = std::make_unique<Plan>();
      p->kind = static_cast<OpKind>(mut_.Uniform(3));
      p->dtype = p->kind == OpKind::kPushPull ? summable[mut_.Uniform(4)] : any[mut_.Uniform(8)];
      p->name = std::string(OpKindName(p->kind)) + "/" + std::to_string(i);
      // A second round of an earlier name now and then: frames are matched by name#round.
      if (i > 0 && mut_.Chance(0.2) && plans_[i - 1]->kind == p->kind) {
        p->name = plans_[i - 1]->name;
        p->round = plans_[i - 1]->round + 1;
      }
      uint64_t elements;
      switch (mut_.Uniform(10)) {
        case 0: p->shape = {}; elements = 1; break;                                      // scalar
        case 1: p->shape = {0, 3}; elements = 0; break;                                  // empty
        case 2: elements = 1 + mut_.Uniform(100000); p->shape = {static_cast<int64_t>(elements)}; break;
        default:
          elements = 4 * (1 + mut_.Uniform(500));
          p->shape = {static_cast<int64_t>(elements / 4), 4};
      }
      if (p->kind == OpKind::kAllgather && p->shape.empty()) p->shape = {1};
      p->peer_shape = p->shape;
      if (p->kind == OpKind::kAllgather && mut_.Chance(0.5)) p->peer_shape[0] = static_cast<int64_t>(mut_.Uniform(9));
      p->root = p->kind == OpKind::kBroadcast ? static_cast<int>(mut_.Uniform(2)) : 0;
      // The engine numbers rounds in submission order: a later round is submitted in the same phase.
      p->late = p->round > 0 ? plans_[i - 1]->late : mut_.Chance(0.4);
      p->input = Values(p->dtype, Elements(p->shape));
      p->output.assign(p->input.size(), 0x5a);
      p->peer_data = Values(p->dtype, Elements(p->peer_shape));
      p->priority = mut_.Chance(0.3) ? kControlPriority : static_cast<int64_t>(mut_.Uniform(5));
      if (p->dtype == DataType::kFloat32 && p->kind != OpKind::kBroadcast && mut_.Chance(0.5))
        p->compression = mut_.Chance(0.5) ? Encoding::kFloat16 : Encoding::kBFloat16;
      by_key_[p->name + "#" + std::to_string(p->round)] = p.get();
      plans_.push_back(std::move(p));
    }
  }

  void Submit(Engine* engine, Plan& p) {
    OpRequest r;
    r.kind = p.kind;
    r.name = p.name;
    r.dtype = p.dtype;
    r.shape = p.shape;
    r.input = p.input.data();
    r.output = p.kind == OpKind::kAllgather ? nullptr : p.output.data();
    r.bytes = p.bytes();
    r.root_rank = p.root;
    r.compression = p.compression;
    r.priority = p.priority;
    Plan* plan = &p;
    r.done = [plan](const Status& s, const GatherResult* g) {
      plan->status = s;
      if (g != nullptr) {
        for (size_t rank = 0; rank < g->data.size(); ++rank) {
          const size_t at = plan->gathered.size();
          plan->gathered.resize(at + g->bytes[rank]);
          g->CopyOut(rank, plan->gathered.data() + at);
          plan->gathered_shapes.push_back(g->shapes[rank]);
        }
      }
      plan->done_calls.fetch_add(1);
    };
    ++totals_.ops;
    engine->Submit(std::move(r));
  }

  FrameMeta Meta(const Plan& p, FrameType type, const std::vector<Partition>& parts, uint32_t part) const {
    FrameMeta m;
    m.type = type;
    m.dtype = p.dtype;
    m.name = p.name;
    m.round = p.round;
    m.shape = type == FrameType::kGather ? p.peer_shape : p.shape;
    m.partition = part;
    m.num_partitions = static_cast<uint32_t>(parts.size());
    m.offset = parts[part].offset;
    m.payload_bytes = parts[part].bytes;
    return m;
  }

  // A frame of plan `p` carrying `bytes` of rank 0's values at `values`, encoded if the plan is
  // compressed.
  static std::string DataFrame(const Plan& p, FrameMeta meta, const char* values, uint64_t bytes) {
    if (p.compression == Encoding::kNone) return EncodeFrame(meta, std::string(values, bytes));
    meta.encoding = p.compression;
    meta.payload_bytes = bytes / 2;
    return EncodeFrame(meta, EncodeReference(p.compression, values, bytes));
  }

  // The frames rank 0 sends for its plans before it hears anything from rank 1.
  std::vector<std::string> ValidFrames() const {
    std::vector<std::string> out;
    for (const auto& pp : plans_) {
      const Plan& p = *pp;
      const size_t elem = DataTypeSize(p.dtype);
      switch (p.kind) {
        case OpKind::kPushPull: {
          OpRequest probe;
          probe.bytes = p.bytes();
          probe.compression = p.compression;
          probe.priority = p.priority;
          if (ExchangesThis(probe, 2, options_)) {
            // By exchange: rank 0's values, the one stage of two workers (small_allreduce.h).
            const std::vector<Partition> stage = {Partition{0, p.bytes(), kEngineRank}};
            out.push_back(EncodeFrame(Meta(p, FrameType::kExchange, stage, 0), std::string(p.peer_data.data(), p.bytes())));
            break;
          }
          const auto parts = MakePartitions(p.name, p.bytes(), elem, 2, options_.partition_bytes);
          for (uint32_t i = 0; i < parts.size(); ++i)
            if (parts[i].owner == kEngineRank)
              out.push_back(DataFrame(p, Meta(p, FrameType::kPush, parts, i), p.peer_data.data() + parts[i].offset,
                                      parts[i].bytes));
          break;
        }
        case OpKind::kBroadcast: {
          if (p.root != kPeerRank) break;
          const auto parts = MakePartitions(p.name, p.bytes(), elem, 1, options_.partition_bytes);
          for (uint32_t i = 0; i < parts.size(); ++i)
            out.push_back(EncodeFrame(Meta(p, FrameType::kBroadcast, parts, i),
                                      std::string(p.peer_data.data() + parts[i].offset, parts[i].bytes)));
          break;
        }
        case OpKind::kAllgather: {
          const std::vector<Partition> whole = {Partition{0, p.peer_data.size(), kEngineRank}};
          out.push_back(DataFrame(p, Meta(p, FrameType::kGather, whole, 0), p.peer_data.data(), p.peer_data.size()));
          break;
        }
      }
    }
    return out;
  }

  std::vector<std::string> BuildStream() {
    std::vector<std::string> stream = ValidFrames();
    std::shuffle(stream.begin(), stream.end(), mut_.rng());
    if (clean_) {
      ++totals_.clean;
      return stream;
    }
    ++totals_.hostile;
    const std::vector<std::string> valid = stream.empty() ? std::vector<std::string>{mut_.RandomValidFrame()} : stream;
    const int hostile = 1 + static_cast<int>(mut_.Uniform(6));
    for (int h = 0; h < hostile; ++h) {
      const std::string& base = valid[mut_.Uniform(valid.size())];
      std::string frame;
      if (mut_.Chance(0.6)) {
        frame = mut_.Mutate(base, mut_.RandomMutation(), valid[mut_.Uniform(valid.size())]);
        ++totals_.mutated;
      } else {
        frame = WrongButWellFormed(base);
        ++totals_.wrong_but_well_formed;
      }
      stream.insert(stream.begin() + static_cast<long>(mut_.Uniform(stream.size() + 1)), frame);
    }
    return stream;
  }

  // What a confused (not malicious) peer sends: everything passes the frame's own checks.
  std::string WrongButWellFormed(const std::string& base) {
    FrameMeta meta;
    const char* payload = nullptr;
    if (!DecodeFrame(base.data(), base.size(), &meta, &payload).ok()) return mut_.RandomValidFrame();
    const std::string body(payload, meta.payload_bytes);
    switch (mut_.Uniform(6)) {
      case 0: return base;  // a duplicate
      case 1: {             // an error notice for this operation
        const std::string message = "rank 0 says '" + meta.name + "' is wrong";
        FrameMeta e;
        e.type = FrameType::kError;
        e.name = meta.name;
        e.round = meta.round;
        e.payload_bytes = message.size();
        return EncodeFrame(e, message);
      }
      case 2: meta.round += 1 + mut_.Uniform(3); return EncodeFrame(meta, body);  // a later round
      case 3: meta.name += "/unknown"; return EncodeFrame(meta, body);             // never submitted
      case 4:  // another shape with the same byte count
        meta.shape = {static_cast<int64_t>(Elements(meta.shape))};
        if (meta.shape[0] > 0) meta.shape = {1, meta.shape[0]};
        return EncodeFrame(meta, body);
      default: return mut_.RandomValidFrame();
    }
  }

  // Rank 0's side of push_pull: the engine pushed a partition rank 0 owns; send back the sum. (An
  // exchange's frame needs no answer: rank 0 sent its values already.)
  void OnEngineFrame(const FrameMeta& meta, const char* payload) {
    if (meta.type == FrameType::kExchange) {
      auto it = by_key_.find(meta.name + "#" + std::to_string(meta.round));
      if (it != by_key_.end() && (meta.payload_bytes != it->second->bytes() || meta.partition != 0))
        Violation("the engine sent an exchange frame that does not fit: " + meta.name);
      return;
    }
    if (meta.type != FrameType::kPush) return;
    auto it = by_key_.find(meta.name + "#" + std::to_string(meta.round));
    if (it == by_key_.end()) return;
    const Plan& p = *it->second;
    const uint64_t bytes = PayloadTensorBytes(meta);
    if (p.kind != OpKind::kPushPull || meta.offset + bytes > p.peer_data.size() || meta.encoding != p.compression) {
      Violation("the engine pushed something it never had: " + meta.name);
      return;
    }
    const std::string values = meta.encoding == Encoding::kNone
                                   ? std::string(payload, bytes)
                                   : DecodeReference(meta.encoding, meta.scale_exp, payload, meta.payload_bytes);
    std::string sum(bytes, '\0');
    ReferenceSum(p.dtype, p.peer_data.data() + meta.offset, values.data(), &sum[0], bytes);
    FrameMeta result = meta;
    result.type = FrameType::kResult;
    result.scale_exp = 0;
    if (!peer_->Send(DataFrame(p, result, sum.data(), bytes)) && clean_ && !peer_->closed_by_engine())
      Violation("the peer could not write the sum of " + meta.name + " for 10 s");
  }

  void Check() {
    for (const auto& pp : plans_) {
      const Plan& p = *pp;
      if (p.done_calls.load() != 1) {
        Violation(p.name + ": done called " + std::to_string(p.done_calls.load()) + " times");
        continue;
      }
      if (p.status.ok()) ++totals_.ops_ok;
      if (!clean_) continue;
      if (!p.status.ok()) {
        Violation(p.name + " failed in a clean session: " + p.status.message());
        continue;
      }
      std::vector<char> expected;
      switch (p.kind) {
        case OpKind::kPushPull:
          expected.resize(p.bytes());
          ReferenceSum(p.dtype, p.peer_data.data(), p.input.data(), expected.data(), p.bytes());
          if (p.output != expected) Violation(p.name + ": wrong sum");
          break;
        case OpKind::kBroadcast:
          if (p.output != (p.root == kPeerRank ? p.peer_data : p.input)) Violation(p.name + ": wrong broadcast");
          break;
        case OpKind::kAllgather:
          expected = p.peer_data;  // rank 0 first
          expected.insert(expected.end(), p.input.begin(), p.input.end());
          if (p.gathered != expected || p.gathered_shapes.size() != 2 || p.gathered_shapes[0] != p.peer_shape ||
              p.gathered_shapes[1] != p.shape)
            Violation(p.name + ": wrong allgather");
          break;
      }
    }
  }

  FrameMutator& mut_;
  Totals& totals_;
  const uint64_t index_;
  bool clean_ = false;
  EngineOptions options_;
  std::vector<std::unique_ptr<Plan>> plans_;
  std::unordered_map<std::string, Plan*> by_key_;
  std::unique_ptr<FakePeer> peer_;
};

int Main(int argc, char** argv) {
  CapMemory();
  const Flags flags(argc, argv, {{"frames", "1000000"}, {"seed", "1"}, {"log_level", "-1"}});
  // The engine logs every dropped connection; thousands of sessions would drown the summary.
  ::setenv("PROPHET_LOG_LEVEL", flags.Str("log_level").c_str(), 1);
  const uint64_t frames = flags.U64("frames"), seed = flags.U64("seed");
  FrameMutator mutator(seed);
  Totals t;
  const auto t0 = std::chrono::steady_clock::now();
  while (t.frames < frames) {
    const uint64_t before = t.frames;
    Session(mutator, t, t.sessions).Run();
    ++t.sessions;
    if (t.frames / 100000 != before / 100000)
      std::fprintf(stderr, "%llu frames, %llu sessions, %llu violations\n", static_cast<unsigned long long>(t.frames),
                   static_cast<unsigned long long>(t.sessions), static_cast<unsigned long long>(t.violations));
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("engine_fuzz: seed %llu, %llu frames in %llu sessions (%llu clean, %llu hostile: %llu mutated frames, "
              "%llu well-formed but wrong; %llu connections dropped by the engine), %llu operations (%llu succeeded), %llu frames from the engine; "
              "%llu violations; %.1f s\n",
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(t.frames),
              static_cast<unsigned long long>(t.sessions), static_cast<unsigned long long>(t.clean),
              static_cast<unsigned long long>(t.hostile), static_cast<unsigned long long>(t.mutated),
              static_cast<unsigned long long>(t.wrong_but_well_formed),
              static_cast<unsigned long long>(t.dropped_by_engine), static_cast<unsigned long long>(t.ops),
              static_cast<unsigned long long>(t.ops_ok), static_cast<unsigned long long>(t.engine_frames),
              static_cast<unsigned long long>(t.violations), seconds);
  return t.violations == 0 ? 0 : 1;
}

}  // namespace
}  // namespace fuzz
}  // namespace prophet

int main(int argc, char** argv) { return prophet::fuzz::Main(argc, argv); }
