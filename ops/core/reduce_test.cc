// Summation kernels: every summable dtype against a scalar reference, fp16/bf16 rounding, division.
#include "ops/core/reduce.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ops/core/testing.h"

namespace prophet {
namespace {

const size_t kLengths[] = {1, 7, 1023, 100003};

uint32_t FloatBits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float BitsFloat(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// Reference fp16 encoder written independently of the compiler's _Float16 (round to nearest even,
// subnormals, overflow to infinity).
uint16_t RefFloatToHalf(float f) {
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

float RefHalfToFloat(uint16_t h) {
  const int sign = (h & 0x8000) ? -1 : 1;
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -24);
  if (e == 31) return m ? std::numeric_limits<float>::quiet_NaN() : sign * std::numeric_limits<float>::infinity();
  return sign * std::ldexp(static_cast<float>(m + 1024), e - 25);
}

uint16_t RefFloatToBFloat16(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);
  uint32_t kept = x >> 16;
  const uint32_t rem = x & 0xffffu;
  if (rem > 0x8000u || (rem == 0x8000u && (kept & 1u))) ++kept;
  return static_cast<uint16_t>(kept);
}

template <typename T>
void CheckExactSum(DataType dtype, std::mt19937_64& rng) {
  for (size_t n : kLengths) {
    std::vector<T> a(n), b(n), ref(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<T>(static_cast<int64_t>(rng() % 2000001) - 1000000);
      b[i] = static_cast<T>(static_cast<int64_t>(rng() % 2000001) - 1000000);
      ref[i] = a[i] + b[i];
    }
    EXPECT_TRUE(SumInto(dtype, a.data(), b.data(), n));
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) bad += a[i] != ref[i];
    EXPECT_EQ(bad, 0u);
  }
}

TEST(SumIntegersAndExactFloats) {
  std::mt19937_64 rng(1);
  CheckExactSum<int32_t>(DataType::kInt32, rng);
  CheckExactSum<int64_t>(DataType::kInt64, rng);
  CheckExactSum<float>(DataType::kFloat32, rng);  // integers below 2^24: exact
  CheckExactSum<double>(DataType::kFloat64, rng);
}

TEST(SumFloat32Float64MatchScalarReference) {
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<double> u(-1e3, 1e3);
  for (size_t n : kLengths) {
    std::vector<float> a(n), b(n), ra(n);
    std::vector<double> c(n), d(n), rc(n);
    for (size_t i = 0; i < n; ++i) {
      a[i] = static_cast<float>(u(rng));
      b[i] = static_cast<float>(u(rng)) * 1e-3f;
      c[i] = u(rng);
      d[i] = u(rng) * 1e-7;
      volatile float fa = a[i];  // a plain scalar float add, whatever the vectoriser does
      ra[i] = fa + b[i];
      volatile double da = c[i];
      rc[i] = da + d[i];
    }
    EXPECT_TRUE(SumInto(DataType::kFloat32, a.data(), b.data(), n));
    EXPECT_TRUE(SumInto(DataType::kFloat64, c.data(), d.data(), n));
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) bad += FloatBits(a[i]) != FloatBits(ra[i]) || c[i] != rc[i];
    EXPECT_EQ(bad, 0u);
  }
}

TEST(HalfConversionsMatchReference) {
  // Every half value converts to float exactly and back to itself (NaNs stay NaN).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    const float r = RefHalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(r)) {
      EXPECT_TRUE(std::isnan(f));
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
      continue;
    }
    if (FloatBits(f) != FloatBits(r) || FloatToHalf(f) != h) {
      std::fprintf(stderr, "half 0x%04x: %g vs %g\n", h, f, r);
      ++::prophet::testing::Failures();
      break;
    }
  }
  // Float -> half rounding against the independent reference on many floats near half values,
  // including exact ties.
  std::mt19937_64 rng(3);
  size_t bad = 0;
  for (int i = 0; i < 400000; ++i) {
    float f;
    if (i % 2) {
      f = BitsFloat(static_cast<uint32_t>(rng()));
    } else {
      // A half value plus a sub-ulp offset in float: ties and near-ties.
      const uint16_t h = static_cast<uint16_t>(rng() & 0x7bffu);
      const uint32_t bits = FloatBits(RefHalfToFloat(h)) + static_cast<uint32_t>(rng() % 0x4000u);
      f = BitsFloat(bits);
    }
    if (std::isnan(f)) continue;
    bad += FloatToHalf(f) != RefFloatToHalf(f);
  }
  EXPECT_EQ(bad, 0u);
}

