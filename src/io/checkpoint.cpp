#include "io/checkpoint.h"

#include <fcntl.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <omp.h>
#include <zlib.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>

#include "core/error.h"
#include "core/log.h"
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

// The pieces that buffers or targets describe: theirs, or whole tensors in the registry's
// layout on every rank, rank r of n writing rows block r of each.
std::shared_ptr<const ShardedState> pieces_or_whole(const ParamRegistry& reg,
                                                    const std::shared_ptr<const ShardedState>& given, int rank, int n) {
  if (given) return given;
  return std::make_shared<const ShardedState>(ShardedState::whole(reg, rank, n));
}

// Each file tensor's piece on this rank (-1: none), after the pieces pass their check on every
// rank (a bad description fails alike on all, before any rank writes or reads).
std::vector<int> checked_pieces(MPI_Comm comm, const ParamRegistry& reg, const ShardedState& pieces) {
  std::string error;
  std::vector<int> of(size_t(reg.size()), -1);
  try {
    pieces.check(reg);
    for (size_t i = 0; i < pieces.pieces.size(); ++i) of[size_t(pieces.pieces[i].tensor)] = int(i);
  } catch (const Error& e) {
    error = fmt::format("checkpoint: {}", e.what());
  }
  throw_if_any_rank_failed(comm, error);
  return of;
}

// One group of the file's tensors as a write or a read sees it: its path, this rank's buffer
// (null: it holds none of the group), its pieces and each file tensor's piece (-1: none).
struct GroupIo {
  std::string path;
  float* data = nullptr;
  std::shared_ptr<const ShardedState> pieces;
  std::vector<int> piece_of;
  bool verify = true;  // reading: this rank's pieces count in the checksums
};

// The model, the moments when given, then the extra groups, each group's pieces checked on
// every rank (collective: every rank lists the same groups in the same order).
std::vector<GroupIo> group_list(MPI_Comm comm, const ParamRegistry& reg, const float* values, const float* exp_avg,
                                const float* exp_avg_sq, const std::shared_ptr<const ShardedState>& main,
                                const std::vector<CheckpointGroup>& extra, bool verify_main = true) {
  std::vector<GroupIo> g;
  g.push_back({kGroups[0], const_cast<float*>(values), main, {}, verify_main});
  if (exp_avg) {
    g.push_back({kGroups[1], const_cast<float*>(exp_avg), main, {}, verify_main});
    g.push_back({kGroups[2], const_cast<float*>(exp_avg_sq), main, {}, verify_main});
  }
  for (const CheckpointGroup& e : extra) g.push_back({e.path, e.data, e.pieces ? e.pieces : main, {}, e.verify});
  for (GroupIo& x : g) {
    x.piece_of = checked_pieces(comm, reg, *x.pieces);
    DS_CHECK(x.data || x.pieces->pieces.empty(), "checkpoint: group /{} has pieces on this rank but no buffer", x.path);
  }
  return g;
}

// The group at `path` (its parents created first).
h5::Handle create_groups(hid_t file, const std::string& path) {
  size_t at = 0;
  while (true) {
    const size_t slash = path.find('/', at);
    const std::string prefix = path.substr(0, slash);
    if (!h5::exists(file, prefix)) h5::create_group(file, prefix);
    if (slash == std::string::npos) break;
    at = slash + 1;
  }
  return h5::open_group(file, path);
}

std::vector<hsize_t> dims_of(const Shape& s) {
  std::vector<hsize_t> d;
  for (int i = 0; i < s.ndim(); ++i) d.push_back(hsize_t(s[i]));
  return d;
}

