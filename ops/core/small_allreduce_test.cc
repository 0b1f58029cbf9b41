// The exchange of small push_pulls (small_allreduce.h): the plan, the threshold, and N workers'
// SmallAllreduce operations wired through fake hosts (no sockets), with frames delivered in
// random orders, some before the receiver started its operation (as the engine's early frames).
// Real engines (equal bits, a dead peer named) are in engine_test.cc.
#include "ops/core/small_allreduce.h"

#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ops/core/schedule_traits.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

struct Message {
  int from = 0, to = 0;
  FrameMeta meta;
  std::string payload;
};

class FakeHost : public CollectiveHost {
 public:
  FakeHost(int rank, int n, std::vector<Message>* wire) : wire_(wire) {
    options_.rank = rank;
    options_.world_size = n;
  }
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  const EngineOptions& options() const override { return options_; }
  void Send(int peer, OutFrame frame) override {
    Message m;
    m.from = rank();
    m.to = peer;
    const char* payload = nullptr;
    std::string whole = frame.head + frame.owned;
    EXPECT_TRUE(frame.tag == 0 && frame.owned.size() == frame.payload_len);  // the frame owns its values
    EXPECT_TRUE(DecodeFrame(whole.data(), whole.size(), &m.meta, &payload).ok());
    m.payload.assign(payload, m.meta.payload_bytes);
    ++frames_sent;
    wire_->push_back(std::move(m));
  }
  bool Alive(uint64_t) const override { return finishes == 0; }
  void Finish(Collective* op, const Status& status) override {
    ++finishes;
    op->Complete(status);
  }
  void FailEverywhere(Collective* op, const std::string& message) override {
    failed_everywhere = message;
    Finish(op, Status(Code::kInvalidArgument, message));
  }
  void Refuse(Collective* op, int, const std::string& message) override { FailEverywhere(op, message); }
  void Announce(const TensorReady&) override { ++announced; }
  void Schedule(SendTask) override { ++scheduled; }
  void PushLeft(const SendTask&) override {}
  void PushCompleted(const TransferDone&) override {}
  ByteBuffer TakeBuffer(size_t bytes) override { return ByteBuffer(bytes); }
  void GiveBuffer(ByteBuffer) override {}

  EngineOptions options_;
  std::vector<Message>* wire_;
  int frames_sent = 0, finishes = 0, announced = 0, scheduled = 0;
  std::string failed_everywhere;
};

// N workers' operations of one push_pull.
struct Job {
  Job(int n, DataType dtype, const std::vector<std::vector<char>>& inputs, bool average, bool in_place)
      : n(n), inputs(inputs) {
    outputs.assign(n, std::vector<char>(inputs[0].size(), 0x5a));
    status.assign(n, Status(Code::kInternal, "not done"));
    done.assign(n, 0);
    for (int r = 0; r < n; ++r) {
      hosts.push_back(std::make_unique<FakeHost>(r, n, &wire));
      OpRequest q;
      q.kind = OpKind::kPushPull;
      q.name = "metrics/loss";
      q.dtype = dtype;
      q.shape = {static_cast<int64_t>(inputs[0].size() / DataTypeSize(dtype))};
      q.input = this->inputs[r].data();
      q.output = in_place ? this->inputs[r].data() : outputs[r].data();
      q.bytes = inputs[0].size();
      q.average = average;
      q.priority = 7;
      q.done = [this, r](const Status& s, const GatherResult*) {
        status[r] = s;
        ++done[r];
      };
      ops.push_back(std::make_unique<SmallAllreduce>(hosts[r].get(), 1, std::move(q), 3));
      out.push_back(in_place ? this->inputs[r].data() : outputs[r].data());
    }
    started.assign(n, false);
    early.resize(n);
  }

  // Starts every operation at a random moment and delivers the frames in a random order; a frame
  // for an operation not started yet is held and handed over whole right after it starts.
  void Run(uint64_t seed) {
    std::mt19937_64 rng(seed);
    int not_started = n;
    while (not_started > 0 || !wire.empty()) {
      const bool start = not_started > 0 && (wire.empty() || rng() % 3 == 0);
      if (start) {
        int pick = static_cast<int>(rng() % static_cast<uint64_t>(not_started));
        int r = 0;
        for (; r < n; ++r)
          if (!started[r] && pick-- == 0) break;
        started[r] = true;
        --not_started;
        ops[r]->Start();
        for (Message& m : early[r]) Deliver(m, /*whole=*/true);
        early[r].clear();
        continue;
      }
      const size_t at = static_cast<size_t>(rng() % wire.size());
      Message m = std::move(wire[at]);
      wire.erase(wire.begin() + static_cast<long>(at));
      if (!started[m.to]) {
        early[m.to].push_back(std::move(m));
        continue;
      }
      Deliver(m, rng() % 2 == 0);
    }
  }

