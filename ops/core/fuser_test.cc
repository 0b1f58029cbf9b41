// Fused push_pull on real engines over loopback: declared small tensors travel in buckets; the
// results are the sums, bitwise the same on every worker and run to run whatever order the
// tensors are submitted in, bitwise the unfused results on two workers; a member that differs
// from its declaration, or one never submitted, fails with an error naming it, on every worker;
// declarations that differ across workers fail every fused member within seconds (not the
// operation timeout), naming the first tensor that differs, while a late worker, another order
// of the same declaration and a worker compiling again alone go on.
#include "ops/core/fuser.h"

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

#include "ops/core/engine_testing.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

using ::prophet::testing::Contains;

std::vector<std::unique_ptr<Engine>> Cluster(int n, double timeout_s = 20.0) {
  std::vector<Status> status;
  auto engines = testing::StartCluster(testing::ClusterOptions(n, timeout_s, "fuser-test"), &status);
  for (size_t r = 0; r < status.size(); ++r)
    if (!status[r].ok()) FAIL("rank " + std::to_string(r) + " failed to start: " + status[r].message());
  return engines;
}

// One worker's tensors of a step: inputs, outputs, and what each push_pull ended with.
struct Step {
  std::vector<std::vector<float>> in, out;
  std::vector<std::future<Status>> done;
};

// 24 gradients of 1 to 3000 floats (some in place), priorities 24..1.
std::vector<FusionDeclaration> Declarations(const std::string& prefix, Encoding compression = Encoding::kNone) {
  std::vector<FusionDeclaration> out;
  for (int i = 0; i < 24; ++i) {
    FusionDeclaration d;
    d.name = prefix + "/grad" + std::to_string(i);
    d.bytes = 4 * static_cast<uint64_t>(1 + (i * 977) % 3000);
    d.shape = {static_cast<int64_t>(d.bytes / 4)};
    d.priority = 24 - i;
    d.average = i < 12;  // two runs: averaging must agree inside a bucket
    d.compression = compression;
    out.push_back(d);
  }
  return out;
}

// Random values of every magnitude (sums of 3 or more round differently in different orders).
std::vector<float> Values(uint64_t elements, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::vector<float> v(elements);
  for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
  return v;
}

// Submits the push_pull of declared tensor `d` (in place when input == output).
std::future<Status> Submit(Engine& engine, const FusionDeclaration& d, const float* input, float* output) {
  auto promise = std::make_shared<std::promise<Status>>();
  std::future<Status> done = promise->get_future();
  OpRequest q;
  q.name = d.name;
  q.dtype = DataType::kFloat32;
  q.shape = {static_cast<int64_t>(d.bytes / 4)};
  q.input = input;
  q.output = output;
  q.bytes = d.bytes;
  q.priority = d.priority;
  q.average = d.average;
  q.compression = d.compression;
  q.done = [promise](const Status& st, const GatherResult*) { promise->set_value(st); };
  engine.Submit(std::move(q));
  return done;
}

