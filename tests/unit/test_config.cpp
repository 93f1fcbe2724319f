// Configuration: strict keys, typed values, overrides, DeepSpeed batch arithmetic, Hugging
// Face config.json fields, and DeepSpeed's learning-rate formulas.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numbers>

#include <sys/stat.h>
#include <unistd.h>

#include "core/json_reader.h"
#include "train/layout_check.h"
#include "train/run_config.h"

namespace dstrain {
namespace {

using ::testing::HasSubstr;

class TempDir {
 public:
  TempDir() : path_(std::filesystem::temp_directory_path() / ("dstrain_cfg_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  std::string write(const std::string& name, const std::string& text) const {
    auto p = path_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

 private:
  std::filesystem::path path_;
};

const char* kModel = R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128,
  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "initializer_range": 0.02,
  "bos_token_id": 256, "eos_token_id": 257, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": true, "hidden_act": "silu",
  "pretraining_tp": 1, "rope_scaling": null})";

std::string run_json(const std::string& train_extra = "", const std::string& top_extra = "") {
  return std::string(R"({"model": )") + kModel + R"(, "train": {"train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
    "eps": 1e-8, "weight_decay": 0.1}}, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100,
    "warmup_num_steps": 10}}, "max_steps": 100)" + train_extra + R"(},
    "data": {"train": "x.bin", "seq_len": 64})" + top_extra + "}";
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Config, ReadsARunAndItsDeepSpeedKeys) {
  TempDir d;
  RunConfig c = RunConfig::load(d.write("run.json", run_json()), {});
  EXPECT_EQ(c.model.num_key_value_heads, 2);
  EXPECT_EQ(c.model.eos_token_ids, std::vector<int64_t>{257});
  EXPECT_EQ(c.train.micro_batch, 4);
  EXPECT_DOUBLE_EQ(c.train.adamw.beta2, 0.95);
  EXPECT_EQ(c.train.schedule.type, LrSchedule::Type::WarmupCosineLR);
  ASSERT_EQ(c.data.train.size(), 1u);
  EXPECT_EQ(c.data.train[0].paths, std::vector<std::string>{"x.bin"});
  EXPECT_EQ(c.data.train[0].format, "llmc");
  c.train.resolve_batch(2, "run.json");
  EXPECT_EQ(c.train.train_batch_size, 16);
  // The resolved configuration reads back to the same values.
  const json resolved = c.to_json();
  EXPECT_EQ(resolved["train"]["train_batch_size"], 16);
  EXPECT_EQ(resolved["model"]["num_key_value_heads"], 2);
}

// The resolved configuration a run writes (output.dir/resolved_config.json, what to_json prints)
// reads back as the same configuration: a sweep or a report that reloads a run's configuration
// needs it. It used to print the selective parts under granularity "none", which the reader
// refuses.
TEST(Config, TheResolvedConfigurationReadsBack) {
  TempDir d;
  for (const char* ac : {"", R"(, "activation_checkpointing": {"granularity": "full"})",
                         R"(, "activation_checkpointing": {"granularity": "selective", "selective": ["layernorm"]})"}) {
    RunConfig c = RunConfig::load(d.write("run.json", run_json(ac)), {});
    check_layout(c, 2);  // resolves the batch, as a run does before it writes the file
    const json resolved = c.to_json();
    RunConfig again;
    ASSERT_NO_THROW(again = RunConfig::load(d.write("resolved.json", resolved.dump()), {})) << ac;
    EXPECT_EQ(again.to_json(), resolved) << ac;
  }
}

TEST(Config, UnknownKeysAreErrorsWithSuggestions) {
  TempDir d;
  std::string msg = error_of([&] { RunConfig::load(d.write("a.json", run_json(R"(, "gradient_cliping": 1.0)")), {}); });
  EXPECT_THAT(msg, HasSubstr("unknown key 'train.gradient_cliping'"));
  EXPECT_THAT(msg, HasSubstr("did you mean 'train.gradient_clipping'"));
  EXPECT_THAT(msg, HasSubstr("a.json"));
  msg = error_of([&] { RunConfig::load(d.write("b.json", run_json("", R"(, "outputs": {})")), {}); });
  EXPECT_THAT(msg, HasSubstr("unknown key 'outputs'"));
}

TEST(Config, IllTypedValuesNameTheKey) {
  TempDir d;
  std::string msg = error_of([&] { RunConfig::load(d.write("a.json", run_json()), {"train.max_steps=\"ten\""}); });
  EXPECT_THAT(msg, HasSubstr("'train.max_steps' must be an integer"));
  msg = error_of([&] { RunConfig::load(d.write("a.json", run_json()), {"train.optimizer.params.betas=[0.9]"}); });
  EXPECT_THAT(msg, HasSubstr("train.optimizer.params.betas"));
  msg = error_of([&] { RunConfig::load(d.write("a.json", run_json()), {"data.shuffle=1"}); });
  EXPECT_THAT(msg, HasSubstr("'data.shuffle' must be true or false"));
  msg = error_of([&] { RunConfig::load(d.write("a.json", run_json()), {"train.optimizer.type=SGD"}); });
  EXPECT_THAT(msg, HasSubstr("train.optimizer.type"));
  msg = error_of([&] { RunConfig::load(d.write("a.json", run_json()), {"novalue"}); });
  EXPECT_THAT(msg, HasSubstr("KEY=VALUE"));
}

TEST(Config, OverridesApplyToAnyKey) {
  TempDir d;
  RunConfig c = RunConfig::load(d.write("a.json", run_json()),
                                {"train.optimizer.params.lr=1e-3", "data.train=[\"a.bin\",\"b.bin\"]",
                                 "output.dir=/tmp/x", "model.num_hidden_layers=3", "generate.prompt=hello world"});
  EXPECT_DOUBLE_EQ(c.train.adamw.lr, 1e-3);
  ASSERT_EQ(c.data.train.size(), 1u) << "a list of paths is one dataset";
  EXPECT_EQ(c.data.train[0].paths.size(), 2u);
  EXPECT_EQ(c.output.dir, "/tmp/x");
  EXPECT_EQ(c.model.num_hidden_layers, 3);
  EXPECT_EQ(c.generate.prompt, "hello world");
}