// The file-space selection of rows `rows` of a piece (or nothing), and a 1-D memory space
// for them.
std::pair<h5::Handle, h5::Handle> selections(hid_t file_space, const TensorPiece& piece, const RowPiece& rows) {
  h5::Handle fsel(H5Scopy(file_space), "H5Scopy");
  h5::Handle msel;
  if (rows.rows == 0 || rows.elems() == 0) {
    DS_H5_CHECK(H5Sselect_none(fsel));
    const hsize_t one = 1;
    msel = h5::Handle(H5Screate_simple(1, &one, nullptr), "H5Screate_simple");
    DS_H5_CHECK(H5Sselect_none(msel));
  } else {
    std::vector<hsize_t> start, count = dims_of(piece.shape);
    for (int64_t o : piece.offset) start.push_back(hsize_t(o));
    start[0] += hsize_t(rows.row_begin);
    count[0] = hsize_t(rows.rows);
    DS_H5_CHECK(H5Sselect_hyperslab(fsel, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr));
    const hsize_t n = hsize_t(rows.elems());
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

// The JSON fields of a checkpoint (each group's "json" attribute and the config dataset),
// parsed. One that is not valid JSON was damaged after the file was written: it becomes a
// problem that names the file and the field, and null (optional groups absent are null too).
void read_json_fields(hid_t file, const std::string& path, TrainState& st, std::vector<std::string>& problems) {
  auto parse = [&](const std::string& field, const std::string& text) {
    try {
      return parse_json(text, fmt::format("checkpoint '{}': field {}", path, field), kDataJson);
    } catch (const Error& e) {
      problems.push_back(e.what());
      return json();
    }
  };
  auto group = [&](const char* name, bool required) {
    if (!required && !h5::exists(file, name)) return json();
    h5::Handle g = h5::open_group(file, name);
    return parse(fmt::format("/{}@json", name), h5::read_attr_string(g, "json"));
  };
  st.scheduler = group("scheduler", true);
  st.rng = group("rng", true);
  st.data = group("data", true);
  st.layout = group("layout", true);
  st.environment = group("environment", false);
  st.loss_scaler = group("loss_scaler", false);
  st.config = parse("/config", h5::read_string_dataset(file, "config"));
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}


// A run of a global tensor's elements that one rank hashed: tensor t (group * tensors + id),
// its first element and length in the tensor, its CRC-32.
struct RunCrc {
  uint64_t tensor = 0, global = 0, elems = 0, crc = 0;
};

// The CRC-32 of every tensor from the runs of all ranks. Tensor t's runs go to rank t mod n,
// which checks that they tile the tensor (every element once) and chains them in order; every
// rank gets every CRC. A description that leaves elements out or covers some twice fails here,
// alike on every rank, naming the tensor. Collective over comm.
std::vector<uint32_t> combine_runs(MPI_Comm comm, const std::vector<RunCrc>& mine, const std::vector<int64_t>& numel,
                                   const std::function<std::string(size_t)>& name_of) {
  int rank = 0, n = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &n);
  const size_t T = numel.size();
  std::vector<std::vector<uint64_t>> out(static_cast<size_t>(n));
  for (const RunCrc& r : mine) {
    auto& o = out[size_t(r.tensor % uint64_t(n))];
    o.insert(o.end(), {r.tensor, r.global, r.elems, r.crc});
  }
  const size_t N = static_cast<size_t>(n);
  std::vector<int> send(N), recv(N), sdispl(N), rdispl(N);
  std::vector<uint64_t> sbuf;
  for (int r = 0; r < n; ++r) {
    sdispl[size_t(r)] = int(sbuf.size());
    send[size_t(r)] = int(out[size_t(r)].size());
    sbuf.insert(sbuf.end(), out[size_t(r)].begin(), out[size_t(r)].end());
  }
  DS_CHECK(MPI_Alltoall(send.data(), 1, MPI_INT, recv.data(), 1, MPI_INT, comm) == MPI_SUCCESS,
           "checkpoint: exchanging checksum counts failed");
  int total = 0;
  for (int r = 0; r < n; ++r) {
    rdispl[size_t(r)] = total;
    total += recv[size_t(r)];
  }
  std::vector<uint64_t> rbuf(size_t(std::max(total, 1)));
  DS_CHECK(MPI_Alltoallv(sbuf.data(), send.data(), sdispl.data(), MPI_UINT64_T, rbuf.data(), recv.data(), rdispl.data(),
                         MPI_UINT64_T, comm) == MPI_SUCCESS,
           "checkpoint: exchanging checksums failed");
  std::vector<std::vector<RunCrc>> runs(T);
  for (int i = 0; i + 3 < total; i += 4) {
    const RunCrc r{rbuf[size_t(i)], rbuf[size_t(i) + 1], rbuf[size_t(i) + 2], rbuf[size_t(i) + 3]};
    runs[size_t(r.tensor)].push_back(r);
  }
  std::vector<uint32_t> crcs(T, 0);
  std::map<uint64_t, uLong> ops;  // zlib's combination operator per run length
  std::string error;
  for (size_t t = size_t(rank); t < T && error.empty(); t += size_t(n)) {
    std::vector<RunCrc>& rs = runs[t];
    std::sort(rs.begin(), rs.end(), [](const RunCrc& a, const RunCrc& b) { return a.global < b.global; });
    uint64_t next = 0;
    uint32_t c = 0;
    for (const RunCrc& r : rs) {
      if (r.global != next) {
        error = r.global > next ? fmt::format("checkpoint: no rank holds elements [{}, {}) of {} to write", next,
                                              r.global, name_of(t))
                                : fmt::format("checkpoint: two ranks write element {} of {}", r.global, name_of(t));
        break;
      }
      const uint64_t bytes = r.elems * sizeof(float);
      auto it = ops.find(bytes);
      if (it == ops.end()) it = ops.emplace(bytes, crc32_combine_gen64(z_off64_t(bytes))).first;
      c = next == 0 ? uint32_t(r.crc) : uint32_t(crc32_combine_op(c, uLong(r.crc), it->second));
      next += r.elems;
    }
    if (error.empty() && next != uint64_t(numel[t])) {
      error = fmt::format("checkpoint: no rank holds elements [{}, {}) of {} to write", next, numel[t], name_of(t));
    }
    crcs[t] = c;
  }
  throw_if_any_rank_failed(comm, error);
  DS_CHECK(MPI_Allreduce(MPI_IN_PLACE, crcs.data(), int(T), MPI_UINT32_T, MPI_BOR, comm) == MPI_SUCCESS,
           "checkpoint: sharing checksums failed");
  return crcs;
}

// The CRC-32 of every tensor of every group (index group * tensors + id) from the rows each
// rank writes of its pieces, which together cover every tensor once. Collective over comm.
std::vector<uint32_t> tensor_crcs(MPI_Comm comm, const ParamRegistry& reg, const std::vector<GroupIo>& groups,
                                  int threads) {
  std::vector<std::pair<const void*, size_t>> ranges;
  std::vector<RunCrc> runs;
  std::vector<int64_t> numel;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const ParamInfo& p : reg.all()) numel.push_back(p.global_shape.numel());
    if (!groups[g].verify) continue;
    for (const TensorPiece& t : groups[g].pieces->pieces) {
      for (const PieceRun& r : piece_runs(t, reg.info(t.tensor).global_shape, t.written())) {
        ranges.emplace_back(groups[g].data + t.at + r.local, size_t(r.elems) * sizeof(float));
        runs.push_back({uint64_t(g) * uint64_t(reg.size()) + uint64_t(t.tensor), uint64_t(r.global), uint64_t(r.elems), 0});
      }
    }
  }
  const std::vector<uint32_t> run_crcs = crc32_many(ranges, threads);
  for (size_t i = 0; i < runs.size(); ++i) runs[i].crc = run_crcs[i];
  return combine_runs(comm, runs, numel, [&](size_t t) {
    const ParamInfo& p = reg.info(int(t % size_t(reg.size())));
    return fmt::format("/{}/{} {}", groups[t / size_t(reg.size())].path, p.name, p.global_shape.str());
  });
}

