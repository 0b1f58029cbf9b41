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
  void Announce(const TensorReady& ready) override {
    announced.push_back(*ready.name);
    announced_bytes.push_back(ready.bytes);
  }
  void Schedule(SendTask task) override { scheduled.push_back(std::move(task)); }
  void PushLeft(const SendTask& task) override {
    left.push_back(task);
    credit_returned += task.bytes;
  }
  void PushCompleted(const TransferDone& done) override { completed.push_back(done); }
  ByteBuffer TakeBuffer(size_t bytes) override {
    ++buffers_taken;
    return ByteBuffer(bytes);
  }
  void GiveBuffer(ByteBuffer buffer) override { buffers_given += buffer.capacity() > 0; }

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
  std::vector<uint64_t> announced_bytes;
  std::vector<SendTask> scheduled;
  std::vector<SendTask> left;  // PushLeft
  std::vector<TransferDone> completed;
  uint64_t credit_returned = 0;
  int buffers_taken = 0, buffers_given = 0;
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
  Run(int rank, int n, size_t elements, bool in_place, Encoding compression = Encoding::kNone)
      : host(rank, n), elements(elements) {
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
    r.compression = compression;
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

// A peer's contribution to partition `part` as it travels: its values, or their codes.
struct Contribution {
  FrameMeta meta;
  std::vector<char> payload;
};
Contribution Contribute(const PayloadCodec& codec, FrameMeta meta, const std::vector<float>& values,
                        const Partition& part) {
  const char* from = reinterpret_cast<const char*>(values.data()) + part.offset;
  Contribution c;
  c.payload.assign(codec.WireBytes(part.bytes), 0);
  if (codec.compresses()) {
    meta.encoding = codec.encoding();
    meta.scale_exp = codec.Encode(from, part.bytes, c.payload.data());
  } else if (part.bytes) {
    std::memcpy(c.payload.data(), from, part.bytes);
  }
  meta.payload_bytes = c.payload.size();
  c.meta = meta;
  return c;
}

// Rank 0 of 3. Peers' contributions to rank 0's partitions stream in interleaved pieces (one
// peer ahead of the other), or arrive whole (early frames); RESULTs come back for the others.
// Compressed, the owner adds the decoded codes to its own float32 values (rank 2's first: it runs
// ahead), sends the encoded sum and holds its decoding itself.
void SumOfThree(bool in_place, bool whole, Encoding compression = Encoding::kNone) {
  const size_t elements = 3 * (1 << 20) / 4 + 5;  // 3 MiB + 20 bytes: 24 partitions, uneven
  Run run(0, 3, elements, in_place, compression);
  const PayloadCodec codec(compression, DataType::kFloat32);
  const std::vector<float> in1 = Values(elements, 1), in2 = Values(elements, 2);
  const std::vector<Partition> parts = MakePartitions("grad/dense", 4 * elements, 4, 3, 1 << 20);
  // The sums, each partition as the owner computes it, then as it travels.
  std::vector<float> expected(elements);
  std::vector<Contribution> from1, from2;
  for (uint32_t p = 0; p < parts.size(); ++p) {
    from1.push_back(Contribute(codec, PartMeta(FrameType::kPush, parts, p, elements), in1, parts[p]));
    from2.push_back(Contribute(codec, PartMeta(FrameType::kPush, parts, p, elements), in2, parts[p]));
    const size_t first = parts[p].offset / 4, count = parts[p].bytes / 4;
    std::vector<float> d1(count), d2(count);
    if (codec.compresses()) {
      codec.Decode(from1[p].payload.data(), from1[p].payload.size(), from1[p].meta.scale_exp, d1.data());
      codec.Decode(from2[p].payload.data(), from2[p].payload.size(), from2[p].meta.scale_exp, d2.data());
    } else {
      std::copy(in1.begin() + first, in1.begin() + first + count, d1.begin());
      std::copy(in2.begin() + first, in2.begin() + first + count, d2.begin());
    }
    for (size_t i = 0; i < count; ++i) {
      volatile float seeded = run.input[first + i] + d2[i];
      expected[first + i] = seeded + d1[i];
    }
  }
  std::vector<float> travelled = expected;  // what every worker ends with
  std::vector<std::vector<char>> results(parts.size());
  std::vector<int> result_scale(parts.size(), 0);
  for (uint32_t p = 0; p < parts.size() && codec.compresses(); ++p) {
    results[p].assign(codec.WireBytes(parts[p].bytes), 0);
    result_scale[p] = codec.Encode(expected.data() + parts[p].offset / 4, parts[p].bytes, results[p].data());
    codec.Decode(results[p].data(), results[p].size(), result_scale[p], travelled.data() + parts[p].offset / 4);
  }
  run.op->Start();
  EXPECT_EQ(run.host.announced.size(), 1u);
  // The tensor's bytes: the profile describes tensors; the tasks carry what travels.
  if (!run.host.announced_bytes.empty()) EXPECT_EQ(run.host.announced_bytes[0], run.op->request().bytes);
  size_t owned = 0;
  for (const Partition& p : parts) owned += p.owner == 0;
  EXPECT_EQ(run.host.scheduled.size(), parts.size() - owned);
  for (const SendTask& t : run.host.scheduled) {
    EXPECT_EQ(t.name, std::string("grad/dense"));
    EXPECT_EQ(t.round, 4u);
    EXPECT_EQ(t.peer, parts[t.partition].owner);
    EXPECT_EQ(t.bytes, codec.WireBytes(parts[t.partition].bytes));  // what travels
  }
  // The peers push their partitions of rank 0.
  size_t summed = 0;
  for (uint32_t p = 0; p < parts.size(); ++p) {
    if (parts[p].owner != 0) continue;
    const Contribution &c1 = from1[p], &c2 = from2[p];
    if (whole) {
      ByteBuffer data2 = Bytes(c2.payload.data(), c2.payload.size()), data1 = Bytes(c1.payload.data(), c1.payload.size());
      run.op->OnWholeFrame(2, c2.meta, &data2);
      EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), summed);  // one contribution missing
      run.op->OnWholeFrame(1, c1.meta, &data1);
      EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), ++summed);
      continue;
    }
    PayloadSink s1 = run.op->OnFrame(1, c1.meta), s2 = run.op->OnFrame(2, c2.meta);
    EXPECT_TRUE(s1.kind == PayloadSink::Kind::kStream && s2.kind == PayloadSink::Kind::kStream);
    // Rank 2 runs 3 pieces ahead of rank 1; pieces of 1025 elements.
    const uint64_t piece = codec.WireBytes(4100), bytes = c1.payload.size();
    uint64_t at1 = 0, at2 = 0;
    while (at1 < bytes || at2 < bytes) {
      if (at2 < bytes && (at2 <= at1 + 3 * piece || at1 >= bytes)) {
        const uint64_t len = std::min(piece, bytes - at2);
        s2.consume(at2, c2.payload.data() + at2, len);
        at2 += len;
      } else {
        const uint64_t len = std::min(piece, bytes - at1);
        s1.consume(at1, c1.payload.data() + at1, len);
        at1 += len;
      }
    }
    run.op->OnPayloadDone(2, c2.meta);
    EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), summed);  // one contribution missing
    run.op->OnPayloadDone(1, c1.meta);
    EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), ++summed);
  }
  // Every owned partition was summed and sent back to both peers: from the output, or encoded
  // once (the same buffer for both peers) with the codes of the sum.
  const char* first_payload = nullptr;
  for (int peer : {1, 2}) {
    const auto sent = run.host.SentTo(peer, FrameType::kResult);
    EXPECT_EQ(sent.size(), owned);
    for (const auto& [meta, payload] : sent) {
      const uint32_t p = meta.partition;
      EXPECT_TRUE(meta.encoding == compression);
      if (!codec.compresses()) {
        EXPECT_TRUE(payload == reinterpret_cast<const char*>(run.out()) + meta.offset);
        EXPECT_TRUE(std::memcmp(payload, reinterpret_cast<const char*>(expected.data()) + meta.offset,
                                meta.payload_bytes) == 0);
        continue;
      }
      EXPECT_EQ(meta.payload_bytes, results[p].size());
      EXPECT_EQ(meta.scale_exp, result_scale[p]);
      EXPECT_TRUE(std::memcmp(payload, results[p].data(), results[p].size()) == 0);
      if (peer == 1 && first_payload == nullptr) first_payload = payload;
      if (peer == 2 && p == run.host.SentTo(1, FrameType::kResult)[0].first.partition)
        EXPECT_TRUE(payload == first_payload);
    }
  }
  // This worker's PUSHes go out when the scheduler releases them (encoded when compressed),
  // leave (their credit returns, not waiting for any other worker), and their RESULTs come back.
  uint64_t pushed = 0;
  for (const SendTask& t : run.host.scheduled) {
    run.op->SendScheduled(t);
    pushed += t.bytes;
  }
  for (const auto& [meta, payload] : run.host.SentTo(1, FrameType::kPush)) {
    const Contribution mine = Contribute(codec, PartMeta(FrameType::kPush, parts, meta.partition, elements),
                                         Values(elements, 0), parts[meta.partition]);
    EXPECT_EQ(meta.payload_bytes, mine.payload.size());
    EXPECT_EQ(meta.scale_exp, mine.meta.scale_exp);
    EXPECT_TRUE(mine.payload.empty() || std::memcmp(payload, mine.payload.data(), mine.payload.size()) == 0);
  }
  EXPECT_EQ(run.host.credit_returned, 0u);
  run.host.CompleteSends(FrameType::kPush);  // (an encoded payload goes back to the pool here)
  EXPECT_EQ(run.host.credit_returned, pushed);
  EXPECT_EQ(run.host.left.size(), run.host.scheduled.size());
  for (const SendTask& t : run.host.scheduled) {
    const Partition& p = parts[t.partition];
    const uint32_t part = static_cast<uint32_t>(t.partition);
    FrameMeta meta = PartMeta(FrameType::kResult, parts, part, elements);
    std::vector<char> payload(p.bytes);
    std::memcpy(payload.data(), reinterpret_cast<const char*>(expected.data()) + p.offset, p.bytes);
    if (codec.compresses()) {
      payload.resize(codec.WireBytes(p.bytes));
      meta.scale_exp = codec.Encode(expected.data() + p.offset / 4, p.bytes, payload.data());
      meta.encoding = compression;
      meta.payload_bytes = payload.size();
    }
    PayloadSink sink = run.op->OnFrame(p.owner, meta);
    if (!codec.compresses()) {
      EXPECT_TRUE(sink.kind == PayloadSink::Kind::kInto);
      if (sink.kind != PayloadSink::Kind::kInto) continue;
      std::memcpy(sink.into, payload.data(), p.bytes);
    } else {
      EXPECT_TRUE(sink.kind == PayloadSink::Kind::kStream);  // decoded piece by piece
      for (uint64_t at = 0; at < payload.size(); at += 2056)
        sink.consume(at, payload.data() + at, std::min<uint64_t>(2056, payload.size() - at));
    }
    run.op->OnPayloadDone(p.owner, meta);
  }
  EXPECT_EQ(run.host.completed.size(), run.host.scheduled.size());
  EXPECT_EQ(run.done_calls, 0);  // the RESULTs it sent have not left yet
  run.host.CompleteSends();
  EXPECT_EQ(run.done_calls, 1);
  EXPECT_TRUE(run.status.ok());
  EXPECT_EQ(run.host.credit_returned, pushed);  // once per push
  EXPECT_TRUE(std::memcmp(run.out(), travelled.data(), 4 * elements) == 0);
  // Every encoded payload (one per PUSH, one per owned partition's RESULT) went back to the pool.
  EXPECT_EQ(run.host.buffers_taken, codec.compresses() ? static_cast<int>(parts.size()) : 0);
  EXPECT_EQ(run.host.buffers_given, run.host.buffers_taken);
  if (codec.compresses()) {  // it did travel in 16 bits: the low mantissa bits are gone
    size_t rounded = 0;
    for (size_t i = 0; i < elements; ++i) rounded += travelled[i] != expected[i];
    EXPECT_TRUE(rounded > 0);
  }
}

