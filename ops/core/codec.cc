#include "ops/core/codec.h"

#include <cmath>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace prophet {

const char* EncodingName(Encoding encoding) {
  switch (encoding) {
    case Encoding::kNone: return "none";
    case Encoding::kFloat16: return "fp16";
    case Encoding::kBFloat16: return "bf16";
  }
  return "?";
}

bool ParseEncoding(const std::string& name, Encoding* encoding) {
  for (Encoding e : {Encoding::kNone, Encoding::kFloat16, Encoding::kBFloat16}) {
    if (name == EncodingName(e) || (name.empty() && e == Encoding::kNone)) {
      *encoding = e;
      return true;
    }
  }
  return false;
}

namespace {

// Per-element routines, written branch-free (every lane computes every case and selects) so that
// the loops below vectorise; always inlined, so that each kernel set compiles them for its ISA.
#define PROPHET_ELEMENT static inline __attribute__((always_inline))

PROPHET_ELEMENT int32_t Bits(float f) {
  int32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
PROPHET_ELEMENT float FromBits(int32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
PROPHET_ELEMENT int32_t Mask(bool condition) { return -static_cast<int32_t>(condition); }
PROPHET_ELEMENT int32_t Select(int32_t mask, int32_t if_set, int32_t if_clear) {
  return (if_set & mask) | (if_clear & ~mask);
}

// float32 -> fp16, to nearest even. Bit patterns of |x|: 0x38800000 = 2^-14 (fp16's smallest
// normal), 0x47800000 = 2^16.
PROPHET_ELEMENT uint16_t HalfBits(float f) {
  const int32_t x = Bits(f);
  const int32_t sign = (x >> 16) & 0x8000;
  const int32_t a = x & 0x7fffffff;
  // Normal: rebias the exponent (127 -> 15) and drop 13 mantissa bits, adding 0xfff plus the
  // lowest kept bit first (ties to even). A carry out of the mantissa bumps the exponent, at
  // 65520 into infinity's pattern 0x7c00, as rounding demands.
  const int32_t normal = (a - ((127 - 15) << 23) + 0xfff + ((a >> 13) & 1)) >> 13;
  // Subnormal (and zero): adding 0.5 makes the FPU round |x| to a multiple of 2^-24, the ulp of
  // [0.5, 1); the low bits of the sum are then the code (1024 = the smallest normal when it
  // rounds up).
  const int32_t subnormal = Bits(FromBits(a) + 0.5f) - Bits(0.5f);
  // NaN: quiet, keeping the top bits of the payload (what F16C's conversion gives).
  const int32_t nan = 0x7e00 | ((a >> 13) & 0x3ff);
  int32_t h = Select(Mask(a < 0x38800000), subnormal, normal);
  h = Select(Mask(a >= 0x47800000), 0x7c00, h);  // 2^16 and above, infinity included
  h = Select(Mask(a > 0x7f800000), nan, h);
  return static_cast<uint16_t>(h | sign);
}

// fp16 -> float32, exact.
PROPHET_ELEMENT float HalfValue(uint16_t code) {
  const int32_t h = code;
  const int32_t sign = (h & 0x8000) << 16;
  const int32_t em = (h & 0x7fff) << 13;  // exponent and mantissa where float32 has them
  const int32_t exponent = em & 0x0f800000;
  // Normal: rebias the exponent (15 -> 127). Infinity and NaN (exponent 31): exponent 255, a NaN
  // made quiet (as F16C does).
  const int32_t special = Mask(exponent == 0x0f800000);
  const int32_t normal = (em + 0x38000000 + (special & 0x38000000)) | (Mask(em > 0x0f800000) & 0x00400000);
  // Zero and subnormals, m * 2^-24: (1 + m / 1024) * 2^-14 - 2^-14, exact in float32.
  const int32_t subnormal = Bits(FromBits(em + 0x38800000) - FromBits(0x38800000));
  return FromBits(Select(Mask(exponent == 0), subnormal, normal) | sign);
}

// float32 -> bfloat16, to nearest even; *overflow is set (all ones) when a finite value rounds to
// infinity.
PROPHET_ELEMENT uint16_t BFloat16Bits(float f, int32_t* overflow) {
  const int32_t x = Bits(f);
  const int32_t a = x & 0x7fffffff;
  const uint32_t u = static_cast<uint32_t>(x);
  const int32_t rounded = static_cast<int32_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  const int32_t nan = static_cast<int32_t>(u >> 16) | 0x40;  // quiet
  *overflow |= Mask(a < 0x7f800000) & Mask((rounded & 0x7fff) == 0x7f80);
  return static_cast<uint16_t>(Select(Mask(a > 0x7f800000), nan, rounded));
}

PROPHET_ELEMENT float BFloat16Value(uint16_t code) { return FromBits(static_cast<int32_t>(code) << 16); }

struct Half {
  PROPHET_ELEMENT float Value(uint16_t code) { return HalfValue(code); }
};
struct BFloat16 {
  PROPHET_ELEMENT float Value(uint16_t code) { return BFloat16Value(code); }
};

// The loops, over distinct (restrict) arrays.
PROPHET_ELEMENT uint32_t MaxFiniteAbsBitsLoop(const float* __restrict x, size_t n) {
  int32_t best = 0;
  for (size_t i = 0; i < n; ++i) {
    const int32_t a = Bits(x[i]) & 0x7fffffff;
    const int32_t finite = a & Mask(a < 0x7f800000);
    best = best > finite ? best : finite;
  }
  return static_cast<uint32_t>(best);
}

PROPHET_ELEMENT void EncodeHalfLoop(const float* __restrict src, size_t n, float scale, uint16_t* __restrict dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = HalfBits(src[i] * scale);
}

PROPHET_ELEMENT bool EncodeBFloat16Loop(const float* __restrict src, size_t n, float scale, uint16_t* __restrict dst) {
  int32_t overflow = 0;
  for (size_t i = 0; i < n; ++i) dst[i] = BFloat16Bits(src[i] * scale, &overflow);
  return overflow != 0;
}

template <typename Format>
PROPHET_ELEMENT void DecodeLoop(const uint16_t* __restrict codes, size_t n, float scale, float* __restrict dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = Format::Value(codes[i]) * scale;
}

template <typename Format>
PROPHET_ELEMENT void DecodeAddLoop(const uint16_t* __restrict codes, size_t n, float scale, float* __restrict dst) {
  for (size_t i = 0; i < n; ++i) dst[i] += Format::Value(codes[i]) * scale;
}

template <typename Format>
PROPHET_ELEMENT void DecodeAddToLoop(const uint16_t* __restrict codes, size_t n, float scale, const float* __restrict a,
                                     float* __restrict dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = a[i] + Format::Value(codes[i]) * scale;
}

// The portable set: the loops compiled for the build's baseline ISA.
uint32_t MaxFiniteAbsBitsPortable(const float* x, size_t n) { return MaxFiniteAbsBitsLoop(x, n); }
void EncodeHalfPortable(const float* src, size_t n, float scale, uint16_t* dst) { EncodeHalfLoop(src, n, scale, dst); }
bool EncodeBFloat16Portable(const float* src, size_t n, float scale, uint16_t* dst) {
  return EncodeBFloat16Loop(src, n, scale, dst);
}
template <typename Format>
void DecodePortable(const uint16_t* codes, size_t n, float scale, float* dst) {
  DecodeLoop<Format>(codes, n, scale, dst);
}
template <typename Format>
void DecodeAddPortable(const uint16_t* codes, size_t n, float scale, float* dst) {
  DecodeAddLoop<Format>(codes, n, scale, dst);
}
template <typename Format>
void DecodeAddToPortable(const uint16_t* codes, size_t n, float scale, const float* a, float* dst) {
  DecodeAddToLoop<Format>(codes, n, scale, a, dst);
}

const CodecKernels kPortable = {
    "portable",
    MaxFiniteAbsBitsPortable,
    EncodeHalfPortable,
    EncodeBFloat16Portable,
    {DecodePortable<Half>, DecodePortable<BFloat16>},
    {DecodeAddPortable<Half>, DecodeAddPortable<BFloat16>},
    {DecodeAddToPortable<Half>, DecodeAddToPortable<BFloat16>},
};

#if defined(__x86_64__)
// The F16C set: fp16 through the hardware conversions (8 values per instruction, rounding to
// nearest even whatever MXCSR says); the other loops compiled for AVX2. Chosen at run time.
#define PROPHET_F16C __attribute__((target("avx2,f16c")))

PROPHET_F16C uint32_t MaxFiniteAbsBitsF16c(const float* x, size_t n) { return MaxFiniteAbsBitsLoop(x, n); }

PROPHET_F16C void EncodeHalfF16c(const float* src, size_t n, float scale, uint16_t* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), s), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = HalfBits(src[i] * scale);  // the same bits, element by element
}

PROPHET_F16C bool EncodeBFloat16F16c(const float* src, size_t n, float scale, uint16_t* dst) {
  return EncodeBFloat16Loop(src, n, scale, dst);
}

PROPHET_F16C __m256 DecodeEight(const uint16_t* codes, __m256 scale) {
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))), scale);
}

