// The argument checks of every op of ops.def, one function per op with the op's own parameters:
// shapes, the dtypes of integer and output tensors, offsets and sizes, the scalar parameters.
// The generated ops:: wrapper (backend.cpp) runs them once per call, before it dispatches, so
// that every backend refuses a bad call with the same message and no kernel checks its arguments
// again. Kernels assume checked arguments; they keep only the checks that read the tensors' data
// (a token or expert id out of range) and those of their own limits (a CUDA kernel's largest
// head dim, a grid's size).
#pragma once

#include "backend/ops.h"

namespace dstrain::ops::checks {

#define DS_OP(name, params, args) void name params;
#include "backend/ops.def"
#undef DS_OP

}  // namespace dstrain::ops::checks
