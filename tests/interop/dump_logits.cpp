// Runs a Hugging Face directory written by `dstrain train --save-hf` through dstrain's model
// and writes what the interop test compares with Hugging Face's own modelling code.
//   interop_dump_logits HF_DIR WINDOWS N T LOGITS_OUT
// WINDOWS: N x (T + 1) int32 tokens (inputs are the first T of a window, targets the last T).
// LOGITS_OUT receives (N, T, V) float32 logits; stdout gets "ce <mean token cross-entropy>".
#include <Kokkos_Core.hpp>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/hf_weights.h"
#include "model/model_config.h"
#include "model/transformer.h"

int main(int argc, char** argv) {
  using namespace dstrain;
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s HF_DIR WINDOWS N T LOGITS_OUT\n", argv[0]);
    return 2;
  }
  // Kokkos outlives the model's buffers.
  Kokkos::ScopeGuard kokkos(argc, argv);
  try {
    const std::string dir = argv[1];
    const int64_t N = std::stoll(argv[3]), T = std::stoll(argv[4]);
    std::vector<int32_t> windows(size_t(N * (T + 1)));
    std::ifstream in(argv[2], std::ios::binary);
    in.read(reinterpret_cast<char*>(windows.data()), std::streamsize(windows.size() * sizeof(int32_t)));
    DS_CHECK(in.gcount() == std::streamsize(windows.size() * sizeof(int32_t)), "{}: expected {} x {} int32 tokens",
             argv[2], N, T + 1);
    std::vector<int32_t> x(size_t(N * T)), y(size_t(N * T));
    for (int64_t i = 0; i < N; ++i)
      for (int64_t t = 0; t < T; ++t) {
        x[size_t(i * T + t)] = windows[size_t(i * (T + 1) + t)];
        y[size_t(i * T + t)] = windows[size_t(i * (T + 1) + t + 1)];
      }

    const ModelConfig config = load_hf_config(dir + "/config.json");
    Transformer model(config, Device::cpu());
    load_hf_weights(dir, model.params());
    const int64_t V = config.vocab_size;
    std::vector<float> logits(size_t(N * T * V));
    Tensor tx(x.data(), DType::I32, Shape{N, T}), ty(y.data(), DType::I32, Shape{N, T});
    model.forward_logits(tx, Tensor(logits.data(), DType::F32, Shape{N, T, V}));
    const LossSums loss = model.forward_loss(tx, ty);
    std::ofstream out(argv[5], std::ios::binary);
    out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * sizeof(float)));
    DS_CHECK(out.good(), "{}: cannot write the logits", argv[5]);
    std::printf("ce %.12g\n", loss.mean());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