PROPHET_F16C void DecodeHalfF16c(const uint16_t* codes, size_t n, float scale, float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, DecodeEight(codes + i, s));
  for (; i < n; ++i) dst[i] = HalfValue(codes[i]) * scale;
}

PROPHET_F16C void DecodeAddHalfF16c(const uint16_t* codes, size_t n, float scale, float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(dst + i), DecodeEight(codes + i, s)));
  for (; i < n; ++i) dst[i] += HalfValue(codes[i]) * scale;
}

PROPHET_F16C void DecodeAddToHalfF16c(const uint16_t* codes, size_t n, float scale, const float* a, float* dst) {
  const __m256 s = _mm256_set1_ps(scale);
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(a + i), DecodeEight(codes + i, s)));
  for (; i < n; ++i) dst[i] = a[i] + HalfValue(codes[i]) * scale;
}

PROPHET_F16C void DecodeBFloat16F16c(const uint16_t* codes, size_t n, float scale, float* dst) {
  DecodeLoop<BFloat16>(codes, n, scale, dst);
}
PROPHET_F16C void DecodeAddBFloat16F16c(const uint16_t* codes, size_t n, float scale, float* dst) {
  DecodeAddLoop<BFloat16>(codes, n, scale, dst);
}
PROPHET_F16C void DecodeAddToBFloat16F16c(const uint16_t* codes, size_t n, float scale, const float* a, float* dst) {
  DecodeAddToLoop<BFloat16>(codes, n, scale, a, dst);
}

