#include "io/hdf5_util.h"

#include <cstring>

#include <fmt/printf.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace dstrain::h5 {
namespace {

// Collects HDF5's error stack as text (innermost first) instead of letting HDF5 print it.
herr_t collect(unsigned n, const H5E_error2_t* e, void* out) {
  auto* text = static_cast<std::string*>(out);
  if (n < 4 && e->desc) {
    *text += fmt::format("\n    {}(): {}", e->func_name ? e->func_name : "?", e->desc);
  }
  return 0;
}

struct Silence {
  Silence() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }
};

}  // namespace

std::recursive_mutex& hdf5_lock() {
  static std::recursive_mutex m;
  static Silence silence;  // HDF5 reports through dstrain's errors, not its own printing
  return m;
}

void check(int64_t status, const char* call, const char* file, int line) {
  if (status >= 0) return;
  std::string stack;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, collect, &stack);
  H5Eclear2(H5E_DEFAULT);
  const char* base = std::strrchr(file, '/');
  throw Error(fmt::format("HDF5 call failed: {}{}\n  (at {}:{})", call, stack, base ? base + 1 : file, line));
}

Handle::Handle(hid_t id, const char* what) : id_(id) { check(id, what, __FILE__, __LINE__); }

Handle& Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    try {
      close();
    } catch (...) {
    }
    id_ = o.id_;
    o.id_ = H5I_INVALID_HID;
  }
  return *this;
}

Handle::~Handle() {
  try {
    close();
  } catch (...) {
    // Destructors do not throw: a failed close during unwinding is already an error path.
  }
}

void Handle::close() {
  if (id_ == H5I_INVALID_HID) return;
  const hid_t id = id_;
  id_ = H5I_INVALID_HID;
  herr_t rc = 0;
  switch (H5Iget_type(id)) {
    case H5I_FILE: rc = H5Fclose(id); break;
    case H5I_GROUP: rc = H5Gclose(id); break;
    case H5I_DATASET: rc = H5Dclose(id); break;
    case H5I_DATASPACE: rc = H5Sclose(id); break;
    case H5I_DATATYPE: rc = H5Tclose(id); break;
    case H5I_ATTR: rc = H5Aclose(id); break;
    case H5I_GENPROP_LST: rc = H5Pclose(id); break;
    default: rc = H5Idec_ref(id); break;
  }
  check(rc, "closing an HDF5 object", __FILE__, __LINE__);
}

namespace {
Handle file_access(MPI_Comm comm) {
  Handle fapl(H5Pcreate(H5P_FILE_ACCESS), "H5Pcreate(H5P_FILE_ACCESS)");
  if (comm != MPI_COMM_NULL) DS_H5_CHECK(H5Pset_fapl_mpio(fapl, comm, MPI_INFO_NULL));
  return fapl;
}
}  // namespace

Handle create_file(const std::string& path, MPI_Comm comm) {
  std::lock_guard lock(hdf5_lock());
  Handle fapl = file_access(comm);
  hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl);
  if (f < 0) {
    try {
      check(f, "H5Fcreate", __FILE__, __LINE__);
    } catch (const Error& e) {
      throw Error(fmt::format("cannot create checkpoint file '{}': check the directory exists and is writable\n{}",
                              path, e.what()));
    }
  }
  return Handle(f, "H5Fcreate");
}

Handle open_file(const std::string& path, MPI_Comm comm) {
  std::lock_guard lock(hdf5_lock());
  Handle fapl = file_access(comm);
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl);
  if (f < 0) {
    try {
      check(f, "H5Fopen", __FILE__, __LINE__);
    } catch (const Error& e) {
      throw Error(fmt::format("cannot open '{}' as HDF5 (missing, truncated or not an HDF5 file)\n{}", path,
                              e.what()));
    }
  }
  return Handle(f, "H5Fopen");
}

Handle transfer_plist(bool collective) {
  Handle p(H5Pcreate(H5P_DATASET_XFER), "H5Pcreate(H5P_DATASET_XFER)");
  if (collective) DS_H5_CHECK(H5Pset_dxpl_mpio(p, H5FD_MPIO_COLLECTIVE));
  return p;
}

Handle create_group(hid_t parent, const std::string& name) {
  return Handle(H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "H5Gcreate2");
}

Handle open_group(hid_t parent, const std::string& name) {
  hid_t g = H5Gopen2(parent, name.c_str(), H5P_DEFAULT);
  if (g < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error(fmt::format("checkpoint has no group '{}'", name));
  }
  return Handle(g, "H5Gopen2");
}

bool exists(hid_t parent, const std::string& name) {
  const htri_t e = H5Lexists(parent, name.c_str(), H5P_DEFAULT);
  if (e < 0) H5Eclear2(H5E_DEFAULT);
  return e > 0;
}

