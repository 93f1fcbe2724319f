// 16-bit GEMMs of the CPU backend (see gemm16.h).
//
// Why these two paths (measured with validation/gemm_ceiling on an AVX2-only AMD EPYC, and from
// the libraries' documentation for the others):
// - oneDNN (libdnnl, Debian 2.6) implements bf16 matmul only from AVX-512 up: natively with
//   vdpbf16ps on AVX-512 BF16 (Cooper Lake, Zen 4) and with AMX tiles on Sapphire Rapids, by
//   emulation on plain AVX-512; on an AVX2 CPU it refuses to create the primitive. It takes all
//   three layouts of a linear layer through strides, writes fp32 or bf16, accumulates into the
//   output with a sum post-op and threads with OpenMP like the rest of dstrain: on CPUs with
//   hardware bf16 it is the bf16 path.
// - libxsmm (Debian 1.17) JITs bf16 kernels only for AVX-512 (none on AVX2: the dispatch returns
//   NULL and its batch interface fails), for small column-major blocks that we would have to tile
//   and thread ourselves, with the A operand in its VNNI-packed layout and no transposed bf16 case:
//   not used.
// - Without hardware bf16 the fastest correct product is the fp32 sgemm (sgemm.h): widening a bf16
//   or f16 operand to fp32 is exact and costs one pass over it, small beside the O(mnk) product, so
//   the 16-bit GEMMs run at nearly the fp32 speed (and fp32 accumulation is what the contract asks).
#include "backend/cpu/gemm16.h"

#include <cpuid.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include <dnnl.hpp>

#include "backend/cpu/convert16.h"
#include "backend/cpu/sgemm.h"
#include "core/error.h"
#include "core/log.h"

