#include "backend/ops.h"
#include "core/buffer.h"

namespace dstrain::ops {

double read_sum_squares(Tensor x) {
  Buffer out("sum_squares", MemCategory::Workspace, DType::F64, 1, x.device());
  sum_squares(out.tensor(), x);
  return read_scalar<double>(out.tensor());
}

int64_t read_count_non_finite(Tensor x) {
  Buffer out("count_non_finite", MemCategory::Workspace, DType::I64, 1, x.device());
  count_non_finite(out.tensor(), x);
  return read_scalar<int64_t>(out.tensor());
}

HostView::HostView(Tensor t) : source_(t) {
  if (t.device().is_cpu()) {
    host_ = t;
    return;
  }
  storage_.resize(t.nbytes());
  host_ = Tensor(storage_.data(), t.dtype(), t.shape());
  copy(host_, t);
}

void HostView::write_back() const {
  if (!source_.device().is_cpu()) copy(source_, host_);
}

}  // namespace dstrain::ops
