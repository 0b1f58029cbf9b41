// push_pull on its own: one worker's PushPull driven through CollectiveHost by a fake engine
// (no sockets, no thread). Contributions stream in concurrently and in pieces, early frames
// arrive whole; the sum, the RESULTs, the scheduling, the credit and the failures are checked.
#include "ops/core/push_pull.h"

#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

class FakeHost : public CollectiveHost {
 public:
  FakeHost(int rank, int n) {
    options_.rank = rank;
    options_.world_size = n;
    options_.partition_bytes = 1 << 20;
  }
  int rank() const override { return options_.rank; }
  int world_size() const override { return options_.world_size; }
  const EngineOptions& options() const override { return options_; }
  void Send(int peer, OutFrame frame) override { sent.emplace_back(peer, std::move(frame)); }
  bool Alive(uint64_t /*op_id*/) const override { return finishes == 0; }
  void Finish(Collective* op, const Status& status) override {
    ++finishes;
    finished = status;
    op->Complete(status);
  }
  void FailEverywhere(Collective* op, const std::string& message) override {
    failed_everywhere = message;
    Finish(op, Status(Code::kInvalidArgument, message));
  }
  void Refuse(Collective* op, int peer, const std::string& message) override {
    refused_peer = peer;
    FailEverywhere(op, message);
  }
  void Announce(const TensorReady& ready) override { announced.push_back(*ready.name); }
  void Schedule(SendTask task) override { scheduled.push_back(std::move(task)); }
  void PushLeft(const SendTask& task) override {
    left.push_back(task);
    credit_returned += task.bytes;
  }
  void PushCompleted(const TransferDone& done) override { completed.push_back(done); }

  // Runs the on_sent callbacks of the frames of `type` sent so far (all: kError), as the
  // connections would once their last byte is in the kernel.
  void CompleteSends(FrameType type = FrameType::kError) {
    for (auto& [peer, frame] : sent)
      if (frame.on_sent && (type == FrameType::kError || TypeOf(frame) == type)) std::exchange(frame.on_sent, nullptr)();
  }
  static FrameType TypeOf(const OutFrame& frame) {
    FrameMeta meta;
    const char* ignored = nullptr;
    std::string head = frame.head;
    head.append(frame.payload_len, '\0');  // DecodeFrame wants the payload's bytes to exist
    return DecodeFrame(head.data(), head.size(), &meta, &ignored).ok() ? meta.type : FrameType::kError;
  }
  // Decoded frames sent to `peer` of `type`.
  std::vector<std::pair<FrameMeta, const char*>> SentTo(int peer, FrameType type) const {
    std::vector<std::pair<FrameMeta, const char*>> out;
    for (const auto& [p, frame] : sent) {
      FrameMeta meta;
      const char* ignored = nullptr;
      std::string head = frame.head;
      head.append(frame.payload_len, '\0');  // DecodeFrame wants the payload's bytes to exist
      if (p != peer || !DecodeFrame(head.data(), head.size(), &meta, &ignored).ok() || meta.type != type) continue;
      out.emplace_back(meta, frame.owned.empty() ? frame.payload : frame.owned.data());
    }
    return out;
  }

  EngineOptions options_;
  std::vector<std::pair<int, OutFrame>> sent;
  std::vector<std::string> announced;
  std::vector<SendTask> scheduled;
  std::vector<SendTask> left;  // PushLeft
  std::vector<TransferDone> completed;
  uint64_t credit_returned = 0;
  int finishes = 0;
  Status finished;
  std::string failed_everywhere;
  int refused_peer = -1;
};

std::vector<float> Values(size_t n, int rank) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int>((i * 7 + rank * 131) % 2001) - 1000);
  return v;
}

