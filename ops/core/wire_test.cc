// Frame format: round trips, rejection of garbage with a message naming the field, truncation.
#include "ops/core/wire.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

using ::prophet::testing::Contains;

FrameMeta SampleMeta() {
  FrameMeta m;
  m.type = FrameType::kPush;
  m.dtype = DataType::kFloat32;
  m.name = "resnet50/conv1/kernel:0";
  m.round = 17;
  m.shape = {7, 7, 3, 64};  // 9408 elements, 37632 bytes
  m.partition = 1;
  m.num_partitions = 3;
  m.offset = 12544;  // element-aligned
  m.payload_bytes = 12544;
  return m;
}

// header + tail + payload of `meta` (payload bytes are a counting pattern).
std::string Frame(const FrameMeta& meta) {
  std::string out;
  EncodeFrameMeta(meta, &out);
  for (uint64_t i = 0; i < meta.payload_bytes; ++i) out.push_back(static_cast<char>(i * 31 + 7));
  return out;
}

// A control frame whose payload is `message` (error notices, lost peers).
std::string WithMessage(FrameMeta meta, const std::string& message) {
  meta.payload_bytes = message.size();
  std::string out;
  EncodeFrameMeta(meta, &out);
  return out + message;
}

FrameHeader HeaderOf(const std::string& frame) {
  FrameHeader h;
  std::memcpy(&h, frame.data(), sizeof(h));
  return h;
}

void PutHeader(std::string* frame, const FrameHeader& h) { std::memcpy(&(*frame)[0], &h, sizeof(h)); }

// `frame` with its header changed by edit(FrameHeader&).
template <typename Edit>
std::string WithHeaderEdit(std::string frame, Edit edit) {
  FrameHeader h = HeaderOf(frame);
  edit(h);
  PutHeader(&frame, h);
  return frame;
}

// Decodes and expects kInvalidArgument with `field` in the message.
void ExpectRejected(const std::string& frame, const std::string& field, int line) {
  FrameMeta meta;
  const char* payload = nullptr;
  const Status s = DecodeFrame(frame.data(), frame.size(), &meta, &payload);
  if (s.code() != Code::kInvalidArgument || !Contains(s.message(), field)) {
    std::fprintf(stderr, "wire_test.cc:%d: expected kInvalidArgument naming '%s', got code %d: '%s'\n", line,
                 field.c_str(), static_cast<int>(s.code()), s.message().c_str());
    ++::prophet::testing::Failures();
  }
}
#define EXPECT_REJECTED(frame, field) ExpectRejected(frame, field, __LINE__)

TEST(HeaderIs50BytesLittleEndianMagic) {
  std::string out;
  EncodeFrameMeta(SampleMeta(), &out);
  EXPECT_EQ(out.size(), 50u + SampleMeta().name.size() + 8u * 4);
  EXPECT_EQ(std::string(out.data(), 4), std::string("PTF1"));
}

TEST(RoundTripEveryTypeAndDtype) {
  const FrameType types[] = {FrameType::kPush, FrameType::kResult, FrameType::kBroadcast, FrameType::kGather};
  const DataType dtypes[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64,
                             DataType::kInt32,   DataType::kInt64,    DataType::kUInt8,   DataType::kBool};
  for (FrameType t : types) {
    for (DataType d : dtypes) {
      FrameMeta m;
      m.type = t;
      m.dtype = d;
      m.name = std::string("layer/") + DataTypeName(d);
      m.round = 0xfedcba9876543210ull;
      m.shape = {3, 5, 2};
      m.partition = 2;
      m.num_partitions = 4;
      m.offset = 4 * DataTypeSize(d);
      m.payload_bytes = 11 * DataTypeSize(d);
      const std::string f = Frame(m);
      FrameMeta got;
      const char* payload = nullptr;
      const Status s = DecodeFrame(f.data(), f.size(), &got, &payload);
      EXPECT_TRUE(s.ok());
      if (!s.ok()) {
        std::fprintf(stderr, "  %s\n", s.message().c_str());
        continue;
      }
      EXPECT_TRUE(got.type == m.type);
      EXPECT_TRUE(got.dtype == m.dtype);
      EXPECT_EQ(got.name, m.name);
      EXPECT_EQ(got.round, m.round);
      EXPECT_TRUE(got.shape == m.shape);
      EXPECT_EQ(got.partition, m.partition);
      EXPECT_EQ(got.num_partitions, m.num_partitions);
      EXPECT_EQ(got.offset, m.offset);
      EXPECT_EQ(got.payload_bytes, m.payload_bytes);
      EXPECT_TRUE(payload == f.data() + f.size() - m.payload_bytes);
      EXPECT_TRUE(std::memcmp(payload, f.data() + f.size() - m.payload_bytes, m.payload_bytes) == 0);
    }
  }
}

