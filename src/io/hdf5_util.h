// Small RAII and error-checking layer over the HDF5 C API, for dstrain's checkpoints. HDF5
// errors become dstrain::Errors carrying HDF5's own description; nothing is printed behind
// the caller's back. The HDF5 library here is not thread-safe: every use holds hdf5_lock().
#pragma once

#include <hdf5.h>
#include <mpi.h>

#include <mutex>
#include <string>
#include <vector>

#include "core/json_reader.h"
#include "core/tensor.h"

namespace dstrain::h5 {

std::recursive_mutex& hdf5_lock();

// Throws with the call, the location and HDF5's error stack when `status` < 0.
void check(int64_t status, const char* call, const char* file, int line);
#define DS_H5_CHECK(call) ::dstrain::h5::check(int64_t(call), #call, __FILE__, __LINE__)

// An owned HDF5 identifier, closed by the function that matches its kind.
class Handle {
 public:
  Handle() = default;
  explicit Handle(hid_t id, const char* what);  // checks id >= 0
  Handle(Handle&& o) noexcept : id_(o.id_) { o.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle&& o) noexcept;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle();
  hid_t get() const { return id_; }
  operator hid_t() const { return id_; }
  void close();  // closes now, reporting errors (a file's close flushes it)

 private:
  hid_t id_ = H5I_INVALID_HID;
};

// Files through MPI-IO on `comm` (collective; every rank of comm takes part), or through the
// default POSIX driver when comm is MPI_COMM_NULL (one process, e.g. tools).
Handle create_file(const std::string& path, MPI_Comm comm);
Handle open_file(const std::string& path, MPI_Comm comm);
// A dataset transfer property list: collective MPI-IO when `collective`.
Handle transfer_plist(bool collective);

Handle create_group(hid_t parent, const std::string& name);
Handle open_group(hid_t parent, const std::string& name);
bool exists(hid_t parent, const std::string& name);

// Attributes: scalars and UTF-8 strings.
void write_attr(hid_t obj, const std::string& name, int64_t v);
void write_attr(hid_t obj, const std::string& name, uint64_t v);
void write_attr(hid_t obj, const std::string& name, double v);
void write_attr(hid_t obj, const std::string& name, const std::string& v);
int64_t read_attr_int(hid_t obj, const std::string& name);
uint64_t read_attr_uint(hid_t obj, const std::string& name);
double read_attr_double(hid_t obj, const std::string& name);
std::string read_attr_string(hid_t obj, const std::string& name);
bool has_attr(hid_t obj, const std::string& name);

// A scalar UTF-8 string dataset (for texts too large for an attribute, e.g. the config).
void write_string_dataset(hid_t parent, const std::string& name, const std::string& text);
std::string read_string_dataset(hid_t parent, const std::string& name);
// The same in two steps, for parallel files: creating is collective (metadata), writing the
// text is raw data that one rank may do alone.
Handle create_string_dataset(hid_t parent, const std::string& name, size_t bytes);
herr_t write_string(hid_t dataset, const std::string& text);

// Attribute names of an object, in name order, and an attribute's value as canonical text:
// integers in decimal, floating point as %.17g, strings as they are.
std::vector<std::string> list_attrs(hid_t obj);
std::string read_attr_text(hid_t obj, const std::string& name);
// A dataset's element type and shape as text, e.g. "float32 [32,64]".
std::string describe_dataset(hid_t dataset);
bool is_string_dataset(hid_t dataset);
// Whether `name` in `parent` is a group (else a dataset or another object).
bool is_group(hid_t parent, const std::string& name);

// Names of the members of a group, in HDF5's name order.
std::vector<std::string> list_members(hid_t group);
// The dims of a dataset.
Shape dataset_shape(hid_t dataset);

}  // namespace dstrain::h5
