// fp16 / bf16 conversion kernels and the payload codec: every 16-bit pattern decoded exactly,
// rounding against an independent reference at every rounding boundary, NaN / infinity /
// subnormals, every kernel set bit-identical (also with denormals flushed), the range guard.
#include "ops/core/codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "ops/core/float16_reference.h"
#include "ops/core/testing.h"

namespace prophet {
namespace {

using reference::BitsFloat;
using reference::FloatBits;
using reference::RefFloatToBFloat16;
using reference::RefFloatToHalf;
using reference::RefHalfToFloat;

constexpr int kHalf = 0, kBFloat16 = 1;  // CodecKernels' format index

std::vector<const CodecKernels*> AllKernels() {
  std::vector<const CodecKernels*> sets = {&PortableCodecKernels()};
  if (F16cCodecKernels() != nullptr) sets.push_back(F16cCodecKernels());
  return sets;
}

// What decoding a NaN code gives: the same sign and payload, made quiet.
uint32_t QuietNanBits(uint32_t float_bits) { return float_bits | 0x00400000u; }

// The float32 value (bits) of every fp16 code, from the reference; NaNs keep their payload.
uint32_t ExpectedHalfBits(uint16_t h) {
  if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff))
    return QuietNanBits((static_cast<uint32_t>(h & 0x8000) << 16) | 0x7f800000u | (static_cast<uint32_t>(h & 0x3ff) << 13));
  return FloatBits(RefHalfToFloat(h));
}

// What encoding gives for a float32: the reference, and for NaNs the quiet NaN with the top bits
// of the payload (the hardware's choice).
uint16_t ExpectedHalfCode(float f) {
  const uint32_t x = FloatBits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>(((x >> 16) & 0x8000u) | 0x7e00u | ((x >> 13) & 0x3ffu));
  return RefFloatToHalf(f);
}

std::vector<uint16_t> EveryCode() {
  std::vector<uint16_t> codes(65536);
  for (uint32_t c = 0; c < 65536; ++c) codes[c] = static_cast<uint16_t>(c);
  return codes;
}

// Floats at and around every rounding boundary of fp16: each fp16 value, the midpoints between
// neighbours (exact ties), one float32 ulp either side of both, and the same for negatives.
std::vector<float> HalfBoundaryFloats() {
  std::vector<float> out;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const uint32_t lo = FloatBits(RefHalfToFloat(static_cast<uint16_t>(h)));
    const uint32_t hi = h + 1 < 0x7c00 ? FloatBits(RefHalfToFloat(static_cast<uint16_t>(h + 1)))
                                       : FloatBits(65536.0f);  // the next step up is infinity
    const uint32_t mid = FloatBits((BitsFloat(lo) + BitsFloat(hi)) / 2);  // exact in float32
    for (uint32_t b : {lo, lo + 1, mid - 1, mid, mid + 1, hi - 1}) {
      out.push_back(BitsFloat(b));
      out.push_back(-BitsFloat(b));
    }
  }
  return out;
}

// Random bit patterns (every exponent, NaNs included) and specials.
std::vector<float> RandomFloats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<float> out;
  for (size_t i = 0; i < n; ++i) out.push_back(BitsFloat(static_cast<uint32_t>(rng())));
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                            BitsFloat(0x7f800001u), BitsFloat(0xffbfffffu), std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min()};
  for (float s : specials) out.push_back(s);
  return out;
}