namespace {
void write_scalar(hid_t obj, const std::string& name, hid_t type, const void* v) {
  Handle space(H5Screate(H5S_SCALAR), "H5Screate");
  Handle a(H5Acreate2(obj, name.c_str(), type, space, H5P_DEFAULT, H5P_DEFAULT), "H5Acreate2");
  DS_H5_CHECK(H5Awrite(a, type, v));
}
Handle open_attr(hid_t obj, const std::string& name) {
  hid_t a = H5Aopen(obj, name.c_str(), H5P_DEFAULT);
  if (a < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error(fmt::format("checkpoint attribute '{}' is missing", name));
  }
  return Handle(a, "H5Aopen");
}
Handle utf8_string_type() {
  Handle t(H5Tcopy(H5T_C_S1), "H5Tcopy");
  DS_H5_CHECK(H5Tset_size(t, H5T_VARIABLE));
  DS_H5_CHECK(H5Tset_cset(t, H5T_CSET_UTF8));
  return t;
}
std::string read_vlen_string(hid_t obj, bool is_attr) {
  Handle t = utf8_string_type();
  char* s = nullptr;
  if (is_attr) {
    DS_H5_CHECK(H5Aread(obj, t, &s));
  } else {
    DS_H5_CHECK(H5Dread(obj, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, &s));
  }
  std::string out = s ? s : "";
  Handle space(H5Screate(H5S_SCALAR), "H5Screate");
  H5Dvlen_reclaim(t, space, H5P_DEFAULT, &s);
  return out;
}
}  // namespace

void write_attr(hid_t obj, const std::string& name, int64_t v) { write_scalar(obj, name, H5T_NATIVE_INT64, &v); }
void write_attr(hid_t obj, const std::string& name, uint64_t v) { write_scalar(obj, name, H5T_NATIVE_UINT64, &v); }
void write_attr(hid_t obj, const std::string& name, double v) { write_scalar(obj, name, H5T_NATIVE_DOUBLE, &v); }
void write_attr(hid_t obj, const std::string& name, const std::string& v) {
  Handle t = utf8_string_type();
  const char* p = v.c_str();
  write_scalar(obj, name, t, &p);
}

bool has_attr(hid_t obj, const std::string& name) {
  const htri_t e = H5Aexists(obj, name.c_str());
  if (e < 0) H5Eclear2(H5E_DEFAULT);
  return e > 0;
}

int64_t read_attr_int(hid_t obj, const std::string& name) {
  Handle a = open_attr(obj, name);
  int64_t v = 0;
  DS_H5_CHECK(H5Aread(a, H5T_NATIVE_INT64, &v));
  return v;
}
uint64_t read_attr_uint(hid_t obj, const std::string& name) {
  Handle a = open_attr(obj, name);
  uint64_t v = 0;
  DS_H5_CHECK(H5Aread(a, H5T_NATIVE_UINT64, &v));
  return v;
}
double read_attr_double(hid_t obj, const std::string& name) {
  Handle a = open_attr(obj, name);
  double v = 0;
  DS_H5_CHECK(H5Aread(a, H5T_NATIVE_DOUBLE, &v));
  return v;
}
std::string read_attr_string(hid_t obj, const std::string& name) {
  Handle a = open_attr(obj, name);
  return read_vlen_string(a, true);
}

void write_string_dataset(hid_t parent, const std::string& name, const std::string& text) {
  // Fixed length: parallel HDF5 cannot write variable-length data.
  Handle t(H5Tcopy(H5T_C_S1), "H5Tcopy");
  DS_H5_CHECK(H5Tset_size(t, text.size() + 1));
  DS_H5_CHECK(H5Tset_cset(t, H5T_CSET_UTF8));
  Handle space(H5Screate(H5S_SCALAR), "H5Screate");
  Handle d(H5Dcreate2(parent, name.c_str(), t, space, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), "H5Dcreate2");
  DS_H5_CHECK(H5Dwrite(d, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, text.c_str()));
}

std::string read_string_dataset(hid_t parent, const std::string& name) {
  hid_t d = H5Dopen2(parent, name.c_str(), H5P_DEFAULT);
  if (d < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw Error(fmt::format("checkpoint dataset '{}' is missing", name));
  }
  Handle h(d, "H5Dopen2");
  Handle t(H5Dget_type(h), "H5Dget_type");
  if (H5Tis_variable_str(t) > 0) return read_vlen_string(h, false);
  std::string text(H5Tget_size(t), '\0');
  DS_H5_CHECK(H5Dread(h, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, text.data()));
  text.resize(std::strlen(text.c_str()));
  return text;
}

