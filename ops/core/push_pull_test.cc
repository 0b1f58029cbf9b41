// push_pull on its own: one worker's PushPull driven through CollectiveHost by a fake engine
// (no sockets, no thread). Contributions stream in concurrently and in pieces, early frames
// arrive whole; the sum, the RESULTs, the scheduling, the credit and the failures are checked.
#include "ops/core/push_pull.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
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

// One peer's PUSH on its way in, received as a Connection would: into the sink the operation
// chose when its header arrived, piece by piece; a held (kBuffer) frame is handed over whole.
struct Incoming {
  Incoming(PushPull& op, int peer, const FrameMeta& meta, const char* from)
      : op(op), peer(peer), meta(meta), from(from), sink(op.OnFrame(peer, meta)) {
    if (sink.kind == PayloadSink::Kind::kBuffer) held = ByteBuffer(meta.payload_bytes);
  }
  // Bytes [at, at + len) of the payload arrive.
  void Receive(uint64_t at, uint64_t len) {
    switch (sink.kind) {
      case PayloadSink::Kind::kInto:
        std::memcpy(sink.into + at, from + at, len);
        if (sink.consume) sink.consume(at, sink.into + at, len);
        break;
      case PayloadSink::Kind::kStream: sink.consume(at, from + at, len); break;
      case PayloadSink::Kind::kBuffer: std::memcpy(held.data() + at, from + at, len); break;
      case PayloadSink::Kind::kDiscard: break;
    }
  }
  // The last byte arrived.
  void Done() {
    if (sink.kind == PayloadSink::Kind::kBuffer) op.OnWholeFrame(peer, meta, &held);
    else if (sink.kind != PayloadSink::Kind::kDiscard) op.OnPayloadDone(peer, meta);
  }
  PushPull& op;
  int peer;
  FrameMeta meta;
  const char* from;
  PayloadSink sink;
  ByteBuffer held;
};

// Rank 0 of 3. Peers' contributions to rank 0's partitions stream in interleaved pieces (one
// peer ahead of the other), or arrive whole (early frames); RESULTs come back for the others.
// Compressed, the owner adds the decoded codes to its own float32 values (in its order: rank 1's,
// then rank 2's, held while it ran ahead), sends the encoded sum and holds its decoding itself.
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
      volatile float seeded = run.input[first + i] + d1[i];
      expected[first + i] = seeded + d2[i];
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
    // Rank 2 comes after rank 1 in rank 0's summation order: while rank 1's contribution is
    // in, rank 2's is held. Rank 1's streams (straight into the output when it is separate and
    // not encoded).
    Incoming in2(*run.op, 2, c2.meta, c2.payload.data()), in1(*run.op, 1, c1.meta, c1.payload.data());
    EXPECT_TRUE(in2.sink.kind == PayloadSink::Kind::kBuffer);
    EXPECT_TRUE(in1.sink.kind == (in_place || codec.compresses() ? PayloadSink::Kind::kStream : PayloadSink::Kind::kInto));
    // Rank 2 runs 3 pieces ahead of rank 1; pieces of 1025 elements.
    const uint64_t piece = codec.WireBytes(4100), bytes = c1.payload.size();
    uint64_t at1 = 0, at2 = 0;
    while (at1 < bytes || at2 < bytes) {
      if (at2 < bytes && (at2 <= at1 + 3 * piece || at1 >= bytes)) {
        const uint64_t len = std::min(piece, bytes - at2);
        in2.Receive(at2, len);
        at2 += len;
      } else {
        const uint64_t len = std::min(piece, bytes - at1);
        in1.Receive(at1, len);
        at1 += len;
      }
    }
    in2.Done();
    EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), summed);  // one contribution missing
    in1.Done();
    EXPECT_EQ(run.host.SentTo(1, FrameType::kResult).size(), ++summed);
  }
  const int held = static_cast<int>(owned);  // rank 2's contribution to each, before its turn
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
  // Every encoded payload (one per PUSH, one per owned partition's RESULT) and every held
  // contribution went back to the pool.
  EXPECT_EQ(run.host.buffers_taken, codec.compresses() ? static_cast<int>(parts.size()) : 0);
  EXPECT_EQ(run.host.buffers_given, run.host.buffers_taken + held);
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

// Contributions whose float32 sum depends on the order of the additions: 1e8 absorbs 1 and 3
// (its ulp is 8), so ((1e8 + 1) - 1e8) + 3 == 3 but ((1e8 - 1e8) + 1) + 3 == 4.
std::vector<float> OrderSensitive(size_t elements, int rank) {
  static const float kTerms[] = {1e8f, 1.0f, -1e8f, 3.0f};
  std::vector<float> v(elements);
  for (size_t i = 0; i < elements; ++i) v[i] = kTerms[(i / 3 + i + static_cast<size_t>(rank)) % 4];
  return v;
}

enum class Arrival { kWhole, kStreamed };