// ---- Metadata checksums ----------------------------------------------------------------
// Every attribute ("/path@name") and every dataset ("/path": a string dataset's text, a
// tensor's type and shape, its data being covered by its crc32 attribute) is a field with a
// canonical text value. /metadata_checksums lists "crc32 name" per field, sorted by name;
// the root attribute metadata_crc32 is the CRC-32 of that list. validation/
// check_checkpoint.py recomputes both with h5py.
constexpr const char* kManifest = "metadata_checksums";
constexpr const char* kManifestCrc = "metadata_crc32";

using Fields = std::map<std::string, std::string>;

void collect_fields(hid_t obj, const std::string& path, const Fields& texts, Fields& out) {
  const std::string at = path == "/" ? "/@" : path + "@";
  for (const std::string& a : h5::list_attrs(obj)) {
    if (path == "/" && a == kManifestCrc) continue;
    out[at + a] = h5::read_attr_text(obj, a);
  }
  for (const std::string& m : h5::list_members(obj)) {
    const std::string child = (path == "/" ? "/" : path + "/") + m;
    if (child == std::string("/") + kManifest) continue;
    if (h5::is_group(obj, m)) {
      h5::Handle g = h5::open_group(obj, m);
      collect_fields(g, child, texts, out);
      continue;
    }
    h5::Handle d(H5Dopen2(obj, m.c_str(), H5P_DEFAULT), "H5Dopen2");
    const auto given = texts.find(child);
    if (given != texts.end()) {
      out[child] = given->second;
    } else {
      out[child] = h5::is_string_dataset(d) ? h5::read_string_dataset(obj, m) : h5::describe_dataset(d);
    }
    for (const std::string& a : h5::list_attrs(d)) out[child + "@" + a] = h5::read_attr_text(d, a);
  }
}

// `texts`: the contents of string datasets created but not written yet.
Fields metadata_fields(hid_t file, const Fields& texts = {}) {
  Fields f;
  collect_fields(file, "/", texts, f);
  return f;
}

std::string manifest_of(const Fields& fields) {
  std::string m;
  for (const auto& [name, value] : fields) m += fmt::format("{:08x} {}\n", crc32_of(value.data(), value.size(), 1), name);
  return m;
}

std::string shortened(const std::string& v) {
  return v.size() <= 48 ? v : v.substr(0, 45) + "...";
}

struct MetadataReport {
  bool sealed = false;
  size_t fields = 0;
  std::vector<std::string> problems;
};

MetadataReport verify_metadata(hid_t file) {
  MetadataReport r;
  if (!h5::has_attr(file, kManifestCrc)) return r;
  r.sealed = true;
  if (!h5::exists(file, kManifest)) {
    r.problems.push_back(fmt::format("/{} is missing (the metadata checksums that /@{} seals)", kManifest, kManifestCrc));
    return r;
  }
  const std::string manifest = h5::read_string_dataset(file, kManifest);
  const uint32_t sealed = uint32_t(h5::read_attr_int(file, kManifestCrc));
  if (crc32_of(manifest.data(), manifest.size(), 1) != sealed) {
    r.problems.push_back(fmt::format("/{} (the list of metadata checksums) does not match /@{}", kManifest, kManifestCrc));
    return r;
  }
  std::map<std::string, uint32_t> want;
  size_t start = 0;
  while (start < manifest.size()) {
    size_t end = manifest.find('\n', start);
    if (end == std::string::npos) end = manifest.size();
    const std::string line = manifest.substr(start, end - start);
    start = end + 1;
    if (line.size() > 9) want[line.substr(9)] = uint32_t(std::stoul(line.substr(0, 8), nullptr, 16));
  }
  const Fields have = metadata_fields(file);
  r.fields = have.size();
  for (const auto& [name, crc] : want) {
    const auto it = have.find(name);
    if (it == have.end()) {
      r.problems.push_back(fmt::format("{} is missing", name));
    } else if (crc32_of(it->second.data(), it->second.size(), 1) != crc) {
      r.problems.push_back(fmt::format("{} fails its checksum (it now reads \"{}\")", name, shortened(it->second)));
    }
  }
  for (const auto& [name, value] : have) {
    if (!want.count(name)) r.problems.push_back(fmt::format("{} was added after the file was written", name));
  }
  return r;
}