  void Deliver(const Message& m, bool whole) {
    SmallAllreduce& op = *ops[m.to];
    if (hosts[m.to]->finishes) return;  // failed already: the engine drops its frames
    ByteBuffer data(m.payload.size());
    if (!m.payload.empty()) std::memcpy(data.data(), m.payload.data(), m.payload.size());
    if (whole) {
      op.OnWholeFrame(m.from, m.meta, &data);
      return;
    }
    const PayloadSink sink = op.OnFrame(m.from, m.meta);
    if (sink.kind == PayloadSink::Kind::kBuffer) op.OnWholeFrame(m.from, m.meta, &data);
  }

  std::vector<char> Output(int r) const {
    return std::vector<char>(static_cast<const char*>(out[r]), static_cast<const char*>(out[r]) + inputs[0].size());
  }

  int n;
  std::vector<std::vector<char>> inputs, outputs;
  std::vector<void*> out;
  std::vector<Message> wire;
  std::vector<std::vector<Message>> early;
  std::vector<std::unique_ptr<FakeHost>> hosts;
  std::vector<std::unique_ptr<SmallAllreduce>> ops;
  std::vector<bool> started;
  std::vector<Status> status;
  std::vector<int> done;
};

template <typename T>
std::vector<char> Bytes(const std::vector<T>& v) {
  std::vector<char> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// float32 terms whose sum depends on the order of the additions (1e8 absorbs 1 and 3).
std::vector<std::vector<char>> OrderSensitive(int n, size_t elements) {
  static const float kTerms[] = {1e8f, 1.0f, -1e8f, 3.0f, 0.1f, -7.5f};
  std::vector<std::vector<char>> in;
  for (int r = 0; r < n; ++r) {
    std::vector<float> v(elements);
    for (size_t i = 0; i < elements; ++i) v[i] = kTerms[(i / 3 + i * 5 + static_cast<size_t>(r) * 7) % 6];
    in.push_back(Bytes(v));
  }
  return in;
}

TEST(EveryFrameOfThePlanHasItsReceiverAndStagesAreLogarithmic) {
  for (int n = 2; n <= 70; ++n) {
    int log2 = 0;
    while ((2 << log2) <= n) ++log2;
    const int power = 1 << log2;
    EXPECT_EQ(ExchangeStages(n), log2 + (power == n ? 0 : 2));
    std::multiset<std::vector<int>> sends, receives;  // {from, to, stage}
    for (int r = 0; r < n; ++r) {
      int sent = 0, last_stage = -1;
      for (const ExchangeStep& s : ExchangePlan(r, n)) {
        EXPECT_TRUE(s.stage > last_stage && s.stage < ExchangeStages(n));  // in stage order
        last_stage = s.stage;
        if (s.send_to >= 0) sends.insert({r, s.send_to, s.stage}), ++sent;
        if (s.receive_from >= 0) receives.insert({s.receive_from, r, s.stage});
        EXPECT_TRUE(s.send_to != r && s.receive_from != r);
      }
      EXPECT_TRUE(sent <= log2 + 1);  // log2(N) messages per worker, +1 for a folded pair
    }
    EXPECT_TRUE(sends == receives);
  }
}

// The rule (ExchangeTimeNs against OwnerTimeNs) with the model every worker assumes: 20 us per
// frame, 25 us of link latency, 10 Gbit/s.
TEST(TheExchangeWhereItsPredictedLatencyIsBelowTheOwners) {
  const uint64_t partition = 4u << 20;
  const ExchangeModel assumed;
  EXPECT_NEAR(assumed.message_ns, 20000.0, 1e-9);
  EXPECT_NEAR(assumed.latency_ns, 25000.0, 1e-9);
  // By hand, an 8-byte tensor (6.4 ns on the wire): N = 2, one hop against a push and its sum.
  EXPECT_NEAR(ExchangeTimeNs(2, 8), 45000 + 6.4, 1e-6);
  EXPECT_NEAR(OwnerTimeNs(2, 8), 90000 + 12.8, 1e-6);
  // N = 8: 3 stages (135 us) against 2 hops and the owner's 8 frames (210 us).
  EXPECT_NEAR(ExchangeTimeNs(8, 8), 3 * 45000 + 3 * 6.4, 1e-6);
  EXPECT_NEAR(OwnerTimeNs(8, 8), 50000 + 160000 + 14 * 6.4, 1e-6);
  // 1 MiB at N = 64 has 16 owners (MakePartitions: one per 64 KiB), which share its 2 x 63 copies.
  EXPECT_NEAR(OwnerTimeNs(64, 1 << 20), 50000 + 64 * 20000 + 2 * 63 * (1 << 20) / 1.25 / 16, 1e-3);
  ExchangeModel exact;  // a schedule with exact partitions (kNoExtraSplit) keeps it on one owner
  exact.min_split_bytes = ~uint64_t{0};
  EXPECT_NEAR(OwnerTimeNs(64, 1 << 20, exact), 50000 + 64 * 20000 + 2 * 63 * (1 << 20) / 1.25, 1e-3);
  auto applies = [&](uint64_t bytes, int n) { return SmallAllreduceApplies(bytes, n, partition, Encoding::kNone); };
  // Small N: the exchange at 2 and 4 (fewer hops or as many), the owner at 3, 5 and 6 (the fold
  // adds two hops that the few frames it saves the owner do not pay for).
  EXPECT_TRUE(applies(8, 2) && applies(8, 4));
  EXPECT_TRUE(!applies(8, 3) && !applies(8, 5) && !applies(8, 6));
  // Large N: the exchange, at every N from 7 to 256, and by far from 25 on (latency-bound: less
  // than half the owner's time).
  for (int n = 7; n <= 256; ++n) {
    EXPECT_TRUE(applies(8, n));
    if (n >= 25) EXPECT_TRUE(ExchangeTimeNs(n, 8) < OwnerTimeNs(n, 8) / 2);
  }
  // Without the latency the exchange would win at 5 and 6 too: the latency is what the fold's
  // extra hops cost. Larger tensors tilt it towards the exchange (fewer bytes through one link).
  ExchangeModel no_latency;
  no_latency.latency_ns = 0;
  EXPECT_TRUE(SmallAllreduceApplies(8, 5, partition, Encoding::kNone, no_latency));
  EXPECT_TRUE(SmallAllreduceApplies(8, 6, partition, Encoding::kNone, no_latency));
  EXPECT_TRUE(!applies(2000, 6) && applies(4000, 6) && !applies(30000, 3) && applies(32000, 3));
  // What fits: one frame, below N x 64 KiB, uncompressed, not empty.
  EXPECT_TRUE(applies(2 * 65536 - 4, 2) && !applies(2 * 65536, 2));
  EXPECT_TRUE(!SmallAllreduceApplies(8192, 2, 4096, Encoding::kNone));
  EXPECT_TRUE(!SmallAllreduceApplies(8, 8, partition, Encoding::kFloat16));
  EXPECT_TRUE(!applies(0, 8) && !applies(8, 1));
  // The engine: control collectives only; kSmallAllreduceNever and kSmallAllreduceAlways.
  OpRequest control;
  control.bytes = 8;
  control.priority = kControlPriority;
  OpRequest gradient = control;
  gradient.priority = 5;
  EngineOptions options;
  // The engine hands its policies options with the schedule's partition size resolved (a setting
  // of 0 means the schedule's own).
  options.partition_bytes = ResolvePartitionBytes(options.partition_bytes, options.schedule);
  options.small_allreduce = EngineOptions::kSmallAllreduceAuto;
  EXPECT_TRUE(ExchangesThis(control, 8, options) && !ExchangesThis(gradient, 8, options));
  EXPECT_TRUE(!ExchangesThis(control, 3, options));
  OpRequest bucket = control;  // to be cut as a bucket (the replay's scaled probe)
  bucket.fusion_bucket_bytes = bucket.bytes;
  EXPECT_TRUE(!ExchangesThis(bucket, 8, options));
  options.small_allreduce = EngineOptions::kSmallAllreduceAlways;
  EXPECT_TRUE(ExchangesThis(control, 3, options) && ExchangesThis(gradient, 3, options));
  options.small_allreduce = EngineOptions::kSmallAllreduceNever;
  EXPECT_TRUE(!ExchangesThis(control, 8, options));
}

// N = 2..8: every worker ends with the same bits, whatever order frames arrive in (60 random
// orders each, frames early or streamed), and the same bits in every order.
TEST(EqualBitsOnEveryWorkerInEveryArrivalOrder) {
  for (int n = 2; n <= 8; ++n) {
    for (bool in_place : {false, true}) {
      std::set<std::vector<char>> results;
      for (uint64_t seed = 0; seed < 60; ++seed) {
        Job job(n, DataType::kFloat32, OrderSensitive(n, 61), /*average=*/false, in_place);
        job.Run(seed * 1000 + static_cast<uint64_t>(n));
        for (int r = 0; r < n; ++r) {
          EXPECT_EQ(job.done[r], 1);
          EXPECT_TRUE(job.status[r].ok());
          EXPECT_TRUE(job.Output(r) == job.Output(0));
          EXPECT_EQ(job.hosts[r]->scheduled, 0);  // nothing through the scheduler
          EXPECT_EQ(job.hosts[r]->announced, 1);  // the profile still sees the tensor
          int sends = 0;
          for (const ExchangeStep& s : ExchangePlan(r, n)) sends += s.send_to >= 0;
          EXPECT_EQ(job.hosts[r]->frames_sent, sends);
        }
        results.insert(job.Output(0));
      }
      if (results.size() != 1) std::printf("  N=%d: %zu different results\n", n, results.size());
      EXPECT_EQ(results.size(), 1u);
    }
  }
}

TEST(SumsAndAveragesExactly) {
  for (int n = 2; n <= 8; ++n) {
    std::vector<std::vector<char>> ints, floats;
    std::vector<int32_t> int_sum(37, 0);
    std::vector<float> mean(37, 0);
    for (int r = 0; r < n; ++r) {
      std::vector<int32_t> iv(37);
      std::vector<float> fv(37);
      for (size_t i = 0; i < iv.size(); ++i) {
        iv[i] = static_cast<int32_t>(i * 1000003 + static_cast<size_t>(r) * 77) - 5000;
        int_sum[i] += iv[i];
        fv[i] = static_cast<float>(static_cast<int>(i) - 3 * r) * static_cast<float>(n);  // the mean is exact
        mean[i] += fv[i];
      }
      ints.push_back(Bytes(iv));
      floats.push_back(Bytes(fv));
    }
    for (float& m : mean) m /= static_cast<float>(n);
    Job sum(n, DataType::kInt32, ints, false, false);
    sum.Run(1);
    Job avg(n, DataType::kFloat32, floats, true, true);
    avg.Run(2);
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(sum.Output(r) == Bytes(int_sum));
      EXPECT_TRUE(avg.Output(r) == Bytes(mean));
    }
  }
}

