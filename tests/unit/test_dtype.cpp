// The storage formats BF16 and F16: conversions from fp32 round to nearest even, keep NaN a NaN,
// saturate to infinity and handle denormals, checked against an independent reference (the
// nearest representable value found by search), and a round trip through BF16 and F16 buffers
// with ops::cast on every device.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "backend/ops.h"
#include "core/buffer.h"
#include "core/dtype.h"
#include "fake_backend.h"

namespace dstrain {
namespace {

float from_bits(uint32_t u) { return std::bit_cast<float>(u); }
uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

// A 16-bit float format, described by its field widths only.
struct Format {
  int exp_bits, mant_bits;
  uint16_t inf_bits() const { return uint16_t(((1u << exp_bits) - 1) << mant_bits); }
  uint16_t sign_bit() const { return uint16_t(1u << (exp_bits + mant_bits)); }
  // The value of a non-negative finite pattern, in double, from the fields.
  double value(uint16_t h) const {
    const int bias = (1 << (exp_bits - 1)) - 1;
    const uint32_t e = h >> mant_bits, m = h & ((1u << mant_bits) - 1);
    if (e == 0) return std::ldexp(double(m), 1 - bias - mant_bits);
    return std::ldexp(double(m + (1u << mant_bits)), int(e) - bias - mant_bits);
  }
};
constexpr Format kBF16{8, 7}, kF16{5, 10};

// Round to nearest, ties to even, by searching the sorted list of the format's values: the
// reference the bit-twiddling conversions are held to. Infinity stands in the list as the next
// power of two after the largest finite value, which is where IEEE rounding overflows.
class Reference {
 public:
  explicit Reference(Format f) : f_(f) {
    for (uint32_t h = 0; h < f.inf_bits(); ++h) values_.push_back(f.value(uint16_t(h)));
    values_.push_back(std::ldexp(1.0, (1 << (f.exp_bits - 1))));  // "infinity"
  }
  uint16_t round(float x) const {
    const uint16_t sign = std::signbit(x) ? f_.sign_bit() : 0;
    if (std::isnan(x)) return uint16_t(sign | f_.inf_bits() | (1u << (f_.mant_bits - 1)));  // a quiet NaN
    const double a = std::fabs(double(x));
    if (a >= values_.back()) return uint16_t(sign | f_.inf_bits());
    const auto hi = size_t(std::lower_bound(values_.begin(), values_.end(), a) - values_.begin());
    if (values_[hi] == a) return uint16_t(sign | hi);
    const size_t lo = hi - 1;
    const double dlo = a - values_[lo], dhi = values_[hi] - a;
    const size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return uint16_t(sign | pick);
  }

 private:
  Format f_;
  std::vector<double> values_;
};

bool is_nan(Format f, uint16_t h) { return (h & ~f.sign_bit()) > f.inf_bits(); }

// fp32 inputs that exercise every rounding case: exact values, ties to both sides, one ulp
// either side of a tie, overflow, every kind of denormal, signed zeros, infinities and NaNs,
// and random bit patterns over the whole range.
std::vector<float> special_and_random_inputs(Format f, int n_random) {
  std::vector<float> xs = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e-8f, -1e-8f,
                           std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                           from_bits(0x7f800001u), from_bits(0xff800001u),  // signalling NaNs
                           std::numeric_limits<float>::max(), std::numeric_limits<float>::lowest(),
                           std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(),
                           from_bits(0x807fffffu), from_bits(0x00008000u), from_bits(0x00018000u)};
  // Around every value of the format near 1, the smallest normals and the denormals: the value,
  // the ties halfway to its neighbour and one fp32 ulp either side of them.
  Reference ref(f);
  for (uint16_t h : {uint16_t(0x0000), uint16_t(0x0001), uint16_t(0x0002), uint16_t(0x0003), uint16_t(0x007f),
                     uint16_t(0x0080), uint16_t(0x0081), uint16_t(0x03ff), uint16_t(0x0400), uint16_t(0x3c00),
                     uint16_t(0x3c01), uint16_t(0x3f80), uint16_t(0x3f81), uint16_t(0x7bfe), uint16_t(0x7f7e)}) {
    if (h >= f.inf_bits() - 1) continue;
    const double lo = f.value(h), hi = f.value(uint16_t(h + 1)), mid = (lo + hi) / 2;
    for (double v : {lo, mid, hi}) {
      const float x = float(v);
      for (float y : {x, std::nextafter(x, 0.0f), std::nextafter(x, 1e30f)}) {
        xs.push_back(y);
        xs.push_back(-y);
      }
    }
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < n_random; ++i) xs.push_back(from_bits(uint32_t(rng())));
  return xs;
}

void expect_rounds_like_reference(Format f, uint16_t (*convert)(float), const char* name) {
  Reference ref(f);
  int checked = 0;
  for (float x : special_and_random_inputs(f, 200000)) {
    const uint16_t got = convert(x), want = ref.round(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(is_nan(f, got)) << name << ": NaN 0x" << std::hex << bits(x) << " became 0x" << got;
      ASSERT_EQ(got & f.sign_bit(), want & f.sign_bit()) << name << ": NaN sign lost";
    } else {
      ASSERT_EQ(got, want) << name << "(" << x << " = 0x" << std::hex << bits(x) << ")";
    }
    ++checked;
  }
  EXPECT_GT(checked, 200000);
}

TEST(DType, FloatToBF16RoundsToNearestEven) {
  expect_rounds_like_reference(kBF16, f32_to_bf16, "f32_to_bf16");
  // The cases named: ties go to the even neighbour, either way.
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808000u)), 0x3f80);  // 1 + 2^-8: tie, down to even
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f818000u)), 0x3f82);  // tie, up to even
  EXPECT_EQ(f32_to_bf16(from_bits(0x3f808001u)), 0x3f81);  // just above the tie
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);  // overflows to +inf
  EXPECT_EQ(f32_to_bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(f32_to_bf16(from_bits(0x00018000u)), 0x0002);  // denormal tie, up to even
  EXPECT_EQ(f32_to_bf16(from_bits(0x807fffffu)), 0x8080);  // largest denormal rounds to -FLT_MIN
}