TEST(HalfRoundingKnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);                // largest finite
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);                // below the midpoint to infinity
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);                // tie at 65520 rounds to even = inf
  EXPECT_EQ(FloatToHalf(1e9f), 0x7c00);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 1 + 2^-10 (odd) and 1 + 2^-9 (even): rounds up.
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Slightly above a tie rounds up.
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Subnormals: 2^-24 is the smallest; 2^-25 is a tie between 0 and it (rounds to 0);
  // 3 * 2^-25 is a tie between 1 and 2 units (rounds to 2).
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
}

TEST(BFloat16RoundingKnownValues) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-1.0f), 0xbf80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8: halfway between 0x3f81 (odd) and 0x3f82: up.
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(FloatToBFloat16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x3f80ffffu)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x3f807fffu)), 0x3f80);
  // The largest finite float rounds to infinity; the largest finite bf16 stays.
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x7f7f0000u)), 0x7f7f);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xff80);
  // NaN stays NaN (not rounded into infinity), including a NaN whose payload is only low bits.
  const uint16_t nan = FloatToBFloat16(BitsFloat(0x7f800001u));
  EXPECT_TRUE((nan & 0x7f80) == 0x7f80 && (nan & 0x7f) != 0);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(BFloat16ToFloat(0x4049), 3.140625f);
  // Every bf16 value round-trips.
  size_t bad = 0;
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) continue;
    bad += FloatToBFloat16(f) != b;
  }
  EXPECT_EQ(bad, 0u);
  // Against the reference on random floats.
  std::mt19937_64 rng(4);
  bad = 0;
  for (int i = 0; i < 400000; ++i) {
    const float f = BitsFloat(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    bad += FloatToBFloat16(f) != RefFloatToBFloat16(f);
  }
  EXPECT_EQ(bad, 0u);
}

TEST(SumFloat16AndBFloat16AgainstReference) {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-100.0f, 100.0f);
  for (size_t n : kLengths) {
    std::vector<uint16_t> h1(n), h2(n), href(n), b1(n), b2(n), bref(n);
    for (size_t i = 0; i < n; ++i) {
      h1[i] = RefFloatToHalf(u(rng));
      h2[i] = RefFloatToHalf(u(rng) * (i % 3 ? 1.0f : 1e-3f));
      // float(a) + float(b) rounded once to half (as TensorFlow's Eigen::half does).
      href[i] = RefFloatToHalf(RefHalfToFloat(h1[i]) + RefHalfToFloat(h2[i]));
      b1[i] = RefFloatToBFloat16(u(rng));
      b2[i] = RefFloatToBFloat16(u(rng) * (i % 3 ? 1.0f : 1e-3f));
      bref[i] = RefFloatToBFloat16(BFloat16ToFloat(b1[i]) + BFloat16ToFloat(b2[i]));
    }
    EXPECT_TRUE(SumInto(DataType::kFloat16, h1.data(), h2.data(), n));
    EXPECT_TRUE(SumInto(DataType::kBFloat16, b1.data(), b2.data(), n));
    size_t bad_h = 0, bad_b = 0;
    for (size_t i = 0; i < n; ++i) {
      bad_h += h1[i] != href[i];
      bad_b += b1[i] != bref[i];
    }
    EXPECT_EQ(bad_h, 0u);
    EXPECT_EQ(bad_b, 0u);
  }
}