TEST(RoundTripScalarEmptyAndWholeTensor) {
  // Scalar: no dims, one element.
  FrameMeta m = SampleMeta();
  m.shape = {};
  m.offset = 0;
  m.payload_bytes = 4;
  m.partition = 0;
  m.num_partitions = 1;
  std::string f = Frame(m);
  FrameMeta got;
  const char* payload = nullptr;
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_TRUE(got.shape.empty());
  EXPECT_EQ(got.payload_bytes, 4u);
  // Empty tensor: a zero dimension, no payload.
  m.shape = {0, 128};
  m.payload_bytes = 0;
  f = Frame(m);
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_TRUE(got.shape == m.shape);
  EXPECT_TRUE(payload == f.data() + f.size());
  // The last partition exactly reaching the end of the tensor.
  m = SampleMeta();
  m.offset = 2 * 12544;
  m.partition = 2;
  f = Frame(m);
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  // A 1-byte name and the longest name.
  m.name = "x";
  f = Frame(m);
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_EQ(got.name, std::string("x"));
  m.name = std::string(kMaxNameBytes, 'n');
  f = Frame(m);
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_EQ(got.name.size(), static_cast<size_t>(kMaxNameBytes));
  // kMaxDims dimensions of 1.
  m = SampleMeta();
  m.shape.assign(kMaxDims, 1);
  m.shape[0] = 9408;
  f = Frame(m);
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_EQ(got.shape.size(), static_cast<size_t>(kMaxDims));
}

TEST(ExtraBytesAfterTheFrameAreNotPartOfIt) {
  // A stream holds frames back to back: DecodeFrame reads one and leaves the rest.
  const FrameMeta m = SampleMeta();
  std::string f = Frame(m);
  const size_t len = f.size();
  f += Frame(m);
  FrameMeta got;
  const char* payload = nullptr;
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_TRUE(payload + got.payload_bytes == f.data() + len);
}

TEST(ControlFramesCarryNoTensor) {
  FrameMeta probe;
  probe.type = FrameType::kProbe;
  probe.name = "grad/dense";
  probe.round = 7;
  std::string f;
  EncodeFrameMeta(probe, &f);
  FrameMeta got;
  const char* payload = nullptr;
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_TRUE(got.type == FrameType::kProbe && got.name == "grad/dense" && got.round == 7u);
  // A heartbeat needs no name; a probe does; neither carries a payload or a shape.
  FrameMeta beat;
  beat.type = FrameType::kHeartbeat;
  f.clear();
  EncodeFrameMeta(beat, &f);
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  probe.name.clear();
  f.clear();
  EncodeFrameMeta(probe, &f);
  EXPECT_REJECTED(f, "name length");
  probe.name = "x";
  probe.payload_bytes = 4;
  f.clear();
  EncodeFrameMeta(probe, &f);
  f += "abcd";
  EXPECT_REJECTED(f, "control frame");
}

TEST(PeerLostFramesNeedNoNameAndCarryTheWords) {
  FrameMeta m;
  m.type = FrameType::kPeerLost;
  m.partition = 2;  // the rank that saw it
  const std::string message = "lost the connection to rank 1 (h:1): the peer closed the connection";
  std::string f = WithMessage(m, message);
  FrameMeta got;
  const char* payload = nullptr;
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_TRUE(got.type == FrameType::kPeerLost && got.name.empty() && got.partition == 2u);
  EXPECT_EQ(std::string(payload, got.payload_bytes), message);
  m.payload_bytes = kMaxErrorMessageBytes + 1;  // its words are held whole, like an error's
  f.clear();
  EncodeFrameMeta(m, &f);
  EXPECT_REJECTED(f, "error message");
}

