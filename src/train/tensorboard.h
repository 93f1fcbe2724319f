// TensorBoard event files written by rank 0 (metrics.tensorboard_dir): the TFRecord framing
// with its masked CRC-32C, and the Event, Summary, HistogramProto and SessionLog protobufs of
// tensorboard/compat/proto encoded by hand, so that dstrain needs neither protobuf nor TensorFlow.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/json_reader.h"

namespace dstrain {

namespace tfrecord {
// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `n` bytes, continuing from `crc`.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);
// TFRecord's stored form of a CRC: rotated right by 15 and offset, so that a CRC of data that
// itself holds CRCs is not trivially zero.
uint32_t mask(uint32_t crc);
// Protobuf base-128 varint, least significant group first.
void put_varint(std::string& out, uint64_t v);
// One record: uint64 length (little-endian), masked CRC-32C of those 8 bytes, the data, masked
// CRC-32C of the data.
std::string frame(std::string_view data);
}  // namespace tfrecord

// HistogramProto: bucket i counts the values in (limits[i-1], limits[i]] (TensorBoard draws
// the first from min, the last up to max).
struct TbHistogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> limits, counts;
};
// One MoE layer's routing as a histogram over expert index: each (token, expert) assignment is
// the value e, expert e's bucket is (e - 0.5, e + 0.5] and holds its token count; min and max
// are the buckets' range, -0.5 and n_experts - 0.5.
TbHistogram expert_load_histogram(const std::vector<int64_t>& tokens_per_expert);

// The scalars of one step as TensorBoard tags (loss/total, loss/ce, lr, grad_norm,
// throughput/tokens_per_s, time/<phase>, memory/<category>, ...), each read from the step's
// metrics.jsonl record, so that both show the same figures (to float32, TensorBoard's type).
std::vector<std::pair<std::string, double>> tensorboard_step_scalars(const json& step_record);
// The expert-load histograms of a step record: {"moe/layer_<l>/expert_tokens", histogram}.
std::vector<std::pair<std::string, TbHistogram>> tensorboard_step_histograms(const json& step_record);
// An evaluation: eval/loss, eval/accuracy, and eval/<dataset>/{loss,accuracy} per dataset.
std::vector<std::pair<std::string, double>> tensorboard_eval_scalars(double loss, double accuracy,
                                                                      const json& per_dataset);

// Rank 0, before it writes: "" when `dir` may take this run's events, after creating it and
// recording the run in dir/dstrain_run.json (the absolute output.dir); otherwise the error,
// naming metrics.tensorboard_dir, the directory, the other run and what to do. A directory
// holds one run: another run's events (or events of no dstrain run) would mix into its curves.
std::string claim_tensorboard_dir(const std::string& dir, const std::string& output_dir);
inline constexpr const char* kTensorBoardMarker = "dstrain_run.json";

// An events file of one run: events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n> in `dir`,
// its seconds above those of any events file already there (TensorBoard reads a directory's
// files in name order: a resumed run's file must come after the earlier run's). Writes are
// buffered; flush() makes them visible.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  const std::string& path() const { return path_; }
  // SessionLog START at `step`: TensorBoard drops whatever earlier files hold from `step` on
  // (an earlier attempt's steps after the checkpoint this run resumed from).
  void session_start(int64_t step);
  void write(int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
             const std::vector<std::pair<std::string, TbHistogram>>& histograms = {});
  void flush();

 private:
  void write_event(int64_t step, std::string_view payload);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace dstrain
