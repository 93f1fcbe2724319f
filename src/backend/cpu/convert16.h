// Bulk conversions between fp32 and the 16-bit float types (BF16, F16), bit for bit the same as
// the scalar f32_to_bf16 / bf16_to_f32 / f32_to_f16 / f16_to_f32 of core/dtype.h (round to
// nearest even; NaN stays NaN with the same bits those give; f16 subnormals, overflow to inf).
//
// The implementation is chosen once, at run time, from what the CPU has: AVX-512 BF16
// (vcvtne2ps2bf16, with the denormal inputs it flushes done the exact way), AVX2 (+ F16C for f16),
// else scalar. Large conversions are split over the OpenMP threads unless called from inside a
// parallel region (then the calling thread does it all), so element-wise kernels may call them on
// their own chunks.
#pragma once

#include <cstdint>
#include <string_view>

namespace dstrain::cpu {

void bulk_bf16_to_f32(const uint16_t* src, float* dst, int64_t n);
void bulk_f32_to_bf16(const float* src, uint16_t* dst, int64_t n);
void bulk_f16_to_f32(const uint16_t* src, float* dst, int64_t n);
void bulk_f32_to_f16(const float* src, uint16_t* dst, int64_t n);

// The instruction sets the conversions can use; kAuto = the best this CPU has.
enum class ConvertIsa { kAuto, kScalar, kAvx2, kAvx512Bf16 };
// The one in use ("scalar", "avx2+f16c", "avx512bf16").
std::string_view convert16_isa_name();
// Whether this CPU can run `isa`.
bool convert16_isa_supported(ConvertIsa isa);
// Forces an implementation (tests compare each one the CPU supports with the scalar reference);
// kAuto restores the run-time choice. Not thread-safe against concurrent conversions.
void set_convert16_isa(ConvertIsa isa);

}  // namespace dstrain::cpu