// A frame that does not fit fails the operation everywhere with a message naming both sides.
TEST(FramesThatDoNotFitFailNamingTheProblem) {
  const int n = 4;
  auto inputs = OrderSensitive(n, 8);
  {  // another shape
    Job job(n, DataType::kFloat32, inputs, false, false);
    job.ops[0]->Start();
    Message m = job.wire[0];  // rank 0's first frame, to rank 1
    job.ops[1]->Start();
    m.meta.shape = {2, 4};
    job.Deliver(m, false);
    EXPECT_TRUE(Contains(job.hosts[1]->failed_everywhere, "'metrics/loss'") &&
                Contains(job.hosts[1]->failed_everywhere, "[8]") && Contains(job.hosts[1]->failed_everywhere, "[2, 4]"));
  }
  {  // a stage it does not expect from that rank, and the same stage twice
    Job job(n, DataType::kFloat32, inputs, false, false);
    job.ops[0]->Start();
    job.ops[2]->Start();
    Message m = job.wire[0];
    m.from = 1;  // rank 2's partners are rank 3 (stage 0) and rank 0 (stage 1), never rank 1
    m.to = 2;
    m.meta.partition = 0;
    job.Deliver(m, true);
    std::printf("unexpected: %s\n", job.hosts[2]->failed_everywhere.c_str());
    EXPECT_TRUE(Contains(job.hosts[2]->failed_everywhere, "rank 1 sent stage 0"));
    job.ops[1]->Start();
    Message first = job.wire[0];  // 0 -> 1, stage 0
    job.Deliver(first, true);
    EXPECT_TRUE(job.hosts[1]->failed_everywhere.empty());
    job.Deliver(first, true);
    EXPECT_TRUE(Contains(job.hosts[1]->failed_everywhere, "twice"));
    EXPECT_EQ(job.done[1], 1);
  }
}

// By rank: the partners whose frames the worker still needs (the timeout's and a departure's
// message name them).
TEST(WaitingForNamesThePartnerOfTheStageReached) {
  const int n = 4;
  Job job(n, DataType::kFloat32, OrderSensitive(n, 8), false, false);
  job.ops[0]->Start();
  std::vector<bool> w = job.ops[0]->WaitingFor();
  EXPECT_TRUE(w[1] && w[2] && !w[3] && !w[0]);  // stage 0 from rank 1, stage 1 from rank 2
  job.ops[1]->Start();
  const std::vector<Message> sent = job.wire;  // delivering makes rank 0 send again
  for (const Message& m : sent)
    if (m.to == 0) job.Deliver(m, true);
  w = job.ops[0]->WaitingFor();
  EXPECT_TRUE(!w[1] && w[2]);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
