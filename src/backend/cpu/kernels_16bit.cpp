// The CPU backend's fused 16-bit element-wise kernels (BF16 and F16 storage, fp32 math).
#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"

namespace dstrain::cpu {

// None yet: the generic widening kernels of widen.h serve every op.
void fill_elementwise_16bit(OpTable&) {}

}  // namespace dstrain::cpu