TEST(FusionChecksCarryTextUpToTheirBound) {
  FrameMeta m;
  m.type = FrameType::kFusionCheck;
  m.name = "fused:a..b/2~00ff";
  m.round = 3;
  m.partition = 1;       // its kind
  m.offset = 0xabcdef;   // a digest
  const std::string text = "M 3 a\nM 3 b\nD 4096 float32 4 16 2 0 none a\n";
  std::string f = WithMessage(m, text);
  FrameMeta got;
  const char* payload = nullptr;
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_TRUE(got.type == FrameType::kFusionCheck && got.name == m.name && got.round == 3u && got.partition == 1u &&
              got.offset == 0xabcdefu);
  EXPECT_EQ(std::string(payload, got.payload_bytes), text);
  m.payload_bytes = kMaxFusionCheckBytes + 1;
  f.clear();
  EncodeFrameMeta(m, &f);
  EXPECT_REJECTED(f, "fusion check");
}

TEST(ErrorFramesRoundTrip) {
  FrameMeta m;
  m.type = FrameType::kError;  // dtype kInvalid, no shape, no partitions: all fine for errors
  m.name = "dense/kernel:0";
  m.round = 3;
  const std::string message = "push_pull 'dense/kernel:0' (round 3): rank 0 has shape [2] but rank 1 has [3]";
  std::string f = WithMessage(m, message);
  FrameMeta got;
  const char* payload = nullptr;
  const Status s = DecodeFrame(f.data(), f.size(), &got, &payload);
  EXPECT_TRUE(s.ok());
  EXPECT_TRUE(got.type == FrameType::kError);
  EXPECT_EQ(got.name, m.name);
  EXPECT_EQ(got.round, 3u);
  EXPECT_EQ(std::string(payload, got.payload_bytes), message);
  // An error frame with an empty message is still a frame.
  m.payload_bytes = 0;
  f.clear();
  EncodeFrameMeta(m, &f);
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  // Every truncation of an error frame is "truncated".
  f = WithMessage(m, message);
  for (size_t len = 0; len < f.size(); ++len) {
    const Status t = DecodeFrame(f.data(), len, &got, &payload);
    EXPECT_TRUE(t.code() == Code::kFailedPrecondition && Contains(t.message(), "truncated"));
  }
  // An error message is buffered whole by the receiver: at most 64 KiB, checked in the header.
  m.payload_bytes = 64 << 10;
  f.clear();
  EncodeFrameMeta(m, &f);
  f.append(64 << 10, 'e');
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  m.payload_bytes = (64 << 10) + 1;
  f.clear();
  EncodeFrameMeta(m, &f);
  EXPECT_REJECTED(f, "error message");
  m.payload_bytes = kMaxPayloadBytes;
  f.clear();
  EncodeFrameMeta(m, &f);
  EXPECT_REJECTED(f, "error message");
  m.payload_bytes = message.size();
  f.clear();
  EncodeFrameMeta(m, &f);
  f += message;
  // The header limits still apply to error frames.
  std::string bad = f;
  FrameHeader h = HeaderOf(bad);
  h.name_len = 0;
  PutHeader(&bad, h);
  EXPECT_REJECTED(bad, "name length");
  bad = f;
  h = HeaderOf(bad);
  h.magic ^= 1;
  PutHeader(&bad, h);
  EXPECT_REJECTED(bad, "magic");
}

// A small push_pull's exchange frame (small_allreduce.h) is a data frame: its payload is checked
// against its shape like a PUSH, and it never travels encoded.
TEST(ExchangeFramesAreCheckedAsDataFrames) {
  FrameMeta m = SampleMeta();
  m.type = FrameType::kExchange;
  m.offset = 0;
  m.payload_bytes = 37632;  // the whole tensor
  EXPECT_TRUE(!IsControlFrame(m.type) && !IsNamelessFrame(m.type));
  FrameMeta got;
  const char* payload = nullptr;
  const std::string f = Frame(m);
  EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  EXPECT_TRUE(got.type == FrameType::kExchange && got.payload_bytes == 37632);
  m.payload_bytes = 37632 + 4;  // beyond the tensor
  EXPECT_REJECTED(Frame(m), "outside a tensor");
  m.payload_bytes = 37632;
  EXPECT_REJECTED(WithHeaderEdit(Frame(m), [](FrameHeader& h) { h.encoding = 1; h.payload_bytes /= 2; }),
                  "frame of type 12");
}

