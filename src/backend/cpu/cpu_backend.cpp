// The CPU backend's table: every op's fp32 kernel; in the BF16 and F16 slots the generic
// widening kernels (widen.h), replaced by fused 16-bit kernels where they exist (gemm and
// element-wise kernels register theirs after the generic ones). cast and copy serve every slot.
#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/widen.h"

namespace dstrain::cpu {

void fill_table(OpTable& t) {
#define DS_OP(name, params, args)                                 \
  t.name[size_t(KernelDType::F32)] = &cpu::name;                  \
  t.name[size_t(KernelDType::BF16)] = DS_CPU_WIDENED(name);       \
  t.name[size_t(KernelDType::F16)] = DS_CPU_WIDENED(name);
#include "backend/ops.def"
#undef DS_OP
  t.cast[size_t(KernelDType::BF16)] = &cpu::cast;
  t.cast[size_t(KernelDType::F16)] = &cpu::cast;
  t.copy[size_t(KernelDType::BF16)] = &cpu::copy;
  t.copy[size_t(KernelDType::F16)] = &cpu::copy;
  // Mixed precision keeps its master state in fp32; only the weights' copy is 16-bit.
  t.adamw_update[size_t(KernelDType::BF16)] = &cpu::adamw_update_16bit;
  t.adamw_update[size_t(KernelDType::F16)] = &cpu::adamw_update_16bit;
  fill_gemm_16bit(t);
  fill_elementwise_16bit(t);
}

}  // namespace dstrain::cpu