// The counters of a checkpoint restate each other; a mismatch names both fields.
std::vector<std::string> consistency_problems(const TrainState& st) {
  std::vector<std::string> p;
  if (st.step < 0) p.push_back(fmt::format("/@step is {}, below 0", st.step));
  if (st.optimizer_steps < 0 || st.optimizer_steps > st.step) {
    p.push_back(fmt::format("/optimizer@step (AdamW's step count) is {} but /@step is {}: AdamW cannot have taken "
                            "more steps than the trainer (skipped steps take none)",
                            st.optimizer_steps, st.step));
  }
  if (st.consumed_samples < st.step) {
    p.push_back(fmt::format("/@consumed_samples is {} but /@step is {}: every step consumes at least one sample",
                            st.consumed_samples, st.step));
  }
  const json& d = st.data;
  if (d.is_object()) {
    if (d.contains("consumed_samples") && d["consumed_samples"] != st.consumed_samples) {
      p.push_back(fmt::format("/data@json consumed_samples is {} but /@consumed_samples is {}",
                              d["consumed_samples"].dump(), st.consumed_samples));
    }
    if (d.contains("seq_len") && d["seq_len"].is_number_integer() &&
        st.consumed_tokens != st.consumed_samples * d["seq_len"].get<int64_t>()) {
      p.push_back(fmt::format("/@consumed_tokens is {} but /@consumed_samples {} x /data seq_len {} is {}",
                              st.consumed_tokens, st.consumed_samples, d["seq_len"].get<int64_t>(),
                              st.consumed_samples * d["seq_len"].get<int64_t>()));
    }
    const json& b = d.value("blend", json());
    if (b.is_object() && b.contains("steps_done") && b["steps_done"] != st.step) {
      p.push_back(fmt::format("/data@json blend.steps_done (the data position's step) is {} but /@step is {}",
                              b["steps_done"].dump(), st.step));
    }
    if (b.is_object() && b.contains("drawn") && b["drawn"].is_array()) {
      int64_t drawn = 0;
      for (const json& x : b["drawn"]) drawn += x.is_number_integer() ? x.get<int64_t>() : 0;
      if (drawn != st.consumed_samples) {
        p.push_back(fmt::format("/data@json blend.drawn sums to {} samples but /@consumed_samples is {}", drawn,
                                st.consumed_samples));
      }
    }
  }
  // The loss scaler sees every step of the run since it started (or since fp16 was switched
  // on), overflows among them.
  const json& ls = st.loss_scaler;
  if (ls.is_object() && ls.contains("cur_iter") && ls["cur_iter"].is_number_integer()) {
    const int64_t iters = ls["cur_iter"].get<int64_t>();
    if (iters > st.step) {
      p.push_back(fmt::format("/loss_scaler@json cur_iter (steps the loss scaler saw) is {} but /@step is {}", iters,
                              st.step));
    }
    if (ls.contains("overflows") && ls["overflows"].is_number_integer() && ls["overflows"].get<int64_t>() > iters) {
      p.push_back(fmt::format("/loss_scaler@json overflows is {} but cur_iter is {}", ls["overflows"].dump(), iters));
    }
  }
  // fp16 steps skipped for an overflow do not advance the schedule (DeepSpeed's rule).
  const json overflow_skips = st.scheduler.is_object() ? st.scheduler.value("skipped_for_overflow", json(0)) : json(0);
  const int64_t skips = overflow_skips.is_number_integer() ? overflow_skips.get<int64_t>() : -1;
  if (skips < 0 || skips > st.step) {
    p.push_back(fmt::format("/scheduler@json skipped_for_overflow is {}: it must be a count of steps in [0, /@step = {}]",
                            overflow_skips.dump(), st.step));
  } else if (st.scheduler.is_object() && st.scheduler.contains("last_batch_iteration") &&
             st.scheduler["last_batch_iteration"] != st.step - 1 - skips) {
    p.push_back(fmt::format("/scheduler@json last_batch_iteration is {} but /@step is {} (it must be step - 1{})",
                            st.scheduler["last_batch_iteration"].dump(), st.step,
                            skips ? fmt::format(" - skipped_for_overflow {}", skips) : std::string()));
  }
  return p;
}

