#include "ops/core/wire.h"

#include <cstring>

namespace prophet {

void EncodeFrameMeta(const FrameMeta& meta, std::string* out) {
  FrameHeader h;
  h.magic = kFrameMagic;
  h.version = kProtocolVersion;
  h.type = static_cast<uint8_t>(meta.type);
  h.dtype = static_cast<uint8_t>(meta.dtype);
  h.name_len = static_cast<uint32_t>(meta.name.size());
  h.ndims = static_cast<uint32_t>(meta.shape.size());
  h.round = meta.round;
  h.partition = meta.partition;
  h.num_partitions = meta.num_partitions;
  h.offset = meta.offset;
  h.payload_bytes = meta.payload_bytes;
  h.encoding = static_cast<uint8_t>(meta.encoding);
  h.scale_exp = static_cast<int8_t>(meta.scale_exp);
  const size_t start = out->size();
  out->resize(start + sizeof(h) + meta.name.size() + 8 * meta.shape.size());
  char* p = &(*out)[start];
  std::memcpy(p, &h, sizeof(h));
  p += sizeof(h);
  std::memcpy(p, meta.name.data(), meta.name.size());
  p += meta.name.size();
  if (!meta.shape.empty()) std::memcpy(p, meta.shape.data(), 8 * meta.shape.size());
}

Status ValidateHeader(const FrameHeader& h) {
  auto bad = [](const std::string& what) {
    return Status(Code::kInvalidArgument, "malformed frame: " + what);
  };
  if (h.magic != kFrameMagic) return bad("bad magic (not a prophet_tf peer, or a corrupted stream)");
  if (h.version != kProtocolVersion)
    return bad("protocol version " + std::to_string(h.version) + ", expected " +
               std::to_string(kProtocolVersion));
  if (h.type < static_cast<uint8_t>(FrameType::kPush) || h.type > kLastFrameType)
    return bad("unknown frame type " + std::to_string(h.type));
  const auto type = static_cast<FrameType>(h.type);
  const uint32_t min_name = IsNamelessFrame(type) ? 0 : 1;
  if (h.name_len < min_name || h.name_len > kMaxNameBytes)
    return bad("name length " + std::to_string(h.name_len) + " outside [" + std::to_string(min_name) + ", " +
               std::to_string(kMaxNameBytes) + "]");
  if (h.ndims > kMaxDims) return bad("rank " + std::to_string(h.ndims) + " above " + std::to_string(kMaxDims));
  if (h.payload_bytes > kMaxPayloadBytes) return bad("payload of " + std::to_string(h.payload_bytes) + " bytes");
  if (h.encoding > kLastEncoding) return bad("unknown payload encoding " + std::to_string(h.encoding));
  const auto encoding = static_cast<Encoding>(h.encoding);
  if (encoding == Encoding::kNone && h.scale_exp != 0) return bad("a scale exponent without an encoding");
  if (encoding != Encoding::kNone) {
    if (type != FrameType::kPush && type != FrameType::kResult && type != FrameType::kGather)
      return bad(std::string("a ") + EncodingName(encoding) + " payload in a frame of type " + std::to_string(h.type));
    if (static_cast<DataType>(h.dtype) != DataType::kFloat32)
      return bad(std::string("a ") + EncodingName(encoding) + " payload for dtype code " + std::to_string(h.dtype) +
                 " (only float32 is encoded)");
    if (h.scale_exp > kMaxScaleExponent || h.scale_exp < -kMaxScaleExponent)
      return bad("scale exponent " + std::to_string(h.scale_exp));
  }
  if (type == FrameType::kError || type == FrameType::kPeerLost)
    return h.payload_bytes <= kMaxErrorMessageBytes ? Status::OK()
                                                    : bad("error message of " + std::to_string(h.payload_bytes) + " bytes");
  if (type == FrameType::kFusionCheck)
    return h.payload_bytes <= kMaxFusionCheckBytes && h.ndims == 0
               ? Status::OK()
               : bad("fusion check of " + std::to_string(h.payload_bytes) + " bytes or with a shape");
  if (IsControlFrame(type))
    return h.payload_bytes == 0 && h.ndims == 0 ? Status::OK() : bad("a control frame with a payload or a shape");
  if (DataTypeSize(static_cast<DataType>(h.dtype)) == 0)
    return bad("unknown dtype code " + std::to_string(h.dtype));
  if (h.num_partitions == 0 || h.partition >= h.num_partitions)
    return bad("partition " + std::to_string(h.partition) + " of " + std::to_string(h.num_partitions));
  return Status::OK();
}

Status DecodeFrameMeta(const FrameHeader& h, const char* tail, size_t tail_len, FrameMeta* meta) {
  if (tail_len != MetaTailBytes(h)) return Status(Code::kInvalidArgument, "malformed frame: tail length");
  meta->type = static_cast<FrameType>(h.type);
  meta->dtype = static_cast<DataType>(h.dtype);
  meta->name.assign(tail, h.name_len);
  meta->shape.resize(h.ndims);
  if (h.ndims) std::memcpy(meta->shape.data(), tail + h.name_len, 8ull * h.ndims);
  meta->round = h.round;
  meta->partition = h.partition;
  meta->num_partitions = h.num_partitions;
  meta->offset = h.offset;
  meta->payload_bytes = h.payload_bytes;
  meta->encoding = static_cast<Encoding>(h.encoding);
  meta->scale_exp = h.scale_exp;
  if (IsControlFrame(meta->type)) return Status::OK();
  // The payload (its tensor bytes, when encoded) must lie inside the tensor the shape describes.
  const uint64_t elem = DataTypeSize(meta->dtype);
  const uint64_t code = meta->encoding == Encoding::kNone ? elem : 2;
  uint64_t elements = 1;
  for (int64_t d : meta->shape) {
    if (d < 0) return Status(Code::kInvalidArgument, "malformed frame: negative dimension in " + ShapeString(meta->shape));
    if (d != 0 && elements > kMaxPayloadBytes / static_cast<uint64_t>(d))
      return Status(Code::kInvalidArgument, "malformed frame: shape " + ShapeString(meta->shape) + " too large");
    elements *= static_cast<uint64_t>(d);
  }
  const uint64_t total = elements * elem;
  if (total > kMaxPayloadBytes) return Status(Code::kInvalidArgument, "malformed frame: tensor too large");
  if (meta->payload_bytes % code != 0)
    return Status(Code::kInvalidArgument, "malformed frame: a payload of " + std::to_string(meta->payload_bytes) +
                                              " bytes is no whole number of " + std::to_string(code) + "-byte elements");
  const uint64_t carried = meta->payload_bytes / code * elem;  // <= 2 * kMaxPayloadBytes: no overflow
  if (meta->offset % elem != 0 || meta->offset > total || carried > total - meta->offset)
    return Status(Code::kInvalidArgument, "malformed frame: payload [" + std::to_string(meta->offset) + ", +" +
                                              std::to_string(carried) + ") outside a tensor of " +
                                              std::to_string(total) + " bytes");
  return Status::OK();
}

uint64_t PayloadTensorBytes(const FrameMeta& meta) {
  return meta.encoding == Encoding::kNone ? meta.payload_bytes : meta.payload_bytes / 2 * DataTypeSize(meta.dtype);
}

Status DecodeFrame(const char* data, size_t len, FrameMeta* meta, const char** payload) {
  FrameHeader h;
  if (len < sizeof(h)) return Status(Code::kFailedPrecondition, "truncated frame: header");
  std::memcpy(&h, data, sizeof(h));
  Status s = ValidateHeader(h);
  if (!s.ok()) return s;
  const uint64_t tail = MetaTailBytes(h);
  if (len - sizeof(h) < tail) return Status(Code::kFailedPrecondition, "truncated frame: name/shape");
  s = DecodeFrameMeta(h, data + sizeof(h), tail, meta);
  if (!s.ok()) return s;
  if (len - sizeof(h) - tail < meta->payload_bytes) return Status(Code::kFailedPrecondition, "truncated frame: payload");
  *payload = data + sizeof(h) + tail;
  return Status::OK();
}

uint64_t HashBytes(const void* data, size_t len, uint64_t seed) {
  // FNV-1a: stable across processes and builds (std::hash is not guaranteed to be).
  const unsigned char* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < len; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

uint64_t HashString(const std::string& s) { return HashBytes(s.data(), s.size()); }

}  // namespace prophet