// Every rank submits every declared tensor, each in its own order, from its own thread.
std::vector<Step> RunStep(std::vector<std::unique_ptr<Engine>>& engines, const std::vector<FusionDeclaration>& decl,
                          unsigned seed) {
  const int n = static_cast<int>(engines.size());
  std::vector<Step> steps(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    Step& s = steps[r];
    for (size_t i = 0; i < decl.size(); ++i) {
      s.in.push_back(Values(decl[i].bytes / 4, seed * 1000 + static_cast<unsigned>(r * 100 + i)));
      s.out.push_back(i % 3 == 1 ? std::vector<float>() : std::vector<float>(decl[i].bytes / 4, -7.0f));
    }
    s.done.resize(decl.size());
  }
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      std::vector<size_t> order(decl.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      if (r % 3 == 1) std::reverse(order.begin(), order.end());
      if (r % 3 == 2) std::shuffle(order.begin(), order.end(), std::mt19937(seed + static_cast<unsigned>(r)));
      for (size_t i : order) {
        Step& s = steps[r];
        // In place when there is no separate output.
        s.done[i] = Submit(*engines[r], decl[i], s.in[i].data(), s.out[i].empty() ? s.in[i].data() : s.out[i].data());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return steps;
}

// Waits for every callback of `s` (at most `bound` each); the statuses.
std::vector<Status> AwaitWithin(Step& s, std::chrono::seconds bound) {
  std::vector<Status> out;
  for (std::future<Status>& f : s.done) {
    if (f.wait_for(bound) != std::future_status::ready) {
      FAIL("no done callback within " + std::to_string(bound.count()) + " s");
      out.push_back(Status(Code::kInternal, "test: no callback"));
      continue;
    }
    out.push_back(f.get());
  }
  return out;
}

std::vector<Status> Await(Step& s) { return AwaitWithin(s, std::chrono::seconds(30)); }

const std::vector<float>& Result(const Step& s, size_t i) { return s.out[i].empty() ? s.in[i] : s.out[i]; }

// Every tensor succeeded on every rank and holds the same bits everywhere; returns rank 0's.
std::vector<std::vector<float>> SameEverywhere(std::vector<Step>& steps, const std::vector<FusionDeclaration>& decl) {
  for (Step& s : steps)
    for (const Status& st : Await(s))
      if (!st.ok()) FAIL(st.message());
  for (size_t r = 1; r < steps.size(); ++r)
    for (size_t i = 0; i < decl.size(); ++i)
      if (std::memcmp(Result(steps[r], i).data(), Result(steps[0], i).data(), decl[i].bytes) != 0)
        FAIL("rank " + std::to_string(r) + " holds other bits than rank 0 for " + decl[i].name);
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < decl.size(); ++i) out.push_back(Result(steps[0], i));
  return out;
}

// Each result is the sum (or mean) of the n workers' inputs of RunStep's `seed`, to float32
// summation's accuracy.
void ExpectSums(const std::vector<std::vector<float>>& results, const std::vector<FusionDeclaration>& decl, int n,
                unsigned seed) {
  for (size_t i = 0; i < decl.size(); ++i) {
    std::vector<std::vector<float>> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(Values(decl[i].bytes / 4, seed * 1000 + static_cast<unsigned>(r * 100 + i)));
    for (size_t e = 0; e < results[i].size(); ++e) {
      double sum = 0, magnitude = 0;
      for (int r = 0; r < n; ++r) {
        sum += inputs[r][e];
        magnitude += std::fabs(inputs[r][e]);
      }
      if (decl[i].average) {
        sum /= n;
        magnitude /= n;
      }
      if (std::fabs(results[i][e] - sum) > 4 * n * 6e-8 * magnitude) {
        FAIL(decl[i].name + " element " + std::to_string(e) + ": " + std::to_string(results[i][e]) + " for " +
             std::to_string(sum));
        break;
      }
    }
  }
}

uint64_t OpsDone(const Engine& e) {
  const std::string stats = e.StatsJson();
  const size_t at = stats.find("\"ops_done\": ");
  return at == std::string::npos ? 0 : std::stoull(stats.substr(at + 12));
}

uint64_t Bucket(int n) { return FusionBucketBytes(n, 125e6); }

// Lanes (engine.h): the plan's buckets are dealt over the lanes (DealBucketsToLanes), every fused
// member to exactly one lane, and what a lane's own plan fuses is what the routing map says.
TEST(FusedBucketsAreDealtOverTheLanes) {
  std::vector<FusionDeclaration> tensors;
  for (int t = 0; t < 40; ++t) {
    FusionDeclaration d;
    d.name = "grad/" + std::to_string(t);
    d.shape = {1000 + 100 * (t % 7)};
    d.bytes = 4 * static_cast<uint64_t>(d.shape[0]);
    d.priority = 40 - t;
    tensors.push_back(d);
  }
  std::unordered_map<std::string, int> one_lane, three_lanes;
  std::vector<std::vector<std::vector<int>>> one_groups, groups;
  const auto whole = FusionByLane(tensors, 4, 16 << 10, 1, &one_lane, &one_groups);
  const auto dealt = FusionByLane(tensors, 4, 16 << 10, 3, &three_lanes, &groups);
  EXPECT_EQ(whole.size(), 1u);
  EXPECT_EQ(dealt.size(), 3u);
  size_t members = 0;
  std::unordered_map<std::string, int> seen;
  for (size_t lane = 0; lane < dealt.size(); ++lane) {
    EXPECT_TRUE(dealt[lane].size() >= 4);  // several buckets each
    members += dealt[lane].size();
    for (const FusionDeclaration& d : dealt[lane]) EXPECT_TRUE(seen.emplace(d.name, static_cast<int>(lane)).second);
  }
  EXPECT_EQ(members, whole[0].size());  // the same fused members, each on one lane
  int lanes_used[3] = {0, 0, 0};
  for (const auto& [name, lane] : three_lanes) {
    EXPECT_EQ(seen.at(name), lane);
    lanes_used[lane]++;
  }
  for (int used : lanes_used) EXPECT_TRUE(used > 0);
  // Each lane's buckets are the whole plan's buckets it was dealt, not a plan of its share again
  // (which the simulator does not model): together, the same bucket names as the whole plan.
  std::vector<FusionInput> inputs;
  for (const FusionDeclaration& d : tensors) inputs.push_back(FusionInputOf(d));
  std::vector<std::string> planned, carried;
  for (const FusionBucket& b : PlanFusion(inputs, 4, 16 << 10))
    if (b.fused()) planned.push_back(b.name);
  EXPECT_EQ(groups.size(), 3u);
  for (size_t lane = 0; lane < dealt.size(); ++lane) {
    std::vector<FusionInput> share;
    for (const FusionDeclaration& d : dealt[lane]) share.push_back(FusionInputOf(d));
    for (const FusionBucket& b : PlanOfBuckets(share, groups[lane])) {
      EXPECT_TRUE(b.fused());  // every member of a share is in a bucket
      carried.push_back(b.name);
    }
  }
  std::sort(planned.begin(), planned.end());
  std::sort(carried.begin(), carried.end());
  EXPECT_TRUE(planned == carried);
  EXPECT_TRUE(planned.size() >= 6);
}

TEST(FusedSumsAreTheSameEverywhereRunToRunAndInAnyOrder) {
  for (int n : {3, 4}) {
    auto engines = Cluster(n);
    if (engines.size() != static_cast<size_t>(n) || !engines.back()) return;
    const std::vector<FusionDeclaration> decl = Declarations("any" + std::to_string(n));
    for (auto& e : engines) e->DeclareFusion("g", decl, Bucket(n) / 8);  // several buckets
    std::vector<Step> first = RunStep(engines, decl, 1);
    const std::vector<std::vector<float>> a = SameEverywhere(first, decl);
    // They travelled fused: far fewer operations than tensors.
    const uint64_t ops = OpsDone(*engines[0]);
    if (ops < 2 || ops >= decl.size()) FAIL(std::to_string(ops) + " operations for " + std::to_string(decl.size()) + " tensors");
    // The same inputs again, submitted in other orders: the same bits.
    std::vector<Step> second = RunStep(engines, decl, 1);
    const std::vector<std::vector<float>> b = SameEverywhere(second, decl);
    for (size_t i = 0; i < decl.size(); ++i)
      if (std::memcmp(a[i].data(), b[i].data(), decl[i].bytes) != 0) FAIL("run to run: other bits for " + decl[i].name);
    // And the values are the sums (or means) of the inputs, to float32 summation's accuracy.
    std::vector<Step> third = RunStep(engines, decl, 2);
    ExpectSums(SameEverywhere(third, decl), decl, n, 2);
  }
}

TEST(TwoWorkersFusedIsBitwiseUnfused) {
  auto engines = Cluster(2);
  if (engines.size() != 2 || !engines[1]) return;
  const std::vector<FusionDeclaration> fused = Declarations("two/fused"), plain = Declarations("two/plain");
  for (auto& e : engines) e->DeclareFusion("g", fused, Bucket(2));
  std::vector<Step> f = RunStep(engines, fused, 5), p = RunStep(engines, plain, 5);
  const std::vector<std::vector<float>> a = SameEverywhere(f, fused), b = SameEverywhere(p, plain);
  for (size_t i = 0; i < fused.size(); ++i)
    if (std::memcmp(a[i].data(), b[i].data(), fused[i].bytes) != 0) FAIL("fused differs from unfused: " + fused[i].name);
}

// A fusable tensor larger than its bucket's cap travels alone, as a bucket of one in its own
// buffers (no packing), cut among owners as buckets are: the sums are right, in place or not,
// and the same bits everywhere.
TEST(ABucketOfOneSumsInItsOwnBuffers) {
  const int n = 4;
  auto engines = Cluster(n);
  if (engines.size() != static_cast<size_t>(n) || !engines.back()) return;
  std::vector<FusionDeclaration> decl;
  for (int i = 0; i < 3; ++i) {
    FusionDeclaration d;
    d.name = "one/grad" + std::to_string(i);
    d.bytes = 4 * static_cast<uint64_t>(40000 + i);  // below N x 64 KiB: fusable
    d.shape = {static_cast<int64_t>(d.bytes / 4)};
    d.priority = 3 - i;
    d.average = i == 1;  // neighbours differ: each alone
    decl.push_back(d);
  }
  std::vector<FusionInput> inputs;
  for (const FusionDeclaration& d : decl) inputs.push_back(FusionInputOf(d));
  const std::vector<FusionBucket> plan = PlanFusion(inputs, n, Bucket(n));
  EXPECT_EQ(plan.size(), 3u);
  for (const FusionBucket& b : plan) {
    EXPECT_TRUE(b.fused() && b.members.size() == 1);
    EXPECT_TRUE(BucketPartitions(b.name, b.bytes, 4, n, 4u << 20, Bucket(n)).size() > 1);  // not whole on one owner
  }
  for (auto& e : engines) e->DeclareFusion("g", decl, Bucket(n));
  std::vector<Step> s = RunStep(engines, decl, 3);
  ExpectSums(SameEverywhere(s, decl), decl, n, 3);
  EXPECT_EQ(OpsDone(*engines[0]), decl.size());  // each travelled as its own bucket
}

TEST(CompressedBucketsAreTheSameEverywhere) {
  auto engines = Cluster(3);
  if (engines.size() != 3 || !engines[2]) return;
  const std::vector<FusionDeclaration> decl = Declarations("fp16", Encoding::kFloat16);
  for (auto& e : engines) e->DeclareFusion("g", decl, Bucket(3));
  std::vector<Step> s = RunStep(engines, decl, 9);
  SameEverywhere(s, decl);
}

TEST(AMemberThatDiffersFromItsDeclarationFailsItsBucketEverywhereNamingIt) {
  auto engines = Cluster(3);
  if (engines.size() != 3 || !engines[2]) return;
  std::vector<FusionDeclaration> decl = Declarations("differs");
  for (FusionDeclaration& d : decl) d.average = false;
  for (auto& e : engines) e->DeclareFusion("g", decl, Bucket(3) * 100);  // one bucket of all 24
  // Rank 2 submits grad5 with one float fewer than declared.
  std::vector<FusionDeclaration> wrong = decl;
  wrong[5].bytes -= 4;
  wrong[5].shape[0] -= 1;
  std::vector<Step> steps(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      const std::vector<FusionDeclaration>& d = r == 2 ? wrong : decl;
      Step& s = steps[r];
      s.done.resize(d.size());
      for (size_t i = 0; i < d.size(); ++i) {
        s.in.push_back(std::vector<float>(d[i].bytes / 4, 1.0f));
        s.out.push_back(std::vector<float>(d[i].bytes / 4));
      }
      for (size_t i = 0; i < d.size(); ++i) s.done[i] = Submit(*engines[r], d[i], s.in[i].data(), s.out[i].data());
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    for (const Status& st : Await(steps[r])) {
      if (st.ok()) FAIL("rank " + std::to_string(r) + ": a member of the broken bucket succeeded");
      else if (!Contains(st.message(), "differs/grad5")) FAIL("rank " + std::to_string(r) + ": " + st.message());
    }
  }
}

TEST(AMemberNeverSubmittedFailsTheHeldOnesNamingIt) {
  auto engines = Cluster(2, /*timeout_s=*/1.0);
  if (engines.size() != 2 || !engines[1]) return;
  std::vector<FusionDeclaration> decl = Declarations("missing");
  decl.resize(3);
  for (FusionDeclaration& d : decl) d.average = false;
  for (auto& e : engines) e->DeclareFusion("g", decl, Bucket(2) * 100);
  std::vector<std::future<Status>> done;
  std::vector<std::vector<float>> data;
  for (int r = 0; r < 2; ++r) {
    for (size_t i = 0; i < 2; ++i) {  // never grad2
      data.push_back(std::vector<float>(decl[i].bytes / 4, 1.0f));
      done.push_back(Submit(*engines[r], decl[i], data.back().data(), data.back().data()));
    }
  }
  for (std::future<Status>& f : done) {
    if (f.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
      FAIL("a held member was never failed");
      continue;
    }
    const Status st = f.get();
    if (st.ok() || st.code() != Code::kDeadlineExceeded || !Contains(st.message(), "'missing/grad2' not submitted"))
      FAIL("expected a timeout naming missing/grad2, got: " + st.message());
  }
}

// One worker submits each of `decl` (ones as input) in its own thread.
std::thread SubmitAll(Engine& engine, const std::vector<FusionDeclaration>& decl, Step* s) {
  for (const FusionDeclaration& d : decl) {
    s->in.push_back(std::vector<float>(d.bytes / 4, 1.0f));
    s->out.push_back(std::vector<float>(d.bytes / 4));
  }
  s->done.resize(decl.size());
  return std::thread([&engine, &decl, s] {
    for (size_t i = 0; i < decl.size(); ++i) s->done[i] = Submit(engine, decl[i], s->in[i].data(), s->out[i].data());
  });
}

uint64_t StatsField(const Engine& e, const std::string& field) {
  const std::string stats = e.StatsJson();
  const size_t at = stats.find("\"" + field + "\": ");
  return at == std::string::npos ? 0 : std::stoull(stats.substr(at + field.size() + 4));
}

std::vector<DeclaredTensor> AsDeclared(const std::vector<FusionDeclaration>& decl, uint64_t bucket_bytes) {
  std::vector<DeclaredTensor> out;
  for (const FusionDeclaration& d : decl) out.push_back(DeclaredTensor{d, bucket_bytes});
  return out;
}

TEST(ADisagreementNamesTheFirstTensorThatDiffersAndBothDeclarations) {
  const std::vector<FusionDeclaration> base = Declarations("say");
  const std::vector<DeclaredTensor> a = AsDeclared(base, 1000);
  // grad5 (1886 floats) has one float more on rank 1.
  std::vector<DeclaredTensor> b = a;
  b[5].tensor.shape = {1887};
  b[5].tensor.bytes += 4;
  const std::string shape = DescribeDisagreement(0, a, 1, b, "unused");
  EXPECT_TRUE(Contains(shape, "the gradients declared for fusion differ across workers: 'say/grad5' has shape [1886] "
                              "float32 (7544 bytes), averaged, compression none on rank 0 but shape [1887] float32 "
                              "(7548 bytes), averaged, compression none on rank 1; every worker must build the same "
                              "model"));
  // The same sentence whichever worker writes it.
  EXPECT_TRUE(DescribeDisagreement(1, b, 0, a, "unused") == shape);
  // A tensor only one worker declares (the priorities of those before it shift too): that tensor.
  std::vector<DeclaredTensor> fewer = a;
  fewer.erase(fewer.begin() + 3);
  for (int i = 0; i < 3; ++i) --fewer[i].tensor.priority;
  const std::string missing = DescribeDisagreement(2, fewer, 0, a, "unused");
  EXPECT_TRUE(Contains(missing, "'say/grad3' is declared on rank 0 (shape ") && Contains(missing, "but not on rank 2"));
  // Only a priority.
  std::vector<DeclaredTensor> urgent = a;
  urgent[7].tensor.priority = 100;
  EXPECT_TRUE(Contains(DescribeDisagreement(0, a, 3, urgent, "unused"), "'say/grad7' has priority 17 on rank 0 but 100 on rank 3"));
  // Only the bucket size; then nothing but the caller's observation.
  EXPECT_TRUE(Contains(DescribeDisagreement(0, a, 1, AsDeclared(base, 2000), "unused"),
                       "in buckets of 1000 bytes on rank 0 but 2000 bytes on rank 1"));
  EXPECT_TRUE(Contains(DescribeDisagreement(0, a, 1, a, "'x' travels alone on rank 1"), "'x' travels alone on rank 1"));
  // Declarations travel as lines (also from Python): every field comes back.
  std::vector<FusionDeclaration> lines = base;
  lines[0].shape = {};
  lines[0].bytes = 4;
  lines[1].name = "a name with spaces";
  lines[2].compression = Encoding::kBFloat16;
  lines[3].dtype = DataType::kFloat64;
  lines[3].bytes *= 2;
  for (const FusionDeclaration& d : lines) {
    FusionDeclaration back;
    if (!ParseFusionDeclarationLine(FusionDeclarationLine(d), &back) || back.name != d.name || back.dtype != d.dtype ||
        back.shape != d.shape || back.bytes != d.bytes || back.priority != d.priority || back.average != d.average ||
        back.compression != d.compression)
      FAIL("the line '" + FusionDeclarationLine(d) + "' did not come back");
  }
  FusionDeclaration bad;
  for (const char* line : {"", "float32 4 16 1 0 none", "float99 4 16 1 0 none x", "float32 4,a 16 1 0 none x",
                           "float32 4 16 1 0 zip x"})
    EXPECT_TRUE(!ParseFusionDeclarationLine(line, &bad));
}

TEST(DeclarationsThatDifferAcrossWorkersFailSoonNamingTheTensorEverywhere) {
  // The operation timeout is 300 s: every callback within 60 s shows the check, not the timeout.
  auto engines = Cluster(3, /*timeout_s=*/300.0);
  if (engines.size() != 3 || !engines[2]) return;
  std::vector<FusionDeclaration> decl = Declarations("apart");
  decl.resize(6);
  for (FusionDeclaration& d : decl) d.average = false;
  // Rank 1 built its model with one more float in grad2 (1955 floats elsewhere).
  std::vector<FusionDeclaration> other = decl;
  other[2].shape[0] += 1;
  other[2].bytes += 4;
  std::vector<Step> steps(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    const std::vector<FusionDeclaration>& mine = r == 1 ? other : decl;
    engines[r]->DeclareFusion("g" + std::to_string(r), mine, Bucket(3) * 100);  // one bucket
    threads.push_back(SubmitAll(*engines[r], mine, &steps[r]));
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    for (const Status& st : AwaitWithin(steps[r], std::chrono::seconds(60))) {
      // Rank 2 hears it from rank 0 (the same buckets) or finds it itself: "rank 1 ... rank 2".
      if (st.ok() || st.code() != Code::kInvalidArgument ||
          !Contains(st.message(), "differ across workers: 'apart/grad2' has shape [") ||
          !Contains(st.message(), "[1955] float32") || !Contains(st.message(), "[1956] float32") ||
          !Contains(st.message(), "on rank 1"))
        FAIL("rank " + std::to_string(r) + ": " + st.message());
    }
  }
}

TEST(AWorkerThatDoesNotFuseFailsSoonAsTheOneThatDoes) {
  auto engines = Cluster(2, /*timeout_s=*/300.0);
  if (engines.size() != 2 || !engines[1]) return;
  std::vector<FusionDeclaration> decl = Declarations("onesided");
  decl.resize(5);
  for (FusionDeclaration& d : decl) d.average = false;
  engines[0]->DeclareFusion("g", decl, Bucket(2) * 100);  // rank 1 declares nothing: all alone
  std::vector<Step> steps(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) threads.push_back(SubmitAll(*engines[r], decl, &steps[r]));
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    for (const Status& st : AwaitWithin(steps[r], std::chrono::seconds(60))) {
      if (st.ok() || !Contains(st.message(), "'onesided/grad0' is declared on rank 0 (shape [1] float32 (4 bytes)") ||
          !Contains(st.message(), "but not on rank 1"))
        FAIL("rank " + std::to_string(r) + ": " + st.message());
    }
  }
}