TEST(BadHeaderFieldsAreNamed) {
  const std::string good = Frame(SampleMeta());
  auto with = [&](auto edit) { return WithHeaderEdit(good, edit); };
  EXPECT_REJECTED(with([](FrameHeader& h) { h.magic = 0x12345678; }), "magic");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.magic = 0; }), "magic");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.version = kProtocolVersion + 1; }), "version");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.version = 0; }), "version");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.type = 0; }), "frame type");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.type = kLastFrameType + 1; }), "frame type");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.type = 255; }), "frame type");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.dtype = 0; }), "dtype");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.dtype = 9; }), "dtype");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.dtype = 200; }), "dtype");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.name_len = 0; }), "name length");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.name_len = kMaxNameBytes + 1; }), "name length");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.name_len = 0xffffffffu; }), "name length");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.ndims = kMaxDims + 1; }), "rank");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.ndims = 0xffffffffu; }), "rank");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.payload_bytes = kMaxPayloadBytes + 1; }), "payload");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.payload_bytes = ~0ull; }), "payload");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.num_partitions = 0; }), "partition");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.partition = h.num_partitions; }), "partition");
  // ValidateHeader alone says the same (the engine calls it before reading the tail).
  FrameHeader h = HeaderOf(good);
  EXPECT_TRUE(ValidateHeader(h).ok());
  h.name_len = kMaxNameBytes + 1;
  const Status s = ValidateHeader(h);
  EXPECT_TRUE(s.code() == Code::kInvalidArgument && Contains(s.message(), "name length"));
}

// Replaces the shape / offset / payload of the sample frame (re-encodes, so the tail matches).
std::string WithShape(const std::vector<int64_t>& shape, uint64_t offset, uint64_t payload_bytes,
                      DataType dtype = DataType::kFloat32) {
  FrameMeta m = SampleMeta();
  m.dtype = dtype;
  m.shape = shape;
  m.offset = offset;
  m.payload_bytes = payload_bytes;
  std::string f;
  EncodeFrameMeta(m, &f);
  f.append(payload_bytes < (1u << 20) ? payload_bytes : 0, 'p');
  return f;
}

TEST(PayloadMustLieInsideTheShape) {
  // Tensor [7, 7, 3, 64] float32 = 37632 bytes.
  EXPECT_TRUE([] {
    const std::string f = WithShape({7, 7, 3, 64}, 37632 - 4, 4);
    FrameMeta m;
    const char* p;
    return DecodeFrame(f.data(), f.size(), &m, &p).ok();
  }());
  EXPECT_REJECTED(WithShape({7, 7, 3, 64}, 37632 - 4, 8), "payload");   // one element past the end
  EXPECT_REJECTED(WithShape({7, 7, 3, 64}, 0, 37632 + 4), "payload");   // longer than the tensor
  EXPECT_REJECTED(WithShape({7, 7, 3, 64}, 37632 + 4, 0), "payload");   // offset past the end
  EXPECT_REJECTED(WithShape({7, 7, 3, 64}, ~0ull - 3, 8), "payload");   // offset + payload wraps
  EXPECT_REJECTED(WithShape({7, 7, 3, 64}, 8, ~0ull - 7), "payload");   // (header limit) payload huge
  EXPECT_REJECTED(WithShape({}, 0, 8), "payload");                      // scalar: 4 bytes only
  EXPECT_REJECTED(WithShape({0, 5}, 0, 4), "payload");                  // empty tensor
  // Misaligned offset or payload length.
  EXPECT_REJECTED(WithShape({7, 7, 3, 64}, 2, 4), "payload");
  EXPECT_REJECTED(WithShape({7, 7, 3, 64}, 0, 6), "payload");
  EXPECT_REJECTED(WithShape({100}, 4, 8, DataType::kFloat64), "payload");
  EXPECT_REJECTED(WithShape({100}, 1, 2, DataType::kFloat16), "payload");
}

