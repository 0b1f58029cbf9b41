// Reference conversions between float32 and fp16 / bfloat16 for tests, written independently of
// the kernels in codec.cc (integer arithmetic on the bits, one case at a time) and of the
// compiler's _Float16. NaNs map to a canonical quiet NaN here; tests compare NaNs separately.
#ifndef PROPHET_OPS_CORE_FLOAT16_REFERENCE_H_
#define PROPHET_OPS_CORE_FLOAT16_REFERENCE_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace prophet {
namespace reference {

inline uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
inline float BitsFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Round to nearest even, subnormals, overflow to infinity.
inline uint16_t RefFloatToHalf(float f) {
  const uint32_t x = FloatBits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to infinity
  if (abs < 0x33000000u) return sign;             // < 2^-25: rounds to zero (2^-25 itself is a tie to 0)
  int exp = static_cast<int>(abs >> 23) - 127;
  uint32_t mant = (abs & 0x7fffffu) | 0x800000u;  // 24 significant bits
  int shift;                                      // bits to drop from the 24-bit mantissa
  uint16_t e16;
  if (exp < -14) {  // subnormal half: value = m * 2^-24
    shift = 13 + (-14 - exp);
    e16 = 0;
  } else {
    shift = 13;
    e16 = static_cast<uint16_t>(exp + 15);
  }
  uint32_t kept = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (kept & 1u))) ++kept;
  if (e16 == 0) return sign | static_cast<uint16_t>(kept);  // may carry into the smallest normal: fine
  // kept has the implicit bit at 1 << 10; a carry to 1 << 11 bumps the exponent.
  uint32_t bits = (static_cast<uint32_t>(e16) << 10) + (kept - 0x400u);
  return sign | static_cast<uint16_t>(bits);
}

inline float RefHalfToFloat(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -24);
  if (e == 31) return m ? std::numeric_limits<float>::quiet_NaN() : sign * std::numeric_limits<float>::infinity();
  return sign * std::ldexp(static_cast<float>(m + 1024), e - 25);
}

inline uint16_t RefFloatToBFloat16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  uint32_t kept = x >> 16;
  const uint32_t rem = x & 0xffffu;
  if (rem > 0x8000u || (rem == 0x8000u && (kept & 1u))) ++kept;
  return static_cast<uint16_t>(kept);
}

}  // namespace reference
}  // namespace prophet

#endif  // PROPHET_OPS_CORE_FLOAT16_REFERENCE_H_