TEST(HalfSumsRoundToNearestEven) {
  // 2048 + 1: the sum is a tie between 2048 and 2050 in half (ulp 2): even mantissa = 2048.
  uint16_t a[4] = {FloatToHalf(2048.0f), FloatToHalf(2050.0f), FloatToHalf(1.0f), FloatToHalf(65504.0f)};
  const uint16_t b[4] = {FloatToHalf(1.0f), FloatToHalf(1.0f), FloatToHalf(std::ldexp(1.0f, -11)),
                         FloatToHalf(32.0f)};
  EXPECT_TRUE(SumInto(DataType::kFloat16, a, b, 4));
  EXPECT_EQ(HalfToFloat(a[0]), 2048.0f);
  EXPECT_EQ(HalfToFloat(a[1]), 2052.0f);  // 2051 is a tie between 2050 (odd) and 2052: up
  EXPECT_EQ(a[2], 0x3c00);                // 1 + 2^-11: tie, stays 1
  EXPECT_EQ(a[3], 0x7c00);                // 65536 overflows to infinity
  // bf16: 256 + 1 is a tie between 256 and 258 (ulp 2): stays 256; 258 + 1 goes to 260.
  uint16_t c[2] = {FloatToBFloat16(256.0f), FloatToBFloat16(258.0f)};
  const uint16_t d[2] = {FloatToBFloat16(1.0f), FloatToBFloat16(1.0f)};
  EXPECT_TRUE(SumInto(DataType::kBFloat16, c, d, 2));
  EXPECT_EQ(BFloat16ToFloat(c[0]), 256.0f);
  EXPECT_EQ(BFloat16ToFloat(c[1]), 260.0f);
}

TEST(DivideByEveryDtype) {
  for (size_t n : kLengths) {
    std::vector<float> f(n);
    std::vector<double> d(n);
    std::vector<int32_t> i32(n);
    std::vector<int64_t> i64(n);
    std::vector<uint16_t> h(n), b(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t v = static_cast<int64_t>(i % 1001) - 500;  // negatives too
      f[i] = static_cast<float>(v);
      d[i] = static_cast<double>(v);
      i32[i] = static_cast<int32_t>(v);
      i64[i] = v * 1000000007ll;
      h[i] = FloatToHalf(static_cast<float>(v));
      b[i] = FloatToBFloat16(static_cast<float>(v));
    }
    EXPECT_TRUE(DivideBy(DataType::kFloat32, f.data(), n, 3));
    EXPECT_TRUE(DivideBy(DataType::kFloat64, d.data(), n, 3));
    EXPECT_TRUE(DivideBy(DataType::kInt32, i32.data(), n, 3));
    EXPECT_TRUE(DivideBy(DataType::kInt64, i64.data(), n, 3));
    EXPECT_TRUE(DivideBy(DataType::kFloat16, h.data(), n, 3));
    EXPECT_TRUE(DivideBy(DataType::kBFloat16, b.data(), n, 3));
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      const int64_t v = static_cast<int64_t>(i % 1001) - 500;
      bad += f[i] != static_cast<float>(v) / 3.0f;
      bad += d[i] != static_cast<double>(v) / 3.0;
      bad += i32[i] != static_cast<int32_t>(v / 3);  // truncates toward zero: -5 / 3 = -1
      bad += i64[i] != v * 1000000007ll / 3;
      bad += h[i] != RefFloatToHalf(static_cast<float>(v) / 3.0f);
      // v above 256 is not exact in bf16: divide the stored value.
      bad += b[i] != RefFloatToBFloat16(BFloat16ToFloat(RefFloatToBFloat16(static_cast<float>(v))) / 3.0f);
    }
    EXPECT_EQ(bad, 0u);
  }
  int32_t x[3] = {-5, 5, -1};
  EXPECT_TRUE(DivideBy(DataType::kInt32, x, 3, 2));
  EXPECT_EQ(x[0], -2);
  EXPECT_EQ(x[1], 2);
  EXPECT_EQ(x[2], 0);
}