namespace dstrain::cpu {
namespace {

bool is16(DType t) { return t == DType::BF16 || t == DType::F16; }

void check_float(DType t, const char* what) {
  DS_CHECK(t == DType::F32 || is16(t), "gemm: {} is {}, expected F32, BF16 or F16", what, dtype_name(t));
}

const void* advance(const void* p, DType t, int64_t elements) {
  return static_cast<const char*>(p) + elements * int64_t(dtype_size(t));
}
void* advance(void* p, DType t, int64_t elements) { return static_cast<char*>(p) + elements * int64_t(dtype_size(t)); }

// Per-thread scratch, grown when a call needs more and then kept: no allocation per call. Plain
// aligned host memory rather than a Buffer: a Buffer's allocator may be gone (Kokkos finalised)
// by the time the main thread's thread_local objects are destroyed.
enum Slot { kSlotA, kSlotB, kSlotC, kSlotDout, kSlotPad, kSlots };
struct Scratch {
  struct Block {
    void* data = nullptr;
    int64_t bytes = 0;
  };
  std::array<Block, kSlots> blocks;
  ~Scratch() {
    for (Block& b : blocks) std::free(b.data);
  }
};
void* scratch(int slot, int64_t bytes) {
  thread_local Scratch s;
  Scratch::Block& b = s.blocks[size_t(slot)];
  if (b.bytes < bytes) {
    const int64_t grown = std::max(bytes, b.bytes * 3 / 2);
    const int64_t rounded = (grown + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, size_t(rounded));
    DS_CHECK(p != nullptr, "16-bit GEMM: cannot allocate {} bytes of scratch", rounded);
    std::free(b.data);
    b = {p, rounded};
  }
  return b.data;
}

void widen(const void* src, DType t, float* dst, int64_t n) {
  if (t == DType::BF16) {
    bulk_bf16_to_f32(static_cast<const uint16_t*>(src), dst, n);
  } else if (t == DType::F16) {
    bulk_f16_to_f32(static_cast<const uint16_t*>(src), dst, n);
  } else {
    std::memcpy(dst, src, size_t(n) * 4);
  }
}
void narrow(const float* src, void* dst, DType t, int64_t n) {
  if (t == DType::BF16) {
    bulk_f32_to_bf16(src, static_cast<uint16_t*>(dst), n);
  } else if (t == DType::F16) {
    bulk_f32_to_f16(src, static_cast<uint16_t*>(dst), n);
  } else {
    std::memcpy(dst, src, size_t(n) * 4);
  }
}
// The operand as fp32: itself, or widened into a scratch slot.
const float* as_f32(GemmOperand op, int64_t n, int slot) {
  if (op.dtype == DType::F32) return static_cast<const float*>(op.data);
  float* s = static_cast<float*>(scratch(slot, n * 4));
  widen(op.data, op.dtype, s, n);
  return s;
}

// ---- widen + sgemm --------------------------------------------------------------------------
// A 16-bit C is computed in blocks of rows into fp32 scratch (and, when A is 16-bit and not
// transposed, only that block of A is widened), so the scratch stays bounded however large C is.
// Blocks of at least kMinBlockRows rows: each sgemm call packs all of B again, which costs about
// as much as 1/(2*rows) of the product's work per element; fewer rows than this would show.
constexpr int64_t kBlockElements = int64_t(1) << 21, kMinBlockRows = 512;

void gemm_convert(bool ta, bool tb, int64_t m, int64_t n, int64_t k, GemmOperand a, GemmOperand b, bool accumulate,
                  void* c, DType ct) {
  const int64_t lda = ta ? m : k, ldb = tb ? k : n;
  const float* B = as_f32(b, k * n, kSlotB);
  if (ct == DType::F32) {
    const float* A = as_f32(a, m * k, kSlotA);
    sgemm(ta, tb, m, n, k, 1.0f, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, static_cast<float*>(c), n);
    return;
  }
  const int64_t rows = std::min(m, std::max(kMinBlockRows, kBlockElements / std::max<int64_t>(n, 1)));
  float* C = static_cast<float*>(scratch(kSlotC, rows * n * 4));
  const bool block_a = a.dtype != DType::F32 && !ta;
  const float* A_all = block_a ? nullptr : as_f32(a, m * k, kSlotA);
  for (int64_t i0 = 0; i0 < m; i0 += rows) {
    const int64_t mb = std::min(rows, m - i0);
    const float* A;
    if (block_a) {
      float* s = static_cast<float*>(scratch(kSlotA, mb * k * 4));
      widen(advance(a.data, a.dtype, i0 * k), a.dtype, s, mb * k);
      A = s;
    } else {
      A = ta ? A_all + i0 : A_all + i0 * k;
    }
    void* c_rows = advance(c, ct, i0 * n);
    if (accumulate) widen(c_rows, ct, C, mb * n);
    sgemm(ta, tb, mb, n, k, 1.0f, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C, n);
    narrow(C, c_rows, ct, mb * n);
  }
}

// ---- oneDNN matmul ------------------------------------------------------------------------
dnnl::engine& dnnl_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// The DType of a oneDNN operand type (bf16 or f32, the two this file uses).
DType dtype_of(dnnl::memory::data_type t) { return t == dnnl::memory::data_type::bf16 ? DType::BF16 : DType::F32; }

// (rows, cols) with leading dimension ld: row-major, or the transpose of a row-major (cols, rows)
// matrix.
dnnl::memory::desc matrix_desc(int64_t rows, int64_t cols, int64_t ld, bool transposed, dnnl::memory::data_type dt) {
  return dnnl::memory::desc({rows, cols}, dt, transposed ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1});
}

struct DnnlGemm {
  dnnl::memory::desc a, b, c;
  dnnl::matmul prim;
  int64_t scratchpad_bytes = 0;
};

// Sets the calling thread's OpenMP thread count to 1 and restores it: oneDNN plans a primitive
// for the thread count it sees when the primitive is made (a plan for two threads may split the
// sum over k between them) and runs it on as many, so one thread it sees is one fixed order of
// every sum.
class OneThread {
 public:
  OneThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int saved_;
};

// A matmul's shape: transposes, sizes, leading dimensions, types and accumulation.
using GemmKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int, int, bool>;

// Primitives are made once per shape (single-threaded plans, see OneThread) and shared by the
// threads: each execution gets the calling thread's own scratchpad (scratchpad_mode::user), as
// oneDNN requires of a primitive run from several threads.
struct GemmCache {
  std::mutex mutex;
  std::map<GemmKey, std::unique_ptr<DnnlGemm>> products;
};
GemmCache& gemm_cache() {
  static GemmCache c;
  return c;
}

const DnnlGemm& dnnl_gemm(const GemmKey& key) {
  auto& [mutex, cache] = gemm_cache();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  const auto [ta, tb, m, n, k, lda, ldb, ldc, in_int, out_int, accumulate] = key;
  const auto in = dnnl::memory::data_type(in_int), out = dnnl::memory::data_type(out_int);
  auto g = std::make_unique<DnnlGemm>();
  g->a = matrix_desc(m, k, lda, ta, in);
  g->b = matrix_desc(k, n, ldb, tb, in);
  g->c = matrix_desc(m, n, ldc, false, out);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  try {
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(g->a, g->b, g->c), attr, dnnl_engine());
    g->scratchpad_bytes = int64_t(pd.scratchpad_desc().get_size());
    g->prim = dnnl::matmul(pd);
  } catch (const dnnl::error& e) {
    DS_FAIL("oneDNN refused a {}x{}x{} matmul ({}): {}", m, n, k, in == dnnl::memory::data_type::bf16 ? "bf16" : "f32",
            e.what());
  }
  return *cache.emplace(key, std::move(g)).first->second;
}

