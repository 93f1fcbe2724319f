// Element types of tensors and files, and the conversions between the storage formats
// Hugging Face checkpoints use (F32, BF16, F16, and DeepSeek's released FP8 E4M3) and dstrain's
// fp32 compute type.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace dstrain {

// F8_E4M3: OCP FP8 E4M3 (PyTorch's float8_e4m3fn), a storage type only: DeepSeek-V3's released
// weights, block-scaled (io/hf_weights.h).
enum class DType : uint8_t { F32, BF16, F16, F64, I64, I32, U32, U16, U8, F8_E4M3 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);            // "F32", "BF16", ... (safetensors spelling)
bool dtype_from_name(std::string_view name, DType* out);

// Storage types of BF16 and F16 elements, for typed access (tensor.data<bf16>()); arithmetic
// is done in fp32 through the conversions below.
struct bf16 {
  uint16_t bits;
};
struct f16 {
  uint16_t bits;
};

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }
template <> constexpr DType dtype_of<f16>() { return DType::F16; }
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<uint32_t>() { return DType::U32; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::U16; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }

// bfloat16: the top 16 bits of an fp32; rounding to nearest even, NaN kept quiet.
inline float bf16_to_f32(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

// FP8 E4M3 as the OCP 8-bit floating point specification defines it ("E4M3FN"): sign, 4
// exponent bits (bias 7), 3 mantissa bits, subnormals, no infinities, NaN = S.1111.111, largest
// finite 448. Decoding is exact.
float f8e4m3_to_f32(uint8_t v);
// Rounds to nearest, ties to even, as PyTorch's float -> float8_e4m3fn conversion does:
// magnitudes up to 464 (the tie between 448 and the missing 480 goes to 448) round to a finite
// value, larger ones and Inf/NaN give NaN (0x7f, with the sign).
uint8_t f32_to_f8e4m3(float f);

}  // namespace dstrain