std::string list_problems(const std::vector<std::string>& problems) {
  std::string out;
  for (size_t i = 0; i < std::min<size_t>(problems.size(), 8); ++i) out += "\n    " + problems[i];
  if (problems.size() > 8) out += fmt::format("\n    and {} more", problems.size() - 8);
  return out;
}

// ---- Agreeing on a failed write ---------------------------------------------------------
struct WriteFailure {
  std::string error;  // "" = none
  int err_no = 0;
};

// The failure of the lowest failing rank, known to every rank.
WriteFailure agree_on_failure(MPI_Comm comm, const WriteFailure& mine) {
  int rank = 0, n = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &n);
  int me = mine.error.empty() ? n : rank, first = n;
  MPI_Allreduce(&me, &first, 1, MPI_INT, MPI_MIN, comm);
  if (first == n) return {};
  int head[2] = {int(mine.error.size()), mine.err_no};
  MPI_Bcast(head, 2, MPI_INT, first, comm);
  WriteFailure out;
  out.error = rank == first ? mine.error : std::string(size_t(head[0]), '\0');
  MPI_Bcast(out.error.data(), head[0], MPI_CHAR, first, comm);
  out.err_no = head[1];
  if (n > 1) out.error += fmt::format(" (on rank {})", first);
  return out;
}

// Whether the file system of `path` has (almost) nothing left: HDF5 does not always keep the
// errno of the write that failed.
bool nearly_full(const std::string& path) {
  const std::string dir = path.substr(0, path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/'));
  struct statvfs v {};
  if (::statvfs(dir.empty() ? "." : dir.c_str(), &v) != 0) return false;
  const double free = double(v.f_bavail) * double(v.f_frsize), total = double(v.f_blocks) * double(v.f_frsize);
  return free < std::max(1e6, 0.001 * total);
}

// An HDF5 call that may fail for lack of storage: its errno is kept before anything else
// can change it, and a full file system is recognised while the partial file still fills it.
void record(WriteFailure& f, herr_t rc, const char* call, const std::string& path) {
  if (rc >= 0 || !f.error.empty()) return;
  f.err_no = errno;
  if (f.err_no != ENOSPC && f.err_no != EDQUOT && f.err_no != EFBIG && nearly_full(path)) f.err_no = ENOSPC;
  if (f.err_no == 0) f.err_no = EIO;
  try {
    h5::check(rc, call, __FILE__, __LINE__);
  } catch (const Error& e) {
    f.error = e.what();
  }
}

[[noreturn]] void raise_write_failure(const std::string& path, const WriteFailure& f) {
  const bool full = f.err_no == ENOSPC || f.err_no == EDQUOT || f.error.find("No space left") != std::string::npos;
  const bool too_big = f.err_no == EFBIG || f.error.find("File too large") != std::string::npos;
  if (full || too_big) {
    throw StorageFullError(full ? "no space left" : "the file size limit (ulimit -f) was reached",
                           fmt::format("writing '{}' failed: {}{}", path, std::strerror(full ? ENOSPC : EFBIG),
                                       "\n  " + f.error));
  }
  throw Error(fmt::format("writing checkpoint '{}' failed: {}", path, f.error));
}

}  // namespace

