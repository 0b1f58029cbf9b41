// The two-level push_pull on real engines over loopback, with artificial hosts (the `hosts`
// option): 2 hosts x 2 workers, 2 x 3, 3 x 2 with interleaved ranks, and hosts of 3 + 1. Every
// worker ends with the same bits, those of the documented summation order (two_level.h), for any
// arrival order; compressed, the algorithm replayed; fused buckets; a lost worker and a missing
// one are named; workers that disagree on the path do not form a job.
#include "ops/core/two_level.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ops/core/codec.h"
#include "ops/core/engine_testing.h"
#include "ops/core/fusion.h"
#include "ops/core/partition.h"
#include "ops/core/reduce.h"
#include "ops/core/testing.h"
#include "ops/core/wire.h"

namespace prophet {
namespace {

using ::prophet::testing::Contains;

constexpr uint64_t kPartitionBytes = 256 << 10;

std::vector<EngineOptions> Options(const std::vector<std::string>& hosts, double timeout_s = 20.0) {
  std::vector<EngineOptions> out =
      testing::ClusterOptions(static_cast<int>(hosts.size()), timeout_s, "two-level-test");
  for (EngineOptions& o : out) {
    o.partition_bytes = kPartitionBytes;
    o.hierarchical = Hierarchy::kOn;
    o.hosts = hosts;
  }
  return out;
}

std::vector<std::unique_ptr<Engine>> Cluster(const std::vector<EngineOptions>& options) {
  std::vector<Status> status;
  auto engines = testing::StartCluster(options, &status);
  for (size_t r = 0; r < status.size(); ++r)
    if (!status[r].ok()) FAIL("rank " + std::to_string(r) + " failed to start: " + status[r].message());
  return engines;
}

bool Started(const std::vector<std::unique_ptr<Engine>>& engines) {
  for (const auto& e : engines)
    if (!e) return false;
  return true;
}

std::future<Status> Submit(Engine& engine, const std::string& name, DataType dtype, uint64_t elements,
                           const void* input, void* output, bool average, Encoding compression = Encoding::kNone,
                           int64_t priority = 0) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> done = promise->get_future();
  OpRequest q;
  q.name = name;
  q.dtype = dtype;
  q.shape = {static_cast<int64_t>(elements)};
  q.input = input;
  q.output = output;
  q.bytes = elements * DataTypeSize(dtype);
  q.priority = priority;
  q.average = average;
  q.compression = compression;
  q.done = [promise](const Status& st, const GatherResult*) { promise->set_value(st); };
  engine.Submit(std::move(q));
  return done;
}

Status Await(std::future<Status>& f, int line, double seconds = 30.0) {
  if (f.wait_for(std::chrono::duration<double>(seconds)) != std::future_status::ready) {
    ::prophet::testing::Fail(__FILE__, line, "no done callback within " + std::to_string(seconds) + " s");
    return Status(Code::kInternal, "test: no callback");
  }
  return f.get();
}
#define AWAIT(f, ...) Await(f, __LINE__, ##__VA_ARGS__)

// Values of every magnitude: sums of 3 or more round differently in different orders.
std::vector<float> Values(uint64_t elements, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<float> v(elements);
  for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
  return v;
}

// The documented order, computed here independently of the engine's code: the tensor is cut for
// the hosts (MakePartitions with H), partition p's leader on host h is the host's rank at
// (hash(name) + p) mod K_h in ascending rank order; a host's sum runs from its leader up its
// ranks, wrapping; the owning host o's leader adds S_o, S_o+1, ... S_o+H-1. `codec` replays the
// compressed path: every frame encoded, the owner's own values and each leader's not.
std::vector<float> Reference(const std::string& name, const std::vector<std::vector<float>>& in,
                             const std::vector<std::string>& labels, bool average,
                             Encoding compression = Encoding::kNone) {
  const HostLayout layout = LayoutFromLabels(labels);
  const int hosts = layout.hosts(), n = static_cast<int>(in.size());
  const uint64_t elements = in[0].size();
  const PayloadCodec codec(compression, DataType::kFloat32);
  const uint64_t hash = HashString(name);
  std::vector<float> out(elements);
  const std::vector<Partition> parts = MakePartitions(name, 4 * elements, 4, hosts, kPartitionBytes);
  for (uint32_t p = 0; p < parts.size(); ++p) {
    const uint64_t first = parts[p].offset / 4, count = parts[p].bytes / 4;
    std::vector<uint8_t> codes(codec.WireBytes(parts[p].bytes));
    // Adds `values` (a worker's or a host's) to `acc` as it travels.
    auto add = [&](std::vector<float>& acc, const float* values) {
      if (!codec.compresses()) {
        for (uint64_t i = 0; i < count; ++i) acc[i] += values[i];
        return;
      }
      const int scale = codec.Encode(values, 4 * count, codes.data());
      codec.DecodeAdd(codes.data(), codes.size(), scale, acc.data());
    };
    auto host_sum = [&](int h) {
      const std::vector<int>& ranks = layout.ranks[h];
      const size_t k = ranks.size(), lead = (hash + p) % k;
      std::vector<float> acc(in[ranks[lead]].begin() + first, in[ranks[lead]].begin() + first + count);
      for (size_t j = 1; j < k; ++j) add(acc, in[ranks[(lead + j) % k]].data() + first);
      return acc;
    };
    const int owner = parts[p].owner;
    std::vector<float> total = host_sum(owner);
    for (int d = 1; d < hosts; ++d) add(total, host_sum((owner + d) % hosts).data());
    if (average) DivideBy(DataType::kFloat32, total.data(), count, n);
    if (codec.compresses()) {
      const int scale = codec.Encode(total.data(), 4 * count, codes.data());
      codec.Decode(codes.data(), codes.size(), scale, total.data());
    }
    std::copy(total.begin(), total.end(), out.begin() + first);
  }
  return out;
}

// One float32 tensor on every rank: inputs, outputs (in place when empty), completions.
struct Tensor {
  std::string name;
  uint64_t elements = 0;
  bool average = false;
  std::vector<std::vector<float>> in, out;
  std::vector<std::future<Status>> done;
  const std::vector<float>& result(int r) const { return out[r].empty() ? in[r] : out[r]; }
};

// Submits every tensor on every rank, each rank in its own order from its own thread (rank
// `late` after a pause), and checks every rank's result against the reference, bit for bit.
void RunAndCheck(std::vector<std::unique_ptr<Engine>>& engines, const std::vector<std::string>& labels,
                 std::vector<Tensor>& tensors, unsigned seed, int late, Encoding compression = Encoding::kNone) {
  const int n = static_cast<int>(engines.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    Tensor& x = tensors[t];
    x.in.clear();
    x.out.clear();
    x.done.clear();
    x.done.resize(n);
    for (int r = 0; r < n; ++r) {
      x.in.push_back(Values(x.elements, seed * 7919 + static_cast<unsigned>(r * 131 + t)));
      x.out.push_back((t + r) % 3 == 1 ? std::vector<float>() : std::vector<float>(x.elements, -7.0f));
    }
  }
  std::vector<std::vector<float>> expected;
  for (Tensor& x : tensors) expected.push_back(Reference(x.name, x.in, labels, x.average, compression));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::vector<size_t> order(tensors.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      std::shuffle(order.begin(), order.end(), std::mt19937(seed * 31 + static_cast<unsigned>(r)));
      // A pause changes which contributions arrive before their turn; the bits must not change.
      if (r == late) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      for (size_t i : order) {
        Tensor& x = tensors[i];
        float* output = x.out[r].empty() ? x.in[r].data() : x.out[r].data();
        x.done[r] = Submit(*engines[r], x.name, DataType::kFloat32, x.elements, x.in[r].data(), output, x.average,
                           compression, static_cast<int64_t>(i));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (size_t t = 0; t < tensors.size(); ++t) {
    Tensor& x = tensors[t];
    for (int r = 0; r < n; ++r) {
      const Status s = AWAIT(x.done[r]);
      if (!s.ok()) {
        FAIL("rank " + std::to_string(r) + " " + x.name + ": " + s.message());
        continue;
      }
      const std::vector<float>& got = x.result(r);
      uint64_t wrong = 0, at = 0;
      for (uint64_t i = 0; i < x.elements; ++i)
        if (std::memcmp(&got[i], &expected[t][i], 4) != 0 && wrong++ == 0) at = i;
      if (wrong)
        FAIL("rank " + std::to_string(r) + " " + x.name + " (seed " + std::to_string(seed) + "): " +
             std::to_string(wrong) + " elements differ from the documented order's sum, first at " +
             std::to_string(at) + ": " + std::to_string(got[at]) + " for " + std::to_string(expected[t][at]));
    }
  }
}

// 1 element, 1000, and 300000 (1.2 MB: many partitions, leaders rotating over each host's ranks).
std::vector<Tensor> Tensors(const std::string& prefix) {
  std::vector<Tensor> out;
  for (uint64_t elements : {uint64_t{1}, uint64_t{1000}, uint64_t{300000}})
    for (bool average : {false, true}) {
      Tensor t;
      t.name = prefix + "/" + std::to_string(elements) + (average ? "/mean" : "/sum");
      t.elements = elements;
      t.average = average;
      out.push_back(std::move(t));
    }
  return out;
}

void CheckLayout(const std::vector<std::string>& labels, Encoding compression = Encoding::kNone) {
  auto engines = Cluster(Options(labels));
  if (!Started(engines)) return;
  const std::string hosts = "\"two_level_hosts\": " + std::to_string(LayoutFromLabels(labels).hosts());
  for (auto& e : engines) {
    const std::string stats = e->StatsJson();
    if (!Contains(stats, hosts + ",") && !Contains(stats, hosts + "}"))
      FAIL("not on the two-level path: " + stats);
  }
  std::string prefix = std::string(EncodingName(compression)) + "/";
  for (const std::string& l : labels) prefix += l;
  std::vector<Tensor> tensors = Tensors(prefix);
  const int n = static_cast<int>(labels.size());
  for (unsigned seed = 1; seed <= 3; ++seed) RunAndCheck(engines, labels, tensors, seed, static_cast<int>(seed) % n, compression);
  // The same inputs again, in other orders and with another late rank: the same bits (checked
  // against the same reference).
  RunAndCheck(engines, labels, tensors, 1, n - 1, compression);
}

TEST(HostsComeFromLabelsOrAddressesAndAutoNeedsSeveralSharedHosts) {
  std::vector<std::string> labels;
  EXPECT_TRUE(HostLabels({}, {"10.0.0.1:1", "10.0.0.1:2", "10.0.0.2:1", "[::1]:4"}, 4, &labels).ok());
  EXPECT_TRUE((labels == std::vector<std::string>{"10.0.0.1", "10.0.0.1", "10.0.0.2", "::1"}));
  const HostLayout interleaved = LayoutFromLabels({"b", "a", "b", "a", "c"});
  EXPECT_EQ(interleaved.hosts(), 3);
  EXPECT_TRUE((interleaved.ranks[0] == std::vector<int>{0, 2} && interleaved.ranks[1] == std::vector<int>{1, 3}));
  EXPECT_EQ(interleaved.local_index[3], 1);
  EXPECT_TRUE(!HostLabels({"a", "b"}, {}, 3, &labels).ok());
  EXPECT_TRUE(UseTwoLevel(Hierarchy::kAuto, LayoutFromLabels({"a", "a", "b", "b"})));
  EXPECT_TRUE(UseTwoLevel(Hierarchy::kAuto, LayoutFromLabels({"a", "a", "a", "b"})));
  EXPECT_TRUE(!UseTwoLevel(Hierarchy::kAuto, LayoutFromLabels({"a", "a", "a"})));  // one host
  EXPECT_TRUE(!UseTwoLevel(Hierarchy::kAuto, LayoutFromLabels({"a", "b", "c"})));  // one worker each
  EXPECT_TRUE(UseTwoLevel(Hierarchy::kOn, LayoutFromLabels({"a", "b"})));
  EXPECT_TRUE(!UseTwoLevel(Hierarchy::kOff, LayoutFromLabels({"a", "a", "b", "b"})));
  EXPECT_TRUE(PathTag(true, UniformLayout(4, 2), false) != PathTag(true, LayoutFromLabels({"a", "b", "a", "b"}), false));
  EXPECT_TRUE(PathTag(true, UniformLayout(4, 2), false) != PathTag(true, UniformLayout(4, 2), true));
  EXPECT_EQ(PathTag(false, UniformLayout(4, 2), true), 0);
  EngineOptions o;
  const Status good =
      ParseEngineOptions("world_size=2\naddresses=h:1,h:2\nallow_no_token=1\nhierarchical=auto\nhosts=x,x", &o);
  EXPECT_TRUE(good.ok() && o.hierarchical == Hierarchy::kAuto && o.hosts.size() == 2);
  const Status bad = ParseEngineOptions("hierarchical=maybe", &o);
  EXPECT_TRUE(!bad.ok() && Contains(bad.message(), "off, on or auto"));
}

TEST(TwoHostsOfTwoGiveTheDocumentedSumEverywhereInAnyArrivalOrder) { CheckLayout({"a", "a", "b", "b"}); }

TEST(TwoHostsOfThreeThreeInterleavedHostsOfTwoAndUnevenHosts) {
  CheckLayout({"a", "a", "a", "b", "b", "b"});
  CheckLayout({"a", "b", "c", "a", "b", "c"});
  CheckLayout({"a", "a", "a", "b"});
}

TEST(CompressedIsTheReplayedAlgorithmOnEveryWorker) {
  CheckLayout({"a", "a", "b", "b"}, Encoding::kFloat16);
  CheckLayout({"a", "b", "a", "b", "a", "b"}, Encoding::kBFloat16);
}

TEST(IntegersSumExactlyAndAverageTruncates) {
  const std::vector<std::string> labels = {"a", "a", "b", "b", "b"};
  auto engines = Cluster(Options(labels));
  if (!Started(engines)) return;
  const int n = 5;
  const uint64_t elements = 100000;
  for (bool average : {false, true}) {
    std::vector<std::vector<int64_t>> in(n, std::vector<int64_t>(elements)), out = in;
    std::vector<int64_t> expected(elements, 0);
    for (int r = 0; r < n; ++r)
      for (uint64_t i = 0; i < elements; ++i) {
        in[r][i] = (static_cast<int64_t>(i) * 1000003 + r * 999999937ll) * ((i + r) % 3 == 0 ? -1 : 1);
        expected[i] += in[r][i];
      }
    if (average)
      for (int64_t& e : expected) e /= n;
    std::vector<std::future<Status>> done;
    for (int r = 0; r < n; ++r)
      done.push_back(Submit(*engines[r], average ? "int/mean" : "int/sum", DataType::kInt64, elements, in[r].data(),
                            out[r].data(), average));
    for (int r = 0; r < n; ++r) {
      const Status s = AWAIT(done[r]);
      if (!s.ok()) FAIL(s.message());
      else if (out[r] != expected) FAIL("rank " + std::to_string(r) + ": wrong int64 " + (average ? "mean" : "sum"));
    }
  }
}

// Lanes (io_threads) on the two-level path: each slice takes the path on its own lane, and the
// integer sums are exact.
TEST(LanesTakeTheTwoLevelPathSliceBySlice) {
  const std::vector<std::string> labels = {"a", "a", "b"};
  std::vector<EngineOptions> options = Options(labels);
  for (EngineOptions& o : options) o.io_threads = 2;
  auto engines = Cluster(options);
  if (!Started(engines)) return;
  const int n = 3;
  const uint64_t elements = 300001;  // 2.4 MB: two slices of odd length
  std::vector<std::vector<int64_t>> in(n, std::vector<int64_t>(elements)), out = in;
  std::vector<int64_t> expected(elements, 0);
  for (int r = 0; r < n; ++r)
    for (uint64_t i = 0; i < elements; ++i) {
      in[r][i] = static_cast<int64_t>(i) * 7919 - r * 104729;
      expected[i] += in[r][i];
    }
  std::vector<std::future<Status>> done;
  for (int r = 0; r < n; ++r)
    done.push_back(Submit(*engines[r], "int/lanes", DataType::kInt64, elements, in[r].data(), out[r].data(), false));
  for (auto& f : done) EXPECT_TRUE(AWAIT(f).ok());
  for (int r = 0; r < n; ++r) EXPECT_TRUE(out[r] == expected);
  const std::string stats = engines[0]->StatsJson();
  EXPECT_TRUE(Contains(stats, "\"io_threads\": 2") && Contains(stats, "\"two_level_hosts\": 2"));
  EXPECT_TRUE(!Contains(stats, "\"lane_bytes_sent\": [0") && !Contains(stats, ", 0]"));
}

TEST(FusedBucketsTravelTheTwoLevelPathTheSameEverywhereRunToRun) {
  const std::vector<std::string> labels = {"a", "a", "b", "b"};
  auto engines = Cluster(Options(labels));
  if (!Started(engines)) return;
  const int n = 4;
  std::vector<FusionDeclaration> decl;
  for (int i = 0; i < 16; ++i) {
    FusionDeclaration d;
    d.name = "fused/grad" + std::to_string(i);
    d.bytes = 4 * static_cast<uint64_t>(1 + (i * 977) % 3000);
    d.shape = {static_cast<int64_t>(d.bytes / 4)};
    d.priority = 16 - i;
    d.average = i < 8;
    decl.push_back(d);
  }
  for (auto& e : engines) e->DeclareFusion("g", decl, FusionBucketBytes(n, 125e6) / 4);
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    std::vector<std::vector<std::vector<float>>> in(n), out(n);
    std::vector<std::vector<std::future<Status>>> done(n);
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < decl.size(); ++i) {
        in[r].push_back(Values(decl[i].bytes / 4, 500 + static_cast<unsigned>(r * 100 + i)));
        out[r].push_back(std::vector<float>(decl[i].bytes / 4, -7.0f));
      }
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        std::vector<size_t> order(decl.size());
        for (size_t i = 0; i < order.size(); ++i) order[i] = i;
        std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(run * 10 + r)));
        done[r].resize(decl.size());
        for (size_t i : order)
          done[r][i] = Submit(*engines[r], decl[i].name, DataType::kFloat32, decl[i].bytes / 4, in[r][i].data(),
                              out[r][i].data(), decl[i].average, Encoding::kNone, decl[i].priority);
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < n; ++r)
      for (size_t i = 0; i < decl.size(); ++i) {
        const Status s = AWAIT(done[r][i]);
        if (!s.ok()) FAIL(decl[i].name + ": " + s.message());
        if (out[r][i] != out[0][i]) FAIL("rank " + std::to_string(r) + " holds other bits than rank 0 for " + decl[i].name);
        if (run == 1 && out[r][i] != first[i]) FAIL("run to run: other bits for " + decl[i].name);
      }
    for (size_t i = 0; i < decl.size(); ++i) {
      if (run == 0) first.push_back(out[0][i]);
      for (size_t e = 0; e < out[0][i].size(); ++e) {
        double sum = 0, magnitude = 0;
        for (int r = 0; r < n; ++r) {
          sum += in[r][i][e];
          magnitude += std::fabs(in[r][i][e]);
        }
        const double scale = decl[i].average ? n : 1;
        if (std::fabs(out[0][i][e] - sum / scale) > 4 * n * 6e-8 * magnitude / scale) {
          FAIL(decl[i].name + " element " + std::to_string(e) + ": " + std::to_string(out[0][i][e]) + " for " +
               std::to_string(sum / scale));
          break;
        }
      }
    }
  }
  // They travelled fused.
  EXPECT_TRUE(!Contains(engines[0]->StatsJson(), "\"fused_submitted\": 0,"));
}