// Compressed float32 payloads: 2-byte codes of the elements [offset, offset + 2 * payload_bytes).
TEST(EncodedPayloadsRoundTripAndCarryTwiceTheirBytes) {
  for (FrameType t : {FrameType::kPush, FrameType::kResult, FrameType::kGather}) {
    for (Encoding e : {Encoding::kFloat16, Encoding::kBFloat16}) {
      for (int k : {-kMaxScaleExponent, -1, 0, 24, kMaxScaleExponent}) {
        FrameMeta m = SampleMeta();
        m.type = t;
        m.encoding = e;
        m.scale_exp = k;
        m.offset = 37632 - 4 * 100;  // the last 100 elements
        m.payload_bytes = 2 * 100;
        const std::string f = Frame(m);
        FrameMeta got;
        const char* payload = nullptr;
        EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
        EXPECT_TRUE(got.encoding == e);
        EXPECT_EQ(got.scale_exp, k);
        EXPECT_EQ(got.payload_bytes, 200u);
        EXPECT_EQ(PayloadTensorBytes(got), 400u);
        EXPECT_TRUE(payload == f.data() + f.size() - 200);
        // One code more reaches past the tensor: its 101 elements do not fit.
        m.payload_bytes += 2;
        EXPECT_REJECTED(Frame(m), "payload");
        m.payload_bytes = 199;  // half a code
        EXPECT_REJECTED(Frame(m), "whole number");
      }
    }
  }
  FrameMeta plain = SampleMeta();
  EXPECT_EQ(PayloadTensorBytes(plain), plain.payload_bytes);
}

TEST(BadEncodingsAreNamed) {
  FrameMeta m = SampleMeta();
  m.encoding = Encoding::kFloat16;
  m.scale_exp = 3;
  m.payload_bytes = 64;
  const std::string good = Frame(m);
  auto with = [&](auto edit) { return WithHeaderEdit(good, edit); };
  EXPECT_REJECTED(with([](FrameHeader& h) { h.encoding = kLastEncoding + 1; }), "encoding");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.encoding = 255; }), "encoding");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.encoding = 0; }), "scale exponent without an encoding");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.scale_exp = kMaxScaleExponent + 1; }), "scale exponent");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.scale_exp = -128; }), "scale exponent");
  // Only float32 values are encoded, and only in the frames of compressed collectives.
  EXPECT_REJECTED(with([](FrameHeader& h) { h.dtype = static_cast<uint8_t>(DataType::kFloat64); }), "only float32");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.dtype = static_cast<uint8_t>(DataType::kFloat16); }), "only float32");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.type = static_cast<uint8_t>(FrameType::kBroadcast); }), "frame of type");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.type = static_cast<uint8_t>(FrameType::kProbe); }), "frame of type");
  EXPECT_REJECTED(with([](FrameHeader& h) { h.type = static_cast<uint8_t>(FrameType::kError); }), "frame of type");
  EXPECT_TRUE(ValidateHeader(HeaderOf(good)).ok());
}

TEST(BadShapesAreRejected) {
  EXPECT_REJECTED(WithShape({-1}, 0, 0), "negative dimension");
  EXPECT_REJECTED(WithShape({4, -3, 2}, 0, 0), "negative dimension");
  EXPECT_REJECTED(WithShape({INT64_MIN}, 0, 0), "negative dimension");
  // Products that overflow 64 bits or exceed the payload limit.
  EXPECT_REJECTED(WithShape({INT64_MAX, INT64_MAX}, 0, 0), "too large");
  EXPECT_REJECTED(WithShape({1ll << 32, 1ll << 32}, 0, 0), "too large");
  EXPECT_REJECTED(WithShape({1ll << 20, 1ll << 20, 1ll << 20}, 0, 0), "too large");
  EXPECT_REJECTED(WithShape({3, 5, 1ll << 62, 4}, 0, 0), "too large");
  // Elements within the limit, bytes beyond it (2^38 float64 elements = 2^41 bytes).
  EXPECT_REJECTED(WithShape({1ll << 19, 1ll << 19}, 0, 8, DataType::kFloat64), "too large");
  // Fits: 2^36 float32 elements = 2^38 bytes, exactly the limit (no payload needed to validate).
  {
    const std::string f = WithShape({1ll << 18, 1ll << 18}, 0, 4);
    FrameMeta m;
    const char* p;
    EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &m, &p).ok());
  }
  // A zero dimension anywhere makes later huge dims harmless (0 elements) but no payload fits.
  EXPECT_REJECTED(WithShape({0, INT64_MAX, INT64_MAX}, 0, 4), "payload");
}