// A thread's memory objects for one shape, made on its first product of that shape and then
// pointed at each call's operands: a product allocates nothing and takes no lock (an MoE layer's
// experts make many small products per step, where per-call set-up is measurable).
struct ThreadGemm {
  const DnnlGemm* g = nullptr;
  dnnl::memory a, b, c, pad;
};

// One thread's product C (m,n; ldc) = op(A) op(B) (+ C), on the calling thread alone.
void onednn_block(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda,
                  const void* b, int64_t ldb, bool accumulate, void* c, int64_t ldc, dnnl::memory::data_type in,
                  dnnl::memory::data_type out) {
  const OneThread one;
  thread_local std::map<GemmKey, ThreadGemm> mine;
  thread_local dnnl::stream stream(dnnl_engine());
  const GemmKey key{ta, tb, m, n, k, lda, ldb, ldc, int(in), int(out), accumulate};
  auto it = mine.find(key);
  if (it == mine.end()) {
    dnnl::engine& eng = dnnl_engine();
    ThreadGemm t;
    t.g = &dnnl_gemm(key);
    t.a = dnnl::memory(t.g->a, eng, nullptr);
    t.b = dnnl::memory(t.g->b, eng, nullptr);
    t.c = dnnl::memory(t.g->c, eng, nullptr);
    if (t.g->scratchpad_bytes > 0) {
      t.pad = dnnl::memory(dnnl::memory::desc({t.g->scratchpad_bytes}, dnnl::memory::data_type::u8, {1}), eng, nullptr);
    }
    it = mine.emplace(key, std::move(t)).first;
  }
  const ThreadGemm& t = it->second;
  t.a.set_data_handle(const_cast<void*>(a));
  t.b.set_data_handle(const_cast<void*>(b));
  t.c.set_data_handle(c);
  dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, t.a.get()}, {DNNL_ARG_WEIGHTS, t.b.get()}, {DNNL_ARG_DST, t.c.get()}, {}};
  int nargs = 3;
  if (t.g->scratchpad_bytes > 0) {
    t.pad.set_data_handle(scratch(kSlotPad, t.g->scratchpad_bytes));  // the slot may have grown since
    args[nargs++] = {DNNL_ARG_SCRATCHPAD, t.pad.get()};
  }
  dnnl::error::wrap_c_api(dnnl_primitive_execute(t.g->prim.get(), stream.get(), nargs, args),
                          "oneDNN could not run a matmul");
  stream.wait();
}

// Calls f(offset, size) over [0, count) in pieces of 64 x 2^j, largest first, then one
// remainder under 64 (none when count is a multiple of 64 and a power of two times it, as the
// dense layers' token counts usually are: one piece, one product).
template <class F>
void token_pieces(int64_t count, F&& f) {
  constexpr int64_t kQuantum = 64;
  const int64_t units = count / kQuantum;
  int64_t off = 0;
  for (int64_t bit = units > 0 ? int64_t(1) << (63 - __builtin_clzll(uint64_t(units))) : 0; bit > 0; bit >>= 1) {
    if (units & bit) {
      f(off, bit * kQuantum);
      off += bit * kQuantum;
    }
  }
  if (off < count) f(off, count - off);
}