// Exhaustive: every fp16 and every bf16 pattern decodes to its exact value, in every mode and
// kernel set (the vector bodies and their scalar tails: the array is not a multiple of 8 long).
TEST(DecodeEveryPatternExactly) {
  std::vector<uint16_t> codes = EveryCode();
  codes.push_back(0x3c00);  // 65537 values: a tail after the vector loop
  const size_t n = codes.size();
  for (const CodecKernels* k : AllKernels()) {
    std::vector<float> out(n), add(n, 0.0f), add_to(n), zeros(n, 0.0f);
    for (int format : {kHalf, kBFloat16}) {
      k->decode[format](codes.data(), n, 1.0f, out.data());
      std::fill(add.begin(), add.end(), 0.0f);
      k->decode_add[format](codes.data(), n, 1.0f, add.data());
      k->decode_add_to[format](codes.data(), n, 1.0f, zeros.data(), add_to.data());
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) {
        const uint16_t c = codes[i];
        uint32_t want = format == kHalf ? ExpectedHalfBits(c) : static_cast<uint32_t>(c) << 16;
        if (format == kBFloat16 && (want & 0x7fffffffu) > 0x7f800000u) want = QuietNanBits(want);
        // 0 + (-0) is +0: the adding modes turn negative zero positive, as any sum does.
        const uint32_t want_sum = (want == 0x80000000u) ? 0u : want;
        if (FloatBits(out[i]) != want || FloatBits(add[i]) != want_sum || FloatBits(add_to[i]) != want_sum) {
          if (bad++ < 5)
            std::fprintf(stderr, "%s %s 0x%04x: %08x %08x %08x, want %08x\n", k->name, format == kHalf ? "fp16" : "bf16",
                         c, FloatBits(out[i]), FloatBits(add[i]), FloatBits(add_to[i]), want);
        }
      }
      EXPECT_EQ(bad, 0u);
    }
  }
  // The scalar conversions are the same routines.
  size_t bad = 0;
  for (uint32_t c = 0; c < 65536; ++c) {
    bad += FloatBits(HalfToFloat(static_cast<uint16_t>(c))) != ExpectedHalfBits(static_cast<uint16_t>(c));
    bad += FloatBits(BFloat16ToFloat(static_cast<uint16_t>(c))) != c << 16;  // no arithmetic: NaNs unchanged
  }
  EXPECT_EQ(bad, 0u);
}

// Every finite pattern survives decode then encode, in both formats and every kernel set.
TEST(EveryFiniteCodeRoundTrips) {
  const std::vector<uint16_t> codes = EveryCode();
  for (const CodecKernels* k : AllKernels()) {
    for (int format : {kHalf, kBFloat16}) {
      std::vector<float> values(codes.size());
      k->decode[format](codes.data(), codes.size(), 1.0f, values.data());
      std::vector<uint16_t> again(codes.size());
      if (format == kHalf) {
        k->encode_half(values.data(), values.size(), 1.0f, again.data());
      } else {
        EXPECT_TRUE(!k->encode_bfloat16(values.data(), values.size(), 1.0f, again.data()));  // no overflow
      }
      size_t bad = 0, nans = 0;
      for (size_t i = 0; i < codes.size(); ++i) {
        if (std::isnan(values[i])) {
          ++nans;
          const uint16_t quiet = format == kHalf ? 0x0200 : 0x0040;
          bad += again[i] != (codes[i] | quiet);  // sign and payload kept, quiet
          continue;
        }
        bad += again[i] != codes[i];
      }
      EXPECT_EQ(bad, 0u);
      EXPECT_EQ(nans, 2u * (format == kHalf ? 1023u : 127u));
    }
  }
}

// float32 -> fp16 against the independent reference at every rounding boundary (ties, one ulp
// either side, overflow into infinity, the subnormal range) and on random bit patterns.
TEST(EncodeHalfMatchesReferenceAtEveryBoundary) {
  std::vector<float> in = HalfBoundaryFloats();
  const std::vector<float> random = RandomFloats(1000003, 7);
  in.insert(in.end(), random.begin(), random.end());
  // Tiny values: everything from 2^-26 up to 2^-14 in steps that hit ties between subnormals.
  for (uint32_t b = FloatBits(std::ldexp(1.0f, -26)); b < FloatBits(std::ldexp(1.0f, -14)); b += 997) {
    in.push_back(BitsFloat(b));
    in.push_back(-BitsFloat(b));
  }
  for (const CodecKernels* k : AllKernels()) {
    std::vector<uint16_t> out(in.size());
    k->encode_half(in.data(), in.size(), 1.0f, out.data());
    size_t bad = 0;
    for (size_t i = 0; i < in.size(); ++i) {
      if (out[i] != ExpectedHalfCode(in[i]) || FloatToHalf(in[i]) != out[i]) {
        if (bad++ < 5)
          std::fprintf(stderr, "%s: %a (%08x) -> %04x, want %04x\n", k->name, in[i], FloatBits(in[i]), out[i],
                       ExpectedHalfCode(in[i]));
      }
    }
    EXPECT_EQ(bad, 0u);
  }
}