TEST(Config, DatasetsToBlendAndTheirSchedule) {
  TempDir d;
  RunConfig c = RunConfig::load(
      d.write("a.json", run_json()),
      {R"(data.train=[{"path": "web_text_document", "weight": 3, "name": "web", "format": "megatron"},
                      {"path": ["code_*.bin"], "weight": 1}])",
       R"(data.blend_schedule=[{"step": 100, "weights": [1, 1]}])"});
  ASSERT_EQ(c.data.train.size(), 2u);
  EXPECT_EQ(c.data.train[0].name, "web");
  EXPECT_EQ(c.data.train[0].format, "megatron");
  EXPECT_EQ(c.data.train[1].format, "llmc");
  ASSERT_EQ(c.data.schedule.size(), 2u);
  EXPECT_EQ(c.data.schedule[0].weights, (std::vector<double>{3, 1}));
  EXPECT_EQ(c.data.schedule[1].from_step, 100);
  // data.split divides Megatron datasets only.
  std::string msg = error_of([&] { RunConfig::load(d.write("b.json", run_json()), {"data.split=[98, 2]"}); });
  EXPECT_THAT(msg, HasSubstr("data.split"));
  c = RunConfig::load(d.write("b.json", run_json()), {"data.format=megatron", "data.train=web", "data.split=[98, 2]"});
  EXPECT_EQ(c.data.split, (std::vector<double>{98, 2}));
  msg = error_of([&] {
    RunConfig::load(d.write("c.json", run_json()),
                    {R"(data.train=[{"path": "a", "weight": 1}, {"path": "b", "weight": 1}])",
                     R"(data.blend_schedule=[{"step": 10, "weights": [1]}])"});
  });
  EXPECT_THAT(msg, HasSubstr("1 weights for 2 training datasets"));
  msg = error_of([&] { RunConfig::load(d.write("d.json", run_json()), {R"(data.train=[{"path": "a", "wieght": 2}])"}); });
  EXPECT_THAT(msg, HasSubstr("unknown key 'data.train[0].wieght'"));
  msg = error_of([&] { RunConfig::load(d.write("e.json", run_json()), {R"(data.train=[{"path": "a", "format": "arrow"}])"}); });
  EXPECT_THAT(msg, HasSubstr("arrow"));
}

TEST(Config, GenerateKeysOutsideTheirRangeAreErrors) {
  TempDir d;
  const std::string path = d.write("gen.json", run_json());
  EXPECT_THAT(error_of([&] { RunConfig::load(path, {"generate.max_new_tokens=0"}); }),
              HasSubstr("key 'generate.max_new_tokens' is 0; it must be positive"));
  EXPECT_THAT(error_of([&] { RunConfig::load(path, {"generate.temperature=-1"}); }),
              HasSubstr("key 'generate.temperature' is -1; it must be a finite number >= 0"));
  EXPECT_THAT(error_of([&] { RunConfig::load(path, {"generate.top_k=-1"}); }), HasSubstr("'generate.top_k'"));
  EXPECT_EQ(RunConfig::load(path, {"generate.max_new_tokens=1"}).generate.max_new_tokens, 1);
}

TEST(Config, DuplicateKeysAreErrorsNamingKeyAndLines) {
  TempDir d;
  std::string msg = error_of([&] {
    const std::string body = run_json().substr(1, run_json().size() - 2);
    const std::string text = R"({"output": {"dir": "a"},)" "\n" + body + ",\n" R"("output": {"dir": "b"}})";
    RunConfig::load(d.write("dup_top.json", text), {});
  });
  EXPECT_THAT(msg, HasSubstr("dup_top.json"));
  EXPECT_THAT(msg, HasSubstr("key 'output' is given twice, on lines 1 and 12"));  // run_json() has 10 lines
  // Nested, inside an array element, with comments and look-alike strings in between.
  msg = error_of([&] {
    RunConfig::load(d.write("dup_nested.json", std::string(R"({"model": )") + kModel + R"(,
      "train": {"train_micro_batch_size_per_gpu": 4, /* "eval_batches": { */ "eval_batches": 2},
      // "weight": 1}
      "data": {"seq_len": 64, "train": [{"path": "a", "name": "\"weight\": 3", "weight": 1},
                                         {"path": "b", "weight": 1,
                                          "weight": 2}]}})"),
                    {});
  });
  EXPECT_THAT(msg, HasSubstr("key 'data.train[1].weight' is given twice, on lines 10 and 11"));
  // The same key in sibling objects is no duplicate.
  const std::string siblings = run_json("", R"(, "output": {"dir": "x"}, "checkpoint": {"dir": "y"})");
  RunConfig c = RunConfig::load(d.write("siblings.json", siblings), {});
  EXPECT_EQ(c.checkpoint.dir, "y");
  // A model's config.json is read the same way.
  const std::string model = d.write("config.json", std::string(kModel).insert(1, "\"vocab_size\": 512,\n"));
  msg = error_of([&] { RunConfig::load(d.write("m.json", run_json()), {"model=\"" + model + "\""}); });
  EXPECT_THAT(msg, HasSubstr("config.json: key 'vocab_size' is given twice, on lines 1 and 3"));
  // And a JSON value given with --set.
  msg = error_of(
      [&] { RunConfig::load(d.write("s.json", run_json()), {R"(data.train=[{"path": "a", "path": "b"}])"}); });
  EXPECT_THAT(msg, HasSubstr("--set data.train: key 'data.train[0].path' is given twice"));
}

// Hostile or careless inputs end with a message, not a hang, a crash or a kernel OOM kill.
TEST(Config, NestingBeyondTheLimitIsRefusedBeforeParsing) {
  TempDir dir;
  // 300,000 nested arrays: the pass that checks duplicate keys once took memory quadratic in
  // the depth (24 GB), and printing such a value recursed until the stack overflowed.
  const std::string deep = R"({"model": )" + std::string(300000, '[') + std::string(300000, ']') + "}";
  const std::string path = dir.write("deep.json", deep);
  std::string msg = error_of([&] { (void)RunConfig::load(path, {}); });
  EXPECT_THAT(msg, HasSubstr(path));
  EXPECT_THAT(msg, HasSubstr("nest deeper than 64 levels (line 1, column 74)"));
  // Brackets inside strings and comments do not count.
  const std::string quoted = dir.write("quoted.json", R"({"a": ")" + std::string(100, '[') + R"("} // [[[[)" "\n");
  EXPECT_EQ(read_json_file(quoted)["a"], std::string(100, '['));
  // The model's config.json goes through the same reader.
  const std::string model = dir.write("config.json", std::string(70, '[') + std::string(70, ']'));
  msg = error_of([&] { (void)RunConfig::load(dir.write("run.json", R"({"model": ")" + model + R"("})"), {}); });
  EXPECT_THAT(msg, HasSubstr(model));
  EXPECT_THAT(msg, HasSubstr("nest deeper than 64 levels"));
  // And --set values.
  msg = error_of([] {
    json root = json::object();
    apply_override(root, "model=" + std::string(100, '[') + std::string(100, ']'));
  });
  EXPECT_THAT(msg, HasSubstr("command line --set model"));
  EXPECT_THAT(msg, HasSubstr("nest deeper than 64 levels"));
}

