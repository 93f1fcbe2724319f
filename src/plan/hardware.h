// Hardware profiles: what the performance model (plan/perf_model.h) needs to know of a node
// type to price a traced step, and the prices themselves.
//
// A profile is JSON (inputs/clusters/*.json; `dstrain calibrate` writes one for the machine it
// runs on). An uncalibrated profile holds datasheet figures, each with its source: peak FLOP/s
// per dtype, memory size and bandwidth, and the bandwidth and latency of the links within a
// node and between nodes (per device, per direction). It prices
//   a GEMM or attention kernel   FLOPs / (peak of its dtype x efficiency.gemm) + kernel overhead
//   any other kernel             bytes its tensors span / memory bandwidth + kernel overhead
//   a collective over n ranks    ring algorithm over the slowest link it crosses:
//                                all-reduce 2(n-1)/n bytes/bw + 2(n-1) latency, all-gather and
//                                reduce-scatter (n-1)/n bytes/bw + (n-1) latency, all-to-all
//                                (n-1)/n bytes/bw + (n-1) latency, send bytes/bw + latency.
// efficiency.gemm is the one constant fitted per device type (validation/published_scaling.py
// fits it from one published point); without it 1 is used (peak), and the model says so.
//
// A calibrated profile adds what was measured on the machine: the seconds of each op shape the
// calibrated model ran ("ops": exact signatures), least-squares fits per op class and dtype
// (seconds = c0 + flops x per_flop + bytes x per_byte) for shapes not measured, and per
// collective and group size a fit seconds = alpha + beta x bytes.
#pragma once

#include <map>
#include <string>

#include "core/exec_trace.h"
#include "core/json_reader.h"

namespace dstrain {

struct LinkSpec {
  double bandwidth = 0;  // bytes/s per device per direction
  double latency = 0;    // seconds per message
};

// seconds = c0 + flops * per_flop + bytes * per_byte
struct OpFit {
  double c0 = 0, per_flop = 0, per_byte = 0;
  int samples = 0;
  double seconds(double flops, double bytes) const { return c0 + flops * per_flop + bytes * per_byte; }
};

// seconds = alpha + beta * bytes
struct CollectiveFit {
  double alpha = 0, beta = 0;
  int samples = 0;
};

struct HardwareProfile {
  std::string name;
  std::string file;  // where it was read from
  bool calibrated = false;
  std::string calibration;  // how it was calibrated, or why not
  std::string device_type = "cuda";
  int ranks_per_node = 8;
  double memory_bytes = 0;
  double memory_bandwidth = 0;
  std::map<std::string, double> peak_flops;  // "f32", "tf32", "bf16", "f16", "fp8"
  double kernel_overhead = 0;
  // CPU nodes: the cores the ranks of a node share and the threads each rank runs; ops slow
  // down by (ranks on the node x threads) / cores when that exceeds 1. 0: not stated.
  int cores_per_node = 0;
  int threads_per_rank = 1;
  LinkSpec intra_node, inter_node;
  double gemm_efficiency = 0;  // 0: not fitted (peak is used)
  std::string efficiency_source;
  // Calibrated.
  std::map<std::string, double> op_seconds;        // op_signature() -> seconds
  std::map<std::string, OpFit> op_fits;            // "<class>/<dtype>" -> fit
  std::map<std::string, std::map<int, CollectiveFit>> collectives;  // kind -> group size -> fit
  // op class -> ranks running at once on the node -> how much slower each runs than alone.
  std::map<std::string, std::map<int, double>> contention;
  json sources;  // every *_source string of the file, kept for the explanation
};

// Reads a profile; errors name the file and key.
HardwareProfile load_profile(const std::string& path);
json profile_to_json(const HardwareProfile& p);

// "gemm", "attention", "optimizer" or "elementwise".
std::string op_class(const TraceEvent& op);
// What identifies a measured op: name, dtype and every tensor's shape and dtype.
std::string op_signature(const TraceEvent& op);
// "f32", "bf16", "f16".
std::string dtype_key(DType t);

// Options of a pricing that are not the profile's.
struct PriceOptions {
  // The linear layers' GEMMs run at the profile's "fp8" peak (DeepSeek-V3's FP8 training: the
  // Fprop, Dgrad and Wgrad GEMMs of the linear layers in FP8, arXiv 2412.19437 sec. 3.3).
  bool fp8_gemms = false;
};

// How much slower each rank's ops of a class run when `ranks_on_node` ranks share a CPU node:
// the calibrated contention (interpolated between the measured rank counts; beyond the largest,
// growing with the ranks over the cores), else (ranks x threads) / cores when that exceeds 1;
// 1 on GPUs.
double oversubscription(const HardwareProfile& hw, const std::string& op_class, double ranks_on_node);

// Seconds of one op on one device of this profile.
double op_seconds(const HardwareProfile& hw, const TraceEvent& op, const PriceOptions& opt = {});
// Seconds of one collective of `bytes` (the buffer the collective is called with) over
// `group_size` ranks; `spans_nodes` when its ranks are on more than one node.
double collective_seconds(const HardwareProfile& hw, const std::string& kind, double bytes, int group_size,
                          bool spans_nodes);
// The peak FLOP/s the profile states for a dtype key ("bf16", ...); 0 when it states none.
double peak_flops(const HardwareProfile& hw, const std::string& dtype);

}  // namespace dstrain
