// Runs a Hugging Face directory through dstrain's model and writes what the interop tests
// compare with PyTorch and Hugging Face's own modelling code.
//   interop_dump_logits HF_DIR WINDOWS N T LOGITS_OUT [--dtype fp32|bf16|fp16] [--grads GRADS_OUT]
//                       [--mtp-weight W]
// WINDOWS: N x (T + 1) int32 tokens (inputs are the first T of a window, targets the last T).
// LOGITS_OUT receives (N, T, V) float32 logits; stdout gets "ce <mean token cross-entropy>".
// --dtype: the compute dtype of the forward (and backward): fp32 masters with a bf16 or fp16
//   compute copy, as a training run with train.bf16 / train.fp16 enabled computes.
// --grads: also one backward of the training loss of the N windows taken as one global batch
//   (mean CE + the MoE auxiliary terms + W x the mean multi-token-prediction CE, W default
//   0.3), written as fp32 safetensors named as the parameters (trainable ones only); stdout
//   gets "loss <total> aux <aux> mtp <mtp>" and, per MoE layer, "experts <layer> <tokens per expert...>".
// Exit status 77 (and a line "dstrain <dtype>: not available in this build") when this build
// cannot compute in the dtype asked for.
#include <Kokkos_Core.hpp>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io/hf_weights.h"
#include "io/safetensors.h"
#include "model/model_config.h"
#include "model/transformer.h"

namespace {

constexpr int kNotAvailable = 77;

// The model computes in `dt` from now on (its compute copy allocated), when this build can.
template <class Model>
bool set_compute_dtype(Model& model, dstrain::DType dt) {
  if (dt == dstrain::DType::F32) return true;
  if constexpr (requires { model.set_compute_dtype(dt); }) {
    model.set_compute_dtype(dt);
    return true;
  } else {
    return false;
  }
}

// The compute copy follows the masters just loaded.
template <class Registry>
void refresh_compute(Registry& reg) {
  if constexpr (requires { reg.refresh_compute(); }) reg.refresh_compute();
}

}  // namespace

int main(int argc, char** argv) {
  using namespace dstrain;
  std::vector<std::string> pos;
  std::string dtype_name = "fp32", grads_out;
  double mtp_weight = 0.3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--dtype" || a == "--grads" || a == "--mtp-weight") && i + 1 < argc) {
      const std::string v = argv[++i];
      if (a == "--dtype") dtype_name = v;
      else if (a == "--grads") grads_out = v;
      else mtp_weight = std::stod(v);
    } else if (a.rfind("--", 0) == 0) {
      pos.clear();
      break;
    } else {
      pos.push_back(a);
    }
  }
  if (pos.size() != 5 || (dtype_name != "fp32" && dtype_name != "bf16" && dtype_name != "fp16")) {
    std::fprintf(stderr,
                 "usage: %s HF_DIR WINDOWS N T LOGITS_OUT [--dtype fp32|bf16|fp16] [--grads GRADS_OUT] "
                 "[--mtp-weight W]\n",
                 argv[0]);
    return 2;
  }
  const DType dt = dtype_name == "bf16" ? DType::BF16 : dtype_name == "fp16" ? DType::F16 : DType::F32;
  // Kokkos outlives the model's buffers.
  Kokkos::ScopeGuard kokkos(argc, argv);
  try {
    const std::string dir = pos[0];
    const int64_t N = std::stoll(pos[2]), T = std::stoll(pos[3]);
    std::vector<int32_t> windows(size_t(N * (T + 1)));
    std::ifstream in(pos[1], std::ios::binary);
    in.read(reinterpret_cast<char*>(windows.data()), std::streamsize(windows.size() * sizeof(int32_t)));
    DS_CHECK(in.gcount() == std::streamsize(windows.size() * sizeof(int32_t)), "{}: expected {} x {} int32 tokens",
             pos[1], N, T + 1);
    std::vector<int32_t> x(size_t(N * T)), y(size_t(N * T));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t t = 0; t < T; ++t) {
        x[size_t(i * T + t)] = windows[size_t(i * (T + 1) + t)];
        y[size_t(i * T + t)] = windows[size_t(i * (T + 1) + t + 1)];
      }

    const ModelConfig config = load_hf_config(dir + "/config.json");
    Transformer model(config, Device::cpu());
    if (!set_compute_dtype(model, dt)) {
      std::printf("dstrain %s: not available in this build (the model has no %s compute path)\n",
                  dtype_name.c_str(), dtype_name.c_str());
      return kNotAvailable;
    }
    load_hf_weights(dir, model.params());
    refresh_compute(model.params());
    const int64_t V = config.vocab_size;
    std::vector<float> logits(size_t(N * T * V));
    Tensor tx(x.data(), DType::I32, Shape{N, T}), ty(y.data(), DType::I32, Shape{N, T});
    model.forward_logits(tx, Tensor(logits.data(), DType::F32, Shape{N, T, V}));
    const LossSums loss = model.forward_loss(tx, ty);
    std::ofstream out(pos[4], std::ios::binary);
    out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
    DS_CHECK(out.good(), "{}: cannot write the logits", pos[4]);
    std::printf("ce %.12g\n", loss.mean());

    if (!grads_out.empty()) {
      // The N windows as one global batch, as the reference tests take a micro-batch.
      const int D = model.mtp_depth();
      LossScales scales;
      scales.token = float(1.0 / double(N * T));
      scales.sequence = 1.0 / double(N);
      scales.micro_batch = 1.0;
      for (int k = 0; k < D; ++k) scales.mtp_token.push_back(float(mtp_weight / D / double(N * (T - k - 1))));
      model.params().grads().zero();
      for (auto& [l, ffn] : model.moe_layers()) ffn->routing()->reset();
      const LossSums s = model.forward_backward(tx, ty, scales);
      double aux = 0, mtp = 0;
      for (auto& [l, ffn] : model.moe_layers()) aux += ffn->routing()->aux_loss;
      for (int k = 0; k < D; ++k) mtp += mtp_weight / D * s.mtp_sum[size_t(k)] / double(s.mtp_count[size_t(k)]);
      std::vector<std::pair<std::string, Tensor>> grads;
      for (int id = 0; id < model.params().size(); ++id)
        if (model.params().info(id).trainable) grads.emplace_back(model.params().info(id).name, model.params().grad(id));
      write_safetensors(grads_out, grads);
      std::printf("loss %.12g aux %.12g mtp %.12g\n", s.mean() + aux + mtp, aux, mtp);
      for (auto& [l, ffn] : model.moe_layers()) {
        std::printf("experts %d", l);
        for (int64_t c : ffn->routing()->tokens_per_expert) std::printf(" %lld", static_cast<long long>(c));
        std::printf("\n");
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