TEST(TailLengthMismatchIsRejected) {
  const std::string f = Frame(SampleMeta());
  const FrameHeader h = HeaderOf(f);
  FrameMeta m;
  const Status s = DecodeFrameMeta(h, f.data() + sizeof(h), MetaTailBytes(h) - 1, &m);
  EXPECT_TRUE(s.code() == Code::kInvalidArgument && Contains(s.message(), "tail"));
}

TEST(EveryTruncationIsReportedNeverACrash) {
  std::vector<FrameMeta> metas;
  metas.push_back(SampleMeta());
  FrameMeta scalar = SampleMeta();
  scalar.shape = {};
  scalar.offset = 0;
  scalar.payload_bytes = 4;
  metas.push_back(scalar);
  FrameMeta empty = SampleMeta();
  empty.shape = {0};
  empty.offset = 0;
  empty.payload_bytes = 0;
  metas.push_back(empty);
  for (const FrameMeta& meta : metas) {
    const std::string f = Frame(meta);
    // Copy each prefix to its own exact-size heap buffer so that a read past `len` is a real
    // out-of-bounds read (visible under ASan), not a read of the rest of `f`.
    for (size_t len = 0; len < f.size(); ++len) {
      std::vector<char> prefix(f.begin(), f.begin() + static_cast<std::ptrdiff_t>(len));
      FrameMeta got;
      const char* payload = nullptr;
      const Status s = DecodeFrame(prefix.data(), len, &got, &payload);
      if (s.code() != Code::kFailedPrecondition || !Contains(s.message(), "truncated")) {
        std::fprintf(stderr, "prefix %zu of %zu: code %d '%s'\n", len, f.size(), static_cast<int>(s.code()),
                     s.message().c_str());
        ++::prophet::testing::Failures();
        break;
      }
    }
    FrameMeta got;
    const char* payload = nullptr;
    EXPECT_TRUE(DecodeFrame(f.data(), f.size(), &got, &payload).ok());
  }
  // Which part is missing is named.
  const std::string f = Frame(SampleMeta());
  FrameMeta got;
  const char* payload = nullptr;
  EXPECT_TRUE(Contains(DecodeFrame(f.data(), sizeof(FrameHeader) - 1, &got, &payload).message(), "header"));
  EXPECT_TRUE(Contains(DecodeFrame(f.data(), sizeof(FrameHeader) + 1, &got, &payload).message(), "name/shape"));
  EXPECT_TRUE(Contains(DecodeFrame(f.data(), f.size() - 1, &got, &payload).message(), "payload"));
}

TEST(RandomBytesAreRejected) {
  std::mt19937_64 rng(12345);
  for (int i = 0; i < 20000; ++i) {
    const size_t len = rng() % 600;
    std::vector<char> buf(len);
    for (char& c : buf) c = static_cast<char>(rng());
    FrameMeta m;
    const char* p = nullptr;
    const Status s = DecodeFrame(buf.data(), len, &m, &p);
    // Without the magic nothing gets past the header check.
    EXPECT_TRUE(!s.ok());
    if (len >= sizeof(FrameHeader)) EXPECT_TRUE(s.code() == Code::kInvalidArgument && Contains(s.message(), "magic"));
    else EXPECT_TRUE(s.code() == Code::kFailedPrecondition);
  }
}

