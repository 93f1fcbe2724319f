#include "io/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <omp.h>
#include <zlib.h>

#include <chrono>
#include <ctime>

#include "core/error.h"
#include "core/version.h"
#include "io/hdf5_util.h"

namespace dstrain {

std::vector<uint32_t> crc32_many(const std::vector<std::pair<const void*, size_t>>& ranges, int threads) {
  constexpr size_t kChunk = size_t(8) << 20;
  struct Task {
    size_t range;
    size_t begin, bytes;
  };
  std::vector<Task> tasks;
  for (size_t r = 0; r < ranges.size(); ++r) {
    const size_t n = ranges[r].second;
    for (size_t b = 0; b == 0 || b < n; b += kChunk) tasks.push_back({r, b, std::min(kChunk, n - b)});
  }
  std::vector<uint32_t> part(tasks.size());
  const int nt = threads > 0 ? threads : omp_get_max_threads();
#pragma omp parallel for schedule(dynamic) num_threads(nt)
  for (int64_t i = 0; i < int64_t(tasks.size()); ++i) {
    const Task& t = tasks[size_t(i)];
    part[size_t(i)] = uint32_t(crc32_z(0, static_cast<const Bytef*>(ranges[t.range].first) + t.begin, t.bytes));
  }
  std::vector<uint32_t> out(ranges.size(), 0);
  for (size_t i = 0; i < tasks.size(); ++i) {
    const Task& t = tasks[i];
    out[t.range] = t.begin == 0 ? part[i] : crc32_concat(out[t.range], part[i], t.bytes);
  }
  return out;
}

uint32_t crc32_of(const void* data, size_t bytes, int threads) { return crc32_many({{data, bytes}}, threads)[0]; }

uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, size_t bytes_b) {
  return uint32_t(crc32_combine64(crc_a, crc_b, z_off64_t(bytes_b)));
}

namespace {

constexpr const char* kGroups[3] = {"model", "optimizer/exp_avg", "optimizer/exp_avg_sq"};

// Rank r of n owns rows [R*r/n, R*(r+1)/n) of a tensor with R rows along dimension 0: a
// contiguous range of the flattened tensor, in rank order.
struct Piece {
  int64_t row_begin = 0, rows = 0, row_elems = 1;
  int64_t elem_begin() const { return row_begin * row_elems; }
  int64_t elems() const { return rows * row_elems; }
};

Piece piece_of(const Shape& global, int rank, int n) {
  Piece p;
  const int64_t R = global.ndim() ? global[0] : 1;
  p.row_elems = global.ndim() ? global.numel() / std::max<int64_t>(R, 1) : 1;
  p.row_begin = R * rank / n;
  p.rows = R * (rank + 1) / n - p.row_begin;
  return p;
}

std::vector<hsize_t> dims_of(const Shape& s) {
  std::vector<hsize_t> d;
  for (int i = 0; i < s.ndim(); ++i) d.push_back(hsize_t(s[i]));
  return d;
}

// The file-space selection of a piece (or nothing), and a 1-D memory space for it.
std::pair<h5::Handle, h5::Handle> selections(hid_t file_space, const Shape& global, const Piece& p) {
  h5::Handle fsel(H5Scopy(file_space), "H5Scopy");
  h5::Handle msel;
  if (p.rows == 0) {
    DS_H5_CHECK(H5Sselect_none(fsel));
    const hsize_t one = 1;
    msel = h5::Handle(H5Screate_simple(1, &one, nullptr), "H5Screate_simple");
    DS_H5_CHECK(H5Sselect_none(msel));
  } else {
    std::vector<hsize_t> start(size_t(global.ndim()), 0), count = dims_of(global);
    start[0] = hsize_t(p.row_begin);
    count[0] = hsize_t(p.rows);
    DS_H5_CHECK(H5Sselect_hyperslab(fsel, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr));
    const hsize_t n = hsize_t(p.elems());
    msel = h5::Handle(H5Screate_simple(1, &n, nullptr), "H5Screate_simple");
  }
  return {std::move(fsel), std::move(msel)};
}

// Scalars of a JSON object as typed attributes (readable at a glance with h5ls -v or h5py),
// the whole object as a "json" string attribute (what dstrain reads back).
void write_json_group(hid_t parent, const std::string& name, const json& j) {
  h5::Handle g = h5::create_group(parent, name);
  h5::write_attr(g, "json", j.dump());
  if (!j.is_object()) return;
  for (const auto& [k, v] : j.items()) {
    if (v.is_number_integer()) {
      h5::write_attr(g, k, v.get<int64_t>());
    } else if (v.is_number()) {
      h5::write_attr(g, k, v.get<double>());
    } else if (v.is_string()) {
      h5::write_attr(g, k, v.get<std::string>());
    } else if (v.is_boolean()) {
      h5::write_attr(g, k, int64_t(v.get<bool>()));
    }
  }
}

json read_json_group(hid_t parent, const std::string& name) {
  h5::Handle g = h5::open_group(parent, name);
  return json::parse(h5::read_attr_string(g, "json"));
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

void fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

std::vector<const float*> group_buffers(const CheckpointBuffers& b) { return {b.values, b.exp_avg, b.exp_avg_sq}; }

// The combined CRC of every tensor piece over all ranks: rank order is flattened order.
std::vector<uint32_t> combine_crcs(MPI_Comm comm, const std::vector<uint64_t>& local) {
  int n = 1;
  MPI_Comm_size(comm, &n);
  std::vector<uint64_t> all(local.size() * size_t(n));
  DS_CHECK(MPI_Allgather(local.data(), int(local.size()), MPI_UINT64_T, all.data(), int(local.size()), MPI_UINT64_T,
                         comm) == MPI_SUCCESS,
           "checkpoint: gathering checksums failed");
  const size_t T = local.size() / 2;
  std::vector<uint32_t> out(T);
  for (size_t t = 0; t < T; ++t) {
    uint32_t c = uint32_t(all[2 * t]);
    for (int r = 1; r < n; ++r) {
      const size_t base = size_t(r) * local.size();
      c = crc32_concat(c, uint32_t(all[base + 2 * t]), size_t(all[base + 2 * t + 1]));
    }
    out[t] = c;
  }
  return out;
}

// The same exception on every rank: the message of the lowest rank that failed.
void throw_if_any_failed(MPI_Comm comm, const std::string& error) {
  int rank = 0, n = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &n);
  int mine = error.empty() ? n : rank, first = n;
  MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == n) return;
  int len = int(error.size());
  MPI_Bcast(&len, 1, MPI_INT, first, comm);
  std::string msg(size_t(len), '\0');
  if (rank == first) msg = error;
  MPI_Bcast(msg.data(), len, MPI_CHAR, first, comm);
  throw Error(n > 1 ? fmt::format("{} (reported by rank {})", msg, first) : msg);
}

}  // namespace