Handle create_string_dataset(hid_t parent, const std::string& name, size_t bytes) {
  Handle t(H5Tcopy(H5T_C_S1), "H5Tcopy");
  DS_H5_CHECK(H5Tset_size(t, bytes + 1));
  DS_H5_CHECK(H5Tset_cset(t, H5T_CSET_UTF8));
  Handle space(H5Screate(H5S_SCALAR), "H5Screate");
  Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), "H5Pcreate(H5P_DATASET_CREATE)");
  DS_H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));  // no raw data written at creation
  return Handle(H5Dcreate2(parent, name.c_str(), t, space, H5P_DEFAULT, dcpl, H5P_DEFAULT), "H5Dcreate2");
}

herr_t write_string(hid_t dataset, const std::string& text) {
  Handle t(H5Dget_type(dataset), "H5Dget_type");
  std::string padded = text;
  padded.resize(H5Tget_size(t), '\0');
  return H5Dwrite(dataset, t, H5S_ALL, H5S_ALL, H5P_DEFAULT, padded.data());
}

std::vector<std::string> list_attrs(hid_t obj) {
  std::vector<std::string> names;
  auto add = [](hid_t, const char* name, const H5A_info_t*, void* out) -> herr_t {
    static_cast<std::vector<std::string>*>(out)->push_back(name);
    return 0;
  };
  hsize_t idx = 0;
  DS_H5_CHECK(H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_INC, &idx, add, &names));
  return names;
}

std::string read_attr_text(hid_t obj, const std::string& name) {
  Handle a = open_attr(obj, name);
  Handle t(H5Aget_type(a), "H5Aget_type");
  switch (H5Tget_class(t)) {
    case H5T_INTEGER:
      if (H5Tget_sign(t) == H5T_SGN_NONE) {
        uint64_t v = 0;
        DS_H5_CHECK(H5Aread(a, H5T_NATIVE_UINT64, &v));
        return std::to_string(v);
      } else {
        int64_t v = 0;
        DS_H5_CHECK(H5Aread(a, H5T_NATIVE_INT64, &v));
        return std::to_string(v);
      }
    case H5T_FLOAT: {
      double v = 0;
      DS_H5_CHECK(H5Aread(a, H5T_NATIVE_DOUBLE, &v));
      return fmt::sprintf("%.17g", v);
    }
    case H5T_STRING: {
      if (H5Tis_variable_str(t) > 0) return read_vlen_string(a, true);
      std::string text(H5Tget_size(t), '\0');
      DS_H5_CHECK(H5Aread(a, t, text.data()));
      text.resize(std::strlen(text.c_str()));
      return text;
    }
    default:
      return fmt::format("(an attribute of HDF5 type class {})", int(H5Tget_class(t)));
  }
}

std::string describe_dataset(hid_t dataset) {
  Handle t(H5Dget_type(dataset), "H5Dget_type");
  const size_t bits = H5Tget_size(t) * 8;
  std::string type;
  switch (H5Tget_class(t)) {
    case H5T_FLOAT: type = fmt::format("float{}", bits); break;
    case H5T_INTEGER: type = fmt::format("{}int{}", H5Tget_sign(t) == H5T_SGN_NONE ? "u" : "", bits); break;
    case H5T_STRING: type = "string"; break;
    default: type = fmt::format("class{}", int(H5Tget_class(t))); break;
  }
  const Shape shape = dataset_shape(dataset);
  std::vector<int64_t> dims;
  for (int i = 0; i < shape.ndim(); ++i) dims.push_back(shape[i]);
  return fmt::format("{} [{}]", type, fmt::join(dims, ","));
}

bool is_string_dataset(hid_t dataset) {
  Handle t(H5Dget_type(dataset), "H5Dget_type");
  return H5Tget_class(t) == H5T_STRING;
}

bool is_group(hid_t parent, const std::string& name) {
  Handle o(H5Oopen(parent, name.c_str(), H5P_DEFAULT), "H5Oopen");
  return H5Iget_type(o) == H5I_GROUP;
}

std::vector<std::string> list_members(hid_t group) {
  std::vector<std::string> names;
  auto add = [](hid_t, const char* name, const H5L_info_t*, void* out) -> herr_t {
    static_cast<std::vector<std::string>*>(out)->push_back(name);
    return 0;
  };
  DS_H5_CHECK(H5Literate(group, H5_INDEX_NAME, H5_ITER_INC, nullptr, add, &names));
  return names;
}

Shape dataset_shape(hid_t dataset) {
  Handle space(H5Dget_space(dataset), "H5Dget_space");
  const int nd = H5Sget_simple_extent_ndims(space);
  DS_H5_CHECK(nd);
  DS_CHECK(nd <= Shape::kMaxDims, "dataset of {} dimensions", nd);
  std::vector<hsize_t> dims(static_cast<size_t>(nd));
  DS_H5_CHECK(H5Sget_simple_extent_dims(space, dims.data(), nullptr));
  return Shape::from(dims.begin(), dims.end());
}

}  // namespace dstrain::h5