TEST(EncodeBFloat16MatchesReference) {
  std::vector<float> in = RandomFloats(1000003, 8);
  // Every bf16 value, the ties between neighbours and one ulp either side.
  for (uint32_t b = 0; b < 0x7f80; ++b) {
    const uint32_t lo = b << 16;
    for (uint32_t x : {lo, lo + 0x7fffu, lo + 0x8000u, lo + 0x8001u, lo + 0xffffu}) {
      in.push_back(BitsFloat(x));
      in.push_back(-BitsFloat(x));
    }
  }
  for (const CodecKernels* k : AllKernels()) {
    std::vector<uint16_t> out(in.size());
    // FLT_MAX is among the inputs: it rounds to infinity, which the kernel reports.
    EXPECT_TRUE(k->encode_bfloat16(in.data(), in.size(), 1.0f, out.data()));
    size_t bad = 0;
    for (size_t i = 0; i < in.size(); ++i) bad += out[i] != RefFloatToBFloat16(in[i]) || FloatToBFloat16(in[i]) != out[i];
    EXPECT_EQ(bad, 0u);
  }
}

TEST(RoundingKnownValues) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);  // below the midpoint to infinity
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // the tie at 65520 rounds to even: infinity
  EXPECT_EQ(FloatToHalf(1e9f), 0x7c00);
  // 1 + 2^-11 is halfway between 1 and 1 + 2^-10: ties to even (1.0); 1 + 3 * 2^-11 is halfway
  // between 1 + 2^-10 (odd) and 1 + 2^-9: up; just above a tie: up.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Subnormals: 2^-24 is the smallest; 2^-25 is a tie between 0 and it (to 0); 3 * 2^-25 a tie
  // between 1 and 2 units (to 2); the largest subnormal rounds up into the smallest normal.
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);
  EXPECT_EQ(FloatToHalf(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(FloatToHalf(3 * std::ldexp(1.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -26)), 0x0400);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::denorm_min()), 0x8000);
  EXPECT_EQ(HalfToFloat(0x3555), 0.333251953125f);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(HalfToFloat(0x83ff), -std::ldexp(1023.0f, -24));
  // Infinities and NaNs.
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToHalf(BitsFloat(0x7f800001u)), 0x7e00);  // a signalling NaN whose payload is below fp16's: quiet NaN, not infinity
  EXPECT_EQ(FloatToHalf(BitsFloat(0xffc02000u)), 0xfe01);  // sign and top payload bits kept
  EXPECT_TRUE(std::isinf(HalfToFloat(0xfc00)) && HalfToFloat(0xfc00) < 0);
  EXPECT_EQ(FloatBits(HalfToFloat(0x7c01)), 0x7fc02000u);  // made quiet, payload kept

  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(-1.0f), 0xbf80);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie: even
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie: up to even
  EXPECT_EQ(FloatToBFloat16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x3f80ffffu)), 0x3f81);
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x3f807fffu)), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to infinity
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x7f7f0000u)), 0x7f7f);             // the largest finite bf16 stays
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x7f800001u)), 0x7fc0);  // NaN stays NaN, not infinity
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x00000001u)), 0x0000);  // float32 subnormals: bf16 subnormals or 0
  EXPECT_EQ(FloatToBFloat16(BitsFloat(0x00018000u)), 0x0002);  // tie between subnormals 1 and 2: even
  EXPECT_EQ(BFloat16ToFloat(0x4049), 3.140625f);
}