void write_checkpoint(const std::string& path, MPI_Comm comm, const ParamRegistry& reg, const CheckpointBuffers& bufs,
                      const TrainState& state, int threads) {
  std::lock_guard lock(h5::hdf5_lock());
  int rank = 0, n = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &n);
  const auto buffers = group_buffers(bufs);
  // Checksums first: every rank hashes its pieces, the combination is known to all before
  // any attribute is written (attribute writes are collective and must agree).
  std::vector<std::pair<const void*, size_t>> ranges;
  for (int g = 0; g < 3; ++g) {
    if (!buffers[size_t(g)]) continue;
    for (const ParamInfo& p : reg.all()) {
      DS_CHECK(p.placement.kind == Placement::Kind::Whole, "checkpoint: '{}' is not held whole on this rank", p.name);
      const Piece pc = piece_of(p.global_shape, rank, n);
      ranges.emplace_back(buffers[size_t(g)] + p.offset + pc.elem_begin(), size_t(pc.elems()) * sizeof(float));
    }
  }
  std::vector<uint64_t> local;
  const std::vector<uint32_t> piece_crcs = crc32_many(ranges, threads);
  for (size_t i = 0; i < ranges.size(); ++i) {
    local.push_back(piece_crcs[i]);
    local.push_back(ranges[i].second);
  }
  const std::vector<uint32_t> crcs = combine_crcs(comm, local);

  h5::Handle file = h5::create_file(path, comm);
  h5::write_attr(file, "format", std::string(kCheckpointFormat));
  h5::write_attr(file, "format_version", kCheckpointFormatVersion);
  h5::write_attr(file, "dstrain_version", std::string(DSTRAIN_VERSION));
  h5::write_attr(file, "build_id", std::string(DSTRAIN_GIT_COMMIT));
  h5::write_attr(file, "created", utc_now());
  h5::write_attr(file, "step", state.step);
  h5::write_attr(file, "consumed_samples", state.consumed_samples);
  h5::write_attr(file, "consumed_tokens", state.consumed_tokens);
  h5::write_attr(file, "checksum_algorithm", std::string("crc32 (zlib) of the tensor's little-endian bytes"));

  h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), "H5Pcreate(H5P_DATASET_CREATE)");
  DS_H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
  h5::Handle xfer = h5::transfer_plist(/*collective=*/true);
  {
    h5::Handle model = h5::create_group(file, "model");
    h5::Handle opt = h5::create_group(file, "optimizer");
    h5::write_attr(opt, "type", std::string("AdamW"));
    h5::write_attr(opt, "step", state.optimizer_steps);
    if (bufs.exp_avg) {
      h5::Handle a = h5::create_group(opt, "exp_avg");
      h5::Handle b = h5::create_group(opt, "exp_avg_sq");
    }
  }
  size_t t = 0;
  for (int g = 0; g < 3; ++g) {
    const float* base = buffers[size_t(g)];
    if (!base) continue;
    h5::Handle group = h5::open_group(file, kGroups[g]);
    for (const ParamInfo& p : reg.all()) {
      const Piece pc = piece_of(p.global_shape, rank, n);
      const auto dims = dims_of(p.global_shape);
      h5::Handle space(H5Screate_simple(int(dims.size()), dims.data(), nullptr), "H5Screate_simple");
      h5::Handle dset(H5Dcreate2(group, p.name.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
                      "H5Dcreate2");
      auto [fsel, msel] = selections(space, p.global_shape, pc);
      DS_H5_CHECK(H5Dwrite(dset, H5T_NATIVE_FLOAT, msel, fsel, xfer, base + p.offset + pc.elem_begin()));
      h5::write_attr(dset, "crc32", int64_t(crcs[t++]));
      h5::write_attr(dset, "kind", std::string(param_kind_name(p.kind)));
    }
  }
  write_json_group(file, "scheduler", state.scheduler);
  write_json_group(file, "rng", state.rng);
  write_json_group(file, "data", state.data);
  write_json_group(file, "layout", state.layout);
  if (state.environment.is_object()) write_json_group(file, "environment", state.environment);
  h5::write_string_dataset(file, "config", state.config.dump(2));
  file.close();  // flushes; collective
  if (rank == 0) fsync_path(path);
}

