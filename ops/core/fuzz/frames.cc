#include "ops/core/fuzz/frames.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

namespace prophet {
namespace fuzz {

namespace {

struct Field {
  size_t offset, bytes;
};
// Every field of FrameHeader, so that kFieldValue reaches each of them.
const Field kFields[] = {
    {offsetof(FrameHeader, magic), 4},      {offsetof(FrameHeader, version), 2},
    {offsetof(FrameHeader, type), 1},       {offsetof(FrameHeader, dtype), 1},
    {offsetof(FrameHeader, name_len), 4},   {offsetof(FrameHeader, ndims), 4},
    {offsetof(FrameHeader, round), 8},      {offsetof(FrameHeader, partition), 4},
    {offsetof(FrameHeader, num_partitions), 4}, {offsetof(FrameHeader, offset), 8},
    {offsetof(FrameHeader, payload_bytes), 8}, {offsetof(FrameHeader, encoding), 1},
    {offsetof(FrameHeader, scale_exp), 1},
};

const DataType kDtypes[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32, DataType::kFloat64,
                            DataType::kInt32,   DataType::kInt64,    DataType::kUInt8,   DataType::kBool};

}  // namespace

const char* MutationName(Mutation m) {
  switch (m) {
    case Mutation::kBitFlips: return "bit_flips";
    case Mutation::kFieldValue: return "field_value";
    case Mutation::kHugeLength: return "huge_length";
    case Mutation::kBadDims: return "bad_dims";
    case Mutation::kTruncate: return "truncate";
    case Mutation::kInsertDelete: return "insert_delete";
    case Mutation::kSplice: return "splice";
    case Mutation::kRandomBytes: return "random_bytes";
    case Mutation::kCount: break;
  }
  return "?";
}

std::string EncodeFrame(const FrameMeta& meta, const std::string& payload) {
  std::string out;
  EncodeFrameMeta(meta, &out);
  out += payload;
  return out;
}

std::string FrameMutator::RandomBytes(size_t n) {
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng_());
  return s;
}

uint64_t FrameMutator::InterestingValue(int bytes) {
  const uint64_t all = bytes == 8 ? ~0ull : (1ull << (8 * bytes)) - 1;
  const uint64_t candidates[] = {0,
                                 1,
                                 2,
                                 all,
                                 all - 1,
                                 all >> 1,
                                 (all >> 1) + 1,
                                 uint64_t{kMaxNameBytes},
                                 uint64_t{kMaxNameBytes} + 1,
                                 uint64_t{kMaxDims},
                                 uint64_t{kMaxDims} + 1,
                                 kMaxPayloadBytes,
                                 kMaxPayloadBytes + 1,
                                 uint64_t{1} << 32,
                                 uint64_t{64} << 10,
                                 (uint64_t{64} << 10) + 1,
                                 Uniform(256),
                                 rng_()};
  return candidates[Uniform(sizeof(candidates) / sizeof(candidates[0]))] & all;
}

std::string FrameMutator::RandomValidFrame() {
  FrameMeta m;
  // The data frames and error notices (kExchange is a data frame numbered after the control ones).
  m.type = Chance(0.1) ? FrameType::kExchange : static_cast<FrameType>(1 + Uniform(5));
  m.dtype = kDtypes[Uniform(8)];
  const size_t name_len = Chance(0.05) ? kMaxNameBytes : 1 + Uniform(24);
  m.name.resize(name_len);
  for (char& c : m.name) c = static_cast<char>('a' + Uniform(26));
  m.round = Chance(0.9) ? Uniform(4) : rng_();
  if (m.type == FrameType::kError) {
    std::string message = "rank 3 says: " + RandomBytes(Uniform(64));
    m.payload_bytes = message.size();
    return EncodeFrame(m, message);
  }
  const int ndims = static_cast<int>(Uniform(4));
  uint64_t elements = 1;
  for (int d = 0; d < ndims; ++d) {
    const int64_t dim = static_cast<int64_t>(Uniform(7));
    m.shape.push_back(dim);
    elements *= static_cast<uint64_t>(dim);
  }
  const uint64_t elem = DataTypeSize(m.dtype);
  m.num_partitions = 1 + static_cast<uint32_t>(Uniform(4));
  m.partition = static_cast<uint32_t>(Uniform(m.num_partitions));
  const uint64_t first = Uniform(elements + 1);
  const uint64_t count = Uniform(elements - first + 1);
  // Compressed gradients: float32 PUSH, RESULT and GATHER payloads in 2-byte codes (an exchange's
  // values travel exactly).
  if (m.dtype == DataType::kFloat32 && m.type != FrameType::kBroadcast && m.type != FrameType::kExchange &&
      Chance(0.5)) {
    m.encoding = Chance(0.5) ? Encoding::kFloat16 : Encoding::kBFloat16;
    m.scale_exp = static_cast<int>(Uniform(2 * kMaxScaleExponent + 1)) - kMaxScaleExponent;
  }
  m.offset = first * elem;
  m.payload_bytes = count * (m.encoding == Encoding::kNone ? elem : 2);
  return EncodeFrame(m, RandomBytes(m.payload_bytes));
}

std::string FrameMutator::Mutate(const std::string& frame, Mutation m, const std::string& other) {
  std::string f = frame;
  switch (m) {
    case Mutation::kBitFlips: {
      const uint64_t flips = 1 + Uniform(8);
      for (uint64_t i = 0; i < flips && !f.empty(); ++i) f[Uniform(f.size())] ^= static_cast<char>(1 << Uniform(8));
      return f;
    }
    case Mutation::kFieldValue: {
      if (f.size() < sizeof(FrameHeader)) return f;
      const Field& field = kFields[Uniform(sizeof(kFields) / sizeof(kFields[0]))];
      uint64_t value = 0;
      std::memcpy(&value, &f[field.offset], field.bytes);
      value = Chance(0.3) ? value + (Chance(0.5) ? 1 : ~0ull) : InterestingValue(static_cast<int>(field.bytes));
      std::memcpy(&f[field.offset], &value, field.bytes);
      return f;
    }
    case Mutation::kHugeLength: {
      // A self-consistent claim: shape, offset and payload agree, only the size is absurd. This
      // is what passes the frame's own checks and must be caught against the operation.
      FrameMeta meta;
      const char* payload = nullptr;
      if (!DecodeFrame(f.data(), f.size(), &meta, &payload).ok()) return f;
      if (IsControlFrame(meta.type)) meta.type = FrameType::kPush;
      if (DataTypeSize(meta.dtype) == 0) meta.dtype = DataType::kFloat32;
      const uint64_t elem = DataTypeSize(meta.dtype);
      const uint64_t max_elements = kMaxPayloadBytes / elem;
      const uint64_t elements = Chance(0.5) ? max_elements : (uint64_t{1} << (20 + Uniform(19))) / elem;
      meta.shape = Chance(0.5) ? std::vector<int64_t>{static_cast<int64_t>(elements)}
                               : std::vector<int64_t>{static_cast<int64_t>(elements / 4), 4};
      meta.offset = 0;
      const uint64_t code = meta.encoding == Encoding::kNone ? elem : 2;  // an encoded frame claims its codes
      meta.payload_bytes = (elements / 4) * 4 * code;
      if (Chance(0.3)) meta.payload_bytes -= code * Uniform(16);  // near, not at, the maximum
      // Some of the claimed payload follows, most of it never will.
      return EncodeFrame(meta, RandomBytes(Uniform(4096)));
    }
    case Mutation::kBadDims: {
      FrameMeta meta;
      const char* payload = nullptr;
      if (!DecodeFrame(f.data(), f.size(), &meta, &payload).ok()) return f;
      switch (Uniform(4)) {
        case 0: meta.shape = {-1}; break;
        case 1: meta.shape = {int64_t{1} << 40, int64_t{1} << 40}; break;                  // product overflows
        case 2: meta.shape = {INT64_MAX}; break;
        default: meta.shape = {0, static_cast<int64_t>(1 + Uniform(8))}; break;             // empty tensor
      }
      if (Chance(0.5)) meta.payload_bytes = 8 * (1 + Uniform(4));
      return EncodeFrame(meta, RandomBytes(std::min<uint64_t>(meta.payload_bytes, 64)));
    }
    case Mutation::kTruncate:
      f.resize(Uniform(f.size()));
      return f;
    case Mutation::kInsertDelete: {
      const size_t at = Uniform(f.size() + 1);
      if (Chance(0.5)) {
        f.insert(at, RandomBytes(1 + Uniform(16)));
      } else if (at < f.size()) {
        f.erase(at, 1 + Uniform(std::min<uint64_t>(16, f.size() - at)));
      }
      return f;
    }
    case Mutation::kSplice: {
      if (f.size() < sizeof(FrameHeader) || other.size() < sizeof(FrameHeader)) return f;
      return f.substr(0, sizeof(FrameHeader)) + other.substr(sizeof(FrameHeader));
    }
    case Mutation::kRandomBytes:
      return RandomBytes(Uniform(2 * sizeof(FrameHeader) + 64));
    case Mutation::kCount:
      break;
  }
  return f;
}

}  // namespace fuzz
}  // namespace prophet
