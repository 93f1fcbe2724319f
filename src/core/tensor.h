// Tensor: a non-owning, contiguous, row-major view (pointer, dtype, shape, device).
// Memory is owned by Buffers (core/buffer.h); ops take Tensors.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

namespace dstrain {

class Shape {
 public:
  static constexpr int kMaxDims = 6;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  template <class It>
  static Shape from(It begin, It end) {
    Shape s;
    for (It it = begin; it != end; ++it) s.push_back(int64_t(*it));
    return s;
  }

  int ndim() const { return ndim_; }
  int64_t operator[](int i) const { return dims_[size_t(i)]; }
  int64_t& operator[](int i) { return dims_[size_t(i)]; }
  int64_t numel() const;
  void push_back(int64_t d);
  bool operator==(const Shape& o) const;
  std::string str() const;  // "(2, 3, 4)"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(void* data, DType dtype, Shape shape, Device device = Device::cpu())
      : data_(data), dtype_(dtype), shape_(shape), device_(device) {}

  bool defined() const { return data_ != nullptr; }
  void* raw() const { return data_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  Device device() const { return device_; }
  int ndim() const { return shape_.ndim(); }
  int64_t size(int i) const { return shape_[i < 0 ? i + ndim() : i]; }
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }

  // Typed host access: the tensor must be in host memory and the element type must match its
  // dtype. Device memory is reached only through ops (kernels run where the data is).
  template <class T>
  T* data() const {
    DS_CHECK(device_.is_cpu(), "a tensor {} on {} was read on the host, but its memory is device memory; copy it "
             "to host with ops::copy first", shape_.str(), device_.str());
    DS_CHECK(dtype_ == dtype_of<T>(), "tensor holds {} but was read as {}", dtype_name(dtype_),
             dtype_name(dtype_of<T>()));
    return static_cast<T*>(data_);
  }

  // Same memory, another shape with the same element count.
  Tensor view(Shape s) const;
  // Rows [begin, end) along the first dimension.
  Tensor slice(int64_t begin, int64_t end) const;
  // Row i along the first dimension, one dimension fewer.
  Tensor row(int64_t i) const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::F32;
  Shape shape_;
  Device device_;
};

}  // namespace dstrain