TEST(DType, FloatToF16RoundsToNearestEven) {
  expect_rounds_like_reference(kF16, f32_to_f16, "f32_to_f16");
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.99f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);           // halfway to 2^16: ties to even, which is inf
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);  // the smallest denormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // half of it: tie, down to even zero
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 of it: tie, up to even
}

// Every 16-bit pattern reads back as its exact value, and converting that value back gives the
// same pattern (NaNs stay NaNs with their sign).
TEST(DType, EverySixteenBitValueRoundTripsThroughFloat) {
  for (Format f : {kBF16, kF16}) {
    const bool bf = f.mant_bits == 7;
    for (uint32_t u = 0; u < 0x10000u; ++u) {
      const auto h = uint16_t(u);
      const float x = bf ? bf16_to_f32(h) : f16_to_f32(h);
      const uint16_t back = bf ? f32_to_bf16(x) : f32_to_f16(x);
      if (is_nan(f, h)) {
        ASSERT_TRUE(std::isnan(x)) << std::hex << u;
        ASSERT_TRUE(is_nan(f, back)) << std::hex << u;
        ASSERT_EQ(std::signbit(x), bool(h & f.sign_bit()));
        continue;
      }
      const uint16_t mag = h & ~f.sign_bit();
      const double want = mag == f.inf_bits() ? std::numeric_limits<double>::infinity() : f.value(mag);
      ASSERT_EQ(double(std::fabs(x)), want) << (bf ? "bf16 " : "f16 ") << std::hex << u;
      ASSERT_EQ(std::signbit(x), bool(h & f.sign_bit())) << std::hex << u;
      ASSERT_EQ(back, h) << (bf ? "bf16 " : "f16 ") << std::hex << u;
    }
  }
}

