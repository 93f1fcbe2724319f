#include "comm/environment.h"

#include <cblas.h>
#include <dnnl.h>
#include <hdf5.h>
#include <mpi.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/version.h"

namespace dstrain {
namespace {

#if defined(__clang__)
constexpr const char* kCompilerName = "Clang";
#elif defined(__GNUC__)
constexpr const char* kCompilerName = "GCC";
#else
constexpr const char* kCompilerName = "unknown compiler";
#endif

// The CPU flags that decide which kernels BLAS and the compiler's vector code can use.
const std::set<std::string>& kernel_features() {
  static const std::set<std::string> f = {
      "sse4_2",   "avx",         "avx2",        "fma",         "f16c",     "avx512f",  "avx512dq", "avx512bw",
      "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
      "asimd",    "asimdhp",     "sve",         "sve2",        "bf16",     "i8mm"};
  return f;
}

// OpenBLAS cores whose sgemm kernels use AVX2 and FMA (lower case). A DYNAMIC_ARCH OpenBLAS that
// does not recognise a CPU model (common under virtual machines that hide it) falls back to
// SSE kernels such as Prescott's, several times slower on a CPU that has AVX2.
bool avx2_kernels(std::string core) {
  std::transform(core.begin(), core.end(), core.begin(), ::tolower);
  static const std::set<std::string> cores = {"haswell", "skylakex", "cooperlake", "sapphirerapids", "zen"};
  return cores.count(core) > 0;
}

bool has(const std::vector<std::string>& features, const char* f) {
  return std::find(features.begin(), features.end(), f) != features.end();
}

std::string trim(std::string s) {
  const auto sp = [](unsigned char c) { return std::isspace(c) != 0; };
  while (!s.empty() && sp((unsigned char)s.back())) s.pop_back();
  size_t i = 0;
  while (i < s.size() && sp((unsigned char)s[i])) ++i;
  return s.substr(i);
}

void read_cpuinfo(Environment& e) {
  std::ifstream in("/proc/cpuinfo");
  std::string line, implementer, part;
  bool have_flags = false;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = trim(line.substr(0, colon)), value = trim(line.substr(colon + 1));
    if (key == "model name" && e.cpu_model.empty()) e.cpu_model = value;
    if (key == "CPU implementer" && implementer.empty()) implementer = value;
    if (key == "CPU part" && part.empty()) part = value;
    if ((key == "flags" || key == "Features") && !have_flags) {
      have_flags = true;
      std::istringstream words(value);
      for (std::string w; words >> w;) {
        if (kernel_features().count(w)) e.cpu_features.push_back(w);
      }
    }
  }
  if (e.cpu_model.empty() && !implementer.empty()) e.cpu_model = "CPU implementer " + implementer + " part " + part;
  if (e.cpu_model.empty()) e.cpu_model = "unknown";
  std::sort(e.cpu_features.begin(), e.cpu_features.end());
}

std::string joined(const std::vector<std::string>& v, const char* sep = " ") {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : sep) + s;
  return out;
}

// "rank 0 (node1), rank 2 (node1)": the ranks of one group, the first few by name.
std::string ranks_on_hosts(const std::vector<int>& ranks, const std::vector<Environment>& all) {
  constexpr size_t kShown = 8;
  std::string out;
  for (size_t i = 0; i < ranks.size() && i < kShown; ++i) {
    out += fmt::format("{}rank {} ({})", i ? ", " : "", ranks[i], all[size_t(ranks[i])].host);
  }
  if (ranks.size() > kShown) out += fmt::format(" and {} more", ranks.size() - kShown);
  return out;
}

// For a value that differs between ranks: each value with the ranks that have it, in rank
// order of first appearance; empty when every rank agrees.
template <class Value>
std::string differences(const std::vector<Environment>& all, Value value) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t r = 0; r < all.size(); ++r) {
    const std::string v = value(all[r]);
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == v; });
    if (it == groups.end()) {
      groups.push_back({v, {}});
      it = groups.end() - 1;
    }
    it->second.push_back(int(r));
  }
  if (groups.size() < 2) return {};
  std::string out;
  for (const auto& [v, ranks] : groups) out += fmt::format("\n    \"{}\" on {}", v, ranks_on_hosts(ranks, all));
  return out;
}