TEST(ALateWorkerAnotherOrderAndACompileOnOneWorkerOnlyAgree) {
  auto engines = Cluster(2, /*timeout_s=*/300.0);
  if (engines.size() != 2 || !engines[1]) return;
  const std::vector<FusionDeclaration> decl = Declarations("agree");
  std::vector<FusionDeclaration> reversed(decl.rbegin(), decl.rend());
  // Rank 0 declares and submits; rank 1 only after rank 0 has asked it about a waiting bucket
  // (rank 1 had declared nothing yet: no answer proves anything). Rank 1 declares the same
  // tensors in another order under another group name.
  engines[0]->DeclareFusion("optimizer 1", decl, Bucket(2) / 8);  // several buckets
  std::vector<Step> steps(2);
  std::thread first = SubmitAll(*engines[0], decl, &steps[0]);
  first.join();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (StatsField(*engines[0], "fusion_questions") == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  if (StatsField(*engines[0], "fusion_questions") == 0) FAIL("rank 0 never asked rank 1 about its waiting bucket");
  engines[1]->DeclareFusion("optimizer 2", reversed, Bucket(2) / 8);
  std::thread second = SubmitAll(*engines[1], decl, &steps[1]);
  second.join();
  for (Step& s : steps)
    for (const Status& st : AwaitWithin(s, std::chrono::seconds(60)))
      if (!st.ok()) FAIL(st.message());
  for (size_t i = 0; i < decl.size(); ++i)
    if (steps[0].out[i] != std::vector<float>(decl[i].bytes / 4, decl[i].average ? 1.0f : 2.0f) ||
        steps[1].out[i] != steps[0].out[i])
      FAIL("not the sum: " + decl[i].name);
  if (OpsDone(*engines[0]) >= decl.size()) FAIL("the tensors did not travel fused");
  // Rank 1 alone compiles again (a new group for the same tensors): nothing changes for the plan.
  engines[1]->DeclareFusion("optimizer 3", decl, Bucket(2) / 8);
  std::vector<Step> again = RunStep(engines, decl, 4);
  SameEverywhere(again, decl);
}

TEST(DeclarationsAreCheckedAndOneWorkerNeverFuses) {
  Fuser fuser;
  std::vector<FusionDeclaration> decl = Declarations("check");
  decl.push_back(decl.front());
  EXPECT_TRUE(!fuser.Declare("g", decl, 4, 1 << 20).ok());
  decl.pop_back();
  decl[0].bytes = 7;  // not whole float32 elements
  EXPECT_TRUE(!fuser.Declare("g", decl, 4, 1 << 20).ok());
  decl[0].bytes = 8;  // not its shape
  EXPECT_TRUE(!fuser.Declare("g", decl, 4, 1 << 20).ok());
  decl = Declarations("check");
  // A lane's dealt buckets (FusionByLane) must name each of its tensors at most once.
  const std::vector<std::vector<int>> twice = {{0, 1}, {1}}, outside = {{0, 24}}, dealt = {{0, 1}, {2}};
  EXPECT_TRUE(!fuser.Declare("g", decl, 4, 1 << 20, &twice).ok());
  EXPECT_TRUE(!fuser.Declare("g", decl, 4, 1 << 20, &outside).ok());
  EXPECT_TRUE(fuser.Declare("g", decl, 4, 1 << 20, &dealt).ok());
  EXPECT_TRUE(fuser.Declare("g", decl, 1, 1 << 20).ok());
  OpRequest q;
  q.name = decl[0].name;
  EXPECT_TRUE(!fuser.Fuses(q));
  EXPECT_TRUE(fuser.Declare("g", decl, 4, 1 << 20).ok());
  EXPECT_TRUE(fuser.Fuses(q));
  q.kind = OpKind::kAllgather;
  EXPECT_TRUE(!fuser.Fuses(q));
  // Groups: a re-declaration replaces its group's plan; another group declaring the same tensors
  // (a model compiled again: a new optimizer for the same gradients) replaces the old group.
  q.kind = OpKind::kPushPull;
  EXPECT_TRUE(fuser.Declare("h", Declarations("other"), 4, 1 << 20).ok());
  EXPECT_TRUE(fuser.Declare("g", decl, 4, 0).ok());  // none of g fused any more
  EXPECT_TRUE(!fuser.Fuses(q));
  q.name = "other/grad0";
  EXPECT_TRUE(fuser.Fuses(q));
  std::vector<FusionDeclaration> some(decl.begin(), decl.begin() + 2);
  some.push_back(Declarations("other")[0]);
  EXPECT_TRUE(fuser.Declare("recompiled", some, 4, 1 << 20).ok());
  EXPECT_TRUE(fuser.Fuses(q));  // now in "recompiled"'s bucket
  q.name = "other/grad1";
  EXPECT_TRUE(!fuser.Fuses(q));  // "h" was replaced: its other tensors travel alone
  // Not while a member of a plan it replaces waits for its bucket.
  std::vector<OpRequest> ready;
  std::vector<Fuser::Refusal> refused;
  std::string notice;
  OpRequest held;
  held.kind = OpKind::kPushPull;
  held.name = some[0].name;
  held.dtype = some[0].dtype;
  held.shape = some[0].shape;
  held.bytes = some[0].bytes;
  held.priority = some[0].priority;
  held.average = some[0].average;
  held.compression = some[0].compression;
  std::vector<char> data(held.bytes);
  held.input = held.output = data.data();
  held.done = [](const Status&, const GatherResult*) {};
  fuser.Hold(std::move(held), 0, 0, &ready, &refused, &notice);
  EXPECT_TRUE(ready.empty() && refused.empty());
  const Status late = fuser.Declare("again", some, 4, 1 << 20);
  EXPECT_TRUE(!late.ok() && Contains(late.message(), "declare between steps"));
  std::vector<OpRequest> all;
  fuser.TakeAll(&all);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