TEST(Config, OnlyRegularFilesOfBoundedSizeAreRead) {
  TempDir dir;
  // A FIFO would block forever waiting for a writer; /dev/zero never ends.
  const std::string fifo = dir.write("x", "") + ".fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  std::string msg = error_of([&] { (void)RunConfig::load(fifo, {}); });
  EXPECT_THAT(msg, HasSubstr(fifo));
  EXPECT_THAT(msg, HasSubstr("is a FIFO: give a regular file"));
  msg = error_of([] { (void)RunConfig::load("/dev/zero", {}); });
  EXPECT_THAT(msg, HasSubstr("'/dev/zero' is a character device"));
  msg = error_of([&] { (void)read_json_file(dir.write("", "")); });
  EXPECT_THAT(msg, HasSubstr("is a directory"));
  const std::string big = dir.write("big.json", "{\"a\": \"" + std::string((16 << 20) + 10, 'x') + "\"}");
  msg = error_of([&] { (void)RunConfig::load(big, {}); });
  EXPECT_THAT(msg, HasSubstr(big));
  EXPECT_THAT(msg, HasSubstr("more than the 16 MB such a file may take"));
  EXPECT_THAT(error_of([&] { (void)RunConfig::load(dir.write("bad.json", "{\"a\": [1,"), {}); }),
              HasSubstr("bad.json': not valid JSON"));
}

TEST(Config, NumbersBeyondADoubleAreErrorsNotStrings) {
  json root = json::object();
  std::string msg = error_of([&] { apply_override(root, "moe.capacity_factor=1e400"); });
  EXPECT_THAT(msg, HasSubstr("--set moe.capacity_factor: 1e400 is out of the range of a number"));
  TempDir dir;
  msg = error_of([&] { (void)read_json_file(dir.write("big_number.json", R"({"lr": -1e400})")); });
  EXPECT_THAT(msg, HasSubstr("big_number.json': not valid JSON"));
  // Text that is not JSON stays a string; an array or object that is not valid JSON is an error.
  apply_override(root, "output.dir=runs/a");
  EXPECT_EQ(root["output"]["dir"], "runs/a");
  EXPECT_THAT(error_of([&] { apply_override(root, "data.train=[a.bin]"); }), HasSubstr("not valid JSON"));
}

TEST(Config, ModelFromAnHFConfigFileWithInlineOverrides) {
  TempDir d;
  const std::string hf = d.write("config.json", kModel);
  RunConfig c = RunConfig::load(d.write("a.json", run_json()), {"model=\"" + hf + "\""});
  EXPECT_EQ(c.model.hidden_size, 32);
  c = RunConfig::load(d.write("a.json", run_json()), {"model={\"hf_config\": \"" + hf + "\", \"rope_theta\": 500000}"});
  EXPECT_DOUBLE_EQ(c.model.rope_theta, 500000);
}

TEST(Config, HFConfigFieldsThatChangeTheMathAreChecked) {
  auto parse = [](const std::string& patch) {
    json j = json::parse(kModel);
    j.merge_patch(json::parse(patch));
    return error_of([&] { ModelConfig::from_hf_json(j, "config.json"); });
  };
  EXPECT_THAT(parse(R"({"hidden_act": "gelu"})"), HasSubstr("hidden_act"));
  EXPECT_THAT(parse(R"({"rope_scaling": {"type": "linear", "factor": 2.0}})"), HasSubstr("rope_scaling"));
  EXPECT_THAT(parse(R"({"num_key_value_heads": 3})"), HasSubstr("num_key_value_heads"));
  EXPECT_THAT(parse(R"({"hiden_size": 3})"), HasSubstr("unknown key 'hiden_size'"));
  EXPECT_THAT(parse(R"({"model_type": "mistral"})"), HasSubstr("model_type"));
  EXPECT_EQ(parse(R"({"eos_token_id": [1, 2]})"), "no error");
}