TEST(SumsStreamedContributions) { SumOfThree(/*in_place=*/false, /*whole=*/false); }
TEST(SumsStreamedContributionsInPlace) { SumOfThree(/*in_place=*/true, /*whole=*/false); }
TEST(SumsWholeEarlyContributions) { SumOfThree(/*in_place=*/false, /*whole=*/true); }
TEST(SumsWholeEarlyContributionsInPlace) { SumOfThree(/*in_place=*/true, /*whole=*/true); }
TEST(SumsCompressedContributions) {
  for (Encoding e : {Encoding::kFloat16, Encoding::kBFloat16})
    for (bool in_place : {false, true})
      for (bool whole : {false, true}) SumOfThree(in_place, whole, e);
}

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

TEST(CompressionMismatchFailsEverywhereNamingBothSides) {
  Run run(0, 2, 1000, false, Encoding::kFloat16);
  run.op->Start();
  const std::vector<Partition> parts = MakePartitions("grad/dense", 4000, 4, 2, 1 << 20);
  FrameMeta meta = PartMeta(FrameType::kPush, parts, 0, 1000);  // 4000 uncompressed bytes
  EXPECT_TRUE(run.op->OnFrame(1, meta).kind == PayloadSink::Kind::kDiscard);
  EXPECT_TRUE(run.host.failed_everywhere.find("rank 1 sends it uncompressed but rank 0 compressed to fp16") !=
              std::string::npos);
  EXPECT_EQ(run.done_calls, 1);
  // bf16 against fp16.
  Run other(0, 2, 1000, false, Encoding::kBFloat16);
  other.op->Start();
  meta.encoding = Encoding::kFloat16;
  meta.payload_bytes = 2000;
  other.op->OnFrame(1, meta);
  EXPECT_TRUE(other.host.failed_everywhere.find("compressed to fp16 but rank 0 compressed to bf16") != std::string::npos);
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
  // Compressed: the credit counts the encoded bytes, and the unsent payloads go back to the pool.
  Run compressed(1, 3, 1 << 20, false, Encoding::kBFloat16);
  compressed.op->Start();
  pushed = 0;
  for (const SendTask& t : compressed.host.scheduled) {
    compressed.op->SendScheduled(t);
    pushed += t.bytes;
  }
  uint64_t others = 0;  // bytes of the partitions rank 1 pushes
  for (const Partition& p : MakePartitions("grad/dense", 4u << 20, 4, 3, 1 << 20)) others += p.owner != 1 ? p.bytes : 0;
  EXPECT_EQ(pushed, others / 2);
  compressed.host.Finish(compressed.op.get(), Status(Code::kDeadlineExceeded, "late"));
  EXPECT_EQ(compressed.host.credit_returned, pushed);
  EXPECT_EQ(compressed.host.buffers_given, compressed.host.buffers_taken);
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