const CodecKernels kF16c = {
    "f16c",
    MaxFiniteAbsBitsF16c,
    EncodeHalfF16c,
    EncodeBFloat16F16c,
    {DecodeHalfF16c, DecodeBFloat16F16c},
    {DecodeAddHalfF16c, DecodeAddBFloat16F16c},
    {DecodeAddToHalfF16c, DecodeAddToBFloat16F16c},
};
#endif

// 2^k as a float (|k| <= kMaxScaleExponent: a normal float, so multiplying by it is exact
// unless the product leaves float32's normal range).
float PowerOfTwo(int k) { return FromBits((127 + k) << 23); }

// fp16's scale exponent for a block whose largest finite |x| has bit pattern `bits`: that
// magnitude lands in [2^14, 2^15), well below 65504.
int HalfScaleExponent(uint32_t bits) {
  if (bits == 0) return 0;  // zeros (or nothing finite): nothing to scale
  const int exponent = static_cast<int>(bits >> 23) - 127;  // float32 subnormals: -127, clamped below
  const int k = 14 - exponent;
  return k > kMaxScaleExponent ? kMaxScaleExponent : (k < -kMaxScaleExponent ? -kMaxScaleExponent : k);
}

// Finite values whose code decodes to infinity (rounded up to 2^128) get the next code down, the
// largest finite one (codes grow with the magnitude). Only blocks that reach float32's top binade
// come here.
void RoundDownOverflows(Encoding encoding, const float* x, size_t n, int k, uint16_t* codes) {
  const float down = PowerOfTwo(-k);
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) continue;
    const float value = (encoding == Encoding::kFloat16 ? HalfValue(codes[i]) : BFloat16Value(codes[i])) * down;
    if (!std::isfinite(value)) --codes[i];
  }
}

