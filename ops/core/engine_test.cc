// The real engine over loopback TCP: several Engines in one process, one thread each for Start.
#include "ops/core/engine.h"


#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/engine_testing.h"
#include "ops/core/partition.h"
#include "ops/core/small_allreduce.h"
#include "ops/core/socket_testing.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

using ::prophet::testing::Contains;

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMB = 1 << 20;

using testing::SecondsSince;

std::vector<EngineOptions> ClusterOptions(int n, double timeout_s = 20.0) {
  std::vector<EngineOptions> out = testing::ClusterOptions(n, timeout_s, "engine-test");
  for (EngineOptions& o : out) o.partition_bytes = kMB;
  return out;
}

// Every engine started; a rank that failed to start fails the test unless `statuses` is asked for.
std::vector<std::unique_ptr<Engine>> StartCluster(const std::vector<EngineOptions>& options,
                                                  std::vector<Status>* statuses = nullptr) {
  std::vector<Status> status;
  std::vector<std::unique_ptr<Engine>> engines = testing::StartCluster(options, &status);
  for (size_t r = 0; r < status.size(); ++r)
    if (!status[r].ok() && statuses == nullptr) FAIL("rank " + std::to_string(r) + " failed to start: " + status[r].message());
  if (statuses) *statuses = status;
  return engines;
}

// A submitted operation whose `done` fulfils a promise.
struct Pending {
  std::shared_ptr<std::promise<Status>> promise = std::make_shared<std::promise<Status>>();
  std::future<Status> future = promise->get_future();
};

// Waits at most `seconds` (never hangs): a missing callback fails the test.
Status Await(Pending& p, int line, double seconds = 20.0) {
  if (p.future.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    ::prophet::testing::Fail(__FILE__, line, "no done callback within " + std::to_string(seconds) + " s");
    return Status(Code::kInternal, "test: no done callback");
  }
  return p.future.get();
}
#define AWAIT(p, ...) Await(p, __LINE__, ##__VA_ARGS__)

std::unique_ptr<Pending> PushPull(Engine* e, const std::string& name, DataType dtype, const std::vector<int64_t>& shape,
                                  const void* input, void* output, uint64_t bytes, bool average = false,
                                  int64_t priority = 0, Encoding compression = Encoding::kNone) {
  auto p = std::make_unique<Pending>();
  OpRequest r;
  r.kind = OpKind::kPushPull;
  r.name = name;
  r.dtype = dtype;
  r.shape = shape;
  r.input = input;
  r.output = output;
  r.bytes = bytes;
  r.average = average;
  r.priority = priority;
  r.compression = compression;
  auto promise = p->promise;
  r.done = [promise](const Status& s, const GatherResult*) { promise->set_value(s); };
  e->Submit(std::move(r));
  return p;
}

// One logical tensor of a push_pull test: inputs per rank, the expected output.
struct Case {
  std::string name;
  DataType dtype;
  uint64_t elements;
  bool average;
  bool in_place;  // output aliases input
  std::vector<std::vector<char>> input;   // by rank
  std::vector<std::vector<char>> output;  // by rank (unused when in_place)
  std::vector<char> expected;
  std::vector<std::unique_ptr<Pending>> pending;  // by rank

  uint64_t bytes() const { return elements * DataTypeSize(dtype); }
  void* out(int r) { return in_place ? input[r].data() : output[r].data(); }
};

// Values that make float32 sums exact (integers well below 2^24) and int64 values large and signed.
void Fill(Case& c, int world, uint64_t round) {
  c.input.assign(world, std::vector<char>(c.bytes()));
  c.output.assign(world, c.in_place ? std::vector<char>() : std::vector<char>(c.bytes(), 0x5a));
  c.pending.clear();
  c.pending.resize(world);
  c.expected.assign(c.bytes(), 0);
  for (uint64_t i = 0; i < c.elements; ++i) {
    if (c.dtype == DataType::kFloat32) {
      float sum = 0;
      for (int r = 0; r < world; ++r) {
        const float v = static_cast<float>(static_cast<int64_t>((i * 7 + r * 131 + round * 17) % 2001) - 1000);
        std::memcpy(c.input[r].data() + 4 * i, &v, 4);
        sum += v;
      }
      if (c.average) sum /= static_cast<float>(world);
      std::memcpy(c.expected.data() + 4 * i, &sum, 4);
    } else {
      int64_t sum = 0;
      for (int r = 0; r < world; ++r) {
        const int64_t v = (static_cast<int64_t>(i) * 1000003 + r * 999999937ll + static_cast<int64_t>(round)) *
                          ((i + r) % 3 == 0 ? -1 : 1);
        std::memcpy(c.input[r].data() + 8 * i, &v, 8);
        sum += v;
      }
      if (c.average) sum /= world;  // truncating, like tf.math.truncatediv
      std::memcpy(c.expected.data() + 8 * i, &sum, 8);
    }
  }
}

std::vector<Case> MakeCases(const std::string& prefix, const std::vector<uint64_t>& byte_sizes) {
  std::vector<Case> cases;
  for (DataType dtype : {DataType::kFloat32, DataType::kInt64}) {
    for (uint64_t bytes : byte_sizes) {
      for (bool average : {false, true}) {
        Case c;
        c.dtype = dtype;
        // Below 1 MB a size is an element count, from 1 MB on a byte count.
        c.elements = bytes < kMB ? bytes : bytes / DataTypeSize(dtype);
        c.average = average;
        c.in_place = (cases.size() % 3) == 1;
        c.name = prefix + "/" + DataTypeName(dtype) + "/" + std::to_string(c.elements) + (average ? "/mean" : "/sum");
        cases.push_back(std::move(c));
      }
    }
  }
  return cases;
}

// Submits every case on every engine, each engine in its own order (and from its own thread), then
// checks every output exactly.
void RunCases(std::vector<std::unique_ptr<Engine>>& engines, std::vector<Case>& cases, uint64_t round,
              int64_t late_rank = -1) {
  const int world = static_cast<int>(engines.size());
  for (Case& c : cases) Fill(c, world, round);
  std::vector<std::thread> submitters;
  for (int r = 0; r < world; ++r) {
    submitters.emplace_back([&, r] {
      std::vector<size_t> order(cases.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      if (r % 3 == 1) std::reverse(order.begin(), order.end());
      if (r % 3 == 2) std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(round * 10 + r)));
      if (r == late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      for (size_t k = 0; k < order.size(); ++k) {
        Case& c = cases[order[k]];
        const std::vector<int64_t> shape = {static_cast<int64_t>(c.elements)};
        // Priorities differ per rank too: they order sends, never matching.
        c.pending[r] = PushPull(engines[r].get(), c.name, c.dtype, shape, c.input[r].data(), c.out(r), c.bytes(),
                                c.average, r == 0 ? static_cast<int64_t>(k) : -static_cast<int64_t>(k));
      }
    });
  }
  for (std::thread& t : submitters) t.join();
  for (Case& c : cases) {
    for (int r = 0; r < world; ++r) {
      const Status s = AWAIT(*c.pending[r]);
      if (!s.ok()) {
        FAIL("rank " + std::to_string(r) + " " + c.name + ": " + s.message());
        continue;
      }
      const char* got = static_cast<const char*>(c.out(r));
      if (std::memcmp(got, c.expected.data(), c.bytes()) != 0) {
        const size_t elem = DataTypeSize(c.dtype);
        uint64_t first = 0, wrong = 0;
        for (uint64_t i = 0; i < c.elements; ++i)
          if (std::memcmp(got + i * elem, c.expected.data() + i * elem, elem) != 0) {
            if (wrong++ == 0) first = i;
          }
        FAIL("rank " + std::to_string(r) + " " + c.name + " round " + std::to_string(round) + ": " +
             std::to_string(wrong) + " wrong elements, first at " + std::to_string(first));
      }
    }
  }
}

// 1 element, 1000 elements, 3 MB and 9 MB (3 and 9 partitions of 1 MB).
const std::vector<uint64_t> kSizes = {1, 1000, 3 * kMB, 9 * kMB};

TEST(PushPullTwoWorkersAnyOrder) {
  const auto t0 = Clock::now();
  std::vector<Case> cases = MakeCases("two", kSizes);
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  RunCases(engines, cases, 0);
  // Round 1 of the same names, with different values: matched by round, not mixed up.
  RunCases(engines, cases, 1);
  // One worker much later than the other: everything it receives first is held as early frames.
  RunCases(engines, cases, 2, /*late_rank=*/1);
  engines.clear();
  std::printf("two workers: %.2f s\n", SecondsSince(t0));
}