TEST(ALostWorkerIsNamedByEverySurvivor) {
  // Rank 3 dies; ranks 0-2 wait on a tensor whose partitions it leads or contributes to.
  for (int dead : {3, 0}) {
    auto engines = Cluster(Options({"a", "a", "b", "b"}));
    if (!Started(engines)) return;
    std::vector<std::vector<float>> in(4, std::vector<float>(100000, 1.0f)), out = in;
    std::vector<std::future<Status>> done(4);
    for (int r = 0; r < 4; ++r)
      if (r != dead) done[r] = Submit(*engines[r], "orphan", DataType::kFloat32, 100000, in[r].data(), out[r].data(), false);
    engines[dead]->StopWithoutNotice();
    for (int r = 0; r < 4; ++r) {
      if (r == dead) continue;
      const Status s = AWAIT(done[r], 15.0);
      if (s.code() != Code::kUnavailable || !Contains(s.message(), "rank " + std::to_string(dead)))
        FAIL("rank " + std::to_string(r) + ": " + s.message());
    }
  }
}

TEST(AMissingWorkerTimesOutNamedByEveryone) {
  auto engines = Cluster(Options({"a", "a", "b", "b"}, /*timeout_s=*/0.5));
  if (!Started(engines)) return;
  std::vector<std::vector<float>> in(4, std::vector<float>(100000, 1.0f)), out = in;
  std::vector<std::future<Status>> done(4);
  for (int r : {0, 1, 3}) done[r] = Submit(*engines[r], "stalled", DataType::kFloat32, 100000, in[r].data(), out[r].data(), false);
  for (int r : {0, 1, 3}) {
    const Status s = AWAIT(done[r], 20.0);
    if (s.code() != Code::kDeadlineExceeded || !Contains(s.message(), "'stalled'") || !Contains(s.message(), "rank(s) 2"))
      FAIL("rank " + std::to_string(r) + ": " + s.message());
  }
  // The job goes on.
  for (int r = 0; r < 4; ++r) done[r] = Submit(*engines[r], "after", DataType::kFloat32, 10, in[r].data(), out[r].data(), false);
  for (int r = 0; r < 4; ++r) {
    const Status s = AWAIT(done[r]);
    if (!s.ok() || out[r][0] != 4.0f) FAIL("rank " + std::to_string(r) + " after the timeout: " + s.message());
  }
}

