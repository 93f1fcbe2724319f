#include "core/tensor.h"

namespace dstrain {

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) push_back(d);
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[size_t(i)];
  return n;
}

void Shape::push_back(int64_t d) {
  DS_CHECK(ndim_ < kMaxDims, "tensors have at most {} dimensions", kMaxDims);
  DS_CHECK(d >= 0, "negative dimension {}", d);
  dims_[size_t(ndim_++)] = d;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[size_t(i)] != o.dims_[size_t(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < ndim_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[size_t(i)]);
  }
  return s + (ndim_ == 1 ? ",)" : ")");
}

Tensor Tensor::view(Shape s) const {
  DS_CHECK(s.numel() == numel(), "cannot view a tensor of shape {} as {}", shape_.str(), s.str());
  return Tensor(data_, dtype_, s, device_);
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  DS_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= size(0), "slice [{}, {}) out of range for shape {}",
           begin, end, shape_.str());
  Shape s = shape_;
  s[0] = end - begin;
  const size_t row_bytes = size(0) ? nbytes() / size_t(size(0)) : 0;
  return Tensor(static_cast<char*>(data_) + size_t(begin) * row_bytes, dtype_, s, device_);
}

Tensor Tensor::row(int64_t i) const {
  Tensor r = slice(i, i + 1);
  Shape s;
  for (int d = 1; d < ndim(); ++d) s.push_back(size(d));
  return r.view(s);
}

}  // namespace dstrain
