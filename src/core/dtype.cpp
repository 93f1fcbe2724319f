#include "core/dtype.h"

#include <cmath>
#include <limits>

namespace dstrain {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: case DType::U32: return 4;
    case DType::BF16: case DType::F16: case DType::U16: return 2;
    case DType::U8: case DType::F8_E4M3: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::I32: return "I32";
    case DType::U32: return "U32";
    case DType::U16: return "U16";
    case DType::U8: return "U8";
    case DType::F8_E4M3: return "F8_E4M3";
  }
  return "?";
}

bool dtype_from_name(std::string_view name, DType* out) {
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F64, DType::I64, DType::I32, DType::U32,
                  DType::U16, DType::U8, DType::F8_E4M3}) {
    if (dtype_name(t) == name) {
      *out = t;
      return true;
    }
  }
  return false;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float f;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    f = std::ldexp(float(mant), -24);
    return sign ? -f : f;
  }
  uint32_t u;
  if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  }
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);        // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);       // overflow to inf
  if (abs < 0x38800000u) {                                        // subnormal or zero in f16
    float a;
    std::memcpy(&a, &abs, 4);
    return uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.0f)));  // a / 2^-24, ties to even
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return uint16_t(sign | uint16_t((rounded - 0x38000000u) >> 13));
}

float f8e4m3_to_f32(uint8_t v) {
  const bool negative = (v & 0x80u) != 0;
  const int exp = (v >> 3) & 0xf, mant = v & 0x7;
  float f;
  if (exp == 0xf && mant == 0x7) {
    f = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    f = std::ldexp(float(mant), -9);  // subnormal: mant/8 * 2^(1-7)
  } else {
    f = std::ldexp(float(8 + mant), exp - 10);  // (1 + mant/8) * 2^(exp-7)
  }
  return negative ? -f : f;
}

uint8_t f32_to_f8e4m3(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = uint8_t((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x43e80000u) return uint8_t(sign | 0x7fu);  // above 464 (Inf and NaN too): NaN
  if (abs < 0x3c800000u) {  // below 2^-6, the smallest normal: multiples of 2^-9
    float a;
    std::memcpy(&a, &abs, 4);
    return uint8_t(sign | uint8_t(std::nearbyint(a * 512.0f)));  // exact scaling, ties to even; 8 is 2^-6
  }
  // Keep 3 of fp32's 23 mantissa bits, rounding to nearest even; a carry moves into the exponent.
  const uint32_t rounded = abs + 0x7ffffu + ((abs >> 20) & 1u);
  const uint32_t exp = (rounded >> 23) - 127 + 7, mant = (rounded >> 20) & 0x7u;
  return uint8_t(sign | uint8_t(exp << 3) | uint8_t(mant));
}

}  // namespace dstrain
