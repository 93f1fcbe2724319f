// Every op of every registered backend against the CPU fp32 reference, in the manner of ggml's
// test-backend-ops. Each op of backend/ops.def has one or more cases: seeded random inputs of
// given shapes and parameters (backward ops get consistent saved tensors from the CPU forward).
// A case's tensors are copied to the backend's device with ops::copy, the op runs there, every
// tensor (outputs, and inputs an op must leave alone) comes back with ops::copy and is compared
// with the CPU backend's result on the same inputs.
//
// Tolerances, relative to the largest magnitude of each reference tensor; integers exact:
//   f32 kernels 1e-5; bf16 kernels 1e-2 (2.5 bf16 ulps); f16 kernels 2e-3 (4 f16 ulps).
// A backend's bf16/f16 kernel of an op (other than cast and copy, whose cases carry 16-bit
// tensors themselves) runs the op's cases with their fp32 tensors rounded to that dtype; the
// reference runs the fp32 kernel on the rounded values.
//
// The table is iterated: an op without a case fails the suite, so a new op cannot be left out.
// The fake backend (fake_backend.h) is always registered here; a GPU backend joins by registering.
//
// Two sets of cases: all_cases(), every op at sizes small enough to read (the quick suite), and
// real_size_cases(), the ops whose GPU kernels change path with size (GEMMs up to K = 4096,
// attention at head dims 64, 128 and MLA's 192/128 over several tiles, vocabularies up to
// 129,280, model widths), with fp32 tolerances for long reductions (real_size_tolerance). Their
// summary lines read "[ backend ops ] <backend> (real sizes) ...".
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda_device.h"
#include "backend/ops.h"
#include "core/buffer.h"
#include "../gpu_test.h"
#include "fake_backend.h"

namespace dstrain {
namespace {

using Bytes = std::vector<unsigned char>;

// A tensor's contents on the host, owned.
struct HostTensor {
  DType dtype = DType::F32;
  Shape shape;
  Bytes bytes;
  bool stays_on_host = false;  // a transfer op's host side: not copied to the device

  HostTensor(DType dt, Shape s) : dtype(dt), shape(s), bytes(size_t(s.numel()) * dtype_size(dt)) {}
  Tensor t() { return Tensor(bytes.data(), dtype, shape); }
  template <class T>
  T* p() {
    return t().data<T>();
  }
};

// One run of an op: its tensor arguments in order and how to call it on them.
struct Case {
  std::string op;    // its name in ops.def
  std::string what;  // shapes and parameters, for messages
  std::vector<HostTensor> args;
  std::function<void(const std::vector<Tensor>&)> run;
};

// Builds cases with seeded random contents.
class Cases {
 public:
  std::map<std::string, std::vector<Case>> by_op;

  // Starts a case; its tensors are added with the functions below, in argument order.
  Case& add(std::string op, std::string what, std::function<void(const std::vector<Tensor>&)> run) {
    auto& list = by_op[op];
    list.push_back(Case{op, std::move(what), {}, std::move(run)});
    rng_.seed(uint32_t(1000 * by_op.size() + list.size()));
    return list.back();
  }
  HostTensor normal(Shape s, float scale = 1.0f) {
    HostTensor h(DType::F32, s);
    std::normal_distribution<float> nd(0.0f, scale);
    for (int64_t i = 0; i < s.numel(); ++i) h.p<float>()[i] = nd(rng_);
    return h;
  }
  HostTensor uniform(Shape s, float lo, float hi) {
    HostTensor h(DType::F32, s);
    std::uniform_real_distribution<float> ud(lo, hi);
    for (int64_t i = 0; i < s.numel(); ++i) h.p<float>()[i] = ud(rng_);
    return h;
  }
  static HostTensor zeros(Shape s, DType dt = DType::F32) { return HostTensor(dt, s); }
  HostTensor ints(Shape s, int32_t lo, int32_t hi) {  // int32 in [lo, hi)
    HostTensor h(DType::I32, s);
    std::uniform_int_distribution<int32_t> ud(lo, hi - 1);
    for (int64_t i = 0; i < s.numel(); ++i) h.p<int32_t>()[i] = ud(rng_);
    return h;
  }
  std::mt19937& rng() { return rng_; }

