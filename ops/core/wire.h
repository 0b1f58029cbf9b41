// The frame format between workers, and its validation.
//
// A frame is a fixed 50-byte header, then `name_len` bytes of tensor name, then `ndims` int64
// dimensions, then `payload_bytes` of data: the tensor's own bytes, or its float32 values encoded
// in 16 bits (`encoding`, codec.h) with the block's scale exponent. Every length is checked against hard limits before
// the receiver allocates or reads anything, so a garbage or hostile stream is rejected instead of
// making the worker allocate gigabytes or read past a buffer.
#ifndef PROPHET_OPS_CORE_WIRE_H_
#define PROPHET_OPS_CORE_WIRE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "ops/core/codec.h"
#include "ops/core/common.h"

namespace prophet {

constexpr uint32_t kFrameMagic = 0x31465450;  // "PTF1" little-endian
// 2: authenticated handshake (handshake.h). Version 1 sent a hash of the job token.
// 4: payload encodings (compressed gradients): `encoding` and `scale_exp` in the header.
// 5: kFusionCheck (fused declarations that differ across workers).
// 6: kExchange frames (small push_pulls by recursive doubling).
// 7: lanes (io_threads): the hello names its lane and the number of lanes.
// 8: a tensor cut across every worker is cut into whole rounds of owners (partition.h): a worker
//    of version 7 would cut some tensors into other partitions.
// 9: a tensor too small for every owner is cut over several (partition.h), and a fusable tensor
//    alone travels as a bucket of one (fusion.h).
constexpr uint16_t kProtocolVersion = 9;
constexpr uint32_t kMaxNameBytes = 4096;
constexpr uint32_t kMaxDims = 32;
constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 38;  // 256 GiB: any tensor a host can hold

enum class FrameType : uint8_t {
  kPush = 1,        // a partition's contribution, sent to the partition's owner
  kResult = 2,      // the summed partition, sent back by the owner
  kBroadcast = 3,   // a partition of the root's tensor
  kGather = 4,      // a whole tensor for allgather
  // Control frames: they name an operation (name, round) but carry no tensor; `partition` holds
  // their value.
  kError = 5,       // payload: a message that fails the operation on every worker; value: its Code
  kProbe = 6,       // "has your worker submitted this operation?" (it timed out on the sender)
  kProbeReply = 7,  // value: 1 if the replying worker has submitted it, 0 if not
  kHeartbeat = 8,   // proof of life (heartbeat_s); no name needed
  // "the job cannot go on: value: rank that saw it first; payload: what it saw" (a lost peer). No
  // name needed. Sent once, before the sender's own failure can close its connections, so that a
  // worker that sees the sender leave names the first failure, not the sender.
  kPeerLost = 9,
  // "my program finished: nothing more comes from me" (no name). The sender's last frame before
  // it half-closes, so that its EOF reads as a departure, not a crash: a worker still waiting for
  // data from it fails naming the departure, and one that is not goes on.
  kLeaving = 10,
  // Fusion's check that every worker declared the same tensors (fuser.h): value: its kind
  // (FusionCheckKind); offset: a digest; payload: text (a bucket's members and a declaration, or
  // the message of a disagreement).
  kFusionCheck = 11,
  // A data frame again: a small push_pull's values at one stage of its exchange (small_allreduce.h):
  // `partition` is the stage, `num_partitions` the stages, the payload the whole tensor.
  kExchange = 12,
};
constexpr uint8_t kLastFrameType = static_cast<uint8_t>(FrameType::kExchange);
inline bool IsControlFrame(FrameType type) { return type >= FrameType::kError && type != FrameType::kExchange; }
// Frames about a worker, not an operation: they carry no name.
inline bool IsNamelessFrame(FrameType type) {
  return type == FrameType::kHeartbeat || type == FrameType::kPeerLost || type == FrameType::kLeaving;
}
constexpr uint64_t kMaxErrorMessageBytes = uint64_t{64} << 10;  // the receiver buffers it whole
constexpr uint64_t kMaxFusionCheckBytes = uint64_t{16} << 20;   // a declaration of ~200k tensors

#pragma pack(push, 1)
struct FrameHeader {
  uint32_t magic;
  uint16_t version;
  uint8_t type;
  uint8_t dtype;
  uint32_t name_len;
  uint32_t ndims;
  uint64_t round;
  uint32_t partition;
  uint32_t num_partitions;
  uint64_t offset;         // byte offset of the payload's first element inside the whole tensor
  uint64_t payload_bytes;  // on the wire (encoded)
  uint8_t encoding;        // Encoding: kNone, or float32 values as fp16 / bf16 (PUSH, RESULT, GATHER)
  int8_t scale_exp;        // the encoded block's scale 2^k (codec.h); 0 without an encoding
};
#pragma pack(pop)
static_assert(sizeof(FrameHeader) == 50, "the header layout is part of the protocol");

// Everything in a frame but the payload.
struct FrameMeta {
  FrameType type = FrameType::kPush;
  DataType dtype = DataType::kInvalid;
  std::string name;
  uint64_t round = 0;
  std::vector<int64_t> shape;
  uint32_t partition = 0;
  uint32_t num_partitions = 0;
  uint64_t offset = 0;
  uint64_t payload_bytes = 0;
  Encoding encoding = Encoding::kNone;
  int scale_exp = 0;
};

// The bytes of the tensor a data frame's payload carries (twice payload_bytes when encoded).
uint64_t PayloadTensorBytes(const FrameMeta& meta);

// Serialises header + name + dims (not the payload) and appends them to `out`.
void EncodeFrameMeta(const FrameMeta& meta, std::string* out);

// Checks a received header. On failure returns a message naming the bad field.
Status ValidateHeader(const FrameHeader& header);
// Size of the name + dims section that follows a valid header.
inline uint64_t MetaTailBytes(const FrameHeader& h) { return uint64_t{h.name_len} + 8ull * h.ndims; }
// Builds FrameMeta from a validated header and its tail; checks the dims and the payload against
// the dtype, the encoding and the shape (negative dims, payload beyond the tensor, misaligned
// payloads).
Status DecodeFrameMeta(const FrameHeader& header, const char* tail, size_t tail_len, FrameMeta* meta);

// Decodes a complete frame held in memory (used by tests and the handshake-free paths).
// Returns kFailedPrecondition with "truncated" when `len` is shorter than the frame.
Status DecodeFrame(const char* data, size_t len, FrameMeta* meta, const char** payload);

// FNV-1a: stable across processes and builds (partition owners are derived from it).
uint64_t HashBytes(const void* data, size_t len, uint64_t seed = 1469598103934665603ull);
uint64_t HashString(const std::string& s);

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_WIRE_H_