TEST(RandomHeadersWithValidMagicNeverCrash) {
  // Magic and version right, every other header byte random; then random tails. Results must be
  // one of: ok, kInvalidArgument, truncated; an accepted frame must be self-consistent.
  std::mt19937_64 rng(777);
  int accepted = 0, invalid = 0, truncated = 0;
  for (int i = 0; i < 100000; ++i) {
    FrameHeader h;
    std::vector<char> raw(sizeof(h));
    for (char& c : raw) c = static_cast<char>(rng());
    std::memcpy(&h, raw.data(), sizeof(h));
    h.magic = kFrameMagic;
    h.version = kProtocolVersion;
    // Bias the fields towards plausible values so that deeper checks are exercised too.
    if (rng() % 2) h.type = static_cast<uint8_t>(1 + rng() % 5);
    if (rng() % 2) h.dtype = static_cast<uint8_t>(1 + rng() % 8);
    if (rng() % 2) h.name_len = static_cast<uint32_t>(rng() % 64);
    if (rng() % 2) h.ndims = static_cast<uint32_t>(rng() % 6);
    if (rng() % 2) h.num_partitions = static_cast<uint32_t>(1 + rng() % 4), h.partition = static_cast<uint32_t>(rng() % 4);
    if (rng() % 2) h.offset = (rng() % 64) * 4;
    if (rng() % 2) h.payload_bytes = (rng() % 64) * 4;
    if (rng() % 4) {  // mostly uncompressed; else any of the encodings with a scale in range
      h.encoding = 0, h.scale_exp = 0;
    } else if (rng() % 2) {
      h.encoding = static_cast<uint8_t>(1 + rng() % 2);
      h.scale_exp = static_cast<int8_t>(static_cast<int>(rng() % 253) - 126);
    }
    const uint64_t tail = MetaTailBytes(h);
    const size_t extra = rng() % 300;
    const size_t len = sizeof(h) + static_cast<size_t>(std::min<uint64_t>(tail, 4400)) + extra;
    std::vector<char> buf(len);
    for (size_t k = 0; k < len; k += 8) {
      const uint64_t word = rng();
      std::memcpy(buf.data() + k, &word, std::min<size_t>(8, len - k));
    }
    std::memcpy(buf.data(), &h, sizeof(h));
    // Sometimes make the dims small and non-negative.
    if (rng() % 2 && h.name_len <= kMaxNameBytes && h.ndims <= kMaxDims && sizeof(h) + tail <= len) {
      for (uint32_t d = 0; d < h.ndims; ++d) {
        const int64_t dim = static_cast<int64_t>(rng() % 9);
        std::memcpy(buf.data() + sizeof(h) + h.name_len + 8 * d, &dim, 8);
      }
    }
    FrameMeta m;
    const char* p = nullptr;
    const Status s = DecodeFrame(buf.data(), len, &m, &p);
    if (s.ok()) {
      ++accepted;
      EXPECT_TRUE(p >= buf.data() && p + m.payload_bytes <= buf.data() + len);
      EXPECT_EQ(m.name.size(), static_cast<size_t>(h.name_len));
      if (!IsControlFrame(m.type)) {
        const uint64_t elem = DataTypeSize(m.dtype);
        uint64_t total = elem;
        for (int64_t d : m.shape) total *= static_cast<uint64_t>(d);
        const uint64_t code = m.encoding == Encoding::kNone ? elem : 2;
        EXPECT_TRUE(elem > 0 && m.offset % elem == 0 && m.payload_bytes % code == 0);
        EXPECT_TRUE(m.offset <= total && PayloadTensorBytes(m) <= total - m.offset);
        EXPECT_TRUE(m.encoding == Encoding::kNone || m.dtype == DataType::kFloat32);
      }
    } else if (s.code() == Code::kInvalidArgument) {
      ++invalid;
      EXPECT_TRUE(Contains(s.message(), "malformed frame"));
    } else {
      ++truncated;
      EXPECT_TRUE(s.code() == Code::kFailedPrecondition && Contains(s.message(), "truncated"));
    }
  }
  std::printf("random headers: %d accepted, %d invalid, %d truncated\n", accepted, invalid, truncated);
  EXPECT_TRUE(accepted > 0 && invalid > 0 && truncated > 0);
}

TEST(NameHashIsStable) {
  // Partition owners are derived from this hash: it must be equal across processes and builds.
  // (Pinned to the current seed, 1469598103934665603, which is the FNV-1a 64 offset basis
  // 14695981039346656037 with its last digit missing; changing it now would change the protocol.)
  EXPECT_EQ(HashString(""), 1469598103934665603ull);
  EXPECT_EQ(HashString("a"), 0x44bd8ad473cd9906ull);
  EXPECT_TRUE(HashString("job-a") != HashString("job-b"));
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