std::string cpu_description(const Environment& e) {
  return fmt::format("{} ({}; OpenBLAS kernels {})", e.cpu_model,
                     e.cpu_features.empty() ? "no vector extensions seen" : joined(e.cpu_features), e.blas_kernels);
}

}  // namespace

json Environment::to_json() const {
  return {{"host", host},
          {"dstrain_version", dstrain_version},
          {"commit", commit},
          {"compiler", compiler},
          {"mpi", mpi},
          {"hdf5", hdf5},
          {"blas", blas},
          {"gemm", gemm},
          {"omp_threads", omp_threads},
          {"cpu_model", cpu_model},
          {"cpu_features", joined(cpu_features)},
          {"blas_kernels", blas_kernels}};
}

Environment Environment::from_json(const json& j) {
  Environment e;
  e.host = j.at("host");
  e.dstrain_version = j.at("dstrain_version");
  e.commit = j.at("commit");
  e.compiler = j.at("compiler");
  e.mpi = j.at("mpi");
  e.hdf5 = j.at("hdf5");
  e.blas = j.at("blas");
  e.gemm = j.value("gemm", std::string());  // absent from checkpoints of earlier versions
  e.omp_threads = j.at("omp_threads");
  e.cpu_model = j.at("cpu_model");
  std::istringstream words(j.at("cpu_features").get<std::string>());
  for (std::string w; words >> w;) e.cpu_features.push_back(w);
  e.blas_kernels = j.at("blas_kernels");
  return e;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return "unknown-host";
  return buf;
}

Environment local_environment() {
  Environment e;
  e.host = host_name();
  e.dstrain_version = DSTRAIN_VERSION;
  e.commit = DSTRAIN_GIT_COMMIT;
  e.compiler = fmt::format("{} {}", kCompilerName, __VERSION__);
  char mpi[MPI_MAX_LIBRARY_VERSION_STRING] = {};
  int len = 0;
  DS_CHECK(MPI_Get_library_version(mpi, &len) == MPI_SUCCESS, "MPI_Get_library_version failed");
  // Open MPI's string runs over lines (build details); the first names the library and release.
  const std::string library(mpi);
  e.mpi = trim(library.substr(0, library.find('\n')));
  unsigned major = 0, minor = 0, release = 0;
  DS_CHECK(H5get_libversion(&major, &minor, &release) >= 0, "H5get_libversion failed");
  e.hdf5 = fmt::format("{}.{}.{}", major, minor, release);
  e.blas_kernels = openblas_get_corename();
  // A DYNAMIC_ARCH OpenBLAS names the core it chose in its configuration: that part depends
  // on the CPU, not on the library, and is compared with the CPU.
  std::istringstream words(openblas_get_config());
  std::vector<std::string> config;
  for (std::string w; words >> w;) {
    std::string lower = w, core = e.blas_kernels;
    std::transform(lower.begin(), lower.end(), lower.begin(), ::tolower);
    std::transform(core.begin(), core.end(), core.begin(), ::tolower);
    if (lower != core) config.push_back(w);
  }
  e.blas = joined(config);
  // The fp32 GEMMs' path (backend/cpu/sgemm.h: dstrain's split over oneDNN and OpenBLAS, or one
  // library's own threading, as DSTRAIN_CPU_SGEMM says) and oneDNN's version change the bits.
  const dnnl_version_t* dnnl = dnnl_version();
  const char* choice = std::getenv("DSTRAIN_CPU_SGEMM");
  e.gemm = fmt::format("oneDNN {}.{}.{}, DSTRAIN_CPU_SGEMM {}", dnnl->major, dnnl->minor, dnnl->patch,
                       choice ? fmt::format("'{}'", choice) : std::string("unset"));
  e.omp_threads = omp_get_max_threads();
  read_cpuinfo(e);
  return e;
}

