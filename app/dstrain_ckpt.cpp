// dstrain-ckpt: inspect and convert dstrain checkpoints.
//   dstrain-ckpt info FILE                 step, layout, tensors, sizes; tensor and metadata checksums verified
//   dstrain-ckpt export FILE --to-hf DIR   Hugging Face safetensors + config.json
// Exit status: 0 done, 1 error (or a checksum mismatch), 2 bad command line.
#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstdio>

#include "cli.h"
#include "core/log.h"
#include "io/checkpoint.h"
#include "io/hf_weights.h"
#include "model/transformer.h"

namespace {

int cmd_info(const std::string& path, bool verify) {
  using namespace dstrain;
  const CheckpointInfo info = inspect_checkpoint(path, verify);
  const TrainState& s = info.state;
  std::printf("checkpoint    %s\n", path.c_str());
  std::printf("written by    dstrain %s (%s) at %s\n", info.version.c_str(), info.build.c_str(), info.created.c_str());
  std::printf("step          %lld (optimizer step %lld)\n", (long long)s.step, (long long)s.optimizer_steps);
  std::printf("consumed      %lld samples, %lld tokens\n", (long long)s.consumed_samples,
              (long long)s.consumed_tokens);
  std::printf("layout        %s\n", s.layout.dump().c_str());
  std::printf("scheduler     %s\n", s.scheduler.dump().c_str());
  if (s.loss_scaler.is_object()) std::printf("loss scaler   %s\n", s.loss_scaler.dump().c_str());
  std::printf("data          %s\n", s.data.dump().c_str());
  // The job that wrote it: what to match (or expect differences from) when resuming elsewhere.
  if (s.environment.is_object()) {
    const json& e = s.environment;
    auto text = [&](const char* key) { return e.value(key, std::string("?")); };
    std::printf("environment   dstrain %s (%s), %s\n", text("dstrain_version").c_str(), text("commit").c_str(),
                text("compiler").c_str());
    std::printf("              MPI: %s\n", text("mpi").c_str());
    std::printf("              HDF5 %s, BLAS: %s, GEMM: %s\n", text("hdf5").c_str(), text("blas").c_str(),
                text("gemm").c_str());
    std::printf("              %lld rank(s) on %s, %lld OpenMP threads each\n",
                (long long)e.value("world_size", int64_t(0)), text("hosts").c_str(),
                (long long)e.value("omp_threads", int64_t(0)));
    std::printf("              CPU: %s (%s), OpenBLAS kernels %s\n", text("cpu_model").c_str(),
                text("cpu_features").c_str(), text("blas_kernels").c_str());
    // Warnings span lines: each line keeps the column.
    std::string warnings = text("warnings");
    for (size_t at = 0; (at = warnings.find('\n', at)) != std::string::npos; at += 15) warnings.insert(at + 1, 14, ' ');
    if (!warnings.empty()) std::printf("              warnings: %s\n", warnings.c_str());
  } else {
    std::printf("environment   not recorded (written by a dstrain that did not record it)\n");
  }
  int64_t bytes = 0, bad = 0;
  std::printf("%-22s %-60s %-16s %12s  %-10s %s\n", "group", "tensor", "shape", "bytes", "crc32", "verified");
  for (const CheckpointTensorInfo& t : info.tensors) {
    const int64_t b = t.shape.numel() * 4;
    bytes += b;
    bad += t.ok() ? 0 : 1;
    std::printf("%-22s %-60s %-16s %12lld  %08x   %s\n", t.group.c_str(), t.name.c_str(), t.shape.str().c_str(),
                (long long)b, t.stored_crc, !verify ? "not checked" : t.ok() ? "ok" : "MISMATCH");
  }
  std::printf("%zu tensors, %.1f MB", info.tensors.size(), double(bytes) / 1e6);
  if (verify) std::printf(", %lld checksum mismatch(es)", (long long)bad);
  std::printf("\n");
  if (info.metadata_sealed) {
    std::printf("metadata      %zu fields (attributes, config, data position, counters), checksums verified: %s\n",
                info.metadata_fields, info.metadata_problems.empty() ? "ok" : "MISMATCH");
  } else {
    std::printf("metadata      unverified: written before dstrain sealed checkpoint metadata with checksums\n");
  }
  for (const std::string& p : info.metadata_problems) {
    std::fprintf(stderr, "dstrain-ckpt: error: %s: %s\n", path.c_str(), p.c_str());
  }
  if (bad) {
    std::fprintf(stderr, "dstrain-ckpt: error: %lld tensor(s) of %s fail their checksum: the file is corrupt\n",
                 (long long)bad, path.c_str());
  }
  if (!info.metadata_problems.empty()) {
    std::fprintf(stderr,
                 "dstrain-ckpt: error: the metadata of %s was altered or damaged after it was written: do not resume "
                 "from it\n",
                 path.c_str());
  }
  return bad || !info.metadata_problems.empty() ? 1 : 0;
}

int cmd_export(const std::string& path, const std::string& dir, std::string dtype, std::string layout) {
  using namespace dstrain;
  const CheckpointInfo info = inspect_checkpoint(path, /*verify=*/false);
  if (!info.metadata_problems.empty()) {
    std::string list;
    for (const std::string& p : info.metadata_problems) list += "\n  " + p;
    throw Error(fmt::format("{}: its metadata was altered or damaged after it was written:{}\n  export another "
                            "checkpoint",
                            path, list));
  }
  const ModelConfig model = ModelConfig::from_hf_json(info.state.config.at("model"), path + " (config)");
  // Unset: what the run would have written (output.save_hf_dtype, hf_layout and hf_fp8_block of
  // its configuration).
  const json out = info.state.config.value("output", json::object());
  if (dtype.empty()) dtype = out.is_object() ? out.value("save_hf_dtype", std::string("float32")) : "float32";
  if (layout.empty()) layout = out.is_object() ? out.value("hf_layout", std::string("standard")) : "standard";
  HFSaveOptions options;
  options.dtype = hf_export_dtype(dtype);
  options.released_layout = layout == "released";
  if (out.is_object() && out.contains("hf_fp8_block")) {
    const json& b = out["hf_fp8_block"];
    options.block = FP8Block{b.at(0).get<int64_t>(), b.at(1).get<int64_t>()};
  }
  Transformer t(model, Device::cpu());
  read_checkpoint(path, MPI_COMM_SELF, t.params(), nullptr, nullptr);  // verifies the model tensors
  save_hf_weights(dir, t.params(), model.to_hf_json(), options);
  std::printf("exported the model of %s (step %lld) to %s in %s, %s layout\n", path.c_str(),
              (long long)info.state.step, dir.c_str(), dtype.c_str(), layout.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  Kokkos::initialize(argc, argv);
  int rc = 0;
  try {
    CLI::App app{"dstrain-ckpt: inspect and convert dstrain checkpoints"};
    app.require_subcommand(1);
    std::string file, to_hf, dtype, layout;
    bool no_verify = false;
    CLI::App* info = app.add_subcommand("info", "show a checkpoint's step, layout and tensors, checksums verified");
    info->add_option("file", file, "checkpoint (.h5)")->required()->check(CLI::ExistingFile);
    info->add_flag("--no-verify", no_verify, "skip reading the tensors to verify their checksums");
    CLI::App* exp = app.add_subcommand("export", "write the model as Hugging Face safetensors + config.json");
    exp->add_option("file", file, "checkpoint (.h5)")->required()->check(CLI::ExistingFile);
    exp->add_option("--to-hf", to_hf, "output directory")->required();
    exp->add_option("--dtype", dtype,
                    "tensor dtype: float32, bfloat16, float16 or fp8 (DeepSeek's block-scaled FP8; default: the "
                    "run's output.save_hf_dtype)")
        ->check(CLI::IsMember({"float32", "bfloat16", "float16", "fp8"}));
    exp->add_option("--layout", layout,
                    "standard (transformers') or released (DeepSeek's: MTP modules with their own embedding and head "
                    "copies; default: the run's output.hf_layout)")
        ->check(CLI::IsMember({"standard", "released"}));
    try {
      app.parse(argc, argv);
      rc = info->parsed() ? cmd_info(file, !no_verify) : cmd_export(file, to_hf, dtype, layout);
    } catch (const CLI::ParseError& e) {
      const CLI::App* sub = info->parsed() ? info : exp->parsed() ? exp : nullptr;
      const std::string usage = sub ? "dstrain-ckpt " + sub->get_name() : "dstrain-ckpt";
      if (sub || e.get_exit_code() == 0 || (argc >= 2 && argv[1][0] == '-')) {
        rc = dstrain::cli::report(app, e, "dstrain-ckpt", usage);
      } else if (argc < 2) {
        rc = dstrain::cli::report("dstrain-ckpt", "no command given; the commands are info and export", usage);
      } else {
        rc = dstrain::cli::report(
            "dstrain-ckpt", fmt::format("unknown command '{}'; the commands are info and export", argv[1]), usage);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dstrain-ckpt: error: %s\n", e.what());
    rc = 1;
  }
  Kokkos::finalize();
  MPI_Finalize();
  return rc;
}