TrainState read_checkpoint(const std::string& path, MPI_Comm comm, ParamRegistry& reg, float* exp_avg,
                           float* exp_avg_sq) {
  std::lock_guard lock(h5::hdf5_lock());
  int rank = 0, n = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &n);
  float* values = reg.values().data<float>();
  const std::vector<float*> buffers = {values, exp_avg, exp_avg_sq};

  // Opening is collective and fails alike on every rank (a truncated or foreign file).
  std::string error;
  h5::Handle file;
  try {
    file = h5::open_file(path, comm);
  } catch (const Error& e) {
    error = e.what();
  }
  throw_if_any_failed(comm, error);

  TrainState st;
  std::vector<std::pair<const void*, size_t>> ranges;
  std::vector<uint32_t> stored;
  std::vector<std::string> names;
  // Each rank reads its rows independently, so a failure on one rank cannot leave the
  // others blocked in a collective read; the outcome is agreed on afterwards.
  try {
    DS_CHECK(h5::has_attr(file, "format") && h5::read_attr_string(file, "format") == kCheckpointFormat,
             "'{}' is an HDF5 file but not a dstrain checkpoint (no format=\"{}\" attribute)", path,
             kCheckpointFormat);
    const int64_t version = h5::read_attr_int(file, "format_version");
    DS_CHECK(version == kCheckpointFormatVersion,
             "'{}' has checkpoint format version {}; this dstrain reads version {}", path, version,
             kCheckpointFormatVersion);
    st.step = h5::read_attr_int(file, "step");
    st.consumed_samples = h5::read_attr_int(file, "consumed_samples");
    st.consumed_tokens = h5::read_attr_int(file, "consumed_tokens");
    {
      h5::Handle opt = h5::open_group(file, "optimizer");
      st.optimizer_steps = h5::read_attr_int(opt, "step");
    }
    st.scheduler = read_json_group(file, "scheduler");
    st.rng = read_json_group(file, "rng");
    st.data = read_json_group(file, "data");
    st.layout = read_json_group(file, "layout");
    st.config = json::parse(h5::read_string_dataset(file, "config"));
    h5::Handle xfer = h5::transfer_plist(/*collective=*/false);
    for (int g = 0; g < 3; ++g) {
      float* base = buffers[size_t(g)];
      if (!base) continue;
      DS_CHECK(h5::exists(file, kGroups[g]), "'{}' has no /{} group: it holds no optimizer state to resume from",
               path, kGroups[g]);
      h5::Handle group = h5::open_group(file, kGroups[g]);
      for (const ParamInfo& p : reg.all()) {
        const std::string where = fmt::format("/{}/{}", kGroups[g], p.name);
        DS_CHECK(h5::exists(group, p.name), "'{}' has no tensor {}: was it written for another model?", path, where);
        h5::Handle dset(H5Dopen2(group, p.name.c_str(), H5P_DEFAULT), "H5Dopen2");
        const Shape shape = h5::dataset_shape(dset);
        DS_CHECK(shape == p.global_shape, "'{}': {} has shape {} but the model expects {}; check the model config",
                 path, where, shape.str(), p.global_shape.str());
        const Piece pc = piece_of(p.global_shape, rank, n);
        h5::Handle space(H5Dget_space(dset), "H5Dget_space");
        auto [fsel, msel] = selections(space, p.global_shape, pc);
        float* dst = base + p.offset + pc.elem_begin();
        DS_H5_CHECK(H5Dread(dset, H5T_NATIVE_FLOAT, msel, fsel, xfer, dst));
        ranges.emplace_back(dst, size_t(pc.elems()) * sizeof(float));
        stored.push_back(uint32_t(h5::read_attr_int(dset, "crc32")));
        names.push_back(where);
      }
    }
  } catch (const Error& e) {
    error = fmt::format("checkpoint '{}' cannot be read: {}", path, e.what());
  }
  throw_if_any_failed(comm, error);
  file.close();

  std::vector<uint64_t> local;
  const std::vector<uint32_t> piece_crcs = crc32_many(ranges);
  for (size_t i = 0; i < ranges.size(); ++i) {
    local.push_back(piece_crcs[i]);
    local.push_back(ranges[i].second);
  }
  const std::vector<uint32_t> crcs = combine_crcs(comm, local);
  std::vector<std::string> bad;
  for (size_t t = 0; t < crcs.size(); ++t) {
    if (crcs[t] != stored[t]) bad.push_back(names[t]);
  }
  if (!bad.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(bad.size(), 5); ++i) list += "\n    " + bad[i];
    throw Error(fmt::format("checkpoint '{}' is corrupt: {} tensor(s) fail their crc32 checksum:{}{}", path,
                            bad.size(), list, bad.size() > 5 ? fmt::format("\n    and {} more", bad.size() - 5) : ""));
  }

  // Every rank holds whole tensors: assemble them from the pieces in place.
  std::vector<int> counts(static_cast<size_t>(n)), displs(static_cast<size_t>(n));
  for (int g = 0; g < 3; ++g) {
    float* base = buffers[size_t(g)];
    if (!base || n == 1) continue;
    for (const ParamInfo& p : reg.all()) {
      for (int r = 0; r < n; ++r) {
        const Piece pc = piece_of(p.global_shape, r, n);
        counts[size_t(r)] = int(pc.elems());
        displs[size_t(r)] = int(pc.elem_begin());
      }
      DS_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_FLOAT, base + p.offset, counts.data(), displs.data(), MPI_FLOAT,
                              comm) == MPI_SUCCESS,
               "checkpoint: assembling '{}' failed", p.name);
    }
  }
  return st;
}