JobEnvironment check_same_environment(Communicator& world, const Environment& mine) {
  // Every rank's environment, as JSON text.
  const int n = world.size();
  std::vector<Environment> all;
  for (const std::string& text : all_gather_strings(world, mine.to_json().dump())) {
    all.push_back(Environment::from_json(json::parse(text)));
  }

  // The same build and libraries everywhere: every rank reaches the same verdict from the
  // same gathered values, so every rank throws the same error and none waits on the others.
  struct Field {
    const char* what;
    std::string Environment::*member;
  };
  const Field build[] = {{"dstrain version", &Environment::dstrain_version},
                         {"dstrain commit", &Environment::commit},
                         {"compiler", &Environment::compiler},
                         {"MPI library", &Environment::mpi},
                         {"HDF5 library", &Environment::hdf5},
                         {"BLAS library", &Environment::blas},
                         {"GEMM library", &Environment::gemm}};
  std::string errors;
  for (const Field& f : build) {
    const std::string d = differences(all, [&](const Environment& e) { return e.*(f.member); });
    if (!d.empty()) errors += fmt::format("\n  {}:{}", f.what, d);
  }
  DS_CHECK(errors.empty(),
           "ranks run different builds or library versions, which would compute differently or fail mid-run:{}\nrun "
           "one dstrain build with the same MPI, HDF5 and BLAS libraries on every node (the same modules or "
           "container in the job script)",
           errors);

  JobEnvironment job;
  const std::string cpus = differences(all, cpu_description);
  if (!cpus.empty()) {
    job.warnings.push_back(fmt::format(
        "ranks run on different CPUs or CPU features, so BLAS runs different kernels and the slowest rank sets "
        "the pace (results may differ in the last bits between ranks):{}",
        cpus));
  }
  const std::string threads = differences(all, [](const Environment& e) { return std::to_string(e.omp_threads); });
  if (!threads.empty()) {
    job.warnings.push_back(
        fmt::format("ranks run different OpenMP thread counts, and the rank with the fewest sets the pace:{}\nset "
                    "OMP_NUM_THREADS (or Slurm's --cpus-per-task) the same for every rank",
                    threads));
  }
  std::vector<int> slow;
  for (size_t r = 0; r < all.size(); ++r) {
    const Environment& e = all[r];
    const bool avx2 = has(e.cpu_features, "avx2") && has(e.cpu_features, "fma");
    if (avx2 && !avx2_kernels(e.blas_kernels)) slow.push_back(int(r));
  }
  if (!slow.empty()) {
    const Environment& e = all[size_t(slow[0])];
    const bool avx512 = has(e.cpu_features, "avx512f");
    job.warnings.push_back(fmt::format(
        "OpenBLAS runs {} kernels, without AVX2, on a CPU with avx2 and fma{} ({}), so its sgemm runs several "
        "times slower than the CPU allows: it does not recognise the CPU model \"{}\" (or OPENBLAS_CORETYPE asked "
        "for them); set OPENBLAS_CORETYPE={} in the job's environment",
        e.blas_kernels, avx512 ? " and avx512f" : "",
        slow.size() == all.size() ? std::string("every rank") : ranks_on_hosts(slow, all), e.cpu_model,
        avx512 ? "SkylakeX (or Haswell)" : "Haswell"));
  }
  std::vector<std::string> hosts;
  for (const Environment& e : all) {
    if (std::find(hosts.begin(), hosts.end(), e.host) == hosts.end()) hosts.push_back(e.host);
  }
  job.record = all[0].to_json();
  job.record.erase("host");
  job.record["world_size"] = n;
  // A few names say where the job ran; thousands would not fit an HDF5 attribute.
  constexpr size_t kHostsNamed = 16;
  const size_t more = hosts.size() > kHostsNamed ? hosts.size() - kHostsNamed : 0;
  hosts.resize(hosts.size() - more);
  job.record["hosts"] = joined(hosts) + (more ? fmt::format(" and {} more", more) : std::string());
  job.record["warnings"] = joined(job.warnings, "\n");
  return job;
}

}  // namespace dstrain