TEST(PushPullThreeWorkersAnyOrder) {
  const auto t0 = Clock::now();
  std::vector<Case> cases = MakeCases("three", kSizes);
  auto engines = StartCluster(ClusterOptions(3));
  if (!engines[0] || !engines[1] || !engines[2]) return;
  RunCases(engines, cases, 0);
  RunCases(engines, cases, 1, /*late_rank=*/0);
  engines.clear();
  std::printf("three workers: %.2f s\n", SecondsSince(t0));
}

TEST(ConcurrentRoundsOfOneName) {
  // Three rounds of one name in flight at once; the two engines submit them from different threads.
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  constexpr int kRounds = 3;
  const uint64_t n = 300000;  // 1.2 MB: 2 partitions
  std::vector<std::vector<float>> in(2 * kRounds, std::vector<float>(n)), out(2 * kRounds, std::vector<float>(n));
  for (int r = 0; r < 2; ++r)
    for (int k = 0; k < kRounds; ++k)
      for (uint64_t i = 0; i < n; ++i) in[r * kRounds + k][i] = static_cast<float>((i % 100) * (k + 1) + r);
  std::vector<std::unique_ptr<Pending>> pending(2 * kRounds);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      for (int k = 0; k < kRounds; ++k)
        pending[r * kRounds + k] = PushPull(engines[r].get(), "grad", DataType::kFloat32, {static_cast<int64_t>(n)},
                                            in[r * kRounds + k].data(), out[r * kRounds + k].data(), 4 * n);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r)
    for (int k = 0; k < kRounds; ++k) {
      const Status s = AWAIT(*pending[r * kRounds + k]);
      EXPECT_TRUE(s.ok());
      uint64_t wrong = 0;
      for (uint64_t i = 0; i < n; ++i) wrong += out[r * kRounds + k][i] != static_cast<float>((i % 100) * (k + 1) * 2 + 1);
      EXPECT_EQ(wrong, 0u);
    }
}

TEST(EmptyAndScalarTensors) {
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  float in0 = 1.5f, in1 = 2.25f, out0 = 0, out1 = 0;
  auto p0 = PushPull(engines[0].get(), "scalar", DataType::kFloat32, {}, &in0, &out0, 4);
  auto p1 = PushPull(engines[1].get(), "scalar", DataType::kFloat32, {}, &in1, &out1, 4);
  auto e0 = PushPull(engines[0].get(), "empty", DataType::kFloat32, {0, 3}, nullptr, nullptr, 0);
  auto e1 = PushPull(engines[1].get(), "empty", DataType::kFloat32, {0, 3}, nullptr, nullptr, 0);
  EXPECT_TRUE(AWAIT(*p0).ok());
  EXPECT_TRUE(AWAIT(*p1).ok());
  EXPECT_EQ(out0, 3.75f);
  EXPECT_EQ(out1, 3.75f);
  EXPECT_TRUE(AWAIT(*e0).ok());
  EXPECT_TRUE(AWAIT(*e1).ok());
}

TEST(ShapeMismatchFailsOnBothWorkers) {
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  // Same byte size, different shapes.
  std::vector<float> a(20, 1.0f), b(20, 2.0f), oa(20), ob(20);
  auto p0 = PushPull(engines[0].get(), "dense/kernel", DataType::kFloat32, {4, 5}, a.data(), oa.data(), 80);
  auto p1 = PushPull(engines[1].get(), "dense/kernel", DataType::kFloat32, {5, 4}, b.data(), ob.data(), 80);
  for (auto* p : {p0.get(), p1.get()}) {
    const Status s = AWAIT(*p);
    EXPECT_TRUE(s.code() == Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "'dense/kernel'"));
    EXPECT_TRUE(Contains(s.message(), "[4, 5]") && Contains(s.message(), "[5, 4]"));
    std::printf("mismatch: %s\n", s.message().c_str());
  }
  // Different sizes (and several partitions on one side): still a clean failure on both.
  std::vector<float> c(3 * kMB / 4, 1.0f), oc(c.size()), d(1000, 1.0f), od(1000);
  auto q0 = PushPull(engines[0].get(), "conv/kernel", DataType::kFloat32, {static_cast<int64_t>(c.size())}, c.data(),
                     oc.data(), 4 * c.size());
  auto q1 = PushPull(engines[1].get(), "conv/kernel", DataType::kFloat32, {1000}, d.data(), od.data(), 4000);
  for (auto* p : {q0.get(), q1.get()}) {
    const Status s = AWAIT(*p);
    EXPECT_TRUE(s.code() == Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "'conv/kernel'"));
    EXPECT_TRUE(Contains(s.message(), "[786432]") && Contains(s.message(), "[1000]"));
  }
  // A dtype mismatch names both dtypes.
  std::vector<int64_t> e(4, 1), oe(4);
  std::vector<double> f(4, 1.0), of(4);
  auto r0 = PushPull(engines[0].get(), "step", DataType::kInt64, {4}, e.data(), oe.data(), 32);
  auto r1 = PushPull(engines[1].get(), "step", DataType::kFloat64, {4}, f.data(), of.data(), 32);
  for (auto* p : {r0.get(), r1.get()}) {
    const Status s = AWAIT(*p);
    EXPECT_TRUE(s.code() == Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "int64") && Contains(s.message(), "float64"));
  }
  // The engines still work afterwards.
  float x = 1, y = 2, ox = 0, oy = 0;
  auto s0 = PushPull(engines[0].get(), "after", DataType::kFloat32, {1}, &x, &ox, 4);
  auto s1 = PushPull(engines[1].get(), "after", DataType::kFloat32, {1}, &y, &oy, 4);
  EXPECT_TRUE(AWAIT(*s0).ok());
  EXPECT_TRUE(AWAIT(*s1).ok());
  EXPECT_EQ(ox, 3.0f);
  EXPECT_EQ(oy, 3.0f);
}

