// DeepSeek-V2/V3 rotary embedding on the CPU: YaRN tables and the interleaved pairing.
// (Implemented with the MLA layer; these definitions keep the library linking meanwhile.)
#include "kernels/cpu/cpu_ops.h"

namespace dstrain::cpu {

void rope_tables_yarn(Tensor, Tensor, int, double, const ops::YarnParams&) {
  DS_FAIL("YaRN rotary tables are not implemented yet");
}

void rope_apply_interleaved(Tensor, int64_t, int, int64_t, int, Tensor, Tensor, bool) {
  DS_FAIL("interleaved rotary embedding is not implemented yet");
}

}  // namespace dstrain::cpu
