// Gradient compression on the wire: float32 values travel as 16-bit floats (fp16 or bf16).
//
// A block of values that travels as one payload (a push_pull partition, a RESULT, one worker's
// allgather tensor) is encoded with a power-of-two scale of its own, 2^k, chosen from the block:
// the wire holds code(x * 2^k) and the receiver decodes float(code) * 2^-k. Multiplying by a
// power of two is exact, so the scale changes nothing but the range the 16 bits cover:
// - fp16 (5 exponent bits, largest finite 65504): k puts the block's largest finite magnitude in
//   [2^14, 2^15), so no finite value can round to infinity and small values keep 28 binades of
//   normal precision below the largest one before they become fp16 subnormals. This is the fp16
//   range guard: a gradient of 1e6 or of 1e-8 travels with 11 significant bits, never as inf or 0.
// - bf16 has float32's exponent range: k = 0.
// Infinities and NaNs travel as such (non-finite gradients must stay visible, e.g. to loss
// scaling); the scale is chosen from the finite values only. A finite value never decodes to
// infinity: the few within half a 16-bit ulp of 2^128 (no float32 holds their rounding, 2^128)
// are rounded down instead, still within the bound below.
//
// Rounding is to nearest, ties to even, as TensorFlow's casts. Per element, with u = 2^-11 (fp16)
// or 2^-8 (bf16): |decode(encode(x)) - x| <= max(u |x|, 2^(-25-k)) for fp16 (the second term is
// half the spacing of fp16 subnormals, scaled back; 2^(-25-k) <= 2^-39 * the block's largest
// magnitude) and <= max(u |x|, 2^-134) for bf16.
// docs/design.md ("Compression") derives the bound of a whole push_pull from these.
//
// The kernels are vectorised: on x86-64 CPUs with F16C and AVX2 (detected at run time; the build
// targets the baseline ISA) fp16 uses the hardware conversions, elsewhere a branch-free routine
// that the compiler vectorises. Both give bit-identical results (codec_test checks every pattern).
#ifndef PROPHET_OPS_CORE_CODEC_H_
#define PROPHET_OPS_CORE_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "ops/core/common.h"

namespace prophet {

// How a payload travels. Wire-stable codes (frame headers carry them; never renumber).
enum class Encoding : uint8_t {
  kNone = 0,      // the tensor's own bytes
  kFloat16 = 1,   // float32 values as IEEE fp16, scaled by 2^k
  kBFloat16 = 2,  // float32 values as bfloat16, scaled by 2^k
};
constexpr uint8_t kLastEncoding = static_cast<uint8_t>(Encoding::kBFloat16);
// "none", "fp16", "bf16": the names the Python API uses.
const char* EncodingName(Encoding encoding);
// Parses those names ("" is "none"); false for anything else.
bool ParseEncoding(const std::string& name, Encoding* encoding);
// The largest |k| of a block's scale 2^k: 2^k and 2^-k are then normal floats.
constexpr int kMaxScaleExponent = 126;

// Scalar conversions, rounding to nearest even (the kernels below convert element by element
// exactly as these do).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

// One set of conversion kernels. `scale` is 2^k for encoding and 2^-k for decoding.
struct CodecKernels {
  const char* name;
  // The largest bit pattern of |x| among the finite x (0 when there are none).
  uint32_t (*max_finite_abs_bits)(const float* x, size_t n);
  void (*encode_half)(const float* src, size_t n, float scale, uint16_t* dst);
  // Returns true when a finite value rounded to infinity (PayloadCodec then rounds it down).
  bool (*encode_bfloat16)(const float* src, size_t n, float scale, uint16_t* dst);
  // [format]: 0 = fp16, 1 = bf16. dst = decoded; dst += decoded; dst = a + decoded (dst != a).
  void (*decode[2])(const uint16_t* codes, size_t n, float scale, float* dst);
  void (*decode_add[2])(const uint16_t* codes, size_t n, float scale, float* dst);
  void (*decode_add_to[2])(const uint16_t* codes, size_t n, float scale, const float* a, float* dst);
};
// The kernels this process uses (the fastest this CPU runs).
const CodecKernels& ActiveCodecKernels();
// For tests and benchmarks: the portable kernels, and the F16C/AVX2 ones (nullptr when this CPU
// or build has none).
const CodecKernels& PortableCodecKernels();
const CodecKernels* F16cCodecKernels();

// How the payloads of one operation's tensor travel, and the four places where the collectives
// convert (a partition that spans segments of several tensors is encoded the same way: the codec
// sees only contiguous float32 values).
class PayloadCodec {
 public:
  PayloadCodec() = default;
  // The codec for a tensor of `dtype` whose operation asked for `requested`: only float32 is
  // compressed. float16 and bfloat16 already travel in 16 bits; float64 is kept (a program asks
  // for float64 for its precision); integers are never rounded.
  PayloadCodec(Encoding requested, DataType dtype);

  Encoding encoding() const { return encoding_; }
  bool compresses() const { return encoding_ != Encoding::kNone; }
  // Payload bytes of `tensor_bytes` of the tensor (a whole number of elements).
  uint64_t WireBytes(uint64_t tensor_bytes) const;
  // Tensor bytes carried by `wire_bytes` of payload (a whole number of codes).
  uint64_t TensorBytes(uint64_t wire_bytes) const;

  // (1) A block for sending (a PUSH, a RESULT, an allgather tensor): `bytes` of tensor data at
  // `src` become WireBytes(bytes) at `dst`. Returns the scale exponent k the frame carries.
  int Encode(const void* src, uint64_t bytes, void* dst) const;
  // (2) The owner adds a received contribution: dst[i] += decode(codes[i]) for the codes in
  // `wire_bytes`; with `a` (the owner's own values, dst != a): dst[i] = a[i] + decode(codes[i]).
  void DecodeAdd(const void* codes, uint64_t wire_bytes, int scale_exp, void* dst) const;
  void DecodeAddTo(const void* codes, uint64_t wire_bytes, int scale_exp, const void* a, void* dst) const;
  // (3) The owner's sum is encoded once for every peer with Encode, and (4) every worker, the
  // owner included, decodes that same payload into its output, so all hold the same bits.
  void Decode(const void* codes, uint64_t wire_bytes, int scale_exp, void* dst) const;

 private:
  Encoding encoding_ = Encoding::kNone;
};

}  // namespace prophet

#endif  // PROPHET_OPS_CORE_CODEC_H_