TEST(DeadPeerFailsPendingOpsWithUnavailable) {
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  // A large op (some partitions pushed to rank 1, held there as early frames) and a small one.
  std::vector<float> big(9 * kMB / 4, 1.0f), big_out(big.size());
  float small = 1, small_out = 0;
  auto p_big = PushPull(engines[0].get(), "orphan/big", DataType::kFloat32, {static_cast<int64_t>(big.size())},
                        big.data(), big_out.data(), 4 * big.size());
  auto p_small = PushPull(engines[0].get(), "orphan/small", DataType::kFloat32, {1}, &small, &small_out, 4);
  // Rank 1 has the partitions once its engine received bytes (it holds them as early frames).
  for (int i = 0; i < 2000 && Contains(engines[1]->StatsJson(), "\"bytes_received\": 0,"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(!Contains(engines[1]->StatsJson(), "\"bytes_received\": 0,"));
  EXPECT_TRUE(p_big->future.wait_for(std::chrono::seconds(0)) == std::future_status::timeout);
  const auto killed = Clock::now();
  engines[1]->StopWithoutNotice();  // rank 1 dies
  // Noticed from the closed connection, not from the operation timeout (20 s): any bound below it
  // proves that; a tighter one would only measure how loaded the machine is.
  for (auto* p : {p_big.get(), p_small.get()}) {
    const Status s = AWAIT(*p, 10.0);
    EXPECT_TRUE(s.code() == Code::kUnavailable);
    EXPECT_TRUE(Contains(s.message(), "lost the connection to rank 1"));
  }
  const double waited = SecondsSince(killed);
  std::printf("dead peer noticed after %.3f s\n", waited);
  EXPECT_TRUE(waited < 10.0);
  // Later requests fail at once, with the same reason.
  float z = 0, oz = 0;
  auto p_after = PushPull(engines[0].get(), "after", DataType::kFloat32, {1}, &z, &oz, 4);
  const Status s = AWAIT(*p_after, 10.0);
  EXPECT_TRUE(s.code() == Code::kUnavailable && Contains(s.message(), "rank 1"));
}

// Small tensors go by exchange (small_allreduce.h): the same bits on every worker, for terms
// whose float32 sum depends on the order of the additions, at powers of two and not.
TEST(SmallPushPullsGiveTheSameBitsOnEveryWorker) {
  static const float kTerms[] = {1e8f, 1.0f, -1e8f, 3.0f, 0.1f};
  for (int n : {3, 5, 8}) {
    std::vector<EngineOptions> options = ClusterOptions(n);
    for (EngineOptions& o : options) o.small_allreduce = EngineOptions::kSmallAllreduceAlways;  // N = 3 too
    auto engines = StartCluster(options);
    bool all = true;
    for (auto& e : engines) all = all && e != nullptr;
    if (!all) return;
    for (int round = 0; round < 2; ++round) {
      std::vector<std::vector<float>> in(n, std::vector<float>(61)), out(n, std::vector<float>(61, -1.0f));
      std::vector<std::unique_ptr<Pending>> pending;
      for (int r = 0; r < n; ++r) {
        for (size_t i = 0; i < in[r].size(); ++i) in[r][i] = kTerms[(i * 3 + static_cast<size_t>(r) * 2) % 5];
        pending.push_back(PushPull(engines[r].get(), "metrics/loss", DataType::kFloat32, {61}, in[r].data(),
                                   out[r].data(), 4 * 61, false, kControlPriority));
      }
      for (int r = 0; r < n; ++r) {
        EXPECT_TRUE(AWAIT(*pending[r]).ok());
        EXPECT_TRUE(std::memcmp(out[r].data(), out[0].data(), 4 * 61) == 0);
      }
    }
  }
}

// A worker killed while the others are inside the exchange: every survivor fails naming it and
// the tensor, from the lost connection (well before the 20 s timeout).
TEST(ADeadPeerMidExchangeIsNamedByEverySurvivor) {
  const int n = 4;
  std::vector<EngineOptions> options = ClusterOptions(n);
  for (EngineOptions& o : options) o.small_allreduce = EngineOptions::kSmallAllreduceAuto;
  auto engines = StartCluster(options);
  for (auto& e : engines)
    if (!e) return;
  std::vector<float> in(n, 1.0f), out(n, 0.0f);
  std::vector<std::unique_ptr<Pending>> pending;
  for (int r = 0; r < n - 1; ++r)  // rank 3 never takes part
    pending.push_back(
        PushPull(engines[r].get(), "flags/finite", DataType::kFloat32, {1}, &in[r], &out[r], 4, false, kControlPriority));
  // Ranks 0 and 1 exchanged stage 0 (rank 0 heard from rank 1) and now wait for ranks 2 and 3.
  for (int i = 0; i < 2000 && Contains(engines[0]->StatsJson(), "\"bytes_received\": 0,"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_TRUE(!Contains(engines[0]->StatsJson(), "\"bytes_received\": 0,"));
  const auto killed = Clock::now();
  engines[3]->StopWithoutNotice();
  for (auto& p : pending) {
    const Status s = AWAIT(*p, 10.0);
    std::printf("survivor: %s\n", s.message().c_str());
    EXPECT_TRUE(s.code() == Code::kUnavailable);
    EXPECT_TRUE(Contains(s.message(), "'flags/finite'") && Contains(s.message(), "rank 3"));
  }
  EXPECT_TRUE(SecondsSince(killed) < 10.0);
}

// With every tensor of a job exchanged, a worker still measures its link: each stage whose
// partner answered after this worker sent is a transfer for the bandwidth monitor (as a push and
// its sum are). Rank 0 owns the tensor on the owner path (no push of its own there either), so
// without that it would never get a sample (schedule="auto" never decided). Rank 1 submits a
// little later, so each stage of rank 0 lasts at least that long; rounds go on until the first
// sample (bounded: the estimate must come).
TEST(ExchangedControlCollectivesMeasureTheLink) {
  std::vector<EngineOptions> options = ClusterOptions(2);
  for (EngineOptions& o : options) o.small_allreduce = EngineOptions::kSmallAllreduceAuto;
  auto engines = StartCluster(options);
  if (!engines[0] || !engines[1]) return;
  std::string name;
  for (int i = 0; name.empty(); ++i) {
    const std::string candidate = "metrics/m" + std::to_string(i);
    if (MakePartitions(candidate, 4, 4, 2, kRuntimePartitionBytes)[0].owner == 0) name = candidate;
  }
  OpRequest probe;
  probe.bytes = 4;
  probe.priority = kControlPriority;
  EXPECT_TRUE(ExchangesThis(probe, 2, options[0]));
  const float one = 1.0f;
  float out0 = 0, out1 = 0;
  int rounds = 0;
  for (; rounds < 400 && Contains(engines[0]->SchedulerStateJson(), "\"bandwidth_samples\": 0,"); ++rounds) {
    auto a = PushPull(engines[0].get(), name, DataType::kFloat32, {1}, &one, &out0, 4, false, kControlPriority);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    auto b = PushPull(engines[1].get(), name, DataType::kFloat32, {1}, &one, &out1, 4, false, kControlPriority);
    EXPECT_TRUE(AWAIT(*a).ok() && AWAIT(*b).ok());
    EXPECT_TRUE(out0 == 2.0f && out1 == 2.0f);
  }
  std::printf("rank 0's first bandwidth sample after %d exchanges\n", rounds);
  EXPECT_TRUE(!Contains(engines[0]->SchedulerStateJson(), "\"bandwidth_samples\": 0,"));
}

TEST(OpWithoutPeerSubmissionTimesOut) {
  auto engines = StartCluster(ClusterOptions(2, /*timeout_s=*/0.5));
  if (!engines[0] || !engines[1]) return;
  std::vector<float> in(1000, 1.0f), out(1000);
  const auto t0 = Clock::now();
  auto p = PushPull(engines[0].get(), "lonely", DataType::kFloat32, {1000}, in.data(), out.data(), 4000);
  const Status s = AWAIT(*p, 20.0);
  const double elapsed = SecondsSince(t0);
  std::printf("timeout after %.3f s: %s\n", elapsed, s.message().c_str());
  EXPECT_TRUE(s.code() == Code::kDeadlineExceeded);
  EXPECT_TRUE(Contains(s.message(), "'lonely'") && Contains(s.message(), "rank(s) 1"));
  // Never before timeout_s. After it, the verdict waits for the peers' answers to a probe (bounded
  // by a grace of at least 1 s): the upper bound only tells 0.5 s from the default 60 s, with room
  // for a machine many times slower than this one.
  EXPECT_TRUE(elapsed >= 0.45 && elapsed < 15.0);
  // The engine is still usable for operations both workers submit.
  float a = 1, b = 2, oa = 0, ob = 0;
  auto q0 = PushPull(engines[0].get(), "together", DataType::kFloat32, {1}, &a, &oa, 4);
  auto q1 = PushPull(engines[1].get(), "together", DataType::kFloat32, {1}, &b, &ob, 4);
  EXPECT_TRUE(AWAIT(*q0).ok());
  EXPECT_TRUE(AWAIT(*q1).ok());
  EXPECT_EQ(oa, 3.0f);
}

size_t Count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos; at = haystack.find(needle, at + 1)) ++n;
  return n;
}

std::unique_ptr<Pending> Broadcast(Engine* e, const std::string& name, const std::vector<int64_t>& shape,
                                   const float* input, float* output, int root) {
  auto p = std::make_unique<Pending>();
  OpRequest r;
  r.kind = OpKind::kBroadcast;
  r.name = name;
  r.dtype = DataType::kFloat32;
  r.shape = shape;
  r.input = input;
  r.output = output;
  r.bytes = 4;
  for (int64_t d : shape) r.bytes *= static_cast<uint64_t>(d);
  r.root_rank = root;
  auto promise = p->promise;
  r.done = [promise](const Status& s, const GatherResult*) { promise->set_value(s); };
  e->Submit(std::move(r));
  return p;
}

TEST(AStallNamesOnlyTheRanksBehindAndEverySurvivorSaysTheSame) {
  // Rank 1 never submits; ranks 0 and 2 do. Each partition has an owner (0, 1 or 2), so rank 0
  // also waits for rank 2's sums, which wait for rank 1: only rank 1 is behind.
  auto engines = StartCluster(ClusterOptions(3, /*timeout_s=*/0.5));
  if (!engines[0] || !engines[1] || !engines[2]) return;
  std::vector<float> in0(3 * kMB / 4 * 3, 1.0f), in2(in0.size(), 2.0f), out0(in0.size()), out2(in0.size());
  const int64_t elements = static_cast<int64_t>(in0.size());
  auto p0 = PushPull(engines[0].get(), "stalled/grad", DataType::kFloat32, {elements}, in0.data(), out0.data(), 4 * in0.size());
  auto p2 = PushPull(engines[2].get(), "stalled/grad", DataType::kFloat32, {elements}, in2.data(), out2.data(), 4 * in2.size());
  const Status s0 = AWAIT(*p0, 10.0), s2 = AWAIT(*p2, 10.0);
  std::printf("rank 0: %s\nrank 2: %s\n", s0.message().c_str(), s2.message().c_str());
  for (const Status* s : {&s0, &s2}) {
    EXPECT_TRUE(s->code() == Code::kDeadlineExceeded);
    EXPECT_TRUE(Contains(s->message(), "rank(s) 1 did not reach it"));
    EXPECT_EQ(Count(s->message(), "rank(s)"), 1u);  // nobody else is named
  }
  EXPECT_EQ(s0.message(), s2.message());
  // The rank that was behind hears the verdict too: when it gets there, it fails the same way.
  auto p1 = PushPull(engines[1].get(), "stalled/grad", DataType::kFloat32, {elements}, in0.data(), out0.data(), 4 * in0.size());
  const Status s1 = AWAIT(*p1, 10.0);
  EXPECT_TRUE(s1.code() == Code::kDeadlineExceeded && s1.message() == s0.message());
  // Everyone carries on with the next operation.
  float a = 1, oa = 0, b = 2, ob = 0, c = 3, oc = 0;
  auto q0 = PushPull(engines[0].get(), "after", DataType::kFloat32, {1}, &a, &oa, 4);
  auto q1 = PushPull(engines[1].get(), "after", DataType::kFloat32, {1}, &b, &ob, 4);
  auto q2 = PushPull(engines[2].get(), "after", DataType::kFloat32, {1}, &c, &oc, 4);
  EXPECT_TRUE(AWAIT(*q0).ok() && AWAIT(*q1).ok() && AWAIT(*q2).ok());
  EXPECT_EQ(oa, 6.0f);
}

TEST(ABroadcastRootHearsThePeersConflictWhenThatPeerGoesAway) {
  // The root finishes a broadcast once its data is sent; the receiver finds the shapes differ,
  // fails, and (its program raising) exits. The root's next operation must say why.
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  std::vector<float> w0(2, 1.0f), o0(2), w1(3, 0.0f), o1(3);
  auto b0 = Broadcast(engines[0].get(), "init/kernel", {2}, w0.data(), o0.data(), 0);
  auto b1 = Broadcast(engines[1].get(), "init/kernel", {3}, w1.data(), o1.data(), 0);
  const Status s1 = AWAIT(*b1);
  EXPECT_TRUE(s1.code() == Code::kInvalidArgument && Contains(s1.message(), "[2]") && Contains(s1.message(), "[3]"));
  EXPECT_TRUE(AWAIT(*b0).ok());
  float x = 1, ox = 0;
  auto next = PushPull(engines[0].get(), "next", DataType::kFloat32, {1}, &x, &ox, 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the error notice arrives first
  engines[1].reset();
  const Status s0 = AWAIT(*next, 5.0);
  std::printf("root: %s\n", s0.message().c_str());
  EXPECT_TRUE(s0.code() == Code::kUnavailable && Contains(s0.message(), "rank 1 (") &&
              Contains(s0.message(), "shut down its prophet_tf runtime"));
  EXPECT_TRUE(Contains(s0.message(), "[2]") && Contains(s0.message(), "[3]") && Contains(s0.message(), "init/kernel"));
  // Every message names its operation once: one that was pending, and one submitted afterwards.
  EXPECT_EQ(Count(s0.message(), "'next'"), 1u);
  auto later = PushPull(engines[0].get(), "later", DataType::kFloat32, {1}, &x, &ox, 4);
  const Status s_later = AWAIT(*later, 5.0);
  EXPECT_TRUE(s_later.code() == Code::kUnavailable && Count(s_later.message(), "'later'") == 1);
  EXPECT_EQ(Count(s_later.message(), "'next'"), 0u);
}

TEST(ASurvivorThatSeesAnotherSurvivorLeaveFirstNamesTheLostRank) {
  // Rank 1 goes away; rank 0 sees it, fails and leaves. Rank 2 reads rank 0's connection first
  // (its engine thread is held inside a callback while both happen, as a busy worker would be),
  // so rank 0's close reaches it before rank 1's: it must still name rank 1, as rank 0 does.
  auto engines = StartCluster(ClusterOptions(3));
  if (!engines[0] || !engines[1] || !engines[2]) return;
  std::promise<void> held, release;
  std::shared_future<void> released = release.get_future().share();
  std::vector<float> w(4, 1.0f), o0(4), o1(4), o2(4);
  OpRequest gate;
  gate.kind = OpKind::kBroadcast;
  gate.name = "gate";
  gate.shape = {4};
  gate.input = w.data();
  gate.output = o2.data();
  gate.bytes = 16;
  // Rank 2 completes it on a frame from rank 0, so it goes on reading rank 0's connection after.
  gate.done = [&held, released](const Status&, const GatherResult*) {
    held.set_value();
    released.wait_for(std::chrono::seconds(60));  // bounded: a failing test must not hang
  };
  engines[2]->Submit(std::move(gate));
  engines[2]->SchedulerStateJson();  // answered after the gate has started: its frame is not early
  auto b0 = Broadcast(engines[0].get(), "gate", {4}, w.data(), o0.data(), 0);
  auto b1 = Broadcast(engines[1].get(), "gate", {4}, w.data(), o1.data(), 0);
  if (held.get_future().wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    FAIL("rank 2 never completed the gate broadcast");
    release.set_value();
    return;
  }
  EXPECT_TRUE(AWAIT(*b0).ok() && AWAIT(*b1).ok());
  float x = 1, ox = 0;
  auto pending0 = PushPull(engines[0].get(), "x", DataType::kFloat32, {1}, &x, &ox, 4);
  engines[1]->StopWithoutNotice();  // rank 1 dies
  const Status s0 = AWAIT(*pending0, 10.0);
  EXPECT_TRUE(s0.code() == Code::kUnavailable && Contains(s0.message(), "rank 1 ("));
  engines[0].reset();  // rank 0 leaves after its failure, as its program would
  release.set_value();
  float y = 1, oy = 0;
  auto after = PushPull(engines[2].get(), "after", DataType::kFloat32, {1}, &y, &oy, 4);
  const Status s2 = AWAIT(*after, 10.0);
  std::printf("rank 0: %s\nrank 2: %s\n", s0.message().c_str(), s2.message().c_str());
  EXPECT_TRUE(s2.code() == Code::kUnavailable && Contains(s2.message(), "lost the connection to rank 1 ("));
  EXPECT_TRUE(!Contains(s2.message(), "lost the connection to rank 0"));
}

TEST(ALateReceiverGetsABroadcastWhoseRootSentEverythingAndLeft) {
  // The root's broadcast ends once its data is sent; the root's program then exits. A receiver
  // that starts the broadcast only afterwards holds every partition already (early frames): it
  // gets the data. What the frames here cannot complete fails, naming the root.
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  std::vector<float> weights(3 * kMB / 4 + 5);  // four partitions of at most 1 MiB
  for (size_t i = 0; i < weights.size(); ++i) weights[i] = static_cast<float>(i % 1009) - 7.5f;
  const std::vector<int64_t> shape = {static_cast<int64_t>(weights.size())};
  std::vector<float> root_out(weights.size()), late_out(weights.size(), 0.0f);
  auto sent = Broadcast(engines[0].get(), "init/weights", shape, weights.data(), root_out.data(), 0);
  EXPECT_TRUE(AWAIT(*sent).ok());
  engines[0].reset();  // the root leaves
  // Rank 1 knows once its next operation fails for the lost root.
  float x = 1, ox = 0;
  auto probe = PushPull(engines[1].get(), "probe", DataType::kFloat32, {1}, &x, &ox, 4);
  const Status lost = AWAIT(*probe, 10.0);
  EXPECT_TRUE(lost.code() == Code::kUnavailable && Contains(lost.message(), "rank 0 (") &&
              Contains(lost.message(), "shut down its prophet_tf runtime before taking part"));
  auto late = Broadcast(engines[1].get(), "init/weights", shape, weights.data(), late_out.data(), 0);
  const Status got = AWAIT(*late, 10.0);
  if (!got.ok()) FAIL("the late receiver failed: " + got.message());
  EXPECT_TRUE(late_out == weights);
  // A broadcast the root never sent cannot complete.
  std::vector<float> never(4);
  auto missing = Broadcast(engines[1].get(), "init/bias", {4}, never.data(), never.data(), 0);
  const Status s = AWAIT(*missing, 10.0);
  EXPECT_TRUE(s.code() == Code::kUnavailable && Contains(s.message(), "'init/bias'") &&
              Contains(s.message(), "rank 0 (") && Contains(s.message(), "shut down its prophet_tf runtime"));
}

TEST(AWorkerThatFinishesFirstDoesNotFailTheOthers) {
  // A worker completes its last push_pull and its program ends while the others still receive
  // results from the partitions' owners: their operations must complete, not fail on its EOF.
  // (Partitions spread over every worker, so each waits for several owners.)
  constexpr int kWorkers = 4;
  const uint64_t elements = 6 * kMB / 4;
  int left_early = 0;
  // At least 8 trials, and more (up to 40) until the race has happened: on a loaded machine the
  // poller below may only look once every worker is done.
  for (int trial = 0; trial < 40 && (trial < 8 || left_early == 0); ++trial) {
    // Before the engines: they must outlive nothing the operations use.
    std::vector<std::vector<float>> in(kWorkers, std::vector<float>(elements, 1.0f));
    std::vector<std::vector<float>> out(kWorkers, std::vector<float>(elements, 0.0f));
    auto engines = StartCluster(ClusterOptions(kWorkers));
    for (auto& e : engines)
      if (!e) return;
    std::vector<std::unique_ptr<Pending>> pending;
    for (int r = 0; r < kWorkers; ++r)
      pending.push_back(PushPull(engines[r].get(), "exit/last", DataType::kFloat32, {static_cast<int64_t>(elements)},
                                 in[r].data(), out[r].data(), 4 * elements));
    // Whichever worker completes first leaves at once, as a program whose last op returned.
    int first = -1;
    const auto began = Clock::now();
    while (first < 0 && SecondsSince(began) < 20.0)
      for (int r = 0; r < kWorkers && first < 0; ++r)
        if (pending[r]->future.wait_for(std::chrono::seconds(0)) == std::future_status::ready) first = r;
    if (first < 0) {
      FAIL("no worker completed 'exit/last'");
      return;
    }
    for (int r = 0; r < kWorkers; ++r)
      if (r != first && pending[r]->future.wait_for(std::chrono::seconds(0)) != std::future_status::ready) ++left_early;
    engines[first].reset();
    for (int r = 0; r < kWorkers; ++r) {
      const Status s = r == first ? pending[r]->future.get() : AWAIT(*pending[r], 10.0);
      if (!s.ok()) FAIL("trial " + std::to_string(trial) + ": rank " + std::to_string(r) + " failed after rank " +
                        std::to_string(first) + " left: " + s.message());
      EXPECT_TRUE(s.ok() && out[r].front() == 4.0f && out[r].back() == 4.0f);
    }
  }
  // The race this test is about happened (a worker left while others were still receiving).
  std::printf("%d times a worker left while another was still receiving\n", left_early);
  EXPECT_TRUE(left_early > 0);
}

TEST(AWorkerThatLeavesBeforeAnOperationFailsItAtOnceNamingIt) {
  // Programs that run different collectives: rank 2 ends while the others wait in one it never
  // submits. They fail from its departure notice, not after timeout_s (60 s here), and say so.
  auto engines = StartCluster(ClusterOptions(3, 60.0));
  if (!engines[0] || !engines[1] || !engines[2]) return;
  float x[2] = {1, 1}, o[2] = {0, 0};
  auto p0 = PushPull(engines[0].get(), "extra_step", DataType::kFloat32, {1}, &x[0], &o[0], 4);
  auto p1 = PushPull(engines[1].get(), "extra_step", DataType::kFloat32, {1}, &x[1], &o[1], 4);
  const auto left = Clock::now();
  engines[2].reset();
  for (auto* p : {p0.get(), p1.get()}) {
    const Status s = AWAIT(*p, 20.0);
    std::printf("%s\n", s.message().c_str());
    EXPECT_TRUE(s.code() == Code::kUnavailable && Contains(s.message(), "'extra_step'") &&
                Contains(s.message(), "rank 2 (") && Contains(s.message(), "different collectives"));
    EXPECT_TRUE(!Contains(s.message(), "lost the connection"));
  }
  EXPECT_TRUE(SecondsSince(left) < 20.0);
  // And so do operations submitted afterwards (each worker may wait only for the partition's
  // owner: the owner's failure reaches the others).
  auto later0 = PushPull(engines[0].get(), "later", DataType::kFloat32, {1}, &x[0], &o[0], 4);
  auto later1 = PushPull(engines[1].get(), "later", DataType::kFloat32, {1}, &x[1], &o[1], 4);
  for (auto* p : {later0.get(), later1.get()}) {
    const Status s = AWAIT(*p, 10.0);
    EXPECT_TRUE(s.code() == Code::kUnavailable && Contains(s.message(), "'later'") && Contains(s.message(), "rank 2 ("));
  }
}

// ---- compressed push_pull and allgather (codec.h) ------------------------------------------

// Gradient-like float32 values over a wide range of magnitudes (2^-30 .. 2^20, some beyond fp16's
// 65504), different on every rank.
std::vector<float> WideValues(uint64_t n, int rank, uint64_t seed) {
  std::mt19937_64 rng(seed * 1000 + static_cast<uint64_t>(rank));
  std::vector<float> v(n);
  for (float& x : v) {
    const double mantissa = static_cast<double>(rng() % 1000001) / 1e6 + 0.5;
    x = static_cast<float>((rng() % 2 ? -1 : 1) * std::ldexp(mantissa, static_cast<int>(rng() % 51) - 30));
  }
  if (n > 10) v[3] = rank ? 1e6f : -3e5f, v[7] = 1e-8f;
  return v;
}

// Two workers: each partition's owner adds the decoded peer contribution to its own float32
// values, averages if asked, encodes the sum, and everyone holds its decoding. With one
// contribution per owner the order of additions is fixed, so the expected bits are known.
TEST(CompressedPushPullTwoWorkersGivesTheOwnersSumAsItTravelled) {
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  int round = 0;
  for (Encoding e : {Encoding::kFloat16, Encoding::kBFloat16}) {
    const PayloadCodec codec(e, DataType::kFloat32);
    for (uint64_t n : {uint64_t{1000}, 3 * kMB / 4 + 3}) {
      for (bool average : {false, true}) {
        for (int late : {-1, 1}) {  // rank 1 late: its peer's frames wait as early frames
          const std::string name = std::string("grad/") + EncodingName(e) + "/" + std::to_string(n);
          std::vector<std::vector<float>> in = {WideValues(n, 0, ++round), WideValues(n, 1, round)};
          std::vector<float> expected(n);
          for (const Partition& part : MakePartitions(name, 4 * n, 4, 2, kMB)) {
            const size_t first = part.offset / 4, count = part.bytes / 4;
            const std::vector<float>& mine = in[part.owner];
            const std::vector<float>& theirs = in[1 - part.owner];
            std::vector<uint16_t> codes(count);
            std::vector<float> sum(count);
            const int k = codec.Encode(theirs.data() + first, part.bytes, codes.data());
            codec.DecodeAddTo(codes.data(), 2 * count, k, mine.data() + first, sum.data());
            if (average)
              for (float& x : sum) x /= 2.0f;
            const int kr = codec.Encode(sum.data(), part.bytes, codes.data());
            codec.Decode(codes.data(), 2 * count, kr, expected.data() + first);
          }
          const bool in_place = n == 1000;
          std::vector<std::vector<float>> out(2, std::vector<float>(n, -7.0f));
          std::vector<std::unique_ptr<Pending>> pending(2);
          std::vector<std::thread> threads;
          for (int r = 0; r < 2; ++r)
            threads.emplace_back([&, r] {
              if (r == late) std::this_thread::sleep_for(std::chrono::milliseconds(300));
              pending[r] = PushPull(engines[r].get(), name, DataType::kFloat32, {static_cast<int64_t>(n)}, in[r].data(),
                                    in_place ? in[r].data() : out[r].data(), 4 * n, average, 0, e);
            });
          for (auto& t : threads) t.join();
          for (int r = 0; r < 2; ++r) {
            const Status s = AWAIT(*pending[r]);
            if (!s.ok()) FAIL(name + ": " + s.message());
            const float* got = in_place ? in[r].data() : out[r].data();
            uint64_t wrong = 0;
            for (uint64_t i = 0; i < n; ++i) wrong += std::memcmp(got + i, &expected[i], 4) != 0;
            if (wrong) FAIL(name + " rank " + std::to_string(r) + ": " + std::to_string(wrong) + " elements differ");
          }
        }
      }
    }
  }
}

// Three workers: the owner adds contributions in arrival order (not predictable), but every worker
// holds the same bits, 16-bit values (scaled), within the bound of docs/design.md.
TEST(CompressedPushPullThreeWorkersIsTheSameEverywhereAndWithinTheBound) {
  auto engines = StartCluster(ClusterOptions(3));
  if (!engines[0] || !engines[1] || !engines[2]) return;
  const uint64_t n = 5 * kMB / 4 + 1;  // 6 partitions of at most 1 MB
  for (Encoding e : {Encoding::kFloat16, Encoding::kBFloat16}) {
    const double u = std::ldexp(1.0, e == Encoding::kFloat16 ? -11 : -8);
    const double gamma = 2 * std::ldexp(1.0, -24) / (1 - 2 * std::ldexp(1.0, -24));  // N - 1 = 2 float32 additions
    std::vector<std::vector<float>> in, out(3, std::vector<float>(n));
    for (int r = 0; r < 3; ++r) in.push_back(WideValues(n, r, 77 + static_cast<int>(e)));
    std::vector<std::unique_ptr<Pending>> pending(3);
    for (int r = 2; r >= 0; --r)
      pending[r] = PushPull(engines[r].get(), std::string("wide/") + EncodingName(e), DataType::kFloat32,
                            {static_cast<int64_t>(n)}, in[r].data(), out[r].data(), 4 * n, false, 0, e);
    bool ok = true;
    for (int r = 0; r < 3; ++r) ok = AWAIT(*pending[r]).ok() && ok;
    EXPECT_TRUE(ok);
    if (!ok) continue;
    EXPECT_TRUE(out[0] == out[1] && out[1] == out[2]);
    // The subnormal terms: half the spacing of fp16 subnormals at each block's scale is at most
    // 2^-39 times the block's largest magnitude (2^-134 for bf16).
    double largest_in = 0, largest_sum = 0;
    for (uint64_t i = 0; i < n; ++i) {
      double a = 0;
      for (int r = 0; r < 3; ++r) a += std::fabs(in[r][i]);
      largest_in = std::max(largest_in, a);
      largest_sum = std::max(largest_sum, std::fabs(static_cast<double>(out[0][i])));
    }
    const double eta = e == Encoding::kFloat16 ? std::ldexp(largest_in, -39) : std::ldexp(1.0, -134);
    const double eta_result = e == Encoding::kFloat16 ? std::ldexp(2 * largest_sum, -39) : eta;
    uint64_t beyond = 0, rounded = 0, wide = 0;
    double worst = 0;  // the largest error as a fraction of its bound
    for (uint64_t i = 0; i < n; ++i) {
      double sum = 0, a = 0;
      for (int r = 0; r < 3; ++r) sum += in[r][i], a += std::fabs(in[r][i]);
      // E1: the contributions' rounding (at most two of three are rounded; counted for all) and
      // the owner's float32 additions; then the rounding of the sum.
      const double e1 = u * a + 3 * eta + gamma * ((1 + u) * a + 3 * eta);
      const double bound = e1 + u * (std::fabs(sum) + e1) + eta_result;
      const double err = std::fabs(static_cast<double>(out[0][i]) - sum);
      beyond += err > bound;
      rounded += err > 0;
      worst = std::max(worst, err / bound);
      uint32_t bits;
      std::memcpy(&bits, &out[0][i], 4);
      wide += (bits & (e == Encoding::kFloat16 ? 0x1fffu : 0xffffu)) != 0;  // more than 16 bits
    }
    std::printf("%s: %llu of %llu elements rounded, the largest error is %.2f of its bound\n", EncodingName(e),
                static_cast<unsigned long long>(rounded), static_cast<unsigned long long>(n), worst);
    EXPECT_EQ(beyond, 0u);
    EXPECT_TRUE(rounded > n / 2 && worst > 0.25);  // the bound is not vacuous
    EXPECT_EQ(wide, 0u);
  }
}

TEST(CompressionAppliesToFloat32OnlyAndMustMatch) {
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  // float64 and int64 travel as they are: exact sums.
  std::vector<double> d0 = {1.0 + 1e-12, -3.5}, d1 = {2.0, 1e-300}, od0(2), od1(2);
  std::vector<int64_t> i0 = {1ll << 60, 3}, i1 = {5, -4}, oi0(2), oi1(2);
  auto a0 = PushPull(engines[0].get(), "f64", DataType::kFloat64, {2}, d0.data(), od0.data(), 16, false, 0, Encoding::kFloat16);
  auto a1 = PushPull(engines[1].get(), "f64", DataType::kFloat64, {2}, d1.data(), od1.data(), 16, false, 0, Encoding::kFloat16);
  auto b0 = PushPull(engines[0].get(), "i64", DataType::kInt64, {2}, i0.data(), oi0.data(), 16, false, 0, Encoding::kBFloat16);
  auto b1 = PushPull(engines[1].get(), "i64", DataType::kInt64, {2}, i1.data(), oi1.data(), 16, false, 0, Encoding::kBFloat16);
  for (auto* p : {a0.get(), a1.get(), b0.get(), b1.get()}) EXPECT_TRUE(AWAIT(*p).ok());
  EXPECT_TRUE(od0 == od1 && od0[0] == d0[0] + d1[0] && od0[1] == d0[1] + d1[1]);
  EXPECT_TRUE(oi0 == oi1 && oi0[0] == (1ll << 60) + 5 && oi0[1] == -1);
  // One worker compresses, the other does not: both fail naming both sides; the engine goes on.
  std::vector<float> x(3000, 1.5f), ox(3000), y(3000, 2.0f), oy(3000);
  auto m0 = PushPull(engines[0].get(), "mixed", DataType::kFloat32, {3000}, x.data(), ox.data(), 12000, false, 0, Encoding::kFloat16);
  auto m1 = PushPull(engines[1].get(), "mixed", DataType::kFloat32, {3000}, y.data(), oy.data(), 12000);
  for (auto* p : {m0.get(), m1.get()}) {
    const Status s = AWAIT(*p);
    std::printf("mismatch: %s\n", s.message().c_str());
    EXPECT_TRUE(s.code() == Code::kInvalidArgument && Contains(s.message(), "'mixed'") &&
                Contains(s.message(), "uncompressed") && Contains(s.message(), "compressed to fp16"));
  }
  auto s0 = PushPull(engines[0].get(), "after", DataType::kFloat32, {3000}, x.data(), ox.data(), 12000, false, 0, Encoding::kBFloat16);
  auto s1 = PushPull(engines[1].get(), "after", DataType::kFloat32, {3000}, y.data(), oy.data(), 12000, false, 0, Encoding::kBFloat16);
  EXPECT_TRUE(AWAIT(*s0).ok() && AWAIT(*s1).ok());
  EXPECT_TRUE(ox[0] == 3.5f && ox == oy);
}

// Sparse gradients' values: every worker's tensor travels encoded, and every worker, the sender
// included, ends with the same decoded rows.
TEST(CompressedAllgatherIsTheSameEverywhere) {
  auto engines = StartCluster(ClusterOptions(3));
  if (!engines[0] || !engines[1] || !engines[2]) return;
  const PayloadCodec codec(Encoding::kFloat16, DataType::kFloat32);
  std::vector<std::vector<float>> in, gathered(3);
  std::vector<std::unique_ptr<Pending>> pending(3);
  for (int r = 0; r < 3; ++r) in.push_back(WideValues(8 * (r + 2), r, 5));
  for (int r = 0; r < 3; ++r) {
    pending[r] = std::make_unique<Pending>();
    OpRequest q;
    q.kind = OpKind::kAllgather;
    q.name = "embedding/values";
    q.dtype = DataType::kFloat32;
    q.shape = {r + 2, 8};
    q.input = in[r].data();
    q.bytes = 4 * in[r].size();
    q.compression = Encoding::kFloat16;
    auto promise = pending[r]->promise;
    std::vector<float>* out = &gathered[r];
    q.done = [promise, out](const Status& s, const GatherResult* g) {
      if (g != nullptr) {
        for (size_t k = 0; k < g->bytes.size(); ++k) {
          const size_t at = out->size();
          out->resize(at + g->bytes[k] / 4);
          g->CopyOut(k, reinterpret_cast<char*>(out->data() + at));
        }
      }
      promise->set_value(s);
    };
    engines[r]->Submit(std::move(q));
  }
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(AWAIT(*pending[r]).ok());
  EXPECT_TRUE(gathered[0] == gathered[1] && gathered[1] == gathered[2]);
  size_t at = 0;
  for (int r = 0; r < 3; ++r) {
    std::vector<uint16_t> codes(in[r].size());
    std::vector<float> travelled(in[r].size());
    codec.Decode(codes.data(), 2 * codes.size(), codec.Encode(in[r].data(), 4 * in[r].size(), codes.data()),
                 travelled.data());
    EXPECT_TRUE(std::equal(travelled.begin(), travelled.end(), gathered[0].begin() + static_cast<std::ptrdiff_t>(at)));
    EXPECT_TRUE(travelled != in[r]);  // rounded: it did travel in 16 bits
    at += in[r].size();
  }
  EXPECT_EQ(at, gathered[0].size());
}

// The bytes each lane sent, from StatsJson.
std::vector<uint64_t> LaneBytes(Engine& e) {
  const std::string stats = e.StatsJson();
  const size_t at = stats.find("\"lane_bytes_sent\": [");
  std::vector<uint64_t> out;
  if (at == std::string::npos) return out;
  std::stringstream list(stats.substr(at + 20, stats.find(']', at) - at - 20));
  std::string item;
  while (std::getline(list, item, ',')) out.push_back(std::stoull(item));
  return out;
}

// Lanes (io_threads): large push_pulls travel in slices, one per lane, the rest whole on the lane
// their name hashes to; the sums are the same exact bits, in any submission order, round after
// round, with a worker much later than the others, and every lane carries bytes.
TEST(LanesGiveExactSumsWithSlicesOnEveryLane) {
  for (const int lanes : {2, 3}) {
    std::vector<EngineOptions> options = ClusterOptions(3);
    for (EngineOptions& o : options) o.io_threads = lanes;
    // The MB sizes are sliced at 2 and 3 lanes; 2 MB + 12 bytes into slices that are not a
    // multiple of the partition size nor of each other.
    std::vector<Case> cases = MakeCases("lanes", {1, 1000, 2 * kMB + 12, 3 * kMB, 9 * kMB});
    auto engines = StartCluster(options);
    if (!engines[0] || !engines[1] || !engines[2]) return;
    RunCases(engines, cases, 0);
    RunCases(engines, cases, 1, /*late_rank=*/2);
    for (auto& e : engines) {
      const std::string stats = e->StatsJson();
      EXPECT_TRUE(Contains(stats, "\"io_threads\": " + std::to_string(lanes)));
      const size_t at = stats.find("\"lane_bytes_sent\": [");
      EXPECT_TRUE(at != std::string::npos);
      if (at == std::string::npos) continue;
      // Every lane sent at least a slice of the 9 MB tensors' pushes.
      const std::vector<uint64_t> sent = LaneBytes(*e);
      EXPECT_EQ(sent.size(), static_cast<size_t>(lanes));
      for (const uint64_t bytes : sent) EXPECT_TRUE(bytes > kMB);
    }
  }
}

// io_threads auto: one lane on one host (its workers share the cores); kAutoLanes connected over
// several hosts, of which one carries everything until every worker sets how many to use.
TEST(AutoLanesConnectOverSeveralHostsAndCarryWhatIsSet) {
  std::vector<EngineOptions> one_host = ClusterOptions(2);
  EXPECT_EQ(one_host[0].io_threads, kIoThreadsAuto);
  EXPECT_EQ(ResolveLanes(one_host[0]), 1);
  std::vector<EngineOptions> options = ClusterOptions(3);
  for (EngineOptions& o : options) o.hosts = {"a", "b", "c"};
  EXPECT_EQ(ResolveLanes(options[0]), kAutoLanes);
  auto engines = StartCluster(options);
  if (!engines[0] || !engines[1] || !engines[2]) return;
  EXPECT_EQ(engines[0]->active_lanes(), 1);
  std::vector<Case> cases = MakeCases("auto", {1000, 9 * kMB});
  RunCases(engines, cases, 0);
  std::vector<uint64_t> lanes = LaneBytes(*engines[0]);
  EXPECT_EQ(lanes.size(), static_cast<size_t>(kAutoLanes));
  if (lanes.size() == static_cast<size_t>(kAutoLanes)) {
    EXPECT_TRUE(lanes[0] > 9 * kMB);
    for (int l = 1; l < kAutoLanes; ++l) EXPECT_EQ(lanes[l], 0u);
  }
  const Status too_many = engines[0]->SetActiveLanes(kAutoLanes + 1);
  EXPECT_TRUE(!too_many.ok() && Contains(too_many.message(), "are connected"));
  for (auto& e : engines) EXPECT_TRUE(e->SetActiveLanes(3).ok());
  RunCases(engines, cases, 1, /*late_rank=*/1);
  lanes = LaneBytes(*engines[0]);
  if (lanes.size() == static_cast<size_t>(kAutoLanes)) {
    for (int l = 1; l < 3; ++l) EXPECT_TRUE(lanes[l] > kMB);
    for (int l = 3; l < kAutoLanes; ++l) EXPECT_EQ(lanes[l], 0u);
  }
  EXPECT_TRUE(Contains(engines[0]->StatsJson(), "\"io_threads\": 3, \"lanes\": " + std::to_string(kAutoLanes)));
}

// Fused buckets are dealt over the lanes (FusionByLane): with 3 lanes every lane forms buckets of
// its share, the sums are exact, and every lane carries bytes.
TEST(LanesFormFusedBucketsOfTheirShare) {
  std::vector<EngineOptions> options = ClusterOptions(3);
  for (EngineOptions& o : options) o.io_threads = 3;
  auto engines = StartCluster(options);
  if (!engines[0] || !engines[1] || !engines[2]) return;
  constexpr int kTensors = 24;
  constexpr int64_t kElements = 3000;  // 12 kB each: 2-3 per bucket of 32 kB
  std::vector<FusionDeclaration> declared;
  for (int t = 0; t < kTensors; ++t) {
    FusionDeclaration d;
    d.name = "grad/t" + std::to_string(t);
    d.shape = {kElements};
    d.bytes = 4 * kElements;
    d.priority = kTensors - t;
    declared.push_back(d);
  }
  for (auto& e : engines) {
    auto applied = std::make_shared<std::promise<Status>>();
    auto answer = applied->get_future();
    e->DeclareFusion("model", declared, 32 << 10, [applied](const Status& s) { applied->set_value(s); });
    EXPECT_TRUE(answer.wait_for(std::chrono::seconds(10)) == std::future_status::ready && answer.get().ok());
  }
  // The whole declaration is checked, not only each lane's share: a tensor named twice is refused
  // as one engine refuses it.
  std::vector<FusionDeclaration> twice = declared;
  twice.push_back(declared.back());
  auto refused = std::make_shared<std::promise<Status>>();
  auto refusal = refused->get_future();
  engines[0]->DeclareFusion("other", twice, 32 << 10, [refused](const Status& s) { refused->set_value(s); });
  const Status no = refusal.get();
  EXPECT_TRUE(no.code() == Code::kInvalidArgument && Contains(no.message(), "twice"));
  for (int round = 0; round < 3; ++round) {
    std::vector<std::vector<float>> in(3, std::vector<float>(kTensors * kElements)), out = in;
    std::vector<std::unique_ptr<Pending>> pending;
    for (int r = 0; r < 3; ++r) {
      for (size_t i = 0; i < in[r].size(); ++i) in[r][i] = static_cast<float>((i * 7 + r * 13 + round) % 1000);
      for (int t = kTensors - 1; t >= 0; --t)  // backward order
        pending.push_back(PushPull(engines[r].get(), declared[t].name, DataType::kFloat32, {kElements},
                                   in[r].data() + t * kElements, out[r].data() + t * kElements, 4 * kElements, false,
                                   declared[t].priority));
    }
    for (auto& p : pending) EXPECT_TRUE(AWAIT(*p).ok());
    for (int r = 0; r < 3; ++r)
      for (size_t i = 0; i < in[r].size(); i += 97) {
        const float want = in[0][i] + in[1][i] + in[2][i];
        if (out[r][i] != want) {
          FAIL("rank " + std::to_string(r) + " element " + std::to_string(i) + ": " + std::to_string(out[r][i]) +
               ", expected " + std::to_string(want));
          break;
        }
      }
  }
  const std::string stats = engines[0]->StatsJson();
  EXPECT_TRUE(!Contains(stats, "\"fused_submitted\": 0,"));
  for (const uint64_t bytes : LaneBytes(*engines[0])) EXPECT_TRUE(bytes > 20000);
  std::printf("%s\n", stats.c_str());
}

// A sliced tensor still fails closed on a shape that differs (same bytes), naming both shapes, on
// every worker; and a worker lost mid-operation fails every slice, naming it.
TEST(LanesFailClosedOnDifferentShapesAndALostPeer) {
  std::vector<EngineOptions> options = ClusterOptions(2);
  for (EngineOptions& o : options) o.io_threads = 2;
  auto engines = StartCluster(options);
  if (!engines[0] || !engines[1]) return;
  const int64_t rows = 1024, cols = 1024;  // 4 MiB of float32: two slices
  std::vector<float> a(rows * cols, 1.0f), b(rows * cols, 2.0f), oa(a.size()), ob(b.size());
  auto p0 = PushPull(engines[0].get(), "dense/kernel", DataType::kFloat32, {rows * 2, cols / 2}, a.data(), oa.data(),
                     4 * a.size());
  auto p1 = PushPull(engines[1].get(), "dense/kernel", DataType::kFloat32, {rows / 2, cols * 2}, b.data(), ob.data(),
                     4 * b.size());
  for (auto* p : {p0.get(), p1.get()}) {
    const Status s = AWAIT(*p);
    EXPECT_TRUE(s.code() == Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "'dense/kernel'"));
    EXPECT_TRUE(Contains(s.message(), "[2048, 512]") && Contains(s.message(), "[512, 2048]"));
  }
  // Sizes that differ: rank 0 slices its 4 MiB, rank 1's 1000 floats travel whole on one lane.
  // That lane finds the mismatch; rank 0's other slice, which rank 1 never sends, fails with it at
  // once instead of at the operation timeout (20 s here).
  std::vector<float> small(1000, 1.0f), small_out(1000);
  const auto t0 = Clock::now();
  auto q0 = PushPull(engines[0].get(), "conv/kernel", DataType::kFloat32, {rows * cols}, a.data(), oa.data(),
                     4 * a.size());
  auto q1 = PushPull(engines[1].get(), "conv/kernel", DataType::kFloat32, {1000}, small.data(), small_out.data(), 4000);
  for (auto* p : {q0.get(), q1.get()}) {
    const Status s = AWAIT(*p);
    EXPECT_TRUE(s.code() == Code::kInvalidArgument);
    EXPECT_TRUE(Contains(s.message(), "'conv/kernel'") && Contains(s.message(), "[1000]"));
  }
  const double waited = SecondsSince(t0);
  std::printf("sizes that differ failed on both after %.3f s\n", waited);
  EXPECT_TRUE(waited < 10.0);
  // Rank 1 is lost while rank 0 waits for a sliced push_pull it alone submitted.
  auto orphan = PushPull(engines[0].get(), "orphan/big", DataType::kFloat32, {rows * cols}, a.data(), oa.data(),
                         4 * a.size());
  for (int i = 0; i < 2000 && Contains(engines[1]->StatsJson(), "\"bytes_received\": 0,"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  engines[1]->StopWithoutNotice();
  const Status s = AWAIT(*orphan, 10.0);
  EXPECT_TRUE(s.code() == Code::kUnavailable);
  EXPECT_TRUE(Contains(s.message(), "rank 1"));
  std::printf("lost peer: %s\n", s.message().c_str());
}

TEST(SingleWorkerReturnsInput) {
  EngineOptions o;
  o.rank = 0;
  o.world_size = 1;
  std::unique_ptr<Engine> e;
  EXPECT_TRUE(Engine::Start(o, &e).ok());
  if (!e) return;
  std::vector<int64_t> in = {1, -2, 3}, out(3);
  auto p = PushPull(e.get(), "solo", DataType::kInt64, {3}, in.data(), out.data(), 24, /*average=*/true);
  EXPECT_TRUE(AWAIT(*p).ok());
  EXPECT_TRUE(out == in);
}

// ProphetStrategy(schedule="auto"): the policy switches between steps, the bandwidth measured so far
// carries over, and the prophet policy's profile of ready times is readable from another thread.
TEST(FullSocketsGiveTheBandwidthEstimate) {
  // Two workers push 8 MiB tensors to each other over loopback: the sockets (TCP_NOTSENT_LOWAT
  // 256 KiB) fill, and the estimate becomes the link's rate from them (bandwidth.h), not the round
  // trips' goodput. Bounded rounds, no timing: a socket fills whatever the machine's speed.
  auto engines = StartCluster(ClusterOptions(2));
  if (!engines[0] || !engines[1]) return;
  std::vector<float> in(2 * 1024 * 1024, 1.0f), out0(in.size()), out1(in.size());
  int rounds = 0;
  for (; rounds < 50 && !Contains(engines[0]->SchedulerStateJson(), "\"bandwidth_drained\": true"); ++rounds) {
    auto a = PushPull(engines[0].get(), "grad/big", DataType::kFloat32, {static_cast<int64_t>(in.size())}, in.data(),
                      out0.data(), in.size() * 4);
    auto b = PushPull(engines[1].get(), "grad/big", DataType::kFloat32, {static_cast<int64_t>(in.size())}, in.data(),
                      out1.data(), in.size() * 4);
    EXPECT_TRUE(AWAIT(*a).ok() && AWAIT(*b).ok());
  }
  const std::string state = engines[0]->SchedulerStateJson();
  std::printf("after %d rounds: %s\n", rounds, state.substr(0, 160).c_str());
  EXPECT_TRUE(Contains(state, "\"bandwidth_drained\": true"));
}

TEST(ScheduleSwitchesBetweenStepsAndStateIsReadable) {
  std::vector<EngineOptions> options = ClusterOptions(2);
  for (EngineOptions& o : options) o.schedule = "prophet";
  std::vector<std::unique_ptr<Engine>> engines = StartCluster(options);
  if (!engines[0] || !engines[1]) return;
  std::vector<float> in(256 * 1024, 1.0f), out0(in.size()), out1(in.size());
  // Steps: two tensors per round, so the profiler sees steps (round 0 is its warm-up). A bandwidth
  // sample needs 2 ms of busy link, which four steps of 1 MiB give on a slow machine but not on a
  // fast one, so the steps go on until the first sample (bounded: the estimate must come).
  for (int step = 0; step < 4 || (step < 400 && Contains(engines[0]->SchedulerStateJson(), "\"bandwidth_samples\": 0,"));
       ++step) {
    std::vector<std::unique_ptr<Pending>> pending;
    for (const char* name : {"grad/b", "grad/a"}) {
      pending.push_back(PushPull(engines[0].get(), name, DataType::kFloat32, {256 * 1024}, in.data(), out0.data(),
                                 in.size() * 4, false, name[5] == 'a' ? 2 : 1));
      pending.push_back(PushPull(engines[1].get(), name, DataType::kFloat32, {256 * 1024}, in.data(), out1.data(),
                                 in.size() * 4, false, name[5] == 'a' ? 2 : 1));
      for (auto& p : pending) EXPECT_TRUE(AWAIT(*p).ok());
      pending.clear();
    }
  }
  const std::string state = engines[0]->SchedulerStateJson();
  EXPECT_TRUE(Contains(state, "\"schedule\": \"prophet\""));
  EXPECT_TRUE(Contains(state, "\"name\": \"grad/a\", \"priority\": 2, \"bytes\": 1048576"));
  EXPECT_TRUE(!Contains(state, "\"bandwidth_samples\": 0,"));
  EXPECT_TRUE(!engines[0]->SetSchedule("lifo").ok());
  EXPECT_TRUE(engines[0]->SetSchedule("fifo").ok());
  // The switch happens at the first pump that finds nothing queued (an operation submitted with
  // the request is sent first, by the old policy).
  auto a = PushPull(engines[0].get(), "after", DataType::kFloat32, {4}, in.data(), out0.data(), 16);
  auto b = PushPull(engines[1].get(), "after", DataType::kFloat32, {4}, in.data(), out1.data(), 16);
  EXPECT_TRUE(AWAIT(*a).ok() && AWAIT(*b).ok());
  std::string after = engines[0]->SchedulerStateJson();
  for (int i = 0; i < 400 && !Contains(after, "\"schedule\": \"fifo\""); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    after = engines[0]->SchedulerStateJson();
  }
  EXPECT_TRUE(Contains(after, "\"schedule\": \"fifo\""));
  EXPECT_TRUE(Contains(after, "\"profile\": null"));      // fifo profiles nothing
  EXPECT_TRUE(!Contains(after, "\"bandwidth_samples\": 0,"));  // the estimate carried over
  EXPECT_TRUE(Contains(engines[0]->StatsJson(), "\"schedule\": \"fifo\""));
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