// SumTo(dst, a, b) = a + b, written to dst (also when dst aliases a or b): bit-identical to
// copying a and then SumInto(b), for every dtype.
TEST(SumToMatchesCopyThenSumInto) {
  std::mt19937_64 rng(6);
  const DataType dtypes[] = {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat32,
                             DataType::kFloat64, DataType::kInt32,    DataType::kInt64};
  for (DataType dtype : dtypes) {
    const size_t elem = DataTypeSize(dtype);
    for (size_t n : kLengths) {
      std::vector<char> a(n * elem), b(n * elem), ref, dst(n * elem, 0x11), alias;
      for (size_t i = 0; i < n; ++i) {
        const float x = static_cast<float>(static_cast<int64_t>(rng() % 20001) - 10000) / 64.0f;
        const float y = static_cast<float>(static_cast<int64_t>(rng() % 20001) - 10000) / 64.0f;
        switch (dtype) {
          case DataType::kFloat16: {
            const uint16_t hx = FloatToHalf(x), hy = FloatToHalf(y);
            std::memcpy(&a[i * 2], &hx, 2), std::memcpy(&b[i * 2], &hy, 2);
            break;
          }
          case DataType::kBFloat16: {
            const uint16_t bx = FloatToBFloat16(x), by = FloatToBFloat16(y);
            std::memcpy(&a[i * 2], &bx, 2), std::memcpy(&b[i * 2], &by, 2);
            break;
          }
          case DataType::kFloat32: std::memcpy(&a[i * 4], &x, 4), std::memcpy(&b[i * 4], &y, 4); break;
          case DataType::kFloat64: {
            const double dx = x, dy = y / 3.0;
            std::memcpy(&a[i * 8], &dx, 8), std::memcpy(&b[i * 8], &dy, 8);
            break;
          }
          case DataType::kInt32: {
            const int32_t ix = static_cast<int32_t>(rng()) / 2, iy = static_cast<int32_t>(rng()) / 2;
            std::memcpy(&a[i * 4], &ix, 4), std::memcpy(&b[i * 4], &iy, 4);
            break;
          }
          default: {
            const int64_t ix = static_cast<int64_t>(rng()) / 2, iy = static_cast<int64_t>(rng()) / 2;
            std::memcpy(&a[i * 8], &ix, 8), std::memcpy(&b[i * 8], &iy, 8);
            break;
          }
        }
      }
      ref = a;
      EXPECT_TRUE(SumInto(dtype, ref.data(), b.data(), n));
      EXPECT_TRUE(SumTo(dtype, dst.data(), a.data(), b.data(), n));
      EXPECT_TRUE(dst == ref);
      alias = a;
      EXPECT_TRUE(SumTo(dtype, alias.data(), alias.data(), b.data(), n));  // dst == a
      EXPECT_TRUE(alias == ref);
      alias = b;
      EXPECT_TRUE(SumTo(dtype, alias.data(), a.data(), alias.data(), n));  // dst == b (received in place)
      EXPECT_TRUE(alias == ref);
    }
  }
  uint8_t x[2] = {1, 2}, y[2] = {3, 4}, z[2] = {0, 0};
  EXPECT_TRUE(!SumTo(DataType::kUInt8, z, x, y, 2));
  EXPECT_TRUE(!SumTo(DataType::kBool, z, x, y, 2));
  EXPECT_EQ(z[0], 0);
}

TEST(ZeroLengthIsANoOp) {
  float a = 1.0f;
  const float b = 2.0f;
  EXPECT_TRUE(SumInto(DataType::kFloat32, &a, &b, 0));
  EXPECT_TRUE(DivideBy(DataType::kFloat32, &a, 0, 2));
  EXPECT_EQ(a, 1.0f);
}

TEST(UnsupportedDtypesReturnFalse) {
  uint8_t a[4] = {1, 2, 3, 4};
  const uint8_t b[4] = {1, 1, 1, 1};
  const DataType bad[] = {DataType::kUInt8, DataType::kBool, DataType::kInvalid, static_cast<DataType>(99)};
  for (DataType d : bad) {
    EXPECT_TRUE(!SumInto(d, a, b, 4));
    EXPECT_TRUE(!DivideBy(d, a, 4, 2));
  }
  // Untouched.
  EXPECT_EQ(a[0], 1);
  EXPECT_EQ(a[3], 4);
  EXPECT_TRUE(IsSummable(DataType::kFloat16) && IsSummable(DataType::kInt64));
  EXPECT_TRUE(!IsSummable(DataType::kUInt8) && !IsSummable(DataType::kBool));
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