struct Run {
  Run(int rank, int n, size_t elements, bool in_place) : host(rank, n), elements(elements) {
    input = Values(elements, rank);
    output.assign(elements, -12345.0f);
    OpRequest r;
    r.kind = OpKind::kPushPull;
    r.name = "grad/dense";
    r.dtype = DataType::kFloat32;
    r.shape = {static_cast<int64_t>(elements)};
    r.input = input.data();
    r.output = in_place ? input.data() : output.data();
    r.bytes = 4 * elements;
    r.priority = 3;
    r.done = [this](const Status& s, const GatherResult*) {
      ++done_calls;
      status = s;
    };
    op = std::make_unique<PushPull>(&host, 1, std::move(r), 4);
    this->in_place = in_place;
  }
  float* out() { return in_place ? input.data() : output.data(); }
  FakeHost host;
  size_t elements;
  bool in_place = false;
  std::vector<float> input, output;
  std::unique_ptr<PushPull> op;
  int done_calls = 0;
  Status status;
};

// What a peer sends for partition `p` of the test's tensor.
FrameMeta PartMeta(FrameType type, const std::vector<Partition>& parts, uint32_t p, size_t elements) {
  FrameMeta meta;
  meta.type = type;
  meta.dtype = DataType::kFloat32;
  meta.name = "grad/dense";
  meta.round = 4;
  meta.shape = {static_cast<int64_t>(elements)};
  meta.partition = p;
  meta.num_partitions = static_cast<uint32_t>(parts.size());
  meta.offset = parts[p].offset;
  meta.payload_bytes = parts[p].bytes;
  return meta;
}

ByteBuffer Bytes(const char* from, size_t bytes) {
  ByteBuffer b(bytes);
  if (bytes) std::memcpy(b.data(), from, bytes);
  return b;
}