// Scales: every power of two a codec uses, against the reference times the scale.
TEST(ScaledKernelsMatchScaledReference) {
  std::mt19937_64 rng(9);
  std::vector<float> x(4099);
  for (float& v : x) v = static_cast<float>(std::ldexp(static_cast<double>(rng() % 2000001) - 1000000.0, -20));
  std::vector<uint16_t> codes(x.size()), expected(x.size());
  std::vector<float> out(x.size()), base(x.size(), 1.5f);
  for (int k : {-126, -20, -1, 0, 1, 14, 40, 126}) {
    const float up = std::ldexp(1.0f, k), down = std::ldexp(1.0f, -k);
    for (const CodecKernels* kernels : AllKernels()) {
      kernels->encode_half(x.data(), x.size(), up, codes.data());
      size_t bad = 0;
      for (size_t i = 0; i < x.size(); ++i) bad += codes[i] != ExpectedHalfCode(x[i] * up);
      kernels->decode_add_to[kHalf](codes.data(), codes.size(), down, base.data(), out.data());
      for (size_t i = 0; i < x.size(); ++i) bad += FloatBits(out[i]) != FloatBits(1.5f + RefHalfToFloat(codes[i]) * down);
      kernels->encode_bfloat16(x.data(), x.size(), up, codes.data());
      for (size_t i = 0; i < x.size(); ++i) bad += codes[i] != RefFloatToBFloat16(x[i] * up);
      kernels->decode[kBFloat16](codes.data(), codes.size(), down, out.data());
      for (size_t i = 0; i < x.size(); ++i) bad += FloatBits(out[i]) != FloatBits(BFloat16ToFloat(codes[i]) * down);
      EXPECT_EQ(bad, 0u);
    }
  }
}

TEST(KernelSetsAreBitIdentical) {
  if (F16cCodecKernels() == nullptr) {
    std::printf("(no F16C/AVX2 on this CPU: only the portable kernels exist)\n");
    return;
  }
  const CodecKernels& a = PortableCodecKernels();
  const CodecKernels& b = *F16cCodecKernels();
  const std::vector<float> x = RandomFloats(1 << 20, 10);
  std::vector<uint16_t> ca(x.size()), cb(x.size());
  a.encode_half(x.data(), x.size(), 1.0f, ca.data());
  b.encode_half(x.data(), x.size(), 1.0f, cb.data());
  EXPECT_TRUE(ca == cb);
  EXPECT_EQ(a.encode_bfloat16(x.data(), x.size(), 1.0f, ca.data()), b.encode_bfloat16(x.data(), x.size(), 1.0f, cb.data()));
  EXPECT_TRUE(ca == cb);
  EXPECT_EQ(a.max_finite_abs_bits(x.data(), x.size()), b.max_finite_abs_bits(x.data(), x.size()));
}

#if defined(__x86_64__)
// TensorFlow's threads flush denormals (FTZ and DAZ set in MXCSR). Decoding never meets a float32
// denormal (fp16 subnormals are normal floats), and encoding only meets float32 denormals that
// round to zero in fp16 anyway: the results are the same bits.
TEST(FlushedDenormalsChangeNothing) {
  const std::vector<uint16_t> codes = EveryCode();
  std::vector<float> x = HalfBoundaryFloats();
  for (uint32_t b = 1; b < 0x00800000u; b += 4099) x.push_back(BitsFloat(b));  // float32 denormals
  for (const CodecKernels* k : AllKernels()) {
    std::vector<float> plain(codes.size()), flushed(codes.size());
    std::vector<uint16_t> enc_plain(x.size()), enc_flushed(x.size());
    k->decode[kHalf](codes.data(), codes.size(), 1.0f, plain.data());
    k->encode_half(x.data(), x.size(), 1.0f, enc_plain.data());
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);  // FTZ | DAZ
    k->decode[kHalf](codes.data(), codes.size(), 1.0f, flushed.data());
    k->encode_half(x.data(), x.size(), 1.0f, enc_flushed.data());
    _mm_setcsr(csr);
    EXPECT_TRUE(std::memcmp(plain.data(), flushed.data(), plain.size() * 4) == 0);
    EXPECT_TRUE(enc_plain == enc_flushed);
  }
}
#endif

// ---- the payload codec ---------------------------------------------------------------------

uint32_t MaxFiniteAbsBits(const std::vector<float>& x) {
  uint32_t best = 0;
  for (float v : x)
    if (std::isfinite(v)) best = std::max(best, FloatBits(v) & 0x7fffffffu);
  return best;
}

// Encodes `x` with `codec` and decodes it again; returns the scale exponent.
int RoundTrip(const PayloadCodec& codec, const std::vector<float>& x, std::vector<float>* out) {
  std::vector<uint16_t> wire(x.size());
  EXPECT_EQ(codec.WireBytes(x.size() * 4), x.size() * 2);
  const int k = codec.Encode(x.data(), x.size() * 4, wire.data());
  out->assign(x.size(), 0.0f);
  codec.Decode(wire.data(), wire.size() * 2, k, out->data());
  return k;
}

