// libFuzzer target for the Megatron .idx reader: after 4 parameter bytes, the input becomes
// PREFIX.idx next to a .bin of the size the index implies; IndexedDataset and GPTDataset read what opens.
// A dstrain::Error is the expected answer to a bad file; anything else (a crash, a sanitizer
// report, another exception type) is a bug.
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"

namespace {

constexpr uint64_t kMaxBinBytes = uint64_t(1) << 16;  // keeps shuffles small: thousands of runs a second

// One directory per fuzzing process (libFuzzer -jobs/-fork run several), removed at exit.
class FuzzDir {
 public:
  FuzzDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "dstrain_fuzz_idx_XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) std::abort();
    path_ = templ;
  }
  ~FuzzDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

void write_file(const std::string& path, const uint8_t* data, size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size > 0 && std::fwrite(data, 1, size, f) != size) std::abort();
  if (std::fclose(f) != 0) std::abort();
}

template <class T>
T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// The .bin size the index claims (last pointer + last length * itemsize) when the input holds
// that much and it is small, so most inputs get past the size check to the deeper ones; else
// a size picked from the input.
uint64_t bin_bytes_for(const uint8_t* data, size_t size) {
  if (size < size_t(dstrain::kIdxHeaderBytes)) return size % 64;
  const uint64_t itemsize = uint64_t(std::max(dstrain::indexed_dtype_size(data[dstrain::kIdxDtypeOffset]), 1));
  const uint64_t S = load<uint64_t>(data + dstrain::kIdxSequenceCountOffset);
  const uint64_t body = size - uint64_t(dstrain::kIdxHeaderBytes);
  if (S == 0 || S > body / 12) return data[size - 1] % 64;
  const uint8_t* lengths = data + dstrain::kIdxHeaderBytes;
  const uint8_t* pointers = lengths + 4 * S;
  const uint64_t last_length = uint64_t(int64_t(load<int32_t>(lengths + 4 * (S - 1))));
  const uint64_t last_pointer = load<uint64_t>(pointers + 8 * (S - 1));
  const uint64_t end = last_pointer + last_length * itemsize;  // wraps harmlessly for garbage
  return end <= kMaxBinBytes ? end : end % 4096;
}

// The input's first bytes: every byte of a valid .idx is constrained, so the choices the
// reader does not make (T, vocabulary, shuffle, seed, .bin contents) get bytes of their own.
struct Params {
  int64_t seq_len;   // T in [1, 32]
  int64_t vocab;     // 256 (so uint16 data has ids outside it) or 65536
  bool shuffle;
  uint64_t seed;     // also picks the split weights
  uint8_t bin_salt;  // varies the .bin's bytes
  int bin_mode;      // 0, 1: the size the index implies; 2: that less some bytes; 3: that plus some
};
constexpr size_t kParamBytes = 4;

Params params_of(const uint8_t* p) {
  return {1 + p[0] % 32, p[1] & 2 ? 256 : 65536, (p[1] & 1) != 0, p[2], p[3], (p[1] >> 2) & 3};
}

// Reads some of everything an opened dataset offers, as the trainer would.
void exercise(const std::shared_ptr<const dstrain::IndexedDataset>& ds, const Params& params) {
  std::vector<int32_t> out(4096);
  for (int64_t s = 0; s < std::min<int64_t>(ds->num_sequences(), 4); ++s) {
    const int64_t n = std::min<int64_t>(ds->sequence_length(s), int64_t(out.size()));
    ds->read(s, 0, n, out.data());
    if (n > 1) ds->read(s, n / 2, n - n / 2, out.data());
  }
  for (int64_t d = 0; d < std::min<int64_t>(ds->num_documents(), 4); ++d) {
    const auto [first, last] = ds->document_tokens(d);
    ds->read_flat(first, std::min<int64_t>(last - first, int64_t(out.size())), out.data());
  }
  if (ds->num_documents() == 0) return;
  // GPT views over the two parts of a split and over all documents.
  const std::vector<double> weights = {double(params.seed % 101), double(100 - params.seed % 101)};
  for (const auto& [begin, end] : {dstrain::split_range(ds->num_documents(), weights, 0),
                                   dstrain::split_range(ds->num_documents(), weights, 1),
                                   std::pair<int64_t, int64_t>(0, ds->num_documents())}) {
    try {
      const dstrain::GPTDataset gpt(ds, begin, end, params.seq_len, params.vocab, params.shuffle, params.seed);
      if (gpt.describe().empty() || gpt.files().size() != 2) std::abort();
      const int64_t spe = gpt.samples_per_epoch();
      for (int64_t i : {int64_t(0), spe - 1, spe, 2 * spe + spe / 2, 5 * spe + 1}) gpt.read_sample(i, out.data());
    } catch (const dstrain::Error&) {
      // Too few tokens for one sample, or a token outside the vocabulary.
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* input, size_t input_size) {
  static const FuzzDir dir;
  if (input_size < kParamBytes) return 0;
  const Params params = params_of(input);
  const uint8_t* data = input + kParamBytes;  // the .idx
  const size_t size = input_size - kParamBytes;
  const std::string prefix = dir.path() + "/f";
  write_file(prefix + ".idx", data, size);
  // Items whose low byte varies with the salt and position; their high bytes are zero (valid
  // ids) unless the salt's top bit asks for garbage (negative or huge ids).
  const int code_size =
      size > size_t(dstrain::kIdxDtypeOffset) ? dstrain::indexed_dtype_size(data[dstrain::kIdxDtypeOffset]) : 1;
  const size_t itemsize = size_t(std::max(code_size, 1));
  // A .bin a little short or long of what the index implies must be rejected, never read
  // past: the shortfall reaches across pages so that a read past the mapping faults.
  const uint64_t implied = bin_bytes_for(data, size);
  const uint64_t delta = 1 + uint64_t(params.bin_salt) * 67;
  const uint64_t bin_bytes = params.bin_mode == 2 ? implied - std::min(implied, delta)
                             : params.bin_mode == 3 ? implied + delta
                                                    : implied;
  std::vector<uint8_t> bin(bin_bytes);
  for (size_t k = 0; k < bin.size(); ++k) {
    const bool low = k % itemsize == 0;
    bin[k] = low || (params.bin_salt & 0x80) ? uint8_t(params.bin_salt * (k % 7) + k / 3) : 0;
  }
  write_file(prefix + ".bin", bin.data(), bin.size());
  try {
    const auto ds = std::make_shared<const dstrain::IndexedDataset>(prefix);
    exercise(ds, params);
  } catch (const dstrain::Error&) {
    // A rejected file or an out-of-vocabulary token: the answer the reader should give.
  }
  return 0;
}
