// Summation kernels: every summable dtype against a scalar reference, fp16/bf16 sums, division.
#include "ops/core/reduce.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "ops/core/codec.h"
#include "ops/core/float16_reference.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

using reference::BitsFloat;
using reference::FloatBits;
using reference::RefFloatToBFloat16;
using reference::RefFloatToHalf;
using reference::RefHalfToFloat;

const size_t kLengths[] = {1, 7, 1023, 100003};

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