// The same exception on every rank: the message of the lowest rank that failed.
void throw_if_any_rank_failed(MPI_Comm comm, const std::string& error) {
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


int64_t checkpoint_size_bound(const ParamRegistry& reg, const CheckpointBuffers& bufs, const TrainState& state) {
  const int64_t groups = (bufs.exp_avg ? 3 : 1) + int64_t(bufs.extra.size());
  const int64_t datasets = groups * int64_t(reg.all().size());
  // The registry may describe pieces held elsewhere: its global shapes give the file.
  const int64_t elems = reg.global_numel();
  // Per dataset: its object header, attributes and line in the metadata checksums (under
  // 1 KB measured); then the configuration text and the fixed groups.
  return groups * elems * int64_t(sizeof(float)) + datasets * 2048 +
         2 * int64_t(state.config.dump(2).size()) + (int64_t(64) << 10);
}

void write_checkpoint(const std::string& path, MPI_Comm comm, const ParamRegistry& reg, const CheckpointBuffers& bufs,
                      const TrainState& state, int threads) {
  std::lock_guard lock(h5::hdf5_lock());
  int rank = 0, n = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &n);
  DS_CHECK((bufs.exp_avg == nullptr) == (bufs.exp_avg_sq == nullptr), "checkpoint: give both AdamW moments or neither");
  const std::shared_ptr<const ShardedState> pieces = pieces_or_whole(reg, bufs.pieces, rank, n);
  const std::vector<GroupIo> groups =
      group_list(comm, reg, bufs.values, bufs.exp_avg, bufs.exp_avg_sq, pieces, bufs.extra);
  // Checksums first: every rank hashes the runs it writes, the combination is known to all
  // before any attribute is written (attribute writes are collective and must agree).
  const std::vector<uint32_t> crcs = tensor_crcs(comm, reg, groups, threads);
  // Attribute values must be the same on every rank: rank 0's clock says when.
  std::string created = utc_now();
  created.resize(20, ' ');
  MPI_Bcast(created.data(), 20, MPI_CHAR, 0, comm);
  const std::string config_text = state.config.dump(2);

  h5::Handle file = h5::create_file(path, comm);
  WriteFailure failed;
  // Once HDF5 fails inside a collective flush, the ranks no longer agree (some wait forever):
  // so the whole file is reserved first, where the file system can, and a full disk or file
  // size limit is found here, by one rank, while HDF5 has next to nothing to write.
  const int64_t reserved = checkpoint_size_bound(reg, bufs, state);
  if (rank == 0) {
    const int fd = ::open(path.c_str(), O_WRONLY);
    if (fd < 0 || ::fallocate(fd, 0, 0, off_t(reserved)) != 0) {
      if (errno == ENOSPC || errno == EDQUOT || errno == EFBIG) {
        failed = {fmt::format("reserving {} bytes: {}", reserved, std::strerror(errno)), errno};
      }
    }
    if (fd >= 0) ::close(fd);
  }
  failed = agree_on_failure(comm, failed);
  auto abandon = [&] {
    // The partial file is worthless; emptying it first gives the collective close the room
    // it needs to finish on every rank.
    if (rank == 0 && ::truncate(path.c_str(), 0) != 0) {
      failed.error += fmt::format(" (and emptying it: {})", std::strerror(errno));
    }
    MPI_Barrier(comm);
    try {
      file.close();
    } catch (const Error&) {
      // Already failing: the file is removed below.
    }
    if (rank == 0) ::unlink(path.c_str());
    MPI_Barrier(comm);  // gone before any rank reports (and may end the job)
    raise_write_failure(path, failed);
  };
  if (!failed.error.empty()) abandon();

  // Metadata: collective, held in HDF5's cache, written by the flush below.
  h5::write_attr(file, "format", std::string(kCheckpointFormat));
  h5::write_attr(file, "format_version", kCheckpointFormatVersion);
  h5::write_attr(file, "dstrain_version", std::string(DSTRAIN_VERSION));
  h5::write_attr(file, "build_id", std::string(DSTRAIN_GIT_COMMIT));
  h5::write_attr(file, "created", created);
  h5::write_attr(file, "step", state.step);
  h5::write_attr(file, "consumed_samples", state.consumed_samples);
  h5::write_attr(file, "consumed_tokens", state.consumed_tokens);
  h5::write_attr(file, "checksum_algorithm", std::string("crc32 (zlib) of the tensor's little-endian bytes"));

  h5::Handle dcpl(H5Pcreate(H5P_DATASET_CREATE), "H5Pcreate(H5P_DATASET_CREATE)");
  DS_H5_CHECK(H5Pset_fill_time(dcpl, H5D_FILL_TIME_NEVER));
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
  struct Write {
    h5::Handle dset;
    const float* src;
    const TensorPiece* piece;
    RowPiece rows;
  };
  std::vector<Write> writes;
  for (size_t g = 0; g < groups.size(); ++g) {
    const float* base = groups[g].data;
    const std::vector<int>& piece_of = groups[g].piece_of;
    h5::Handle group = create_groups(file, groups[g].path);
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      const auto dims = dims_of(p.global_shape);
      h5::Handle space(H5Screate_simple(int(dims.size()), dims.data(), nullptr), "H5Screate_simple");
      h5::Handle dset(H5Dcreate2(group, p.name.c_str(), H5T_IEEE_F32LE, space, H5P_DEFAULT, dcpl, H5P_DEFAULT),
                      "H5Dcreate2");
      h5::write_attr(dset, "crc32", int64_t(crcs[g * size_t(reg.size()) + size_t(id)]));
      h5::write_attr(dset, "kind", std::string(param_kind_name(p.kind)));
      // Every rank keeps every dataset open until the end, in the same order (their closing
      // takes part in the collective flush); the ones this rank writes rows of carry them.
      Write w{std::move(dset), nullptr, nullptr, RowPiece{}};
      if (piece_of[size_t(id)] >= 0) {
        const TensorPiece& t = groups[g].pieces->pieces[size_t(piece_of[size_t(id)])];
        w.rows = t.written();
        if (w.rows.rows > 0 && w.rows.elems() > 0) {
          w.piece = &t;
          w.src = base + t.at + w.rows.elem_begin();
        }
      }
      writes.push_back(std::move(w));
    }
  }
  write_json_group(file, "scheduler", state.scheduler);
  write_json_group(file, "rng", state.rng);
  write_json_group(file, "data", state.data);
  write_json_group(file, "layout", state.layout);
  if (state.environment.is_object()) write_json_group(file, "environment", state.environment);
  if (state.loss_scaler.is_object()) write_json_group(file, "loss_scaler", state.loss_scaler);
  h5::Handle config = h5::create_string_dataset(file, "config", config_text.size());
  // Every attribute is written above: the seal covers all of them.
  const std::string manifest = manifest_of(metadata_fields(file, {{"/config", config_text}}));
  h5::Handle manifest_dset = h5::create_string_dataset(file, kManifest, manifest.size());
  h5::write_attr(file, kManifestCrc, int64_t(crc32_of(manifest.data(), manifest.size(), 1)));
  // Where nothing could be reserved, HDF5 may fail this collective flush on some ranks only
  // and wait forever on the others: the watchdog ends that, naming the full disk.
  errno = 0;
  record(failed, H5Fflush(file, H5F_SCOPE_GLOBAL), "H5Fflush(metadata)", path);

  // Raw data: each rank its own rows, independently, so that a failure (a full disk) stays
  // on its rank until all agree on it below.
  h5::Handle xfer = h5::transfer_plist(/*collective=*/false);
  for (Write& w : writes) {
    if (!w.piece || !failed.error.empty()) continue;
    h5::Handle space(H5Dget_space(w.dset), "H5Dget_space");
    auto [fsel, msel] = selections(space, *w.piece, w.rows);
    errno = 0;
    record(failed, H5Dwrite(w.dset, H5T_NATIVE_FLOAT, msel, fsel, xfer, w.src), "H5Dwrite(tensor rows)", path);
  }
  if (rank == 0) {
    errno = 0;
    record(failed, h5::write_string(config, config_text), "H5Dwrite(/config)", path);
    errno = 0;
    record(failed, h5::write_string(manifest_dset, manifest), "H5Dwrite(/metadata_checksums)", path);
  }
  writes.clear();
  config.close();
  manifest_dset.close();
  failed = agree_on_failure(comm, failed);
  if (!failed.error.empty()) abandon();
  try {
    errno = 0;
    file.close();  // flushes; collective
  } catch (const Error& e) {
    failed = {e.what(), errno};
    if (failed.err_no != ENOSPC && failed.err_no != EDQUOT && failed.err_no != EFBIG && nearly_full(path)) {
      failed.err_no = ENOSPC;
    }
  }
  // A write-back that fails shows up here on some file systems (NFS): complete on disk, or
  // not a checkpoint.
  if (rank == 0 && failed.error.empty()) {
    // The reservation beyond the file's end (HDF5 extends files, never shrinks them) is
    // given back.
    hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    haddr_t eoa = 0;
    if (f >= 0 && H5Fget_eoa(f, &eoa) >= 0 && eoa > 0 && int64_t(eoa) < reserved) {
      if (::truncate(path.c_str(), off_t(eoa)) != 0) log::warn("could not trim {}: {}", path, std::strerror(errno));
    }
    if (f >= 0) H5Fclose(f);
    H5Eclear2(H5E_DEFAULT);
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd < 0 || ::fsync(fd) != 0) failed = {fmt::format("fsync: {}", std::strerror(errno)), errno};
    if (fd >= 0) ::close(fd);
  }
  failed = agree_on_failure(comm, failed);
  if (!failed.error.empty()) {
    if (rank == 0) ::unlink(path.c_str());
    MPI_Barrier(comm);
    raise_write_failure(path, failed);
  }
}