TEST(Config, ShippedDeepSeekConfigsParse) {
  for (const char* name : {"deepseek-llm-7b-base.json", "deepseek-llm-67b-base.json"}) {
    const std::string path = std::string(DSTRAIN_SOURCE_DIR) + "/inputs/models/" + name;
    ModelConfig c = load_hf_config(path);
    EXPECT_EQ(c.vocab_size, 102400) << name;
    EXPECT_EQ(c.num_parameters() > 6'000'000'000, true) << name;
  }
  EXPECT_NEAR(load_hf_config(std::string(DSTRAIN_SOURCE_DIR) + "/inputs/models/deepseek-llm-7b-base.json")
                  .num_parameters(), 6.91e9, 0.01e9);
  EXPECT_NEAR(load_hf_config(std::string(DSTRAIN_SOURCE_DIR) + "/inputs/models/deepseek-llm-67b-base.json")
                  .num_parameters(), 67.4e9, 0.2e9);
}

// DeepSeek-V2-Lite and V3 as shipped: every MLA/MoE/MTP field read, and the parameter counts
// of their model cards (V2-Lite 15.7B; V3 671B plus the 14B multi-token-prediction module).
TEST(Config, ShippedDeepSeekV2AndV3ConfigsParse) {
  const std::string dir = std::string(DSTRAIN_SOURCE_DIR) + "/inputs/models/";
  ModelConfig lite = load_hf_config(dir + "deepseek-v2-lite.json");
  EXPECT_EQ(lite.model_type, "deepseek_v2");
  EXPECT_EQ(lite.q_lora_rank, 0) << "q_lora_rank null: q_proj";
  EXPECT_EQ(lite.kv_lora_rank, 512);
  EXPECT_EQ(lite.qk_nope_head_dim, 128);
  EXPECT_EQ(lite.qk_rope_head_dim, 64);
  EXPECT_EQ(lite.n_routed_experts, 64);
  EXPECT_EQ(lite.n_shared_experts, 2);
  EXPECT_EQ(lite.num_experts_per_tok, 6);
  EXPECT_EQ(lite.first_k_dense_replace, 1);
  EXPECT_EQ(lite.topk_method, "greedy");
  EXPECT_EQ(lite.scoring_func, "softmax");
  EXPECT_TRUE(lite.rope_scaling.yarn());
  EXPECT_NEAR(lite.num_parameters(), 15.7e9, 0.05e9);

  ModelConfig v3 = load_hf_config(dir + "deepseek-v3.json");
  EXPECT_EQ(v3.model_type, "deepseek_v3");
  EXPECT_EQ(v3.q_lora_rank, 1536);
  EXPECT_EQ(v3.n_routed_experts, 256);
  EXPECT_EQ(v3.n_group, 8);
  EXPECT_EQ(v3.topk_group, 4);
  EXPECT_EQ(v3.topk_method, "noaux_tc");
  EXPECT_EQ(v3.scoring_func, "sigmoid");
  EXPECT_TRUE(v3.norm_topk_prob);
  EXPECT_DOUBLE_EQ(v3.routed_scaling_factor, 2.5);
  EXPECT_EQ(v3.first_k_dense_replace, 3);
  EXPECT_EQ(v3.num_nextn_predict_layers, 1);
  EXPECT_NEAR(v3.num_parameters(), 671e9 + 14e9, 3e9);
  // Written back, a config reads the same.
  ModelConfig again = ModelConfig::from_hf_json(v3.to_hf_json(), "round trip");
  EXPECT_EQ(again.to_hf_json().dump(), v3.to_hf_json().dump());

  for (const char* name : {"deepseek-v2-tiny.json", "deepseek-v3-tiny.json"}) {
    ModelConfig c = load_hf_config(dir + name);
    EXPECT_TRUE(c.mla()) << name;
    EXPECT_GT(c.n_routed_experts, 0) << name;
    EXPECT_LT(c.num_parameters(), 50'000'000) << name << " is meant for CPU runs";
  }
}

TEST(Config, DeepSeekMoEFieldsThatCannotWorkAreErrors) {
  const std::string dir = std::string(DSTRAIN_SOURCE_DIR) + "/inputs/models/";
  const json base = json::parse(std::ifstream(dir + "deepseek-v3-tiny.json"));
  auto parse = [&](const std::string& patch) {
    json j = base;
    j.merge_patch(json::parse(patch));
    return error_of([&] { ModelConfig::from_hf_json(j, "v3.json"); });
  };
  EXPECT_EQ(parse("{}"), "no error");
  EXPECT_THAT(parse(R"({"scoring_func": "relu"})"), HasSubstr("scoring_func"));
  EXPECT_THAT(parse(R"({"topk_method": "random"})"), HasSubstr("topk_method"));
  EXPECT_THAT(parse(R"({"n_group": 5})"), HasSubstr("n_group"));
  EXPECT_THAT(parse(R"({"topk_group": 1, "num_experts_per_tok": 9})"), HasSubstr("topk_group"));
  EXPECT_THAT(parse(R"({"rope_scaling": {"factor": null}})"), HasSubstr("factor"));
  EXPECT_THAT(parse(R"({"rope_scaling": {"type": "dynamic", "factor": 2}})"), HasSubstr("yarn"));
  EXPECT_EQ(parse(R"({"topk_method": "gready", "scoring_func": "softmax"})"), "no error");
  EXPECT_EQ(parse(R"({"q_lora_rank": null})"), "no error");
}

// The "moe" block: optional token dropping, onto the model's runtime fields, never into its
// config.json; every key checked.
TEST(Config, MoECapacityBlockParsesAndIsChecked) {
  TempDir d;
  const std::string moe_model = std::string("\"") + DSTRAIN_SOURCE_DIR + "/inputs/models/deepseek-v3-tiny.json\"";
  auto run = [&](const std::string& top_extra, bool moe = true) {
    std::string text = run_json("", top_extra);
    if (moe) text.replace(text.find(kModel), std::strlen(kModel), moe_model);
    return d.write("moe.json", text);
  };
  // Absent: no capacity, DeepSeek's behaviour.
  RunConfig none = RunConfig::load(run(""), {});
  EXPECT_EQ(none.model.moe_capacity_factor, 0.0);
  EXPECT_EQ(none.model.moe_drop_policy, "probs");
  EXPECT_TRUE(none.to_json()["moe"]["capacity_factor"].is_null());
  EXPECT_EQ(none.to_json()["moe"]["drop_policy"], "probs");

  RunConfig c = RunConfig::load(run(R"(, "moe": {"capacity_factor": 1.25, "drop_policy": "position"})"), {});
  EXPECT_DOUBLE_EQ(c.model.moe_capacity_factor, 1.25);
  EXPECT_EQ(c.model.moe_drop_policy, "position");
  const json resolved = c.to_json();
  EXPECT_DOUBLE_EQ(resolved["moe"]["capacity_factor"].get<double>(), 1.25);
  EXPECT_EQ(resolved["moe"]["drop_policy"], "position");
  // A training choice, not the architecture: config.json neither has it nor changes with it.
  EXPECT_EQ(c.model.to_hf_json().dump(), none.model.to_hf_json().dump());
  EXPECT_EQ(resolved["model"].dump().find("capacity"), std::string::npos);
  EXPECT_EQ(ModelConfig::from_hf_json(c.model.to_hf_json(), "round trip").moe_capacity_factor, 0.0);

  EXPECT_EQ(RunConfig::load(run(R"(, "moe": {"capacity_factor": null})"), {}).model.moe_capacity_factor, 0.0);
  EXPECT_EQ(RunConfig::load(run(R"(, "moe": {"capacity_factor": 2})"), {}).model.moe_drop_policy, "probs");
  EXPECT_DOUBLE_EQ(RunConfig::load(run(""), {"moe.capacity_factor=1.5"}).model.moe_capacity_factor, 1.5);

  auto error = [&](const std::string& moe) { return error_of([&] { RunConfig::load(run(moe), {}); }); };
  EXPECT_THAT(error(R"(, "moe": {"capacity_factr": 1.0})"), HasSubstr("unknown key 'moe.capacity_factr'"));
  EXPECT_THAT(error(R"(, "moe": {"capacity_factr": 1.0})"), HasSubstr("did you mean 'moe.capacity_factor'"));
  EXPECT_THAT(error(R"(, "moe": {"capacity_factor": 0})"),
              HasSubstr("key 'moe.capacity_factor' is 0; it must be a positive number"));
  EXPECT_THAT(error(R"(, "moe": {"capacity_factor": -1.5})"), HasSubstr("key 'moe.capacity_factor' is -1.5"));
  EXPECT_THAT(error(R"(, "moe": {"capacity_factor": "1"})"), HasSubstr("'moe.capacity_factor' must be a number"));
  // Beyond n_routed_experts nothing can be dropped; 1e300 once overflowed the capacity's int64.
  EXPECT_THAT(error(R"(, "moe": {"capacity_factor": 1e300})"),
              HasSubstr("key 'moe.capacity_factor' is 1e+300, above n_routed_experts"));
  EXPECT_THAT(error_of([&] { RunConfig::load(run(""), {"moe.capacity_factor=1e400"}); }),
              HasSubstr("1e400 is out of the range of a number"));
  EXPECT_THAT(error(R"(, "moe": {"capacity_factor": 1, "drop_policy": "random"})"),
              HasSubstr("key 'moe.drop_policy' is \"random\"; it must be \"probs\""));
  EXPECT_THAT(error_of([&] { RunConfig::load(run(R"(, "moe": {"capacity_factor": 1})", /*moe=*/false), {}); }),
              HasSubstr("key 'moe.capacity_factor' is set, but the model has no routed experts"));
}

TEST(Config, DeviceIsTheHostOrCuda) {
  TempDir d;
  auto run = [&](const std::string& top_extra) { return d.write("device.json", run_json("", top_extra)); };
  EXPECT_EQ(RunConfig::load(run(""), {}).device, "cpu");
  const RunConfig c = RunConfig::load(run(R"(, "device": "cuda")"), {});
  EXPECT_EQ(c.device, "cuda");
  EXPECT_EQ(c.to_json()["device"], "cuda");
  EXPECT_EQ(RunConfig::load(run(""), {R"(device="cuda")"}).device, "cuda");
  auto error = [&](const std::string& extra) { return error_of([&] { RunConfig::load(run(extra), {}); }); };
  EXPECT_THAT(error(R"(, "device": "gpu")"), HasSubstr("key 'device' is \"gpu\"; it must be \"cpu\" or \"cuda\""));
  EXPECT_THAT(error(R"(, "device": 0)"), HasSubstr("'device' must be a string"));
}

TEST(Config, BatchArithmeticFollowsDeepSpeed) {
  TrainConfig t;
  t.train_batch_size = 32;
  t.micro_batch = 4;
  t.resolve_batch(2, "x");
  EXPECT_EQ(t.grad_accum, 4);
  TrainConfig u;
  u.train_batch_size = 30;
  u.micro_batch = 4;
  EXPECT_THAT(error_of([&] { u.resolve_batch(1, "x"); }), HasSubstr("not divisible"));
  TrainConfig v;
  v.train_batch_size = 16;
  v.micro_batch = 4;
  v.grad_accum = 2;
  EXPECT_THAT(error_of([&] { v.resolve_batch(1, "x"); }), HasSubstr("train_batch_size 16 != 4 x 2 x 1"));
}

TEST(Config, ZeroOrNegativeBatchKeysAreErrorsNotUnset) {
  TempDir d;
  const std::string path = d.write("batch.json", run_json());
  for (const char* key : {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"}) {
    for (const char* value : {"0", "-2"}) {
      const std::string msg =
          error_of([&] { RunConfig::load(path, {fmt::format("train.{}={}", key, value)}); });
      EXPECT_THAT(msg, HasSubstr(fmt::format("key 'train.{}' is {}; it must be a positive integer", key, value)));
      EXPECT_THAT(msg, HasSubstr("batch.json"));
    }
  }
  // null leaves a key to be derived, e.g. to override the accumulation through train_batch_size.
  RunConfig c = RunConfig::load(path, {"train.gradient_accumulation_steps=null", "train.train_batch_size=24"});
  c.train.resolve_batch(2, path);
  EXPECT_EQ(c.train.grad_accum, 3);
}

TEST(Config, MixedPrecisionKeysWithDeepSpeedsNamesAndDefaults) {
  TempDir d;
  const std::string path = d.write("mp.json", run_json());
  // Neither enabled: fp32 everywhere, and the fp16 block's defaults are DeepSpeed's.
  RunConfig c = RunConfig::load(path, {});
  EXPECT_EQ(c.train.precision.compute_dtype(), DType::F32);
  EXPECT_EQ(c.train.precision.communication_dtype(), DType::F32);
  EXPECT_EQ(c.output.save_hf_dtype, "float32");
  const LossScalerConfig& s = c.train.precision.fp16_scaler;
  EXPECT_EQ(s.loss_scale, 0);
  EXPECT_EQ(s.initial_scale_power, 16);
  EXPECT_EQ(s.loss_scale_window, 1000);
  EXPECT_EQ(s.hysteresis, 2);
  EXPECT_EQ(s.min_loss_scale, 1);

  c = RunConfig::load(path, {"train.bf16={\"enabled\": true}"});
  EXPECT_EQ(c.train.precision.compute_dtype(), DType::BF16);
  EXPECT_EQ(c.train.precision.communication_dtype(), DType::BF16) << "DeepSpeed communicates in the compute dtype";
  EXPECT_EQ(c.output.save_hf_dtype, "bfloat16");

  c = RunConfig::load(path, {"train.fp16={\"enabled\": true, \"loss_scale\": 0, \"initial_scale_power\": 12, "
                             "\"loss_scale_window\": 100, \"hysteresis\": 3, \"min_loss_scale\": 0.25}",
                             "train.communication_data_type=fp32", "output.save_hf_dtype=bfloat16"});
  EXPECT_EQ(c.train.precision.compute_dtype(), DType::F16);
  EXPECT_EQ(c.train.precision.communication_dtype(), DType::F32);
  EXPECT_EQ(c.train.precision.fp16_scaler.initial_scale_power, 12);
  EXPECT_EQ(c.train.precision.fp16_scaler.loss_scale_window, 100);
  EXPECT_EQ(c.train.precision.fp16_scaler.hysteresis, 3);
  EXPECT_EQ(c.train.precision.fp16_scaler.min_loss_scale, 0.25);
  EXPECT_EQ(c.output.save_hf_dtype, "bfloat16");

  // to_json prints them, and what it prints reads back to the same configuration.
  const json j = c.to_json();
  EXPECT_EQ(j["train"]["fp16"]["enabled"], true);
  EXPECT_EQ(j["train"]["fp16"]["hysteresis"], 3);
  EXPECT_EQ(j["train"]["bf16"]["enabled"], false);
  EXPECT_EQ(j["train"]["communication_data_type"], "fp32");
  EXPECT_EQ(j["output"]["save_hf_dtype"], "bfloat16");
  json again = json::parse(run_json());
  again["train"]["fp16"] = j["train"]["fp16"];
  again["train"]["bf16"] = j["train"]["bf16"];
  again["train"]["communication_data_type"] = j["train"]["communication_data_type"];
  const RunConfig c2 = RunConfig::load(d.write("again.json", again.dump()), {});
  EXPECT_EQ(c2.to_json()["train"], j["train"]);
}

TEST(Config, MixedPrecisionMistakesAreErrorsNamingTheKey) {
  TempDir d;
  const std::string path = d.write("mp.json", run_json());
  auto msg = [&](std::vector<std::string> o) { return error_of([&] { RunConfig::load(path, o); }); };
  EXPECT_THAT(msg({"train.bf16={\"enabled\": true}", "train.fp16={\"enabled\": true}"}),
              HasSubstr("'train.fp16' and train.bf16 are both enabled"));
  EXPECT_THAT(msg({"train.fp16={\"enabled\": true, \"loss_scale_windows\": 10}"}),
              HasSubstr("unknown key 'train.fp16.loss_scale_windows'"));
  EXPECT_THAT(msg({"train.bf16={\"enable\": true}"}), HasSubstr("unknown key 'train.bf16.enable'"));
  EXPECT_THAT(msg({"train.epochs=-1"}), HasSubstr("key 'train.epochs' is -1; it must be a number of passes"));
  // A static scale no step could survive (the scaled loss is fp32, whose maximum is 3.4e38).
  EXPECT_THAT(msg({"train.fp16={\"enabled\": true, \"loss_scale\": 1e39}"}),
              HasSubstr("key 'train.fp16.loss_scale' is 1e+39, above 2^100"));
  EXPECT_THAT(msg({"train.bf16={\"enabled\": \"auto\"}"}), HasSubstr("'train.bf16.enabled' must be true or false"));
  EXPECT_THAT(msg({"train.fp16={\"hysteresis\": 1.5}"}), HasSubstr("'train.fp16.hysteresis' must be an integer"));
  EXPECT_THAT(msg({"train.fp16={\"loss_scale\": \"dynamic\"}"}), HasSubstr("'train.fp16.loss_scale' must be a number"));
  EXPECT_THAT(msg({"train.fp16={\"loss_scale\": -1}"}), HasSubstr("'train.fp16.loss_scale' is -1"));
  EXPECT_THAT(msg({"train.fp16={\"hysteresis\": 0}"}), HasSubstr("train.fp16.hysteresis"));
  EXPECT_THAT(msg({"train.fp16={\"loss_scale_window\": 0}"}), HasSubstr("train.fp16.loss_scale_window"));
  EXPECT_THAT(msg({"train.fp16={\"min_loss_scale\": 0}"}), HasSubstr("train.fp16.min_loss_scale"));
  EXPECT_THAT(msg({"train.fp16={\"initial_scale_power\": 200}"}), HasSubstr("train.fp16.initial_scale_power"));
  EXPECT_THAT(msg({"train.fp16=true"}), HasSubstr("'train.fp16' must be an object"));
  EXPECT_THAT(msg({"train.communication_data_type=fp8"}), HasSubstr("'train.communication_data_type' is \"fp8\""));
  EXPECT_THAT(msg({"train.communication_data_type=16"}), HasSubstr("'train.communication_data_type' must be a string"));
  EXPECT_THAT(msg({"output.save_hf_dtype=half"}), HasSubstr("'output.save_hf_dtype' is \"half\""));
  EXPECT_THAT(msg({"output.hf_dtype=e5m2"}), HasSubstr("'output.hf_dtype' is \"e5m2\""));
  EXPECT_THAT(msg({"output.hf_dtype=fp8", "output.save_hf_dtype=fp8"}),
              HasSubstr("'output.hf_dtype' and save_hf_dtype are the same setting"));
  EXPECT_THAT(msg({"output.hf_layout=deepseek"}), HasSubstr("'output.hf_layout' is \"deepseek\""));
  EXPECT_THAT(msg({"output.hf_fp8_block=[128]"}), HasSubstr("'output.hf_fp8_block' is [128]"));
  EXPECT_THAT(msg({"output.hf_fp8_block=[0, 128]"}), HasSubstr("'output.hf_fp8_block'"));
}

// DeepSeek's released layout and FP8: output.hf_dtype (save_hf_dtype by another name),
// hf_layout and hf_fp8_block, kept in the run's configuration.
TEST(Config, ReleasedLayoutAndFP8Export) {
  TempDir d;
  const std::string path = d.write("run.json", run_json());
  RunConfig c = RunConfig::load(path, {});
  EXPECT_EQ(c.output.hf_layout, "standard");
  EXPECT_EQ(c.output.hf_fp8_block, (std::vector<int64_t>{128, 128}));
  c = RunConfig::load(path, {"output.hf_dtype=fp8", "output.hf_layout=released", "output.hf_fp8_block=[64, 32]"});
  EXPECT_EQ(c.output.save_hf_dtype, "fp8");
  EXPECT_EQ(c.output.hf_layout, "released");
  EXPECT_EQ(c.output.hf_fp8_block, (std::vector<int64_t>{64, 32}));
  const json j = c.to_json();
  EXPECT_EQ(j["output"]["save_hf_dtype"], "fp8");
  EXPECT_EQ(j["output"]["hf_layout"], "released");
  EXPECT_EQ(j["output"]["hf_fp8_block"], (json{64, 32}));
}

TEST(Config, ZeroOptimizationKeysWithDeepSpeedsNames) {
  TempDir d;
  const std::string path = d.write("zero.json", run_json());
  RunConfig c = RunConfig::load(path, {});
  EXPECT_EQ(c.train.zero.stage, 0);
  EXPECT_EQ(c.train.zero.stage3_param_persistence_threshold, 100000);  // DeepSpeed's defaults
  EXPECT_EQ(c.train.zero.stage3_prefetch_bucket_size, 50000000);
  c = RunConfig::load(path, {"train.zero_optimization={\"stage\": 3, \"reduce_bucket_size\": 1000, "
                             "\"allgather_bucket_size\": 2000, \"overlap_comm\": false, \"contiguous_gradients\": true, "
                             "\"offload_optimizer\": {\"device\": \"cpu\", \"pin_memory\": true}, "
                             "\"offload_param\": {\"device\": \"cpu\"}, \"stage3_prefetch_bucket_size\": 300, "
                             "\"stage3_param_persistence_threshold\": 10, \"stage3_max_live_parameters\": 5000}",
                             "train.bf16={\"enabled\": true}"});
  const ZeroConfig& z = c.train.zero;
  EXPECT_EQ(z.stage, 3);
  EXPECT_EQ(z.reduce_bucket_size, 1000);
  EXPECT_EQ(z.allgather_bucket_size, 2000);
  EXPECT_FALSE(z.overlap_comm);
  EXPECT_TRUE(z.offloads_optimizer());
  EXPECT_TRUE(z.offload_optimizer_pin_memory);
  EXPECT_TRUE(z.offloads_params());
  EXPECT_EQ(z.stage3_prefetch_bucket_size, 300);
  EXPECT_EQ(z.stage3_param_persistence_threshold, 10);
  EXPECT_EQ(z.stage3_max_live_parameters, 5000);
  // As at stage 0, gradients travel in the compute precision unless told otherwise.
  EXPECT_EQ(c.train.precision.communication_data_type, "bf16");
  // The resolved configuration reads back to itself.
  const json j = c.to_json();
  json again = json::parse(run_json());
  again["train"]["zero_optimization"] = j["train"]["zero_optimization"];
  again["train"]["bf16"] = j["train"]["bf16"];
  const RunConfig c2 = RunConfig::load(d.write("again.json", again.dump()), {});
  EXPECT_EQ(c2.to_json()["train"]["zero_optimization"], j["train"]["zero_optimization"]);
}

TEST(Config, ZeroMistakesAreErrorsNamingTheKey) {
  TempDir d;
  const std::string path = d.write("zero.json", run_json());
  auto msg = [&](std::vector<std::string> o) { return error_of([&] { RunConfig::load(path, o); }); };
  EXPECT_THAT(msg({"train.zero_optimization.stage=4"}), HasSubstr("'train.zero_optimization.stage' is 4"));
  EXPECT_THAT(msg({"train.zero_optimization.stage=\"2\""}), HasSubstr("'train.zero_optimization.stage' must be an integer"));
  EXPECT_THAT(msg({"train.zero_optimization.reduce_bucket_size=0"}), HasSubstr("train.zero_optimization.reduce_bucket_size"));
  EXPECT_THAT(msg({"train.zero_optimization.stage3_max_live_parameters=-1"}),
              HasSubstr("train.zero_optimization.stage3_max_live_parameters"));
  EXPECT_THAT(msg({"train.zero_optimization.overlap_com=true"}), HasSubstr("unknown key 'train.zero_optimization.overlap_com'"));
  EXPECT_THAT(msg({"train.zero_optimization.offload_optimizer={\"device\": \"nvme\"}", "train.zero_optimization.stage=2"}),
              HasSubstr("'train.zero_optimization.offload_optimizer.device' is \"nvme\""));
  EXPECT_THAT(msg({"train.zero_optimization.offload_optimizer={\"device\": \"cpu\"}"}),
              HasSubstr("needs a sharded optimizer"));
  EXPECT_THAT(msg({"train.zero_optimization.offload_param={\"device\": \"cpu\"}", "train.zero_optimization.stage=2"}),
              HasSubstr("needs stage 3"));
  EXPECT_THAT(msg({"train.zero_optimization.offload_param={\"device\": \"cpu\"}", "train.zero_optimization.stage=3"}),
              HasSubstr("needs offload_optimizer.device \"cpu\" as well"));
  EXPECT_THAT(msg({"train.zero_optimization.offload_param={\"device\": \"cpu\", \"nvme_path\": \"/x\"}",
                   "train.zero_optimization.stage=3"}),
              HasSubstr("unknown key 'train.zero_optimization.offload_param.nvme_path'"));
}

// train.activation_checkpointing: DeepSpeed's section name, Megatron's choices; what is not
// implemented or not a choice is an error naming the key.
TEST(Config, ActivationCheckpointingKeys) {
  TempDir d;
  const std::string path = d.write("ac.json", run_json());
  EXPECT_FALSE(RunConfig::load(path, {}).train.activation_checkpointing.full());
  const RunConfig c = RunConfig::load(path, {"train.activation_checkpointing={\"granularity\": \"full\", "
                                             "\"method\": \"block\", \"num_layers\": 3, \"cpu_checkpointing\": false}"});
  const ActivationCheckpointingConfig& a = c.train.activation_checkpointing;
  EXPECT_TRUE(a.full());
  EXPECT_EQ(a.method, "block");
  EXPECT_EQ(a.num_layers, 3);
  EXPECT_EQ(c.to_json()["train"]["activation_checkpointing"]["method"], "block");
  auto msg = [&](std::vector<std::string> o) { return error_of([&] { RunConfig::load(path, o); }); };
  EXPECT_THAT(msg({"train.activation_checkpointing.granularity=\"layers\""}),
              HasSubstr("'train.activation_checkpointing.granularity' is \"layers\""));
  const RunConfig sel = RunConfig::load(path, {"train.activation_checkpointing={\"granularity\": \"selective\", "
                                               "\"selective\": [\"layernorm\", \"moe_act\"]}"});
  EXPECT_TRUE(sel.train.activation_checkpointing.selects("layernorm"));
  EXPECT_TRUE(sel.train.activation_checkpointing.selects("moe_act"));
  EXPECT_FALSE(sel.train.activation_checkpointing.selects("core_attn"));
  // "mla_up_proj" on a model with MLA; on one without (this llama model) it would save nothing.
  const std::string mla_up_proj = "train.activation_checkpointing={\"granularity\": \"selective\", \"selective\": "
                                  "[\"layernorm\", \"mla_up_proj\"]}";
  std::string v3_text = run_json();
  v3_text.replace(v3_text.find(kModel), std::strlen(kModel),
                  std::string("\"") + DSTRAIN_SOURCE_DIR + "/inputs/models/deepseek-v3-tiny.json\"");
  const RunConfig v3 = RunConfig::load(d.write("ac_v3.json", v3_text), {mla_up_proj});
  EXPECT_TRUE(v3.train.activation_checkpointing.selects("mla_up_proj"));
  EXPECT_EQ(v3.to_json()["train"]["activation_checkpointing"]["selective"], json({"layernorm", "mla_up_proj"}));
  EXPECT_THAT(msg({mla_up_proj}), HasSubstr("key 'train.activation_checkpointing.selective' \"mla_up_proj\" forms "
                                            "Multi-head Latent Attention's heads again, but model_type \"llama\" has "
                                            "no MLA"));
  for (const char* part : {"mlp", "moe", "shared_experts"}) {
    EXPECT_THAT(msg({fmt::format("train.activation_checkpointing={{\"granularity\": \"selective\", \"selective\": "
                                 "[\"{}\"]}}",
                                 part)}),
                HasSubstr(fmt::format("'train.activation_checkpointing.selective' \"{}\" is not implemented yet", part)));
  }
  EXPECT_THAT(msg({"train.activation_checkpointing={\"granularity\": \"selective\", \"selective\": [\"norms\"]}"}),
              HasSubstr("'train.activation_checkpointing.selective' \"norms\" is not a part"));
  EXPECT_THAT(msg({"train.activation_checkpointing={\"granularity\": \"full\", \"selective\": [\"layernorm\"]}"}),
              HasSubstr("but granularity is \"full\""));
  EXPECT_THAT(msg({"train.activation_checkpointing.method=\"all\""}),
              HasSubstr("'train.activation_checkpointing.method' is \"all\""));
  EXPECT_THAT(msg({"train.activation_checkpointing.num_layers=0"}),
              HasSubstr("'train.activation_checkpointing.num_layers' is 0"));
  EXPECT_FALSE(a.cpu_checkpointing);
  const RunConfig cpu = RunConfig::load(path, {"train.activation_checkpointing={\"granularity\": \"full\", "
                                               "\"cpu_checkpointing\": true}"});
  EXPECT_TRUE(cpu.train.activation_checkpointing.cpu_checkpointing);
  EXPECT_EQ(cpu.to_json()["train"]["activation_checkpointing"]["cpu_checkpointing"], true);
  EXPECT_THAT(msg({"train.activation_checkpointing.cpu_checkpointing=true"}),
              HasSubstr("key 'train.activation_checkpointing.cpu_checkpointing' keeps the inputs of recomputed layers "
                        "in host memory, so it needs granularity \"full\", but granularity is \"none\""));
  EXPECT_THAT(msg({"train.activation_checkpointing={\"granularity\": \"selective\", \"cpu_checkpointing\": true}"}),
              HasSubstr("granularity is \"selective\""));
  EXPECT_THAT(msg({"train.activation_checkpointing.partition_activations=true"}),
              HasSubstr("unknown key 'train.activation_checkpointing.partition_activations'"));
}

// The process grid with Megatron's names; mistakes name the key.
TEST(Config, TensorAndSequenceParallelKeys) {
  TempDir d;
  const std::string path = d.write("tp.json", run_json());
  const RunConfig c = RunConfig::load(path, {"parallel.tensor=2", "parallel.sequence_parallel=true"});
  EXPECT_EQ(c.parallel.tensor, 2);
  EXPECT_TRUE(c.parallel.sequence_parallel);
  EXPECT_EQ(c.to_json()["parallel"]["sequence_parallel"], true);
  EXPECT_FALSE(RunConfig::load(path, {}).parallel.sequence_parallel);
  auto msg = [&](std::vector<std::string> o) { return error_of([&] { RunConfig::load(path, o); }); };
  EXPECT_THAT(msg({"parallel.tensor=0"}), HasSubstr("parallel.tensor"));
  EXPECT_THAT(msg({"parallel.sequence_parallel=1"}), HasSubstr("parallel.sequence_parallel"));
  EXPECT_THAT(msg({"parallel.sequence_paralel=true"}), HasSubstr("unknown key 'parallel.sequence_paralel'"));
  // Without tensor parallelism there is no sequence to split: an error, not a silent no-op.
  EXPECT_THAT(msg({"parallel.sequence_parallel=true"}),
              HasSubstr("key 'parallel.sequence_parallel' is true, but parallel.tensor is 1"));
}

TEST(Config, PipelineKeys) {
  TempDir d;
  const std::string path = d.write("pp.json", run_json());
  const RunConfig c = RunConfig::load(path, {"parallel.pipeline=4", "parallel.schedule=\"interleaved\"",
                                             "parallel.virtual_stages=2", "parallel.partition=[1, 2, 1, 2, 1, 1, 1, 1]"});
  EXPECT_EQ(c.parallel.pipeline, 4);
  EXPECT_EQ(c.parallel.schedule, "interleaved");
  EXPECT_EQ(c.parallel.virtual_stages, 2);
  EXPECT_EQ(c.parallel.partition, (std::vector<int64_t>{1, 2, 1, 2, 1, 1, 1, 1}));
  EXPECT_EQ(c.to_json()["parallel"]["schedule"], "interleaved");
  const RunConfig plain = RunConfig::load(path, {});
  EXPECT_EQ(plain.parallel.schedule, "1f1b");
  EXPECT_TRUE(plain.parallel.partition.empty());
  auto msg = [&](std::vector<std::string> o) { return error_of([&] { RunConfig::load(path, o); }); };
  EXPECT_THAT(msg({"parallel.schedule=\"gpipe\""}), HasSubstr("parallel.schedule"));
  EXPECT_THAT(msg({"parallel.schedule=\"interleaved\""}), HasSubstr("parallel.virtual_stages"));
  EXPECT_THAT(msg({"parallel.virtual_stages=2"}), HasSubstr("parallel.virtual_stages"));
  EXPECT_THAT(msg({"parallel.partition=[1, \"x\"]"}), HasSubstr("parallel.partition"));
  EXPECT_THAT(msg({"parallel.partition=3"}), HasSubstr("parallel.partition"));
}

TEST(LrSchedule, DeepSpeedFormulas) {
  auto sched = [](const std::string& text) {
    json j = json::parse(text);
    return LrSchedule::from_json(JsonReader(j, "train.scheduler", "test"));
  };
  // WarmupCosineLR with linear warmup, ratios of the base lr.
  LrSchedule c = sched(R"({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 4,
                          "warmup_min_ratio": 0.1, "cos_min_ratio": 0.2, "warmup_type": "linear"}})");
  EXPECT_DOUBLE_EQ(c.lr_at(0, 1.0), 0.1);
  EXPECT_DOUBLE_EQ(c.lr_at(2, 1.0), 0.1 + 0.5 * 0.9);
  EXPECT_NEAR(c.lr_at(4, 1.0), 0.2 + 0.8 * (1 + std::cos(std::numbers::pi * 1 / 6)) / 2, 1e-12);
  EXPECT_NEAR(c.lr_at(9, 2.0), 2 * 0.2, 1e-12);  // the floor at the last step
  // WarmupLR with DeepSpeed's default log warmup, then constant.
  LrSchedule w = sched(R"({"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                          "warmup_num_steps": 100}})");
  EXPECT_DOUBLE_EQ(w.lr_at(0, 1.0), 0.0);
  EXPECT_NEAR(w.lr_at(9, 1.0), 0.01 * std::log(10.0) / std::log(100.0), 1e-15);
  EXPECT_DOUBLE_EQ(w.lr_at(500, 1.0), 0.01);
  // WarmupDecayLR decays linearly to warmup_min_lr at total_num_steps.
  LrSchedule d = sched(R"({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.001, "warmup_num_steps": 10,
                          "total_num_steps": 110, "warmup_type": "linear"}})");
  EXPECT_DOUBLE_EQ(d.lr_at(5, 0.1), 0.001 + (0.1 - 0.001) * 0.5);
  EXPECT_DOUBLE_EQ(d.lr_at(60, 0.1), 0.001 + (0.1 - 0.001) * 0.5);
  EXPECT_DOUBLE_EQ(d.lr_at(200, 0.1), 0.001);
  EXPECT_DOUBLE_EQ(LrSchedule().lr_at(77, 0.3), 0.3);
  EXPECT_THAT(error_of([&] { sched(R"({"type": "OneCycle"})"); }), HasSubstr("OneCycle"));
  EXPECT_THAT(error_of([&] { sched(R"({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}})"); }),
              HasSubstr("total_num_steps"));
}

}  // namespace
}  // namespace dstrain