// onednn_block over the pieces of the token dimension (TokenDim): rows of C, or the sum over k
// (the later pieces adding to the earlier ones).
void onednn_tokens(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b,
                   int64_t ldb, bool accumulate, void* c, int64_t ldc, dnnl::memory::data_type in,
                   dnnl::memory::data_type out, TokenDim tokens) {
  const DType in_type = dtype_of(in), out_type = dtype_of(out);
  if (tokens == TokenDim::kRows) {
    token_pieces(m, [&](int64_t i0, int64_t rows) {
      onednn_block(ta, tb, rows, n, k, advance(a, in_type, ta ? i0 : i0 * lda), lda, b, ldb, accumulate,
                   advance(c, out_type, i0 * ldc), ldc, in, out);
    });
  } else if (tokens == TokenDim::kSum) {
    token_pieces(k, [&](int64_t k0, int64_t depth) {
      onednn_block(ta, tb, m, n, depth, advance(a, in_type, ta ? k0 * lda : k0), lda,
                   advance(b, in_type, tb ? k0 : k0 * ldb), ldb, accumulate || k0 > 0, c, ldc, in, out);
    });
  } else {
    onednn_block(ta, tb, m, n, k, a, lda, b, ldb, accumulate, c, ldc, in, out);
  }
}

// The operand in the compute type: a bf16 operand itself on the bf16 path (which only takes two
// bf16 operands), else the operand widened to fp32 into a scratch slot.
const void* as_compute(GemmOperand op, int64_t n, int slot, bool bf16) {
  if (!bf16) return as_f32(op, n, slot);
  DS_CHECK(op.dtype == DType::BF16, "gemm16: the bf16 path got a {} operand", dtype_name(op.dtype));
  return op.data;
}

// oneDNN's matmul, split over the threads as sgemm.h's default path splits (split_product), each
// block a single-threaded oneDNN product. Every element of C is
// then one single-threaded sum in k order, whichever block or thread computes it, so the bits do
// not depend on where the product is called from (a split backward's weight gradients equal the
// full backward's; evaluation's logits equal training's).
void gemm_onednn(bool ta, bool tb, int64_t m, int64_t n, int64_t k, GemmOperand a, GemmOperand b, bool accumulate,
                 void* c, DType ct, bool bf16, TokenDim tokens) {
  using dt = dnnl::memory::data_type;
  const dt in = bf16 ? dt::bf16 : dt::f32;
  // oneDNN writes fp32, or bf16 straight into a BF16 output of the bf16 path; F16 (and BF16 in
  // the fp32 check path) goes through fp32 scratch.
  const bool direct_c = ct == DType::F32 || (bf16 && ct == DType::BF16);
  const dt out = direct_c && ct == DType::BF16 ? dt::bf16 : dt::f32;
  const DType out_type = dtype_of(out);
  const void* A = as_compute(a, m * k, kSlotA, bf16);
  const void* B = as_compute(b, k * n, kSlotB, bf16);
  const DType in_type = dtype_of(in);
  void* C = c;
  if (!direct_c) {
    C = scratch(kSlotC, m * n * 4);
    if (accumulate) widen(c, ct, static_cast<float*>(C), m * n);
  }
  const int64_t lda = ta ? m : k, ldb = tb ? k : n;
  split_product(m, n, k, [&](int64_t lo, int64_t hi, bool by_rows) {
    if (by_rows) {
      onednn_tokens(ta, tb, hi - lo, n, k, advance(A, in_type, ta ? lo : lo * lda), lda, B, ldb, accumulate,
                    advance(C, out_type, lo * n), n, in, out, tokens);
    } else {
      onednn_tokens(ta, tb, m, hi - lo, k, A, lda, advance(B, in_type, tb ? lo * ldb : lo), ldb, accumulate,
                    advance(C, out_type, lo), n, in, out, tokens);
    }
  });
  if (!direct_c) narrow(static_cast<const float*>(C), c, ct, m * n);
}