// The fp16 range guard: a block's scale puts its largest finite magnitude in [2^14, 2^15), so
// neither 1e6 (beyond 65504) nor 1e-8 (below fp16's smallest subnormal) is lost, and every
// element is within the stated bound max(2^-11 |x|, 2^(-25-k)).
TEST(HalfRangeGuardScalesEachBlock) {
  const PayloadCodec codec(Encoding::kFloat16, DataType::kFloat32);
  std::mt19937_64 rng(11);
  for (double magnitude : {1e6, 1e-8, 3e38, 1e-30, 1.0, 65504.0, 70000.0, 3.4028234663852886e38}) {
    std::vector<float> x(1000);
    for (float& v : x) v = static_cast<float>(magnitude * (static_cast<double>(rng() % 2000001) / 1e6 - 1.0));
    x[17] = static_cast<float>(magnitude);  // the block's largest
    std::vector<float> y;
    const int k = RoundTrip(codec, x, &y);
    const double top = std::ldexp(static_cast<double>(MaxFiniteAbsBits(x) ? BitsFloat(MaxFiniteAbsBits(x)) : 0.0f), k);
    EXPECT_TRUE(top >= 16384.0 && top < 32768.0);
    size_t bad = 0, exact = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double err = std::fabs(static_cast<double>(y[i]) - x[i]);
      const double bound = std::max(std::ldexp(std::fabs(static_cast<double>(x[i])), -11), std::ldexp(1.0, -25 - k));
      bad += !std::isfinite(y[i]) || err > bound;
      exact += err == 0.0;
    }
    EXPECT_EQ(bad, 0u);
    EXPECT_TRUE(exact < x.size());  // it was rounded: the test is not comparing x with itself
    EXPECT_TRUE(std::fabs(y[17] - x[17]) <= std::ldexp(std::fabs(x[17]), -11));
  }
  // Zeros only: scale 1, zeros back.
  std::vector<float> zeros(9, 0.0f), y;
  EXPECT_EQ(RoundTrip(codec, zeros, &y), 0);
  EXPECT_TRUE(y == zeros);
}

// Non-finite values travel as themselves; the finite ones beside them still get a scale from
// the finite values only and never become infinite.
TEST(NonFiniteValuesStayNonFinite) {
  const float inf = std::numeric_limits<float>::infinity();
  for (Encoding e : {Encoding::kFloat16, Encoding::kBFloat16}) {
    const PayloadCodec codec(e, DataType::kFloat32);
    const std::vector<float> x = {1e6f, -inf, std::numeric_limits<float>::quiet_NaN(), 3.0f, inf, -1e6f, 0.125f};
    std::vector<float> y;
    RoundTrip(codec, x, &y);
    EXPECT_TRUE(std::isinf(y[1]) && y[1] < 0);
    EXPECT_TRUE(std::isnan(y[2]));
    EXPECT_TRUE(std::isinf(y[4]) && y[4] > 0);
    for (size_t i : {0, 3, 5, 6}) EXPECT_TRUE(std::isfinite(y[i]) && std::fabs(y[i] - x[i]) <= std::fabs(x[i]) / 128);
  }
}

// bf16 keeps float32's range without a scale. Near float32's largest finite value, where
// rounding to 8 bits would give 2^128, both formats round down instead of to infinity.
TEST(NothingFiniteDecodesToInfinity) {
  const PayloadCodec bf16(Encoding::kBFloat16, DataType::kFloat32);
  std::vector<float> x = {1e-30f, 1.0f, -3e38f, 1e-8f, std::numeric_limits<float>::denorm_min() * 3}, y;
  EXPECT_EQ(RoundTrip(bf16, x, &y), 0);
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_TRUE(std::fabs(y[i] - x[i]) <= std::max(std::ldexp(std::fabs(x[i]), -8), std::ldexp(1.0f, -134)));
  const float top = std::numeric_limits<float>::max();
  for (Encoding e : {Encoding::kBFloat16, Encoding::kFloat16}) {
    const PayloadCodec codec(e, DataType::kFloat32);
    const double u = std::ldexp(1.0, e == Encoding::kFloat16 ? -11 : -8);
    const double subnormal = std::ldexp(1.0, e == Encoding::kFloat16 ? -25 + 113 : -134);  // k = -113 for fp16
    x = {top, -top, std::nextafter(top, 0.0f), 3.3961e38f, -3.3e38f, 1.0f, std::numeric_limits<float>::infinity()};
    RoundTrip(codec, x, &y);
    for (size_t i = 0; i + 1 < x.size(); ++i) {
      EXPECT_TRUE(std::isfinite(y[i]));
      EXPECT_TRUE(std::fabs(static_cast<double>(y[i]) - x[i]) <= std::max(u * std::fabs(x[i]), subnormal));
    }
    EXPECT_TRUE(y[0] == -y[1] && y[0] < top);
    EXPECT_TRUE(std::isinf(y.back()));
  }
}