void CheckPathChosenBetweenSubmissions(int lanes) {
  const std::vector<std::string> labels = {"a", "a", "b", "b"};
  const int n = 4;
  std::vector<EngineOptions> options = Options(labels), flat_options = Options(labels);
  for (EngineOptions& o : options) o.hierarchical = Hierarchy::kAuto;
  for (EngineOptions& o : flat_options) o.hierarchical = Hierarchy::kOff;
  for (auto* cluster : {&options, &flat_options})
    for (EngineOptions& o : *cluster) o.io_threads = lanes;
  auto engines = Cluster(options);
  auto flat = Cluster(flat_options);
  if (!Started(engines) || !Started(flat)) return;
  EXPECT_TRUE(Contains(engines[0]->StatsJson(), "\"two_level_hosts\": 2,"));
  EXPECT_TRUE(Contains(engines[0]->StatsJson(), "\"path_choosable\": true, \"path_chosen\": false"));
  EXPECT_TRUE(Contains(flat[0]->StatsJson(), "\"path_choosable\": false"));
  const Status fixed = flat[0]->SetTwoLevel(true);
  EXPECT_TRUE(!fixed.ok() && Contains(fixed.message(), "hierarchical is 'off'"));
  std::vector<FusionDeclaration> decl;
  for (int i = 0; i < 3; ++i) {
    FusionDeclaration d;
    d.name = "chosen/fused" + std::to_string(i);
    d.bytes = 4 * static_cast<uint64_t>(700 + 300 * i);
    d.shape = {static_cast<int64_t>(d.bytes / 4)};
    d.priority = 3 - i;
    decl.push_back(d);
  }
  for (auto* cluster : {&engines, &flat})
    for (auto& e : *cluster) e->DeclareFusion("g", decl, 1 << 20);
  // name, elements: one alone (many partitions) and the fused ones.
  std::vector<std::pair<std::string, uint64_t>> tensors = {{"chosen/alone", 300000}};
  for (const FusionDeclaration& d : decl) tensors.push_back({d.name, d.bytes / 4});
  for (int pass = 0; pass < 2; ++pass) {
    const bool two_level = pass == 1;
    std::vector<std::vector<std::vector<float>>> in(n), out(n), flat_out(n);
    std::vector<std::vector<std::future<Status>>> done(n), flat_done(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      for (size_t t = 0; t < tensors.size(); ++t) {
        in[r].push_back(Values(tensors[t].second, 900 + static_cast<unsigned>(pass * 100 + r * 10 + t)));
        out[r].push_back(std::vector<float>(tensors[t].second, -7.0f));
        flat_out[r].push_back(out[r].back());
      }
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        std::this_thread::sleep_for(std::chrono::milliseconds(40 * ((r + pass) % n)));
        EXPECT_TRUE(engines[r]->SetTwoLevel(two_level).ok());
        for (size_t t = 0; t < tensors.size(); ++t) {
          done[r].push_back(Submit(*engines[r], tensors[t].first, DataType::kFloat32, tensors[t].second,
                                   in[r][t].data(), out[r][t].data(), false));
          flat_done[r].push_back(Submit(*flat[r], tensors[t].first, DataType::kFloat32, tensors[t].second,
                                        in[r][t].data(), flat_out[r][t].data(), false));
        }
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < n; ++r)
      for (size_t t = 0; t < tensors.size(); ++t) {
        const Status s = AWAIT(done[r][t]), f = AWAIT(flat_done[r][t]);
        if (!s.ok() || !f.ok()) FAIL(tensors[t].first + ": " + s.message() + " / " + f.message());
      }
    const std::string hosts = two_level ? "\"two_level_hosts\": 2," : "\"two_level_hosts\": 0,";
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(Contains(engines[r]->StatsJson(), hosts));
      for (size_t t = 0; t < tensors.size(); ++t) {
        std::vector<std::vector<float>> inputs;
        for (int q = 0; q < n; ++q) inputs.push_back(in[q][t]);
        const bool alone = t == 0;
        // Alone, the two-level sum has its documented order; fused, it holds the bucket's bits,
        // which differ from the flat job's for these values.
        const bool expected_flat = out[r][t] == flat_out[r][t];
        if (!two_level && !expected_flat) FAIL("flat: rank " + std::to_string(r) + " " + tensors[t].first + " differs from a flat job's sum");
        // (On two lanes each slice is cut for the hosts on its own: not the reference's cut.)
        if (two_level && alone && lanes == 1 && out[r][t] != Reference(tensors[t].first, inputs, labels, false))
          FAIL("two-level: rank " + std::to_string(r) + " " + tensors[t].first + " is not in the documented order");
        if (two_level && out[r][t] != out[0][t]) FAIL("two-level: rank " + std::to_string(r) + " differs from rank 0");
      }
    }
    if (two_level && out[0][0] == flat_out[0][0]) FAIL("the two-level sum has the flat one's bits: the test cannot tell the paths apart");
  }
  EXPECT_TRUE(Contains(engines[0]->StatsJson(), "\"path_chosen\": true"));
}