// Rank 0 of 3. Peers' contributions to rank 0's partitions stream in interleaved pieces (one
// peer ahead of the other), or arrive whole (early frames); RESULTs come back for the others.
void SumOfThree(bool in_place, bool whole) {
  const size_t elements = 3 * (1 << 20) / 4 + 5;  // 3 MiB + 20 bytes: 24 partitions, uneven
  Run run(0, 3, elements, in_place);
  const std::vector<float> in1 = Values(elements, 1), in2 = Values(elements, 2);
  std::vector<float> expected(elements);
  for (size_t i = 0; i < elements; ++i) expected[i] = run.input[i] + in1[i] + in2[i];
  run.op->Start();
  EXPECT_EQ(run.host.announced.size(), 1u);
  const std::vector<Partition> parts = MakePartitions("grad/dense", 4 * elements, 4, 3, 1 << 20);
  size_t owned = 0;
  for (const Partition& p : parts) owned += p.owner == 0;
  EXPECT_EQ(run.host.scheduled.size(), parts.size() - owned);
  for (const SendTask& t : run.host.scheduled) {
    EXPECT_EQ(t.name, std::string("grad/dense"));
    EXPECT_EQ(t.round, 4u);
    EXPECT_EQ(t.peer, parts[t.partition].owner);
  }
  // The peers push their partitions of rank 0.
  size_t summed = 0;
  for (uint32_t p = 0; p < parts.size(); ++p) {
    if (parts[p].owner != 0) continue;
    const FrameMeta meta = PartMeta(FrameType::kPush, parts, p, elements);
    const char* from1 = reinterpret_cast<const char*>(in1.data()) + parts[p].offset;
    const char* from2 = reinterpret_cast<const char*>(in2.data()) + parts[p].offset;
    if (whole) {
      ByteBuffer data2 = Bytes(from2, parts[p].bytes), data1 = Bytes(from1, parts[p].bytes);
      run.op->OnWholeFrame(2, meta, &data2);
      EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), summed);  // one contribution missing
      run.op->OnWholeFrame(1, meta, &data1);
      EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), ++summed);
      continue;
    }
    PayloadSink s1 = run.op->OnFrame(1, meta), s2 = run.op->OnFrame(2, meta);
    EXPECT_TRUE(s1.kind == PayloadSink::Kind::kStream && s2.kind == PayloadSink::Kind::kStream);
    // Rank 2 runs 3 pieces ahead of rank 1; pieces of 4 KiB + 4 bytes.
    const uint64_t piece = 4100, bytes = parts[p].bytes;
    uint64_t at1 = 0, at2 = 0;
    while (at1 < bytes || at2 < bytes) {
      if (at2 < bytes && (at2 <= at1 + 3 * piece || at1 >= bytes)) {
        const uint64_t len = std::min(piece, bytes - at2);
        s2.consume(at2, from2 + at2, len);
        at2 += len;
      } else {
        const uint64_t len = std::min(piece, bytes - at1);
        s1.consume(at1, from1 + at1, len);
        at1 += len;
      }
    }
    run.op->OnPayloadDone(2, meta);
    EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), summed);  // one contribution missing
    run.op->OnPayloadDone(1, meta);
    EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), ++summed);
  }
  // Every owned partition was summed and sent back to both peers, from the output.
  for (int peer : {1, 2}) {
    const auto results = run.host.SentTo(peer, FrameType::kResult);
    EXPECT_EQ(results.size(), owned);
    for (const auto& [meta, payload] : results) {
      EXPECT_TRUE(payload == reinterpret_cast<const char*>(run.out()) + meta.offset);
      EXPECT_TRUE(std::memcmp(payload, reinterpret_cast<const char*>(expected.data()) + meta.offset,
                              meta.payload_bytes) == 0);
    }
  }
  // This worker's PUSHes go out when the scheduler releases them, leave (their credit returns,
  // not waiting for any other worker), and their RESULTs come back.
  uint64_t pushed = 0;
  for (const SendTask& t : run.host.scheduled) {
    run.op->SendScheduled(t);
    pushed += t.bytes;
  }
  EXPECT_EQ(run.host.credit_returned, 0u);
  run.host.CompleteSends(FrameType::kPush);
  EXPECT_EQ(run.host.credit_returned, pushed);
  EXPECT_EQ(run.host.left.size(), run.host.scheduled.size());
  for (const SendTask& t : run.host.scheduled) {
    const Partition& p = parts[t.partition];
    const FrameMeta meta = PartMeta(FrameType::kResult, parts, static_cast<uint32_t>(t.partition), elements);
    PayloadSink sink = run.op->OnFrame(p.owner, meta);
    EXPECT_TRUE(sink.kind == PayloadSink::Kind::kInto);
    if (sink.kind != PayloadSink::Kind::kInto) continue;
    std::memcpy(sink.into, reinterpret_cast<const char*>(expected.data()) + p.offset, p.bytes);
    run.op->OnPayloadDone(p.owner, meta);
  }
  EXPECT_EQ(run.host.completed.size(), run.host.scheduled.size());
  EXPECT_EQ(run.done_calls, 0);  // the RESULTs it sent have not left yet
  run.host.CompleteSends();
  EXPECT_EQ(run.done_calls, 1);
  EXPECT_TRUE(run.status.ok());
  EXPECT_EQ(run.host.credit_returned, pushed);  // once per push
  EXPECT_TRUE(std::memcmp(run.out(), expected.data(), 4 * elements) == 0);
}

TEST(SumsStreamedContributions) { SumOfThree(/*in_place=*/false, /*whole=*/false); }
TEST(SumsStreamedContributionsInPlace) { SumOfThree(/*in_place=*/true, /*whole=*/false); }
TEST(SumsWholeEarlyContributions) { SumOfThree(/*in_place=*/false, /*whole=*/true); }
TEST(SumsWholeEarlyContributionsInPlace) { SumOfThree(/*in_place=*/true, /*whole=*/true); }