// The owner's hooks: decode-and-add, and the first contribution added to its own values.
TEST(DecodeAddHooksMatchScalarSums) {
  std::mt19937_64 rng(12);
  std::uniform_real_distribution<float> u(-1e4f, 1e4f);
  for (Encoding e : {Encoding::kFloat16, Encoding::kBFloat16}) {
    const PayloadCodec codec(e, DataType::kFloat32);
    for (size_t n : {1, 7, 8, 1023, 100003}) {
      std::vector<float> x(n), own(n), dst(n), sum(n);
      for (size_t i = 0; i < n; ++i) x[i] = u(rng) * (i % 5 ? 1.0f : 1e-4f), own[i] = u(rng);
      std::vector<uint16_t> wire(n);
      const int k = codec.Encode(x.data(), n * 4, wire.data());
      const float down = std::ldexp(1.0f, -k);
      codec.DecodeAddTo(wire.data(), n * 2, k, own.data(), dst.data());
      sum = own;
      codec.DecodeAdd(wire.data(), n * 2, k, sum.data());
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) {
        const float decoded = (e == Encoding::kFloat16 ? RefHalfToFloat(wire[i]) : BFloat16ToFloat(wire[i])) * down;
        volatile float expected = own[i] + decoded;  // one float32 addition
        bad += FloatBits(dst[i]) != FloatBits(expected) || FloatBits(sum[i]) != FloatBits(expected);
      }
      EXPECT_EQ(bad, 0u);
      codec.DecodeAddTo(wire.data(), n * 2, k, sum.data(), sum.data());  // aliasing: adds in place
    }
  }
}

TEST(OnlyFloat32IsCompressed) {
  EXPECT_TRUE(PayloadCodec(Encoding::kFloat16, DataType::kFloat32).compresses());
  EXPECT_TRUE(PayloadCodec(Encoding::kBFloat16, DataType::kFloat32).compresses());
  for (DataType d : {DataType::kFloat16, DataType::kBFloat16, DataType::kFloat64, DataType::kInt32, DataType::kInt64,
                     DataType::kUInt8, DataType::kBool}) {
    const PayloadCodec codec(Encoding::kFloat16, d);
    EXPECT_TRUE(!codec.compresses());
    EXPECT_EQ(codec.WireBytes(64), 64u);
  }
  const PayloadCodec none(Encoding::kNone, DataType::kFloat32);
  EXPECT_TRUE(!none.compresses());
  EXPECT_EQ(none.TensorBytes(12), 12u);
  EXPECT_EQ(PayloadCodec(Encoding::kBFloat16, DataType::kFloat32).TensorBytes(12), 24u);
}

TEST(EncodingNames) {
  Encoding e = Encoding::kFloat16;
  EXPECT_TRUE(ParseEncoding("", &e) && e == Encoding::kNone);
  EXPECT_TRUE(ParseEncoding("bf16", &e) && e == Encoding::kBFloat16);
  EXPECT_TRUE(ParseEncoding("fp16", &e) && e == Encoding::kFloat16);
  EXPECT_TRUE(ParseEncoding("none", &e) && e == Encoding::kNone);
  EXPECT_TRUE(!ParseEncoding("float16", &e) && e == Encoding::kNone);
  EXPECT_EQ(std::string(EncodingName(Encoding::kBFloat16)), "bf16");
}

}  // namespace
}  // namespace prophet

PROPHET_TEST_MAIN()