TrainState read_checkpoint(const std::string& path, MPI_Comm comm, ParamRegistry& reg, float* exp_avg,
                           float* exp_avg_sq) {
  CheckpointTargets whole;
  whole.values = reg.values().data<float>();
  whole.exp_avg = exp_avg;
  whole.exp_avg_sq = exp_avg_sq;
  return read_checkpoint(path, comm, reg, whole);
}

TrainState read_checkpoint(const std::string& path, MPI_Comm comm, ParamRegistry& reg, const CheckpointTargets& into) {
  std::lock_guard lock(h5::hdf5_lock());
  int rank = 0, n = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &n);
  DS_CHECK((into.exp_avg == nullptr) == (into.exp_avg_sq == nullptr), "checkpoint: read both AdamW moments or neither");
  const std::shared_ptr<const ShardedState> pieces = pieces_or_whole(reg, into.pieces, rank, n);
  const std::vector<GroupIo> groups =
      group_list(comm, reg, into.values, into.exp_avg, into.exp_avg_sq, pieces, into.extra, into.verify);

  // Opening is collective and fails alike on every rank (a truncated or foreign file).
  std::string error;
  h5::Handle file;
  try {
    file = h5::open_file(path, comm);
  } catch (const Error& e) {
    error = e.what();
  }
  throw_if_any_rank_failed(comm, error);

  TrainState st;
  bool unsealed = false;
  std::string written_by;
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
    written_by = h5::has_attr(file, "dstrain_version") ? h5::read_attr_string(file, "dstrain_version") : "?";
    st.step = h5::read_attr_int(file, "step");
    st.consumed_samples = h5::read_attr_int(file, "consumed_samples");
    st.consumed_tokens = h5::read_attr_int(file, "consumed_tokens");
    {
      h5::Handle opt = h5::open_group(file, "optimizer");
      st.optimizer_steps = h5::read_attr_int(opt, "step");
    }
    // One rank reads every attribute back and checks it against its checksum before anything
    // is interpreted (a damaged field is reported as damaged, not as whatever it now parses
    // to); its verdict reaches all below.
    const MetadataReport meta = rank == 0 ? verify_metadata(file) : MetadataReport{};
    std::vector<std::string> problems = meta.problems;
    if (problems.empty()) {
      read_json_fields(file, path, st, problems);
      for (std::string& c : consistency_problems(st)) problems.push_back(std::move(c));
    }
    if (!problems.empty()) {
      throw Error(fmt::format("its metadata fails verification:{}\n  the file was altered or damaged after it was "
                              "written; resume from another checkpoint",
                              list_problems(problems)));
    }
    unsealed = rank == 0 && !meta.sealed;
    h5::Handle xfer = h5::transfer_plist(/*collective=*/false);
    for (size_t g = 0; g < groups.size(); ++g) {
      float* base = groups[g].data;
      const std::vector<int>& piece_of = groups[g].piece_of;
      DS_CHECK(h5::exists(file, groups[g].path), "'{}' has no /{} group: {}", path, groups[g].path,
               g < 3 ? "it holds no optimizer state to resume from"
                     : "it was written by a run without this state (train.gradient_sync)");
      h5::Handle group = h5::open_group(file, groups[g].path);
      for (int id = 0; id < reg.size(); ++id) {
        const ParamInfo& p = reg.info(id);
        const std::string where = fmt::format("/{}/{}", groups[g].path, p.name);
        DS_CHECK(h5::exists(group, p.name), "'{}' has no tensor {}: was it written for another model?", path, where);
        h5::Handle dset(H5Dopen2(group, p.name.c_str(), H5P_DEFAULT), "H5Dopen2");
        const Shape shape = h5::dataset_shape(dset);
        DS_CHECK(shape == p.global_shape, "'{}': {} has shape {} but the model expects {}; check the model config",
                 path, where, shape.str(), p.global_shape.str());
        stored.push_back(uint32_t(h5::read_attr_int(dset, "crc32")));
        names.push_back(where);
        if (piece_of[size_t(id)] < 0) continue;
        // The whole block: every replica reads what it holds.
        const TensorPiece& t = groups[g].pieces->pieces[size_t(piece_of[size_t(id)])];
        h5::Handle space(H5Dget_space(dset), "H5Dget_space");
        auto [fsel, msel] = selections(space, t, row_piece(t.shape, 0, 1));
        DS_H5_CHECK(H5Dread(dset, H5T_NATIVE_FLOAT, msel, fsel, xfer, base + t.at));
      }
    }
  } catch (const std::exception& e) {  // an Error, or a library's exception on a damaged field
    error = fmt::format("checkpoint '{}' cannot be read: {}", path, e.what());
  }
  throw_if_any_rank_failed(comm, error);
  file.close();
  if (unsealed && rank == 0) {
    log::info("note: '{}' was written by dstrain {}, before checkpoints sealed their metadata: its step, data "
              "position and optimizer state counters are unverified (the tensors are verified)",
              path, written_by);
  }

  // The checksums over the rows each rank would write.
  const std::vector<uint32_t> crcs = tensor_crcs(comm, reg, groups, 0);
  std::vector<std::string> bad;
  for (size_t k = 0; k < stored.size(); ++k) {
    if (crcs[k] != stored[k]) bad.push_back(names[k]);
  }
  if (!bad.empty()) {
    std::string list;
    for (size_t i = 0; i < std::min<size_t>(bad.size(), 5); ++i) list += "\n    " + bad[i];
    throw Error(fmt::format("checkpoint '{}' is corrupt: {} tensor(s) fail their crc32 checksum:{}{}", path,
                            bad.size(), list, bad.size() > 5 ? fmt::format("\n    and {} more", bad.size() - 5) : ""));
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
  // Verified before it is interpreted: a damaged field shows as a problem, and what can be
  // read of the rest is still shown.
  const MetadataReport meta = verify_metadata(file);
  info.metadata_sealed = meta.sealed;
  info.metadata_fields = meta.fields;
  info.metadata_problems = meta.problems;
  read_json_fields(file, path, st, info.metadata_problems);
  for (std::string& c : consistency_problems(st)) info.metadata_problems.push_back(std::move(c));
  std::vector<float> buf;
  std::vector<std::string> gnames(std::begin(kGroups), std::end(kGroups));
  // Asynchronous aggregation's state (train.gradient_sync): every group under /gradient_sync.
  std::function<void(const std::string&)> walk = [&](const std::string& at) {
    h5::Handle g = h5::open_group(file, at);
    for (const std::string& m : h5::list_members(g)) {
      if (!h5::is_group(g, m)) continue;
      gnames.push_back(at + "/" + m);
      walk(at + "/" + m);
    }
  };
  if (h5::exists(file, "gradient_sync")) walk("gradient_sync");
  for (const std::string& gname : gnames) {
    if (!h5::exists(file, gname)) continue;
    h5::Handle group = h5::open_group(file, gname);
    for (const std::string& name : h5::list_members(group)) {
      if (h5::is_group(group, name)) continue;
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