// Two workers, separate output: the peer's contribution lands in the output and the local values
// are added to each piece as it lands; in place, it goes through the staging path.
void SumOfTwo(bool in_place) {
  const size_t elements = (1 << 20) / 4 + 3;  // 1 MiB + 12 bytes: 16 partitions
  Run run(0, 2, elements, in_place);
  const std::vector<float> in1 = Values(elements, 1);
  std::vector<float> expected(elements);
  for (size_t i = 0; i < elements; ++i) expected[i] = run.input[i] + in1[i];
  run.op->Start();
  const std::vector<Partition> parts = MakePartitions("grad/dense", 4 * elements, 4, 2, 1 << 20);
  for (uint32_t p = 0; p < parts.size(); ++p) {
    if (parts[p].owner != 0) continue;
    const FrameMeta meta = PartMeta(FrameType::kPush, parts, p, elements);
    const char* from = reinterpret_cast<const char*>(in1.data()) + parts[p].offset;
    PayloadSink sink = run.op->OnFrame(1, meta);
    if (in_place) {
      EXPECT_TRUE(sink.kind == PayloadSink::Kind::kStream);
    } else {
      EXPECT_TRUE(sink.kind == PayloadSink::Kind::kInto && sink.consume != nullptr);
      EXPECT_TRUE(sink.into == reinterpret_cast<char*>(run.out()) + parts[p].offset);
    }
    for (uint64_t at = 0; at < parts[p].bytes; at += 4096) {
      const uint64_t len = std::min<uint64_t>(4096, parts[p].bytes - at);
      if (sink.kind == PayloadSink::Kind::kInto) {
        std::memcpy(sink.into + at, from + at, len);  // what the receive does
        sink.consume(at, sink.into + at, len);
      } else {
        sink.consume(at, from + at, len);
      }
    }
    run.op->OnPayloadDone(1, meta);
    const Partition& q = parts[p];
    EXPECT_TRUE(std::memcmp(reinterpret_cast<const char*>(run.out()) + q.offset,
                            reinterpret_cast<const char*>(expected.data()) + q.offset, q.bytes) == 0);
  }
  EXPECT_TRUE(!run.host.SentTo(1, FrameType::kResult).empty());
}

TEST(TwoWorkersReceiveStraightIntoTheOutput) { SumOfTwo(/*in_place=*/false); }
TEST(TwoWorkersInPlaceStageTheContribution) { SumOfTwo(/*in_place=*/true); }

TEST(MismatchesFailEverywhereNamingBothSides) {
  Run run(0, 2, 1000, false);
  run.op->Start();
  FrameMeta meta;
  meta.type = FrameType::kPush;
  meta.dtype = DataType::kFloat32;
  meta.name = "grad/dense";
  meta.round = 4;
  meta.shape = {10, 100};
  meta.num_partitions = 1;
  meta.payload_bytes = 4000;
  const PayloadSink sink = run.op->OnFrame(1, meta);
  EXPECT_TRUE(sink.kind == PayloadSink::Kind::kDiscard);
  EXPECT_TRUE(run.host.failed_everywhere.find("[1000]") != std::string::npos &&
              run.host.failed_everywhere.find("[10, 100]") != std::string::npos);
  EXPECT_EQ(run.done_calls, 1);
  EXPECT_TRUE(run.status.code() == Code::kInvalidArgument);

  // A broadcast under a push_pull's name.
  Run other(0, 2, 1000, false);
  other.op->Start();
  meta.type = FrameType::kBroadcast;
  meta.shape = {1000};
  other.op->OnFrame(1, meta);
  EXPECT_TRUE(other.host.failed_everywhere.find("is a broadcast on rank 1 but a push_pull on rank 0") !=
              std::string::npos);
}

TEST(WaitingForNamesTheMissingRanksAndCreditReturnsOnFailure) {
  Run run(1, 3, 1 << 20, false);  // 1 MiB: 24 partitions over 3 ranks
  run.op->Start();
  std::vector<bool> waiting = run.op->WaitingFor();
  EXPECT_TRUE(waiting[0] && !waiting[1] && waiting[2]);
  uint64_t pushed = 0;
  for (const SendTask& t : run.host.scheduled) {
    run.op->SendScheduled(t);
    pushed += t.bytes;
  }
  // Half of the pushes left; the operation fails before the rest do, and their credit returns
  // then, each push's exactly once.
  for (size_t i = 0; i < run.host.sent.size() / 2; ++i)
    std::exchange(run.host.sent[i].second.on_sent, nullptr)();
  const size_t left_before = run.host.left.size();
  EXPECT_TRUE(left_before > 0 && left_before < run.host.scheduled.size());
  run.host.Finish(run.op.get(), Status(Code::kDeadlineExceeded, "late"));
  EXPECT_EQ(run.host.credit_returned, pushed);
  EXPECT_EQ(run.host.left.size(), run.host.scheduled.size());
  EXPECT_TRUE(run.status.code() == Code::kDeadlineExceeded);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