// FP8 E4M3 (DeepSeek-V3's released weights): every code reads back as the value the OCP FP8
// specification gives it (computed here from its fields), and converting fp32 to it rounds to the
// nearest code, ties to the even one, checked against a search over the 127 finite magnitudes;
// magnitudes above 464 (halfway from 448 to the 480 the format lacks) are NaN, as in PyTorch's
// float8_e4m3fn conversion.
TEST(DType, FP8E4M3DecodesEveryCodeAndRoundsToNearestEven) {
  std::vector<double> magnitude(0x7f);  // codes 0x00 .. 0x7e
  for (int code = 0; code < 0x7f; ++code) {
    const int e = code >> 3, m = code & 7;
    magnitude[size_t(code)] = e == 0 ? m * std::ldexp(1.0, -9) : (1 + m / 8.0) * std::ldexp(1.0, e - 7);
  }
  EXPECT_EQ(magnitude[0x7e], 448.0);
  EXPECT_EQ(magnitude[0x01], std::ldexp(1.0, -9));
  for (int code = 0; code < 256; ++code) {
    const float x = f8e4m3_to_f32(uint8_t(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(x)) << code;
      continue;
    }
    ASSERT_EQ(double(std::fabs(x)), magnitude[size_t(code & 0x7f)]) << code;
    ASSERT_EQ(std::signbit(x), bool(code & 0x80)) << code;
    ASSERT_EQ(f32_to_f8e4m3(x), uint8_t(code)) << code;
  }
  auto reference = [&](float x) -> uint8_t {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs(double(x));
    if (std::isnan(x) || a > 464.0) return uint8_t(sign | 0x7f);
    int best = 0;
    for (int code = 1; code < 0x7f; ++code) {
      const double d = std::fabs(magnitude[size_t(code)] - a), db = std::fabs(magnitude[size_t(best)] - a);
      if (d < db || (d == db && (code & 1) == 0)) best = code;
    }
    return uint8_t(sign | best);
  };
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> exponent(-14, 10);
  for (int i = 0; i < 200000; ++i) {
    float x = float(std::exp2(exponent(rng)));
    if (i & 1) x = -x;
    ASSERT_EQ(f32_to_f8e4m3(x), reference(x)) << x;
  }
  // Every midpoint between neighbours, and one fp32 step either side of it.
  for (int code = 0; code < 0x7e; ++code) {
    const float mid = float((magnitude[size_t(code)] + magnitude[size_t(code + 1)]) / 2);
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f)}) {
      ASSERT_EQ(f32_to_f8e4m3(x), reference(x)) << x;
      ASSERT_EQ(f32_to_f8e4m3(-x), reference(-x)) << x;
    }
  }
  EXPECT_EQ(f32_to_f8e4m3(464.0f), 0x7e);                          // tie: down to 448, the even code
  EXPECT_EQ(f32_to_f8e4m3(std::nextafter(464.0f, 500.0f)), 0x7f);  // above: NaN
  EXPECT_EQ(f32_to_f8e4m3(-std::numeric_limits<float>::infinity()), 0xff);
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(1.0f, -10)), 0x00);           // half the smallest subnormal: to even zero
  EXPECT_EQ(f32_to_f8e4m3(std::ldexp(3.0f, -10)), 0x02);           // 1.5 of it: up to even
  EXPECT_EQ(f32_to_f8e4m3(-0.0f), 0x80);
}

// fp32 values -> a BF16 (F16) buffer -> fp32 through ops::cast, on the host and on the emulated
// device (the fake backend): the 16-bit buffer holds the reference rounding of each value, and
// what comes back is that rounding's exact value.
TEST(DType, BufferRoundTripThroughSixteenBitStorageWithCast) {
  for (Device device : {Device::cpu(), fake::use_fake_backend()}) {
    for (DType dt : {DType::BF16, DType::F16}) {
      SCOPED_TRACE(device.str() + " " + std::string(dtype_name(dt)));
      const Format f = dt == DType::BF16 ? kBF16 : kF16;
      const std::vector<float> xs = special_and_random_inputs(f, 5000);
      const auto n = int64_t(xs.size());
      Buffer host("test.f32", MemCategory::Workspace, DType::F32, n);
      std::copy(xs.begin(), xs.end(), host.data<float>());
      Buffer src("test.src", MemCategory::Workspace, DType::F32, n, device);
      Buffer half("test.half", MemCategory::Workspace, dt, n, device);
      Buffer back("test.back", MemCategory::Workspace, DType::F32, n, device);
      EXPECT_EQ(half.nbytes(), size_t(n) * 2);
      ops::copy(src.tensor(), host.tensor());
      ops::cast(half.tensor(), src.tensor());
      ops::cast(back.tensor(), half.tensor());
      Buffer half_host("test.half_host", MemCategory::Workspace, dt, n), back_host("test.back_host",
                                                                                   MemCategory::Workspace, DType::F32, n);
      ops::copy(half_host.tensor(), half.tensor());
      ops::copy(back_host.tensor(), back.tensor());

      Reference ref(f);
      for (int64_t i = 0; i < n; ++i) {
        const float x = xs[size_t(i)], y = back_host.data<float>()[i];
        const uint16_t stored = dt == DType::BF16 ? half_host.data<bf16>()[i].bits : half_host.data<f16>()[i].bits;
        const uint16_t want = ref.round(x);
        if (std::isnan(x)) {
          ASSERT_TRUE(is_nan(f, stored)) << i;
          ASSERT_TRUE(std::isnan(y)) << i;
          continue;
        }
        ASSERT_EQ(stored, want) << "element " << i << " = " << x;
        const uint16_t mag = want & ~f.sign_bit();
        const double v = mag == f.inf_bits() ? std::numeric_limits<double>::infinity() : f.value(mag);
        ASSERT_EQ(double(std::fabs(y)), v) << "element " << i << " = " << x;
        ASSERT_EQ(std::signbit(y), std::signbit(x)) << "element " << i;
      }
      EXPECT_THROW((void)half_host.data<float>(), Error);  // typed access checks the element type
    }
  }
}

}  // namespace
}  // namespace dstrain