// ---- the choice -----------------------------------------------------------------------------
bool onednn_bf16_works() {
  static const bool works = [] {
    if (int(dnnl::get_effective_cpu_isa()) < int(dnnl::cpu_isa::avx512_core_bf16)) return false;
    try {
      using dt = dnnl::memory::data_type;
      dnnl::matmul::primitive_desc pd(
          dnnl::matmul::desc(matrix_desc(64, 64, 64, false, dt::bf16), matrix_desc(64, 64, 64, true, dt::bf16),
                             matrix_desc(64, 64, 64, false, dt::f32)),
          dnnl_engine());
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return works;
}

std::atomic<Gemm16Path> g_forced{Gemm16Path::kAuto};

Gemm16Path path_for(DType half) {
  const Gemm16Path forced = g_forced.load(std::memory_order_relaxed);
  if (forced != Gemm16Path::kAuto) return forced;
  if (half == DType::BF16 && cpu_has_hardware_bf16() && onednn_bf16_works()) return Gemm16Path::kOneDnnBf16;
  return Gemm16Path::kConvertSgemm;
}

}  // namespace

bool cpu_has_hardware_bf16() {
#if defined(__x86_64__)
  static const bool has = [] {
    unsigned a, b, c, d;
    if (__get_cpuid_max(0, nullptr) < 7) return false;
    __cpuid_count(7, 1, a, b, c, d);
    const bool avx512_bf16 = (a >> 5) & 1u;
    __cpuid_count(7, 0, a, b, c, d);
    const bool amx_bf16 = (d >> 22) & 1u;
    __builtin_cpu_init();
    return (avx512_bf16 && __builtin_cpu_supports("avx512f")) || amx_bf16;
  }();
  return has;
#else
  return false;
#endif
}

void set_gemm16_path(Gemm16Path path) {
  DS_CHECK(path != Gemm16Path::kOneDnnBf16 || onednn_bf16_works(),
           "set_gemm16_path: oneDNN has no bf16 matmul on this CPU");
  g_forced.store(path, std::memory_order_relaxed);
}

std::string gemm16_path_description() {
  const dnnl_version_t* v = dnnl_version();
  if (path_for(DType::BF16) == Gemm16Path::kOneDnnBf16) {
    return fmt::format(
        "hardware bf16 on this CPU: bf16 GEMMs use oneDNN {}.{} bf16 matmul (fp32 accumulation); f16 GEMMs widen to "
        "fp32 ({} conversions) for {}",
        v->major, v->minor, convert16_isa_name(), sgemm_path_name());
  }
  return fmt::format(
      "no hardware bf16 on this CPU{}: bf16 and f16 GEMMs widen their operands to fp32 ({} conversions) for "
      "{}",
      cpu_has_hardware_bf16() ? " that oneDNN can use" : " (no AVX-512 BF16, no AMX)", convert16_isa_name(),
      sgemm_path_name());
}

bool gemm16_computes_in_f32(DType half) {
  const Gemm16Path p = path_for(half);
  return !(p == Gemm16Path::kOneDnnBf16 && half == DType::BF16);
}

const float* gemm16_widen_shared(GemmOperand op, int64_t n) { return as_f32(op, n, kSlotDout); }

bool gemm16_bf16_hardware() { return path_for(DType::BF16) == Gemm16Path::kOneDnnBf16; }

int64_t gemm16_product_shapes() {
  GemmCache& c = gemm_cache();
  std::lock_guard<std::mutex> lock(c.mutex);
  return int64_t(c.products.size());
}

void gemm_mixed(bool ta, bool tb, int64_t m, int64_t n, int64_t k, GemmOperand a, GemmOperand b, bool accumulate,
                void* c, DType ct, TokenDim tokens) {
  check_float(a.dtype, "A");
  check_float(b.dtype, "B");
  check_float(ct, "C");
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum
    if (!accumulate) std::memset(c, 0, size_t(m * n) * dtype_size(ct));
    return;
  }
  const DType half = is16(a.dtype) ? a.dtype : is16(b.dtype) ? b.dtype : ct;
  if (!is16(half)) {
    sgemm(ta, tb, m, n, k, 1.0f, static_cast<const float*>(a.data), ta ? m : k, static_cast<const float*>(b.data),
          tb ? k : n, accumulate ? 1.0f : 0.0f, static_cast<float*>(c), n);
    return;
  }
  static std::once_flag logged;
  std::call_once(logged, [] { log::info("cpu backend: {}", gemm16_path_description()); });
  switch (path_for(half)) {
    case Gemm16Path::kOneDnnBf16:
      // Only a product of two bf16 operands runs in bf16: rounding an fp32 operand (the router's
      // fp32 gate, an fp32 activation) to bf16 would break the contract that fp32 values enter
      // the arithmetic as they are. Such products take the fp32 path below.
      if (a.dtype == DType::BF16 && b.dtype == DType::BF16) {
        gemm_onednn(ta, tb, m, n, k, a, b, accumulate, c, ct, /*bf16=*/true, tokens);
        return;
      }
      break;  // f16: the fp32 path
    case Gemm16Path::kOneDnnF32: gemm_onednn(ta, tb, m, n, k, a, b, accumulate, c, ct, /*bf16=*/false, tokens); return;
    default: break;
  }
  gemm_convert(ta, tb, m, n, k, a, b, accumulate, c, ct);
}

}  // namespace dstrain::cpu
