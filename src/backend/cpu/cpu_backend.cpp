// The CPU backend's table: every op's fp32 kernel; cast also serves the bf16 and f16 slots
// (it converts between them).
#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"

namespace dstrain::cpu {

void fill_table(OpTable& t) {
#define DS_OP(name, params, args) t.name[size_t(KernelDType::F32)] = &cpu::name;
#include "backend/ops.def"
#undef DS_OP
  t.cast[size_t(KernelDType::BF16)] = &cpu::cast;
  t.cast[size_t(KernelDType::F16)] = &cpu::cast;
  t.copy[size_t(KernelDType::BF16)] = &cpu::copy;
  t.copy[size_t(KernelDType::F16)] = &cpu::copy;
}

}  // namespace dstrain::cpu