int FormatIndex(Encoding encoding) { return encoding == Encoding::kFloat16 ? 0 : 1; }

}  // namespace

float HalfToFloat(uint16_t h) { return HalfValue(h); }
uint16_t FloatToHalf(float f) { return HalfBits(f); }
float BFloat16ToFloat(uint16_t b) { return BFloat16Value(b); }
uint16_t FloatToBFloat16(float f) {
  int32_t overflow = 0;
  return BFloat16Bits(f, &overflow);
}

const CodecKernels& PortableCodecKernels() { return kPortable; }

const CodecKernels* F16cCodecKernels() {
#if defined(__x86_64__)
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  }();
  return supported ? &kF16c : nullptr;
#else
  return nullptr;
#endif
}

const CodecKernels& ActiveCodecKernels() {
  static const CodecKernels& kernels = F16cCodecKernels() ? *F16cCodecKernels() : kPortable;
  return kernels;
}

PayloadCodec::PayloadCodec(Encoding requested, DataType dtype)
    : encoding_(dtype == DataType::kFloat32 ? requested : Encoding::kNone) {}

uint64_t PayloadCodec::WireBytes(uint64_t tensor_bytes) const {
  return compresses() ? tensor_bytes / 2 : tensor_bytes;
}

uint64_t PayloadCodec::TensorBytes(uint64_t wire_bytes) const {
  return compresses() ? wire_bytes * 2 : wire_bytes;
}

int PayloadCodec::Encode(const void* src, uint64_t bytes, void* dst) const {
  const CodecKernels& kernels = ActiveCodecKernels();
  const float* x = static_cast<const float*>(src);
  const size_t n = bytes / sizeof(float);
  uint16_t* codes = static_cast<uint16_t*>(dst);
  int k = 0;
  bool near_infinity;
  if (encoding_ == Encoding::kFloat16) {
    const uint32_t largest = kernels.max_finite_abs_bits(x, n);
    k = HalfScaleExponent(largest);
    kernels.encode_half(x, n, PowerOfTwo(k), codes);
    near_infinity = largest >= 0x7f000000u;  // 2^127: its binade's rounding may decode to 2^128
  } else {
    near_infinity = kernels.encode_bfloat16(x, n, 1.0f, codes);
  }
  if (near_infinity) RoundDownOverflows(encoding_, x, n, k, codes);
  return k;
}

void PayloadCodec::DecodeAdd(const void* codes, uint64_t wire_bytes, int scale_exp, void* dst) const {
  ActiveCodecKernels().decode_add[FormatIndex(encoding_)](static_cast<const uint16_t*>(codes), wire_bytes / 2,
                                                          PowerOfTwo(-scale_exp), static_cast<float*>(dst));
}

void PayloadCodec::DecodeAddTo(const void* codes, uint64_t wire_bytes, int scale_exp, const void* a,
                               void* dst) const {
  if (a == dst) return DecodeAdd(codes, wire_bytes, scale_exp, dst);
  ActiveCodecKernels().decode_add_to[FormatIndex(encoding_)](static_cast<const uint16_t*>(codes), wire_bytes / 2,
                                                             PowerOfTwo(-scale_exp), static_cast<const float*>(a),
                                                             static_cast<float*>(dst));
}

void PayloadCodec::Decode(const void* codes, uint64_t wire_bytes, int scale_exp, void* dst) const {
  ActiveCodecKernels().decode[FormatIndex(encoding_)](static_cast<const uint16_t*>(codes), wire_bytes / 2,
                                                      PowerOfTwo(-scale_exp), static_cast<float*>(dst));
}

}  // namespace prophet