// This worker is `rank` of `n`; the peers' contributions to its partitions arrive in `order`
// (whole, as early frames do, or streamed with every peer's pieces interleaved in that order).
// Returns its output.
std::vector<float> SumInArrivalOrder(int rank, int n, const std::vector<int>& order, Arrival arrival, bool in_place) {
  const size_t elements = 10000 + 3;  // 16 partitions of at most 4 KiB, uneven
  Run run(rank, n, elements, in_place);
  run.host.options_.partition_bytes = 4096;
  const std::vector<float> own = OrderSensitive(elements, rank);
  std::copy(own.begin(), own.end(), run.input.begin());  // in place, the request points at it
  run.op->Start();
  std::vector<std::vector<float>> values(n);
  for (int r = 0; r < n; ++r) values[r] = OrderSensitive(elements, r);
  const std::vector<Partition> parts = MakePartitions("grad/dense", 4 * elements, 4, n, 4096);
  int owned = 0;
  for (uint32_t p = 0; p < parts.size(); ++p) {
    if (parts[p].owner != rank) continue;
    ++owned;
    const FrameMeta meta = PartMeta(FrameType::kPush, parts, p, elements);
    std::vector<std::unique_ptr<Incoming>> in;
    for (int peer : order) {
      const char* from = reinterpret_cast<const char*>(values[peer].data()) + parts[p].offset;
      in.push_back(std::make_unique<Incoming>(*run.op, peer, meta, from));
      if (arrival == Arrival::kWhole) {
        in.back()->Receive(0, parts[p].bytes);
        in.back()->Done();
      }
    }
    if (arrival == Arrival::kStreamed) {
      for (uint64_t at = 0; at < parts[p].bytes; at += 1000)
        for (auto& c : in) c->Receive(at, std::min<uint64_t>(1000, parts[p].bytes - at));
      for (auto& c : in) c->Done();
    }
    EXPECT_EQ(run.host.SentTo((rank + 1) % n, FrameType::kResult).size(), static_cast<size_t>(owned));
  }
  EXPECT_TRUE(owned > 0);
  return std::vector<float>(run.out(), run.out() + elements);
}

// The owner sums in one order whatever the order of arrival: every permutation of the peers, whole
// or streamed, in place or not, gives the same bits, those of own + (rank+1) + (rank+2) + ...
TEST(SumDoesNotDependOnArrivalOrder) {
  for (int n : {3, 4}) {
    // The terms are chosen so that the order matters: arrival-order sums differ.
    std::set<std::vector<uint32_t>> arrival_sums;
    std::vector<int> peers;
    for (int r = 1; r < n; ++r) peers.push_back(r);
    do {
      std::vector<float> sum = OrderSensitive(64, 0);
      for (int peer : peers) {
        const std::vector<float> v = OrderSensitive(64, peer);
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += v[i];
      }
      std::vector<uint32_t> bits(sum.size());
      std::memcpy(bits.data(), sum.data(), 4 * sum.size());
      arrival_sums.insert(bits);
    } while (std::next_permutation(peers.begin(), peers.end()));
    EXPECT_TRUE(arrival_sums.size() > 1);

    for (int rank = 0; rank < n; ++rank) {
      const size_t elements = 10003;
      std::vector<float> expected = OrderSensitive(elements, rank);
      for (int k = 1; k < n; ++k) {
        const std::vector<float> v = OrderSensitive(elements, (rank + k) % n);
        for (size_t i = 0; i < elements; ++i) expected[i] += v[i];
      }
      std::vector<int> order;
      for (int r = 0; r < n; ++r)
        if (r != rank) order.push_back(r);
      do {
        for (Arrival arrival : {Arrival::kWhole, Arrival::kStreamed})
          for (bool in_place : {false, true}) {
            const std::vector<float> got = SumInArrivalOrder(rank, n, order, arrival, in_place);
            // Only the owned partitions are summed here; the rest of the output is not this test's.
            const std::vector<Partition> parts = MakePartitions("grad/dense", 4 * elements, 4, n, 4096);
            bool same = true;
            for (const Partition& p : parts)
              if (p.owner == rank)
                same = same && std::memcmp(reinterpret_cast<const char*>(got.data()) + p.offset,
                                           reinterpret_cast<const char*>(expected.data()) + p.offset, p.bytes) == 0;
            if (!same)
              std::printf("  n=%d rank=%d %s%s: the sum depends on the arrival order\n", n, rank,
                          arrival == Arrival::kWhole ? "whole" : "streamed", in_place ? " in place" : "");
            EXPECT_TRUE(same);
          }
      } while (std::next_permutation(order.begin(), order.end()));
    }
  }
}

// Streaming is kept where the order allows it: with more than two workers the first peer in the
// owner's order still lands straight in the output, the others stream when their turn has come
// (and are held only when they arrive before it).
TEST(FirstPeerInOrderStreamsIntoTheOutput) {
  const size_t elements = 1000;  // one partition
  const std::vector<Partition> parts = MakePartitions("grad/dense", 4 * elements, 4, 4, 1 << 20);
  EXPECT_EQ(parts.size(), 1u);
  const int owner = parts[0].owner;
  Run run(owner, 4, elements, /*in_place=*/false);
  run.op->Start();
  const std::vector<float> values = Values(elements, 9);
  const char* from = reinterpret_cast<const char*>(values.data());
  const FrameMeta meta = PartMeta(FrameType::kPush, parts, 0, elements);
  Incoming first(*run.op, (owner + 1) % 4, meta, from);
  EXPECT_TRUE(first.sink.kind == PayloadSink::Kind::kInto && first.sink.consume != nullptr);
  first.Receive(0, parts[0].bytes);
  first.Done();
  Incoming third(*run.op, (owner + 3) % 4, meta, from);  // before its turn
  EXPECT_TRUE(third.sink.kind == PayloadSink::Kind::kBuffer);
  Incoming second(*run.op, (owner + 2) % 4, meta, from);  // its turn
  EXPECT_TRUE(second.sink.kind == PayloadSink::Kind::kStream);
  third.Receive(0, parts[0].bytes);
  third.Done();
  EXPECT_TRUE(run.host.SentTo((owner + 1) % 4, FrameType::kResult).empty());
  second.Receive(0, parts[0].bytes);
  second.Done();
  EXPECT_EQ(run.host.SentTo((owner + 1) % 4, FrameType::kResult).size(), 1u);
  EXPECT_EQ(run.host.buffers_given, 1);
}

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