CheckpointInfo inspect_checkpoint(const std::string& path, bool verify) {
  std::lock_guard lock(h5::hdf5_lock());
  h5::Handle file = h5::open_file(path, MPI_COMM_NULL);
  DS_CHECK(h5::has_attr(file, "format") && h5::read_attr_string(file, "format") == kCheckpointFormat,
           "'{}' is an HDF5 file but not a dstrain checkpoint", path);
  CheckpointInfo info;
  info.version = h5::read_attr_string(file, "dstrain_version");
  info.build = h5::read_attr_string(file, "build_id");
  info.created = h5::read_attr_string(file, "created");
  TrainState& st = info.state;
  st.step = h5::read_attr_int(file, "step");
  st.consumed_samples = h5::read_attr_int(file, "consumed_samples");
  st.consumed_tokens = h5::read_attr_int(file, "consumed_tokens");
  st.optimizer_steps = h5::read_attr_int(h5::open_group(file, "optimizer"), "step");
  st.scheduler = read_json_group(file, "scheduler");
  st.rng = read_json_group(file, "rng");
  st.data = read_json_group(file, "data");
  st.layout = read_json_group(file, "layout");
  st.config = json::parse(h5::read_string_dataset(file, "config"));
  if (h5::exists(file, "environment")) st.environment = read_json_group(file, "environment");
  std::vector<float> buf;
  for (const char* gname : kGroups) {
    if (!h5::exists(file, gname)) continue;
    h5::Handle group = h5::open_group(file, gname);
    for (const std::string& name : h5::list_members(group)) {
      h5::Handle dset(H5Dopen2(group, name.c_str(), H5P_DEFAULT), "H5Dopen2");
      CheckpointTensorInfo t;
      t.group = gname;
      t.name = name;
      t.shape = h5::dataset_shape(dset);
      t.stored_crc = uint32_t(h5::read_attr_int(dset, "crc32"));
      t.computed_crc = t.stored_crc;
      if (verify) {
        buf.resize(size_t(t.shape.numel()));
        DS_H5_CHECK(H5Dread(dset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, buf.data()));
        t.computed_crc = crc32_of(buf.data(), buf.size() * sizeof(float));
      }
      info.tensors.push_back(std::move(t));
    }
  }
  return info;
}

}  // namespace dstrain