 private:
  std::mt19937 rng_;
};

using T = const std::vector<Tensor>&;
constexpr int32_t kIgnore = ops::kIgnoreIndex;

// ---- the cases, in ops.def order ------------------------------------------------------------

void dense_cases(Cases& c) {
  for (bool acc : {false, true}) {
    auto& k = c.add("linear_forward", acc ? "x (2,3,6) w (4,6) accumulate" : "x (5,7) w (3,7)",
                    [acc](T t) { ops::linear_forward(t[0], t[1], t[2], acc); });
    if (acc) {
      k.args = {c.normal({2, 3, 4}), c.normal({2, 3, 6}), c.normal({4, 6})};
    } else {
      k.args = {Cases::zeros({5, 3}), c.normal({5, 7}), c.normal({3, 7})};
    }
  }
  // dx and dw accumulate differently: dw always (+=), dx only with accumulate_dx; either may be skipped.
  struct V {
    const char* what;
    bool dx, dw, acc;
  };
  for (V v : {V{"dx and dw", true, true, false}, V{"dx (+=) and dw", true, true, true}, V{"dw only", false, true, false},
              V{"dx only", true, false, false}}) {
    auto& k = c.add("linear_backward", std::string("M=5 K=7 N=3, ") + v.what, [v](T t) {
      ops::linear_backward(v.dx ? t[0] : Tensor(), v.dw ? t[1] : Tensor(), t[2], t[3], t[4], v.acc);
    });
    k.args = {c.normal({5, 7}), c.normal({3, 7}), c.normal({5, 3}), c.normal({5, 7}), c.normal({3, 7})};
  }
}

void embedding_norm_cases(Cases& c) {
  auto& f = c.add("embedding_forward", "N=9 V=11 C=6", [](T t) { ops::embedding_forward(t[0], t[1], t[2]); });
  f.args = {Cases::zeros({9, 6}), c.ints({9}, 0, 11), c.normal({11, 6})};
  auto& b = c.add("embedding_backward", "N=12 V=5 C=4 (repeated ids)",
                  [](T t) { ops::embedding_backward(t[0], t[1], t[2]); });
  b.args = {c.normal({5, 4}), c.normal({12, 4}), c.ints({12}, 0, 5)};
  // Vocabulary shard [4, 8) of 12: tokens in it and outside, on both sides.
  auto& sf = c.add("embedding_shard_forward", "N=9 shard [4,8) of V=12 C=6",
                   [](T t) { ops::embedding_shard_forward(t[0], t[1], t[2], 4, 12); });
  HostTensor stok = c.ints({9}, 0, 12);
  std::copy_n(std::vector<int32_t>{0, 4, 7, 11, 5}.begin(), 5, stok.p<int32_t>());
  sf.args = {c.normal({9, 6}), stok, c.normal({4, 6})};
  auto& sb = c.add("embedding_shard_backward", "N=12 shard [4,8) of V=12 C=4 (repeated ids)",
                   [](T t) { ops::embedding_shard_backward(t[0], t[1], t[2], 4); });
  HostTensor btok = c.ints({12}, 0, 12);
  std::copy_n(std::vector<int32_t>{5, 3, 5, 8, 4, 7}.begin(), 6, btok.p<int32_t>());
  sb.args = {c.normal({4, 4}), c.normal({12, 4}), btok};

  auto& nf = c.add("rmsnorm_forward", "N=7 C=10", [](T t) { ops::rmsnorm_forward(t[0], t[1], t[2], t[3], 1e-6f); });
  nf.args = {Cases::zeros({7, 10}), Cases::zeros({7}), c.normal({7, 10}), c.normal({10})};
  auto& nb = c.add("rmsnorm_backward", "N=7 C=10, dx and dweight (+=)",
                   [](T t) { ops::rmsnorm_backward(t[0], t[1], t[2], t[3], t[4], t[5]); });
  HostTensor x = c.normal({7, 10}), w = c.normal({10}), out = Cases::zeros({7, 10}), rstd = Cases::zeros({7});
  ops::rmsnorm_forward(out.t(), rstd.t(), x.t(), w.t(), 1e-6f);
  nb.args = {c.normal({7, 10}), c.normal({10}), c.normal({7, 10}), x, w, rstd};
}

void rope_cases(Cases& c) {
  auto& tb = c.add("rope_tables", "T=6 head_dim=8", [](T t) { ops::rope_tables(t[0], t[1], 8, 10000.0); });
  tb.args = {Cases::zeros({6, 4}), Cases::zeros({6, 4})};
  HostTensor cos = Cases::zeros({8, 4}), sin = Cases::zeros({8, 4});
  ops::rope_tables(cos.t(), sin.t(), 8, 10000.0);
  for (const char* op : {"rope_forward", "rope_backward"}) {
    const bool fwd = std::string(op) == "rope_forward";
    auto& k = c.add(op, "x (2,6,22), 2 heads of 8 at column 4", [fwd](T t) {
      if (fwd) {
        ops::rope_forward(t[0], 4, 2, 8, t[1], t[2]);
      } else {
        ops::rope_backward(t[0], 4, 2, 8, t[1], t[2]);
      }
    });
    k.args = {c.normal({2, 6, 22}), cos, sin};
  }

  ops::YarnParams plain, yarn;
  yarn.factor = 40;
  yarn.original_max_position_embeddings = 4;
  yarn.mscale = 0.707;
  yarn.mscale_all_dim = 0.707;
  for (const auto& [what, params] : {std::pair{"dim=8 plain", plain}, std::pair{"dim=8 YaRN factor 40", yarn}}) {
    const ops::YarnParams p = params;
    auto& k = c.add("rope_tables_yarn", what, [p](T t) { ops::rope_tables_yarn(t[0], t[1], 8, 10000.0, p); });
    k.args = {Cases::zeros({7, 4}), Cases::zeros({7, 4})};
  }
  HostTensor ycos = Cases::zeros({7, 4}), ysin = Cases::zeros({7, 4});
  ops::rope_tables_yarn(ycos.t(), ysin.t(), 8, 10000.0, yarn);
  for (const char* op : {"rope_forward_interleaved", "rope_backward_interleaved"}) {
    const bool fwd = std::string(op) == "rope_forward_interleaved";
    auto& k = c.add(op, "x (2,5,30), 2 heads of 8 at column 2, stride 12", [fwd](T t) {
      if (fwd) {
        ops::rope_forward_interleaved(t[0], 2, 2, 12, 8, t[1], t[2]);
      } else {
        ops::rope_backward_interleaved(t[0], 2, 2, 12, 8, t[1], t[2]);
      }
    });
    k.args = {c.normal({2, 5, 30}), ycos, ysin};
  }
}

void attention_cases(Cases& c) {
  // Grouped-query heads with a value width of its own, and one padding column the op must not touch.
  ops::AttentionLayout gqa{4, 2, 6, 4, 0, 24, 36, 45};
  ops::AttentionLayout mha{2, 2, 4, 4, 0, 8, 16, 24};
  for (const auto& [what, layout, B, Tn] : {std::tuple{"GQA 4/2 heads, qk 6, v 4, T=7", gqa, 2, 7},
                                            std::tuple{"MHA 2 heads of 4, T=70", mha, 1, 70}}) {
    const ops::AttentionLayout L = layout;
    const float scale = 1.0f / std::sqrt(float(L.qk_dim));
    const int64_t width = int64_t(L.n_head) * L.v_dim;
    auto& f = c.add("attention_forward", what, [L, scale](T t) { ops::attention_forward(t[0], t[1], t[2], L, scale); });
    HostTensor qkv = c.normal({B, Tn, L.row_stride});
    f.args = {Cases::zeros({B, Tn, width}), Cases::zeros({B, L.n_head, Tn}), qkv};

    HostTensor out = Cases::zeros({B, Tn, width}), lse = Cases::zeros({B, L.n_head, Tn});
    ops::attention_forward(out.t(), lse.t(), qkv.t(), L, scale);
    auto& b = c.add("attention_backward", what,
                    [L, scale](T t) { ops::attention_backward(t[0], t[1], t[2], t[3], t[4], L, scale); });
    b.args = {c.normal({B, Tn, L.row_stride}), c.normal({B, Tn, width}), qkv, out, lse};
  }
}

void swiglu_loss_token_cases(Cases& c) {
  auto& f = c.add("swiglu_forward", "N=6 I=9", [](T t) { ops::swiglu_forward(t[0], t[1]); });
  f.args = {Cases::zeros({6, 9}), c.normal({6, 18}, 2.0f)};
  auto& b = c.add("swiglu_backward", "N=6 I=9", [](T t) { ops::swiglu_backward(t[0], t[1], t[2]); });
  b.args = {Cases::zeros({6, 18}), c.normal({6, 9}), c.normal({6, 18}, 2.0f)};

  HostTensor logits = c.normal({6, 13}, 3.0f), targets = c.ints({6}, 0, 13);
  targets.p<int32_t>()[2] = kIgnore;
  auto& cf = c.add("cross_entropy_forward", "N=6 V=13, one ignored row",
                   [](T t) { ops::cross_entropy_forward(t[0], t[1], t[2], t[3]); });
  cf.args = {Cases::zeros({6}), Cases::zeros({6}), logits, targets};
  HostTensor losses = Cases::zeros({6}), lse = Cases::zeros({6});
  ops::cross_entropy_forward(losses.t(), lse.t(), logits.t(), targets.t());
  auto& cb = c.add("cross_entropy_backward", "N=6 V=13, one ignored row",
                   [](T t) { ops::cross_entropy_backward(t[0], t[1], t[2], t[3], 0.25f); });
  cb.args = {Cases::zeros({6, 13}), logits, lse, targets};
  auto& cba = c.add("cross_entropy_backward", "in place (dlogits is logits)",
                    [](T t) { ops::cross_entropy_backward(t[0], t[0], t[1], t[2], 0.25f); });
  cba.args = {logits, lse, targets};

  // Vocabulary-parallel: V=15 in three shards of 5; shard 1 holds columns [5, 10).
  HostTensor full = c.normal({6, 15}, 3.0f), stargets = c.ints({6}, 0, 15);
  std::copy_n(std::vector<int32_t>{6, 2, kIgnore, 9, 14, 5}.begin(), 6, stargets.p<int32_t>());
  std::vector<HostTensor> shard_logits;
  HostTensor stats = Cases::zeros({3, 6, 2});
  for (int64_t p = 0; p < 3; ++p) {
    HostTensor& sl = shard_logits.emplace_back(Cases::zeros({6, 5}));
    for (int64_t n = 0; n < 6; ++n) std::copy_n(full.p<float>() + n * 15 + p * 5, 5, sl.p<float>() + n * 5);
    ops::cross_entropy_shard_forward(stats.t().row(p), sl.t(), stargets.t(), p * 5, 15);
  }
  auto& sf = c.add("cross_entropy_shard_forward", "N=6 shard [5,10) of V=15, one ignored row",
                   [](T t) { ops::cross_entropy_shard_forward(t[0], t[1], t[2], 5, 15); });
  sf.args = {Cases::zeros({6, 2}), shard_logits[1], stargets};
  auto& cc = c.add("cross_entropy_combine", "P=3 N=6, one ignored row",
                   [](T t) { ops::cross_entropy_combine(t[0], t[1], t[2], t[3]); });
  cc.args = {Cases::zeros({6}), Cases::zeros({6}), stats, stargets};
  HostTensor slosses = Cases::zeros({6}), slse = Cases::zeros({6});
  ops::cross_entropy_combine(slosses.t(), slse.t(), stats.t(), stargets.t());
  auto& sb = c.add("cross_entropy_shard_backward", "N=6 shard [5,10) of V=15, one ignored row",
                   [](T t) { ops::cross_entropy_shard_backward(t[0], t[1], t[2], t[3], 0.25f, 5); });
  sb.args = {Cases::zeros({6, 5}), shard_logits[1], slse, stargets};
  auto& sba = c.add("cross_entropy_shard_backward", "in place (dlogits is logits)",
                    [](T t) { ops::cross_entropy_shard_backward(t[0], t[0], t[1], t[2], 0.25f, 5); });
  sba.args = {shard_logits[1], slse, stargets};

  auto& top = c.add("logit_max_and_target", "N=6 V=13, one ignored row",
                    [](T t) { ops::logit_max_and_target(t[0], t[1], t[2], 0); });
  top.args = {Cases::zeros({6, 2}), logits, targets};
  auto& stop = c.add("logit_max_and_target", "N=6 shard [5,10) of V=15, one ignored row",
                     [](T t) { ops::logit_max_and_target(t[0], t[1], t[2], 5); });
  stop.args = {Cases::zeros({6, 2}), shard_logits[1], stargets};

  auto& ls = c.add("loss_sums", "N=6 (+=), one ignored row", [](T t) { ops::loss_sums(t[0], t[1], t[2]); });
  HostTensor sums = Cases::zeros({2}, DType::F64);
  sums.p<double>()[0] = 1.25;
  sums.p<double>()[1] = 3;
  ls.args = {sums, losses, targets};

  for (int64_t shift : {1, 2}) {
    auto& k = c.add("shift_tokens", "B=2 T=7 shift " + std::to_string(shift),
                    [shift](T t) { ops::shift_tokens(t[0], t[1], shift, kIgnore, 0); });
    HostTensor src = c.ints({2, 7}, 0, 50);
    src.p<int32_t>()[3] = kIgnore;
    src.p<int32_t>()[12] = kIgnore;
    k.args = {Cases::zeros({2, 7}, DType::I32), src};
  }
}

void elementwise_cases(Cases& c) {
  auto& a = c.add("add", "n=37", [](T t) { ops::add(t[0], t[1], t[2]); });
  a.args = {Cases::zeros({37}), c.normal({37}), c.normal({37})};
  auto& aa = c.add("add", "n=37, out is a", [](T t) { ops::add(t[0], t[0], t[1]); });
  aa.args = {c.normal({37}), c.normal({37})};
  auto& ai = c.add("add_inplace", "(5,8)", [](T t) { ops::add_inplace(t[0], t[1]); });
  ai.args = {c.normal({5, 8}), c.normal({5, 8})};
  auto& s = c.add("scale_inplace", "(5,8) by 0.37", [](T t) { ops::scale_inplace(t[0], 0.37f); });
  s.args = {c.normal({5, 8})};
  auto& f = c.add("fill", "(5,8) with 2.5", [](T t) { ops::fill(t[0], 2.5f); });
  f.args = {c.normal({5, 8})};

  // copy: on the device, host to device and device to host, of several element types.
  auto& cd = c.add("copy", "f32 (6,5) device to device", [](T t) { ops::copy(t[0], t[1]); });
  cd.args = {Cases::zeros({6, 5}), c.normal({6, 5})};
  auto& ch = c.add("copy", "f32 (6,5) host to device", [](T t) { ops::copy(t[0], t[1]); });
  ch.args = {Cases::zeros({6, 5}), c.normal({6, 5})};
  ch.args[1].stays_on_host = true;
  auto& cdh = c.add("copy", "i32 (11) device to host", [](T t) { ops::copy(t[0], t[1]); });
  cdh.args = {Cases::zeros({11}, DType::I32), c.ints({11}, -5, 5)};
  cdh.args[0].stays_on_host = true;
  auto& cb = c.add("copy", "bf16 (9) device to device", [](T t) { ops::copy(t[0], t[1]); });
  HostTensor bsrc(DType::BF16, {9});
  for (int i = 0; i < 9; ++i) bsrc.p<bf16>()[i].bits = f32_to_bf16(0.3f * float(i) - 1.0f);
  cb.args = {Cases::zeros({9}, DType::BF16), bsrc};

  // cast between every pair of F32, BF16 and F16, through rounding ties, denormals, inf and NaN.
  HostTensor values = c.normal({40}, 100.0f);
  const float specials[] = {0.0f, -0.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, std::ldexp(1.0f, -130),
                            std::ldexp(1.0f, -25), 65520.0f, std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  std::memcpy(values.p<float>(), specials, sizeof specials);
  auto to16 = [&](DType dt) {
    HostTensor h(dt, values.shape);
    for (int64_t i = 0; i < values.shape.numel(); ++i) {
      const float v = values.p<float>()[i];
      static_cast<uint16_t*>(h.t().raw())[i] = dt == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
    }
    return h;
  };
  const std::pair<DType, DType> pairs[] = {{DType::BF16, DType::F32}, {DType::F16, DType::F32},
                                           {DType::F32, DType::BF16}, {DType::F32, DType::F16},
                                           {DType::BF16, DType::F16}, {DType::F16, DType::BF16}};
  for (auto [dst, src] : pairs) {
    auto& k = c.add("cast", fmt::format("{} -> {} (40, with specials)", dtype_name(src), dtype_name(dst)),
                    [](T t) { ops::cast(t[0], t[1]); });
    k.args = {Cases::zeros({40}, dst), src == DType::F32 ? values : to16(src)};
  }

  struct B {
    const char* what;
    int64_t dst_offset, dst_step, src_offset, src_step, blocks, width;
    bool acc;
  };
  for (B b : {B{"3 blocks of 4, strided", 1, 6, 0, 4, 3, 4, false}, B{"3 blocks of 4, strided (+=)", 1, 6, 0, 4, 3, 4, true},
              B{"broadcast src (step 0)", 2, 5, 3, 0, 3, 5, false}, B{"sum into one place (dst step 0, +=)", 4, 0, 0, 4, 3, 4, true}}) {
    auto& k = c.add("copy_blocks", b.what, [b](T t) {
      ops::copy_blocks(t[0], b.dst_offset, b.dst_step, t[1], b.src_offset, b.src_step, b.blocks, b.width, b.acc);
    });
    k.args = {c.normal({3, 20}), c.normal({3, 12})};
  }

  auto& ss = c.add("sum_squares", "n=1000", [](T t) { ops::sum_squares(t[0], t[1]); });
  ss.args = {Cases::zeros({1}, DType::F64), c.normal({1000})};
  auto& nf = c.add("count_non_finite", "n=50 with NaN and both infinities",
                   [](T t) { ops::count_non_finite(t[0], t[1]); });
  HostTensor x = c.normal({50}, 1e30f);
  x.p<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  x.p<float>()[17] = std::numeric_limits<float>::infinity();
  x.p<float>()[40] = -std::numeric_limits<float>::infinity();
  nf.args = {Cases::zeros({1}, DType::I64), x};
  auto& fnm = c.add("fill_normal", "n=101, std 0.02, stream 3 from index 1000",
                    [](T t) { ops::fill_normal(t[0], 0.02, 42, 3, 1000); });
  fnm.args = {Cases::zeros({101})};

  ops::AdamWStep step;
  step.lr = 1e-3f;
  step.weight_decay = 0.1f;
  step.step = 3;
  auto& ad = c.add("adamw_update", "n=64, step 3, weight decay 0.1",
                   [step](T t) { ops::adamw_update(t[0], t[1], t[2], t[3], Tensor(), step); });
  ad.args = {c.normal({64}), c.normal({64}), c.normal({64}, 0.1f), c.uniform({64}, 0.0f, 0.01f)};
  // Mixed precision: fp32 master state, the updated weights' bf16 copy written in the same pass,
  // the gradient unscaled as it is read.
  ops::AdamWStep scaled = step;
  scaled.grad_scale = 1.0f / 1024;
  auto& adc = c.add("adamw_update", "n=64, fp32 masters with a bf16 copy, gradients scaled by 1024",
                    [scaled](T t) { ops::adamw_update(t[0], t[1], t[2], t[3], t[4], scaled); });
  adc.args = {c.normal({64}), c.normal({64}, 1024.0f), c.normal({64}, 0.1f), c.uniform({64}, 0.0f, 0.01f),
              Cases::zeros({64}, DType::BF16)};
}

void moe_cases(Cases& c) {
  using ops::MoEScoring;
  constexpr int64_t N = 8, E = 8;
  for (MoEScoring sc : {MoEScoring::Softmax, MoEScoring::Sigmoid}) {
    const std::string name = sc == MoEScoring::Softmax ? "softmax" : "sigmoid";
    auto& f = c.add("moe_scores", name + " N=8 E=8", [sc](T t) { ops::moe_scores(t[0], t[1], sc); });
    f.args = {Cases::zeros({N, E}), c.normal({N, E}, 2.0f)};
    auto& fa = c.add("moe_scores", name + " in place", [sc](T t) { ops::moe_scores(t[0], t[0], sc); });
    fa.args = {c.normal({N, E}, 2.0f)};
    HostTensor scores = Cases::zeros({N, E});
    ops::moe_scores(scores.t(), c.normal({N, E}, 2.0f).t(), sc);
    auto& b = c.add("moe_scores_backward", name, [sc](T t) { ops::moe_scores_backward(t[0], t[1], t[2], sc); });
    b.args = {Cases::zeros({N, E}), c.normal({N, E}), scores};
  }

  // Greedy over softmax (V2), group-limited (V2), noaux_tc over sigmoid with a bias (V3).
  struct R {
    const char* what;
    MoEScoring scoring;
    ops::MoERouteParams p;
    bool bias;
  };
  ops::MoERouteParams greedy, grouped, noaux;
  greedy.top_k = 2;
  greedy.routed_scaling_factor = 1.5f;
  grouped.method = ops::MoETopK::GroupLimitedGreedy;
  grouped.top_k = 3;
  grouped.n_group = 4;
  grouped.topk_group = 2;
  grouped.norm_topk_prob = true;
  noaux.method = ops::MoETopK::NoAuxTC;
  noaux.top_k = 2;
  noaux.n_group = 2;
  noaux.topk_group = 1;
  noaux.norm_topk_prob = true;
  noaux.routed_scaling_factor = 2.5f;
  for (const R& r : {R{"greedy top-2, softmax", MoEScoring::Softmax, greedy, false},
                     R{"group-limited top-3 of 4 groups keeping 2, normalised", MoEScoring::Softmax, grouped, false},
                     R{"noaux_tc top-2, sigmoid with bias, 2 groups", MoEScoring::Sigmoid, noaux, true}}) {
    const int k = r.p.top_k;
    HostTensor scores = Cases::zeros({N, E});
    ops::moe_scores(scores.t(), c.normal({N, E}, 2.0f).t(), r.scoring);
    HostTensor bias = c.normal({E}, 0.1f);
    const ops::MoERouteParams p = r.p;
    const bool has_bias = r.bias;
    auto& f = c.add("moe_route", r.what, [p, has_bias](T t) {
      ops::moe_route(t[0], t[1], t[2], has_bias ? t[3] : Tensor(), p);
    });
    f.args = {Cases::zeros({N, k}, DType::I32), Cases::zeros({N, k}), scores, bias};

    HostTensor ids = Cases::zeros({N, k}, DType::I32), weights = Cases::zeros({N, k});
    ops::moe_route(ids.t(), weights.t(), scores.t(), has_bias ? bias.t() : Tensor(), p);
    auto& b = c.add("moe_route_backward", r.what, [p](T t) { ops::moe_route_backward(t[0], t[1], t[2], t[3], p); });
    b.args = {c.normal({N, E}), c.normal({N, k}), ids, scores};

    // Load balancing over G = 2 sequences of 4 tokens.
    auto& af = c.add("moe_aux_loss", r.what, [sc = r.scoring](T t) { ops::moe_aux_loss(t[0], t[1], t[2], t[3], sc); });
    af.args = {Cases::zeros({1}, DType::F64), Cases::zeros({2, E}), scores, ids};
    HostTensor aux = Cases::zeros({1}, DType::F64), coef = Cases::zeros({2, E});
    ops::moe_aux_loss(aux.t(), coef.t(), scores.t(), ids.t(), r.scoring);
    auto& ab = c.add("moe_aux_loss_backward", std::string(r.what) + ", dscores (+=)",
                     [sc = r.scoring](T t) { ops::moe_aux_loss_backward(t[0], t[1], t[2], sc, 0.01f); });
    ab.args = {c.normal({N, E}), coef, scores};

    // The permutation by expert and back, for these ids.
    const int64_t M = N * k, C = 5;
    auto& dp = c.add("moe_dispatch_plan", r.what, [](T t) { ops::moe_dispatch_plan(t[0], t[1], t[2], t[3]); });
    dp.args = {Cases::zeros({E + 1}, DType::I64), Cases::zeros({M}, DType::I32), Cases::zeros({M}, DType::I32), ids};
    HostTensor offsets = Cases::zeros({E + 1}, DType::I64), sorted = Cases::zeros({M}, DType::I32),
               position = Cases::zeros({M}, DType::I32);
    ops::moe_dispatch_plan(offsets.t(), sorted.t(), position.t(), ids.t());
    auto& pf = c.add("moe_permute", r.what, [k](T t) { ops::moe_permute(t[0], t[1], t[2], k); });
    pf.args = {Cases::zeros({M, C}), c.normal({N, C}), sorted};
    for (bool acc : {false, true}) {
      auto& pb = c.add("moe_permute_backward", std::string(r.what) + (acc ? ", dx (+=)" : ""),
                       [acc](T t) { ops::moe_permute_backward(t[0], t[1], t[2], acc); });
      pb.args = {c.normal({N, C}), c.normal({M, C}), position};
    }
    auto& uf = c.add("moe_unpermute", std::string(r.what) + ", out (+=)",
                     [](T t) { ops::moe_unpermute(t[0], t[1], t[2], t[3]); });
    uf.args = {c.normal({N, C}), c.normal({M, C}), weights, position};
    auto& ub = c.add("moe_unpermute_backward", r.what,
                     [](T t) { ops::moe_unpermute_backward(t[0], t[1], t[2], t[3], t[4], t[5]); });
    ub.args = {Cases::zeros({M, C}), Cases::zeros({N, k}), c.normal({N, C}), c.normal({M, C}), weights, sorted};

    // Capacity 1 (about M/E = k rows per expert): both drop policies, then the permutation of
    // the R kept rows (sorted's first R entries; position -1 for a dropped pair).
    for (ops::MoEDropPolicy policy : {ops::MoEDropPolicy::Probs, ops::MoEDropPolicy::Position}) {
      const std::string what = std::string(r.what) + (policy == ops::MoEDropPolicy::Probs ? ", probs" : ", position");
      auto& cp = c.add("moe_capacity_plan", what + ", capacity 1", [policy](T t) {
        ops::moe_capacity_plan(t[0], t[1], t[2], t[3], t[4], 1, policy);
      });
      cp.args = {Cases::zeros({E + 1}, DType::I64), sorted, position, offsets, weights};
    }
    HostTensor kept = Cases::zeros({E + 1}, DType::I64), ksorted = sorted, kposition = position;
    ops::moe_capacity_plan(kept.t(), ksorted.t(), kposition.t(), offsets.t(), weights.t(), 1, ops::MoEDropPolicy::Probs);
    const int64_t R = kept.p<int64_t>()[E];
    HostTensor rsorted = Cases::zeros({R}, DType::I32);
    std::memcpy(rsorted.p<int32_t>(), ksorted.p<int32_t>(), size_t(R) * sizeof(int32_t));
    const std::string dropped = std::string(r.what) + fmt::format(", {} of {} rows kept", R, M);
    auto& kpf = c.add("moe_permute", dropped, [k](T t) { ops::moe_permute(t[0], t[1], t[2], k); });
    kpf.args = {Cases::zeros({R, C}), c.normal({N, C}), rsorted};
    auto& kpb = c.add("moe_permute_backward", dropped + ", dx (+=)",
                      [](T t) { ops::moe_permute_backward(t[0], t[1], t[2], true); });
    kpb.args = {c.normal({N, C}), c.normal({R, C}), kposition};
    auto& kuf = c.add("moe_unpermute", dropped + ", out (+=)", [](T t) { ops::moe_unpermute(t[0], t[1], t[2], t[3]); });
    kuf.args = {c.normal({N, C}), c.normal({R, C}), weights, kposition};
    auto& kub = c.add("moe_unpermute_backward", dropped,
                      [](T t) { ops::moe_unpermute_backward(t[0], t[1], t[2], t[3], t[4], t[5]); });
    kub.args = {Cases::zeros({R, C}), c.normal({N, k}), c.normal({N, C}), c.normal({R, C}), weights, rsorted};
  }

  auto& bu = c.add("moe_bias_update", "E=8, counts below, at and above the mean",
                   [](T t) { ops::moe_bias_update(t[0], t[1], 0.001f); });
  HostTensor counts = Cases::zeros({E}, DType::I64);
  const int64_t per_expert[E] = {3, 5, 4, 4, 0, 9, 4, 3};  // mean 4
  std::memcpy(counts.p<int64_t>(), per_expert, sizeof per_expert);
  bu.args = {c.normal({E}, 0.01f), counts};
}

const std::map<std::string, std::vector<Case>>& all_cases() {
  static const std::map<std::string, std::vector<Case>> cases = [] {
    Cases c;
    dense_cases(c);
    embedding_norm_cases(c);
    rope_cases(c);
    attention_cases(c);
    swiglu_loss_token_cases(c);
    elementwise_cases(c);
    moe_cases(c);
    return c.by_op;
  }();
  return cases;
}

// ---- real sizes ------------------------------------------------------------------------------
// The cases above are small enough to read; a GPU takes other paths at the sizes of real models:
// tensor-core attention for head dims above 64 and tiles of 64 or 128 rows, vectorised loads of
// aligned rows, loops over a vocabulary of 10^5 columns, GEMM tiles and split reductions over
// K = 4096. These cases run those sizes through the same comparison. Chosen for the CPU too:
// every case runs twice per kernel slot (reference and backend), three slots, on CI's 2 cores.

void real_linear_forward_cases(Cases& c) {
  struct G {
    int64_t M, N, K;
    bool acc;
  };
  // (M, N, K): out (M,N) = x (M,K) · w (N,K)^T. Every dimension from 256 to 4096, one K = 4096
  // reduction, and one shape that is no multiple of any tile (300 rows, 1000 columns).
  for (G g : {G{256, 256, 256, false}, G{512, 4096, 1024, false}, G{4096, 1024, 512, true}, G{1024, 512, 4096, false},
              G{300, 1000, 768, true}}) {
    auto& k = c.add("linear_forward", fmt::format("M={} N={} K={}{}", g.M, g.N, g.K, g.acc ? ", accumulate" : ""),
                    [acc = g.acc](T t) { ops::linear_forward(t[0], t[1], t[2], acc); });
    k.args = {g.acc ? c.normal({g.M, g.N}) : Cases::zeros({g.M, g.N}), c.normal({g.M, g.K}), c.normal({g.N, g.K})};
  }
}

void real_linear_backward_cases(Cases& c) {
  // dx (M,K) = dout · w reduces over N, dw (N,K) (+=) dout^T · x over M: K = 4096 reductions for
  // both (N = 4096, then M = 4096). Every variant at 256^3; the larger shapes one each.
  struct V {
    int64_t M, N, K;
    const char* what;
    bool dx, dw, acc;
  };
  for (V v : {V{256, 256, 256, "dx and dw", true, true, false}, V{256, 256, 256, "dx (+=) and dw", true, true, true},
              V{256, 256, 256, "dw only", false, true, false}, V{256, 256, 256, "dx only", true, false, false},
              V{512, 4096, 1024, "dx and dw", true, true, false}, V{4096, 1024, 512, "dx (+=) and dw", true, true, true},
              V{1024, 512, 4096, "dw only", false, true, false}, V{300, 1000, 768, "dx only", true, false, false}}) {
    auto& k = c.add("linear_backward", fmt::format("M={} N={} K={}, {}", v.M, v.N, v.K, v.what), [v](T t) {
      ops::linear_backward(v.dx ? t[0] : Tensor(), v.dw ? t[1] : Tensor(), t[2], t[3], t[4], v.acc);
    });
    k.args = {c.normal({v.M, v.K}), c.normal({v.N, v.K}), c.normal({v.M, v.N}), c.normal({v.M, v.K}),
              c.normal({v.N, v.K})};
  }
}

void real_embedding_norm_cases(Cases& c) {
  // DeepSeek-V3's vocabulary; a narrow table keeps the CPU's copies small (the index arithmetic
  // over 129,280 rows is what is new). The first and last ids, and repeats for the backward.
  constexpr int64_t V = 129280, C = 64, N = 512, Vl = V / 4, begin = 3 * Vl;
  HostTensor tokens = c.ints({N}, 0, int32_t(V));
  std::copy_n(std::vector<int32_t>{0, int32_t(V - 1), 7, 7, int32_t(V - 1), int32_t(begin), int32_t(begin - 1)}.begin(),
              7, tokens.p<int32_t>());
  auto& f = c.add("embedding_forward", "N=512 V=129280 C=64", [](T t) { ops::embedding_forward(t[0], t[1], t[2]); });
  f.args = {Cases::zeros({N, C}), tokens, c.normal({V, C})};
  auto& b = c.add("embedding_backward", "N=512 V=129280 C=64 (repeated ids)",
                  [](T t) { ops::embedding_backward(t[0], t[1], t[2]); });
  b.args = {c.normal({V, C}), c.normal({N, C}), tokens};
  // The last of four vocabulary shards, [96960, 129280): about a quarter of the tokens fall in it.
  auto& sf = c.add("embedding_shard_forward", "N=512 shard [96960,129280) of V=129280 C=64",
                   [](T t) { ops::embedding_shard_forward(t[0], t[1], t[2], begin, V); });
  sf.args = {c.normal({N, C}), tokens, c.normal({Vl, C})};
  auto& sb = c.add("embedding_shard_backward", "N=512 shard [96960,129280) of V=129280 C=64 (repeated ids)",
                   [](T t) { ops::embedding_shard_backward(t[0], t[1], t[2], begin); });
  sb.args = {c.normal({Vl, C}), c.normal({N, C}), tokens};

  // Hidden widths of DeepSeek-LLM 7B (4096) and V3 (7168).
  for (int64_t width : {4096, 7168}) {
    auto& nf = c.add("rmsnorm_forward", fmt::format("N=64 C={}", width),
                     [](T t) { ops::rmsnorm_forward(t[0], t[1], t[2], t[3], 1e-6f); });
    nf.args = {Cases::zeros({64, width}), Cases::zeros({64}), c.normal({64, width}), c.normal({width})};
    auto& nb = c.add("rmsnorm_backward", fmt::format("N=64 C={}, dx and dweight (+=)", width),
                     [](T t) { ops::rmsnorm_backward(t[0], t[1], t[2], t[3], t[4], t[5]); });
    HostTensor x = c.normal({64, width}), w = c.normal({width}), out = Cases::zeros({64, width}),
               rstd = Cases::zeros({64});
    ops::rmsnorm_forward(out.t(), rstd.t(), x.t(), w.t(), 1e-6f);
    nb.args = {c.normal({64, width}), c.normal({width}), c.normal({64, width}), x, w, rstd};
  }
}

void real_rope_cases(Cases& c) {
  // Tables over 4096 positions: angles up to 4096 radians, where argument reduction matters.
  auto& tb = c.add("rope_tables", "T=4096 head_dim=128", [](T t) { ops::rope_tables(t[0], t[1], 128, 10000.0); });
  tb.args = {Cases::zeros({4096, 64}), Cases::zeros({4096, 64})};
  // DeepSeek-LLM 7B's queries: 32 heads of 128 filling rows of 4096.
  HostTensor cos = Cases::zeros({256, 64}), sin = Cases::zeros({256, 64});
  ops::rope_tables(cos.t(), sin.t(), 128, 10000.0);
  for (const char* op : {"rope_forward", "rope_backward"}) {
    const bool fwd = std::string(op) == "rope_forward";
    auto& k = c.add(op, "x (2,256,4096), 32 heads of 128", [fwd](T t) {
      if (fwd) {
        ops::rope_forward(t[0], 0, 32, 128, t[1], t[2]);
      } else {
        ops::rope_backward(t[0], 0, 32, 128, t[1], t[2]);
      }
    });
    k.args = {c.normal({2, 256, 4096}), cos, sin};
  }
  // DeepSeek-V3's rope_scaling (YaRN factor 40 over 4096 original positions, mscale 1 and 1) and
  // its MLA query heads: 64 rotary columns after 128 others in each head of 192.
  ops::YarnParams v3;
  v3.factor = 40;
  v3.original_max_position_embeddings = 4096;
  v3.mscale = 1;
  v3.mscale_all_dim = 1;
  auto& yt = c.add("rope_tables_yarn", "T=4096 dim=64, V3's YaRN",
                   [v3](T t) { ops::rope_tables_yarn(t[0], t[1], 64, 10000.0, v3); });
  yt.args = {Cases::zeros({4096, 32}), Cases::zeros({4096, 32})};
  HostTensor ycos = Cases::zeros({512, 32}), ysin = Cases::zeros({512, 32});
  ops::rope_tables_yarn(ycos.t(), ysin.t(), 64, 10000.0, v3);
  for (const char* op : {"rope_forward_interleaved", "rope_backward_interleaved"}) {
    const bool fwd = std::string(op) == "rope_forward_interleaved";
    auto& k = c.add(op, "x (1,512,3072), 16 heads of 192, 64 rotary at column 128", [fwd](T t) {
      if (fwd) {
        ops::rope_forward_interleaved(t[0], 128, 16, 192, 64, t[1], t[2]);
      } else {
        ops::rope_backward_interleaved(t[0], 128, 16, 192, 64, t[1], t[2]);
      }
    });
    k.args = {c.normal({1, 512, 3072}), ycos, ysin};
  }
}

void real_attention_cases(Cases& c) {
  // q, k and v side by side in each row, as the models fuse them, with rows aligned for vector
  // loads. Tiles of 64 or 128 queries and keys: T = 256 and 512 fill them, T = 333 ends in a
  // partial tile (and is odd). Head dims 64 and 128, and MLA's qk 192 with v 128.
  struct A {
    const char* what;
    ops::AttentionLayout L;
    int64_t B, T;
  };
  for (A a : {A{"MHA 4 heads of 64, B=2 T=256", {4, 4, 64, 64, 0, 256, 512, 768}, 2, 256},
              A{"GQA 8/2 heads of 128, B=1 T=512", {8, 2, 128, 128, 0, 1024, 1280, 1536}, 1, 512},
              A{"MLA 4 heads, qk 192 v 128, B=2 T=333", {4, 4, 192, 128, 0, 768, 1536, 2048}, 2, 333}}) {
    const ops::AttentionLayout L = a.L;
    const float scale = 1.0f / std::sqrt(float(L.qk_dim));
    const int64_t width = int64_t(L.n_head) * L.v_dim;
    auto& f =
        c.add("attention_forward", a.what, [L, scale](T t) { ops::attention_forward(t[0], t[1], t[2], L, scale); });
    HostTensor qkv = c.normal({a.B, a.T, L.row_stride});
    f.args = {Cases::zeros({a.B, a.T, width}), Cases::zeros({a.B, L.n_head, a.T}), qkv};

    HostTensor out = Cases::zeros({a.B, a.T, width}), lse = Cases::zeros({a.B, L.n_head, a.T});
    ops::attention_forward(out.t(), lse.t(), qkv.t(), L, scale);
    auto& b = c.add("attention_backward", a.what,
                    [L, scale](T t) { ops::attention_backward(t[0], t[1], t[2], t[3], t[4], L, scale); });
    b.args = {c.normal({a.B, a.T, L.row_stride}), c.normal({a.B, a.T, width}), qkv, out, lse};
  }
}

void real_swiglu_loss_cases(Cases& c) {
  // DeepSeek-V3's dense intermediate size.
  auto& f = c.add("swiglu_forward", "N=32 I=18432", [](T t) { ops::swiglu_forward(t[0], t[1]); });
  f.args = {Cases::zeros({32, 18432}), c.normal({32, 36864}, 2.0f)};
  auto& b = c.add("swiglu_backward", "N=32 I=18432", [](T t) { ops::swiglu_backward(t[0], t[1], t[2]); });
  b.args = {Cases::zeros({32, 36864}), c.normal({32, 18432}), c.normal({32, 36864}, 2.0f)};

  // Vocabularies of Llama-like models (32,000), DeepSeek-LLM (102,400) and V3 (129,280); rows
  // with targets at both ends of the vocabulary and two ignored rows each.
  auto targets_for = [&](int64_t N, int64_t V) {
    HostTensor t = c.ints({N}, 0, int32_t(V));
    std::copy_n(std::vector<int32_t>{0, kIgnore, int32_t(V - 1), 5, kIgnore}.begin(), 5, t.p<int32_t>());
    return t;
  };
  struct Loss {
    int64_t N, V;
  };
  for (auto [N, V] : {Loss{64, 32000}, Loss{32, 102400}, Loss{16, 129280}}) {
    const std::string what = fmt::format("N={} V={}, two ignored rows", N, V);
    HostTensor logits = c.normal({N, V}, 3.0f), targets = targets_for(N, V);
    auto& cf = c.add("cross_entropy_forward", what, [](T t) { ops::cross_entropy_forward(t[0], t[1], t[2], t[3]); });
    cf.args = {Cases::zeros({N}), Cases::zeros({N}), logits, targets};
    HostTensor losses = Cases::zeros({N}), lse = Cases::zeros({N});
    ops::cross_entropy_forward(losses.t(), lse.t(), logits.t(), targets.t());
    const float scale = 1.0f / float(N);
    if (V == 102400) {  // in place, as the trainer runs it
      auto& cb = c.add("cross_entropy_backward", what + ", in place",
                       [scale](T t) { ops::cross_entropy_backward(t[0], t[0], t[1], t[2], scale); });
      cb.args = {logits, lse, targets};
    } else {
      auto& cb = c.add("cross_entropy_backward", what,
                       [scale](T t) { ops::cross_entropy_backward(t[0], t[1], t[2], t[3], scale); });
      cb.args = {Cases::zeros({N, V}), logits, lse, targets};
    }
    auto& top = c.add("logit_max_and_target", what, [](T t) { ops::logit_max_and_target(t[0], t[1], t[2], 0); });
    top.args = {Cases::zeros({N, 2}), logits, targets};
  }

  // V3's vocabulary in four shards of 32,320 columns; the last one, [96960, 129280), checked,
  // with targets on both sides of its first column.
  constexpr int64_t N = 16, V = 129280, P = 4, Vl = V / P, begin = 3 * Vl;
  HostTensor full = c.normal({N, V}, 3.0f), targets = targets_for(N, V);
  std::copy_n(std::vector<int32_t>{int32_t(begin), int32_t(begin - 1), int32_t(begin + 17)}.begin(), 3,
              targets.p<int32_t>() + 5);
  std::vector<HostTensor> shards;
  HostTensor stats = Cases::zeros({P, N, 2});
  for (int64_t p = 0; p < P; ++p) {
    HostTensor& sl = shards.emplace_back(Cases::zeros({N, Vl}));
    for (int64_t n = 0; n < N; ++n) std::copy_n(full.p<float>() + n * V + p * Vl, Vl, sl.p<float>() + n * Vl);
    ops::cross_entropy_shard_forward(stats.t().row(p), sl.t(), targets.t(), p * Vl, V);
  }
  const std::string what = "N=16 shard [96960,129280) of V=129280, two ignored rows";
  auto& sf = c.add("cross_entropy_shard_forward", what,
                   [](T t) { ops::cross_entropy_shard_forward(t[0], t[1], t[2], begin, V); });
  sf.args = {Cases::zeros({N, 2}), shards[3], targets};
  auto& cc = c.add("cross_entropy_combine", "P=4 N=16 of V=129280, two ignored rows",
                   [](T t) { ops::cross_entropy_combine(t[0], t[1], t[2], t[3]); });
  cc.args = {Cases::zeros({N}), Cases::zeros({N}), stats, targets};
  HostTensor losses = Cases::zeros({N}), lse = Cases::zeros({N});
  ops::cross_entropy_combine(losses.t(), lse.t(), stats.t(), targets.t());
  auto& sb = c.add("cross_entropy_shard_backward", what,
                   [](T t) { ops::cross_entropy_shard_backward(t[0], t[1], t[2], t[3], 1.0f / 16, begin); });
  sb.args = {Cases::zeros({N, Vl}), shards[3], lse, targets};
  auto& sba = c.add("cross_entropy_shard_backward", what + ", in place",
                    [](T t) { ops::cross_entropy_shard_backward(t[0], t[0], t[1], t[2], 1.0f / 16, begin); });
  sba.args = {shards[3], lse, targets};
  auto& stop = c.add("logit_max_and_target", what, [](T t) { ops::logit_max_and_target(t[0], t[1], t[2], begin); });
  stop.args = {Cases::zeros({N, 2}), shards[3], targets};
}

// Built by each test that runs them and freed after it (about half a GB of inputs): a run of the
// whole unit_tests binary does not keep them.
std::map<std::string, std::vector<Case>> real_size_cases() {
  Cases c;
  real_linear_forward_cases(c);
  real_linear_backward_cases(c);
  real_embedding_norm_cases(c);
  real_rope_cases(c);
  real_attention_cases(c);
  real_swiglu_loss_cases(c);
  return std::move(c.by_op);
}

// ---- running and comparing ------------------------------------------------------------------

bool is_float(DType d) { return d == DType::F32 || d == DType::F64 || d == DType::BF16 || d == DType::F16; }

double element(const HostTensor& h, const Bytes& b, int64_t i) {
  const unsigned char* p = b.data() + size_t(i) * dtype_size(h.dtype);
  uint16_t u16;
  switch (h.dtype) {
    case DType::F32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::F64: { double d; std::memcpy(&d, p, 8); return d; }
    case DType::BF16: std::memcpy(&u16, p, 2); return bf16_to_f32(u16);
    case DType::F16: std::memcpy(&u16, p, 2); return f16_to_f32(u16);
    default: break;
  }
  return 0;
}

// Runs a case with its tensors on `device` (but those that stay on the host): each is copied there
// with ops::copy, the op runs, and every tensor is copied back. Returns their bytes after the op.
std::vector<Bytes> run_on(const Case& c, Device device) {
  std::vector<Buffer> staging, placed;
  std::vector<Tensor> args;
  staging.reserve(c.args.size());
  placed.reserve(c.args.size());
  for (const HostTensor& a : c.args) {
    const Device where = a.stays_on_host ? Device::cpu() : device;
    Buffer& host = staging.emplace_back("op_suite.staging", MemCategory::Workspace, a.dtype, a.shape.numel());
    std::memcpy(host.data(), a.bytes.data(), a.bytes.size());
    Buffer& on = placed.emplace_back("op_suite." + c.op, MemCategory::Workspace, a.dtype, a.shape.numel(), where);
    ops::copy(on.tensor(), host.tensor());
    args.push_back(on.tensor(0, a.shape));
  }
  c.run(args);
  std::vector<Bytes> out;
  for (size_t i = 0; i < c.args.size(); ++i) {
    ops::copy(staging[i].tensor(), placed[i].tensor());
    const auto* p = static_cast<const unsigned char*>(staging[i].data());
    out.emplace_back(p, p + staging[i].nbytes());
  }
  return out;
}

// Largest error of `got` against `ref` for one tensor: relative to the reference's largest
// magnitude for floating-point tensors (NaN and infinities must match exactly), and 0 or
// infinity for integer tensors (exact). `where` says which element was worst.
double tensor_error(const HostTensor& want_layout, const HostTensor& got_layout, const Bytes& ref, const Bytes& got,
                    std::string* where) {
  const int64_t n = want_layout.shape.numel();
  if (!is_float(want_layout.dtype)) {
    if (ref == got) return 0;
    const size_t es = dtype_size(want_layout.dtype);
    for (int64_t i = 0; i < n; ++i) {
      if (std::memcmp(ref.data() + size_t(i) * es, got.data() + size_t(i) * es, es) != 0) {
        *where = fmt::format("element {} differs", i);
        break;
      }
    }
    return std::numeric_limits<double>::infinity();
  }
  double scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = element(want_layout, ref, i);
    if (std::isfinite(r)) scale = std::max(scale, std::fabs(r));
  }
  if (scale == 0) scale = 1e-30;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double r = element(want_layout, ref, i), g = element(got_layout, got, i);
    double e;
    if (!std::isfinite(r) || !std::isfinite(g)) {
      const bool same = (std::isnan(r) && std::isnan(g)) || r == g;
      e = same ? 0 : std::numeric_limits<double>::infinity();
    } else {
      e = std::fabs(g - r) / scale;
    }
    if (e > worst) {
      worst = e;
      *where = fmt::format("element {}: {} want {}", i, g, r);
    }
  }
  return worst;
}

double tolerance(KernelDType k) {
  switch (k) {
    case KernelDType::F32: return 1e-5;
    case KernelDType::BF16: return 1e-2;
    case KernelDType::F16: return 2e-3;
  }
  return 0;
}

// The real sizes' tolerances. fp32: two summation orders of a length-K reduction (the CPU's
// blocked sgemm against cuBLAS's tiles, split-K or a GPU tree reduction) differ by about
// sqrt(K) * 2^-24 of the result's scale: the rounding errors of the partial sums add up like a
// random walk. Measured on normal(0,1) operands, relative to the largest |result| of 65,536 dot
// products at K = 4096 (sqrt(K) 2^-24 = 3.8e-6): sequential fma 2.3e-6 from the exact sum,
// 16 fma lanes or chunks of 256 0.34e-6, sequential against 16 lanes 2.3e-6. The longest
// reductions here are K = 4096 (GEMMs) and 1024 (attention's dK and dV over 2 query heads x 512
// queries); 4 sqrt(4096) 2^-24 = 1.5e-5 is 4 times that model and 6.5 times the worst order
// measured, room for the few ulps by which a GPU's expf and sincosf differ from the CPU's too,
// while a wrong index, tile or scale is off by 1e-3 and more. (The quick suite's fp32
// reductions are at most 70 terms long: its 1e-5 stays.)
// 16-bit slots: the quick suite's tolerances still hold. The reference is the fp32 kernel on
// the rounded inputs, so a GEMM of any K differs by the one rounding of its 16-bit output, at
// most half an ulp of each value (the unit roundoff: 2^-8 = 3.9e-3 of the value in bf16, 2^-11 =
// 4.9e-4 in f16; the fake backend's maxima here are those, 3.8e-3 and 4.8e-4), plus the fp32
// summation order above (1.5e-5). The GPU's tensor-core attention also rounds the probabilities
// P and their gradient dS to 16 bits as they enter its products: at most one more unit roundoff
// of the terms' scale (a row of P sums to 1), less as the roundings of a row's terms average
// out. Two unit roundoffs are 7.8e-3 of bf16's 1e-2 and 9.8e-4 of f16's 2e-3. (On a CPU with
// AVX-512 BF16 the fake backend's bf16 attention rounds P and dS too, backend/cpu/
// attention_16bit.cpp; its errors at these sizes are 2.4e-3 forward and 2.7e-3 backward.)
double real_size_tolerance(KernelDType k) {
  return k == KernelDType::F32 ? 4 * std::sqrt(4096.0) * std::ldexp(1.0, -24) : tolerance(k);
}

// A set of cases, its tolerances and the label its summary lines carry after the backend's name.
struct CaseSet {
  const char* label;
  double (*tolerance)(KernelDType);
};
const CaseSet kQuick{"", tolerance};
const CaseSet kRealSizes{" (real sizes)", real_size_tolerance};

// The kernel slot a case runs in, as ops dispatch: its 16-bit floating-point type, else F32.
KernelDType slot_of(const Case& c) {
  for (const HostTensor& a : c.args) {
    if (a.dtype == DType::BF16) return KernelDType::BF16;
    if (a.dtype == DType::F16) return KernelDType::F16;
  }
  return KernelDType::F32;
}

// The case with its fp32 tensors rounded to `to` (BF16 or F16), or rounded and widened back to
// fp32 (the reference's inputs) when `widen`.
Case lowered(const Case& c, DType to, bool widen) {
  Case out{c.op, c.what, {}, c.run};
  for (const HostTensor& a : c.args) {
    if (a.dtype != DType::F32) {
      out.args.push_back(a);
      continue;
    }
    HostTensor h(widen ? DType::F32 : to, a.shape);
    h.stays_on_host = a.stays_on_host;
    for (int64_t i = 0; i < a.shape.numel(); ++i) {
      float v;
      std::memcpy(&v, a.bytes.data() + size_t(i) * 4, 4);
      const uint16_t r = to == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
      if (widen) {
        const float w = to == DType::BF16 ? bf16_to_f32(r) : f16_to_f32(r);
        std::memcpy(h.bytes.data() + size_t(i) * 4, &w, 4);
      } else {
        std::memcpy(h.bytes.data() + size_t(i) * 2, &r, 2);
      }
    }
    out.args.push_back(std::move(h));
  }
  return out;
}

struct Outcome {
  double error = 0;     // the worst over the case's tensors
  std::string message;  // for a failure: which tensor, which element
};

// Runs `on_device` on the backend's device and `reference` on the CPU and compares every tensor.
Outcome compare(const Case& reference, const Case& on_device, Device device) {
  Outcome o;
  std::vector<Bytes> ref, got;
  try {
    ref = run_on(reference, Device::cpu());
    got = run_on(on_device, device);
  } catch (const std::exception& e) {
    o.error = std::numeric_limits<double>::infinity();
    o.message = std::string("threw: ") + e.what();
    return o;
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    std::string where;
    const double e = tensor_error(reference.args[i], on_device.args[i], ref[i], got[i], &where);
    if (e > o.error) {
      o.error = e;
      o.message = fmt::format("argument {} ({} {}): {}", i, dtype_name(on_device.args[i].dtype),
                              on_device.args[i].shape.str(), where);
    }
  }
  return o;
}

Device device_of(const Backend& b) { return Device{b.device, 0}; }

// Checks every case of `op` on backend `b` in every kernel slot it has; returns whether all passed.
// Prints one line per slot.
bool check_op(const Backend& b, const std::string& op, const std::vector<Case>& cases, bool quiet = false,
              const CaseSet& set = kQuick) {
  const std::string name_of_backend = b.name + set.label;
  bool all_ok = true;
  const bool carries_16_bit = op == "cast" || op == "copy";
  for (KernelDType k : {KernelDType::F32, KernelDType::BF16, KernelDType::F16}) {
    if (!has_kernel(b.ops, op, k)) continue;
    if (k != KernelDType::F32 && carries_16_bit) continue;  // their cases use those slots already
    double worst = 0;
    int failed = 0;
    std::string slots;  // the kernel dtypes the cases ran in
    for (const Case& c : cases) {
      // A case that carries 16-bit tensors already ran in their slot with the fp32 ones.
      if (k != KernelDType::F32 && slot_of(c) != KernelDType::F32) continue;
      const KernelDType slot = k == KernelDType::F32 ? slot_of(c) : k;
      const std::string name(kernel_dtype_name(slot));
      if (("/" + slots + "/").find("/" + name + "/") == std::string::npos) slots += (slots.empty() ? "" : "/") + name;
      Outcome o;
      double tol;
      if (k == KernelDType::F32) {
        tol = set.tolerance(slot);
        o = compare(c, c, device_of(b));
      } else {
        const DType dt = k == KernelDType::BF16 ? DType::BF16 : DType::F16;
        tol = set.tolerance(k);
        o = compare(lowered(c, dt, /*widen=*/true), lowered(c, dt, /*widen=*/false), device_of(b));
      }
      worst = std::max(worst, o.error);
      if (!(o.error <= tol)) {
        ++failed;
        all_ok = false;
        if (!quiet) {
          ADD_FAILURE() << fmt::format("{} {} [{}] {}: error {:.2e} > {:.1e}; {}", name_of_backend, op, name, c.what,
                                       o.error, tol, o.message);
        }
      }
    }
    if (!quiet) {
      std::printf("[ backend ops ] %-5s %-28s %-13s %2zu case%s  max err %.1e  %s\n", name_of_backend.c_str(),
                  op.c_str(), slots.c_str(), cases.size(), cases.size() == 1 ? " " : "s", worst,
                  failed ? "FAILED" : "ok");
    }
  }
  return all_ok;
}

std::vector<const Backend*> backends_under_test() {
  fake::use_fake_backend();
  if (cuda::device_count() > 0) cuda::use_device(0);  // the CUDA backend joins where a GPU is
  std::vector<const Backend*> out;
  for (const Backend* b : registered_backends())
    if (b->device != DeviceType::CPU && b->device != DeviceType::Meta) out.push_back(b);
  return out;
}

// ---- the suite ------------------------------------------------------------------------------

TEST(BackendOps, EveryOpOfTheTableHasACase) {
  const auto& cases = all_cases();
  for (const std::string& op : op_names()) {
    EXPECT_TRUE(cases.count(op)) << "op '" << op << "' of backend/ops.def has no case in test_backend_ops.cpp: "
                                 << "add one, so that every backend is checked on it";
  }
  for (const auto& [op, list] : cases) {
    EXPECT_NE(std::find(op_names().begin(), op_names().end(), op), op_names().end())
        << "test_backend_ops.cpp has cases for '" << op << "', which is not an op of backend/ops.def";
    EXPECT_FALSE(list.empty());
  }
}

TEST(BackendOps, EveryBackendMatchesTheCpuReference) {
  const auto backends = backends_under_test();
  ASSERT_FALSE(backends.empty()) << "the fake backend is not registered";
  const auto& cases = all_cases();
  for (const Backend* b : backends) {
    if (b->device == DeviceType::CUDA) continue;  // CudaBackendMatchesTheCpuReference
    for (const std::string& op : op_names()) {
      auto it = cases.find(op);
      if (it == cases.end()) continue;  // reported by EveryOpOfTheTableHasACase
      check_op(*b, op, it->second);
    }
  }
}

// The CUDA backend on its own, so that a run without a GPU says, by name, that its kernels were
// not checked (ctest reports it as skipped).
TEST(BackendOps, CudaBackendMatchesTheCpuReference) {
  DSTRAIN_SKIP_WITHOUT_GPU();
  backends_under_test();
  const Backend* b = find_backend(DeviceType::CUDA);
  ASSERT_NE(b, nullptr);
  const auto& cases = all_cases();
  int ops = 0;
  for (const std::string& op : op_names()) {
    auto it = cases.find(op);
    if (it == cases.end()) continue;
    ops += check_op(*b, op, it->second);
  }
  std::printf("[ backend ops ] cuda: %d of %zu ops match the CPU reference in every slot\n", ops, op_names().size());
}

// The real sizes (real_size_cases) on every backend under test but CUDA: the fake backend, so
// that the cases, their shapes and the comparison run on every CI run before a GPU sees them.
TEST(BackendOps, RealSizesMatchTheCpuReference) {
  const auto backends = backends_under_test();
  ASSERT_FALSE(backends.empty()) << "the fake backend is not registered";
  const auto cases = real_size_cases();
  for (const auto& [op, list] : cases) {
    EXPECT_NE(std::find(op_names().begin(), op_names().end(), op), op_names().end())
        << "test_backend_ops.cpp has real-size cases for '" << op << "', which is not an op of backend/ops.def";
  }
  for (const Backend* b : backends) {
    if (b->device == DeviceType::CUDA) continue;  // CudaRealSizesMatchTheCpuReference
    for (const std::string& op : op_names()) {
      auto it = cases.find(op);
      if (it != cases.end()) check_op(*b, op, it->second, /*quiet=*/false, kRealSizes);
    }
  }
}

// The CUDA backend at real sizes: its tensor-core attention for head dims above 64, its
// vectorised loads, its vocabulary loops and cuBLASLt at K = 4096 (skipped, by name, without a GPU).
TEST(BackendOps, CudaRealSizesMatchTheCpuReference) {
  DSTRAIN_SKIP_WITHOUT_GPU();
  backends_under_test();
  const Backend* b = find_backend(DeviceType::CUDA);
  ASSERT_NE(b, nullptr);
  const auto cases = real_size_cases();
  int ops = 0;
  for (const std::string& op : op_names()) {
    auto it = cases.find(op);
    if (it == cases.end()) continue;
    ops += check_op(*b, op, it->second, /*quiet=*/false, kRealSizes);
  }
  std::printf("[ backend ops ] cuda (real sizes): %d of %zu ops match the CPU reference in every slot\n", ops,
              cases.size());
}

// At real sizes too, a corrupted output fails its op: one wrong element among millions is not
// averaged away. One case each (the last, cheapest to rerun) of a GEMM, attention both ways and
// the loss over V3's vocabulary, in every slot.
TEST(BackendOps, APerturbedOpFailsAtRealSizes) {
  backends_under_test();
  const Backend* fake = find_backend(DeviceType::Emulated);
  ASSERT_NE(fake, nullptr);
  Cases c;  // only the groups of the ops tried
  real_linear_forward_cases(c);
  real_attention_cases(c);
  real_swiglu_loss_cases(c);
  const auto& cases = c.by_op;
  for (const char* op : {"linear_forward", "attention_forward", "attention_backward", "cross_entropy_backward"}) {
    const std::vector<Case> one{cases.at(op).back()};
    fake::perturb_op(op);
    const bool passed = check_op(*fake, op, one, /*quiet=*/true, kRealSizes);
    fake::perturb_op("");
    EXPECT_FALSE(passed) << "the fake backend corrupted " << op << "'s output at real size (" << one[0].what
                         << "), but the comparison did not notice";
    EXPECT_TRUE(check_op(*fake, op, one, /*quiet=*/true, kRealSizes)) << op << " fails unperturbed: " << one[0].what;
  }
}

// The suite can fail: with the fake backend corrupting one op's first output, that op fails and
// only that one. Tried for every op, so every op's cases compare what the op writes.
TEST(BackendOps, APerturbedOpFailsTheSuite) {
  backends_under_test();
  const Backend* fake = find_backend(DeviceType::Emulated);
  ASSERT_NE(fake, nullptr);
  const auto& cases = all_cases();
  int caught = 0;
  for (const std::string& op : op_names()) {
    auto it = cases.find(op);
    if (it == cases.end()) continue;
    fake::perturb_op(op);
    const bool passed = check_op(*fake, op, it->second, /*quiet=*/true);
    fake::perturb_op("");
    EXPECT_FALSE(passed) << "the fake backend corrupted " << op << "'s output, but its cases did not notice";
    caught += !passed;
  }
  // And the corruption stays in the op it was put in.
  fake::perturb_op("swiglu_forward");
  EXPECT_TRUE(check_op(*fake, "add", cases.at("add"), /*quiet=*/true));
  fake::perturb_op("");
  std::printf("[ backend ops ] a corrupted output was caught for %d of %zu ops\n", caught, op_names().size());
}

}  // namespace
}  // namespace dstrain