// Under `auto` the path can be chosen between submissions (Engine::SetTwoLevel, as the start-up
// probe does): each rank switches at its own moment, its peers' frames for the next tensor wait
// for it, and every tensor sums in the chosen path's order: flat, the bits of a flat job; back on
// the two-level path, the documented order. Fused buckets take their members' path; on two
// lanes, so do the slices of a tensor cut across them (1.2 MB).
TEST(UnderAutoThePathIsChosenBetweenSubmissionsOnEveryWorker) {
  CheckPathChosenBetweenSubmissions(1);
  CheckPathChosenBetweenSubmissions(2);
}

// Starts a job of 2 hosts x 2 workers with `odd`'s setting on rank `rank` and `on` elsewhere:
// every worker fails to start, and one names both `first` and `second` in its error.
void ExpectNoJob(int rank, Hierarchy odd, const std::string& first, const std::string& second) {
  std::vector<EngineOptions> options = Options({"a", "a", "b", "b"});
  options[rank].hierarchical = odd;
  for (EngineOptions& o : options) o.connect_timeout_s = 3.0;
  std::vector<Status> status;
  auto engines = testing::StartCluster(options, &status);
  bool named = false;
  for (const Status& s : status) {
    EXPECT_TRUE(!s.ok());
    named = named || (Contains(s.message(), first) && Contains(s.message(), second));
  }
  if (!named) FAIL("no worker names " + first + " and " + second + ": " + status[rank].message());
}

TEST(WorkersThatDisagreeOnThePathDoNotFormAJob) {
  ExpectNoJob(3, Hierarchy::kOff, "hierarchical", "flat path");
  // `on` beside `auto`: only the auto workers would choose the path at start-up.
  ExpectNoJob(1, Hierarchy::kAuto, "hierarchical on", "hierarchical auto");
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
