// A libFuzzer-free driver for a fuzz target, so that ctest exercises the targets in the normal
// build (gcc, AddressSanitizer and UndefinedBehaviorSanitizer, no coverage guidance): every
// seed as is, then random mutations of the seeds for a fixed time. The mutation stream comes
// from a fixed seed, so a run repeats the same inputs; only how far it gets depends on speed.
//   fuzz_smoke_<target> SECONDS [-dict=FILE] SEED_FILE_OR_DIR...
// A crash, a sanitizer report or an exception the target does not expect ends the run; the
// input is then in fuzz_smoke_<target>.crash in the working directory (replay it with the
// libFuzzer build, or with this driver and 0 seconds).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

// Sanitizer reports end in abort(), whose handler below saves the input. (A death callback
// would not do: gcc links ASan and UBSan as two runtimes, and UBSan's does not call ASan's.)
extern "C" const char* __asan_default_options() { return "abort_on_error=1"; }
extern "C" const char* __ubsan_default_options() { return "print_stacktrace=1:abort_on_error=1"; }

namespace {

using Bytes = std::vector<uint8_t>;

// The input under test, for the crash handlers (which may only make async-signal-safe calls).
const Bytes* g_current = nullptr;
std::string g_crash_file;

void save_current() {
  if (g_current == nullptr) return;
  const int fd = ::open(g_crash_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  const ssize_t n = ::write(fd, g_current->data(), g_current->size());
  (void)n;
  ::close(fd);
  const char msg[] = "fuzz smoke: the input that failed is in ";
  (void)!::write(2, msg, sizeof(msg) - 1);
  (void)!::write(2, g_crash_file.c_str(), g_crash_file.size());
  (void)!::write(2, "\n", 1);
}

void on_signal(int sig) {
  save_current();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

Bytes read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// libFuzzer's dictionary format: one "quoted string" a line, with \\, \" and \xHH escapes.
std::vector<Bytes> read_dict(const std::string& path) {
  std::vector<Bytes> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const size_t a = line.find('"'), b = line.rfind('"');
    if (line.empty() || line[0] == '#' || a == std::string::npos || b <= a) continue;
    Bytes word;
    for (size_t i = a + 1; i < b; ++i) {
      if (line[i] == '\\' && i + 1 < b) {
        if (line[i + 1] == 'x' && i + 3 < b) {
          word.push_back(uint8_t(std::stoi(line.substr(i + 2, 2), nullptr, 16)));
          i += 3;
        } else {
          word.push_back(uint8_t(line[++i]));
        }
      } else {
        word.push_back(uint8_t(line[i]));
      }
    }
    out.push_back(word);
  }
  return out;
}

Bytes mutate(const std::vector<Bytes>& seeds, const std::vector<Bytes>& dict, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return n == 0 ? size_t(0) : size_t(rng() % n); };
  Bytes x = seeds[pick(seeds.size())];
  static const uint8_t interesting[] = {0, 1, 0x7f, 0x80, 0xff, '0', '9', '"', '\\', '{', '}', '[', ']', ',', ':', '-'};
  // Mostly few edits that keep the size: binary formats (an .idx) are rejected early when
  // their size changes, so that is how inputs get past the first checks.
  const int edits = 1 + int(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t at = pick(x.size() + 1);
    switch (rng() % 10) {
      case 0:
      case 1:
      case 2:  // flip a bit
        if (!x.empty()) x[pick(x.size())] ^= uint8_t(1u << (rng() % 8));
        break;
      case 3:
      case 4:  // an interesting byte
        if (!x.empty()) x[pick(x.size())] = interesting[pick(sizeof(interesting))];
        break;
      case 5:  // a random byte inserted
        x.insert(x.begin() + std::ptrdiff_t(at), uint8_t(rng()));
        break;
      case 6: {  // erase a range
        const size_t n = std::min(x.size() - std::min(at, x.size()), size_t(1 + rng() % 16));
        x.erase(x.begin() + std::ptrdiff_t(at), x.begin() + std::ptrdiff_t(at + n));
        break;
      }
      case 7: {  // duplicate a range
        if (x.empty()) break;
        const size_t from = pick(x.size()), n = std::min(x.size() - from, size_t(1 + rng() % 64));
        const Bytes chunk(x.begin() + std::ptrdiff_t(from), x.begin() + std::ptrdiff_t(from + n));
        x.insert(x.begin() + std::ptrdiff_t(at), chunk.begin(), chunk.end());
        break;
      }
      case 8: {  // splice in part of another seed
        const Bytes& other = seeds[pick(seeds.size())];
        if (other.empty()) break;
        const size_t from = pick(other.size()), n = std::min(other.size() - from, size_t(1 + rng() % 256));
        x.insert(x.begin() + std::ptrdiff_t(at), other.begin() + std::ptrdiff_t(from),
                 other.begin() + std::ptrdiff_t(from + n));
        break;
      }
      default:  // a dictionary word
        if (!dict.empty()) {
          const Bytes& w = dict[pick(dict.size())];
          x.insert(x.begin() + std::ptrdiff_t(at), w.begin(), w.end());
        }
    }
  }
  if (x.size() > 16384) x.resize(16384);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s SECONDS [-dict=FILE] SEED_FILE_OR_DIR...\n", argv[0]);
    return 2;
  }
  const double seconds = std::stod(argv[1]);
  g_crash_file = std::filesystem::path(argv[0]).filename().string() + ".crash";
  std::vector<Bytes> seeds, dict;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("-dict=", 0) == 0) {
      dict = read_dict(arg.substr(6));
      continue;
    }
    if (std::filesystem::is_directory(arg)) {
      for (const auto& e : std::filesystem::recursive_directory_iterator(arg))
        if (e.is_regular_file()) seeds.push_back(read_file(e.path()));
    } else {
      seeds.push_back(read_file(arg));
    }
  }
  if (seeds.empty()) {
    std::fprintf(stderr, "fuzz smoke: no seed inputs\n");
    return 2;
  }
  for (int sig : {SIGSEGV, SIGABRT, SIGFPE, SIGBUS, SIGILL}) std::signal(sig, on_signal);
  std::set_terminate([] {
    save_current();
    std::abort();
  });

  for (const Bytes& s : seeds) {
    g_current = &s;
    LLVMFuzzerTestOneInput(s.data(), s.size());
  }
  std::mt19937_64 rng(20240501);
  const auto start = std::chrono::steady_clock::now();
  int64_t runs = int64_t(seeds.size());
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds) {
    const Bytes x = mutate(seeds, dict, rng);
    g_current = &x;
    LLVMFuzzerTestOneInput(x.data(), x.size());
    ++runs;
  }
  g_current = nullptr;
  std::printf("fuzz smoke: %zu seeds and %lld inputs in all, no failure\n", seeds.size(), static_cast<long long>(runs));
  return 0;
}
