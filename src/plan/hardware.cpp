#include "plan/hardware.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace dstrain {
namespace {

bool is_source_key(const std::string& k) {
  return k == "source" || k == "_comment" || (k.size() > 7 && k.compare(k.size() - 7, 7, "_source") == 0);
}

// Marks an object's source and comment keys as read, and keeps them for the explanation.
void take_sources(const JsonReader& r, const json& object, json& sources, const std::string& prefix) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    if (!is_source_key(it.key())) continue;
    r.raw(it.key());
    sources[prefix.empty() ? it.key() : prefix + "." + it.key()] = it.value();
  }
}

double positive(const JsonReader& r, const std::string& key) {
  const double v = r.get<double>(key);
  if (!(v > 0) || !std::isfinite(v)) r.error(key, fmt::format("must be a positive number, not {}", v));
  return v;
}

LinkSpec read_link(const JsonReader& r, const json& object, json& sources, const std::string& path) {
  take_sources(r, object, sources, path);
  LinkSpec l;
  l.bandwidth = positive(r, "bandwidth");
  l.latency = r.get<double>("latency");
  if (!(l.latency >= 0)) r.error("latency", "must be >= 0 seconds");
  r.done();
  return l;
}

}  // namespace

std::string dtype_key(DType t) {
  switch (t) {
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    default: return "f32";
  }
}

std::string op_class(const TraceEvent& op) {
  const std::string n = op.name;
  if (n == "linear_forward" || n == "linear_backward") return "gemm";
  if (n == "attention_forward" || n == "attention_backward") return "attention";
  if (n == "adamw_update") return "optimizer";
  return "elementwise";
}

std::string op_signature(const TraceEvent& op) {
  std::string s = fmt::format("{}/{}", op.name, dtype_key(op.dtype));
  for (size_t i = 0; i < op.shapes.size(); ++i) {
    s += fmt::format(" {}{}", op.shapes[i].ndim() ? op.shapes[i].str() : std::string("-"),
                     i < op.dtypes.size() && op.shapes[i].ndim() ? dtype_key(op.dtypes[i]) : "");
  }
  for (int64_t v : op.extra) s += fmt::format(" {}", v);
  return s;
}

double peak_flops(const HardwareProfile& hw, const std::string& dtype) {
  auto it = hw.peak_flops.find(dtype);
  return it == hw.peak_flops.end() ? 0.0 : it->second;
}

namespace {
HardwareProfile read_profile(const std::string& path) {
  const json root = read_json_file(path);
  if (!root.is_object()) DS_FAIL("{}: a hardware profile is a JSON object (see inputs/clusters/)", path);
  HardwareProfile p;
  p.file = path;
  JsonReader r(root, "", path);
  take_sources(r, root, p.sources, "");
  p.name = r.get<std::string>("name");
  p.calibrated = r.get<bool>("calibrated");
  p.calibration = r.get<std::string>("calibration", std::string());
  p.ranks_per_node = int(r.get<int64_t>("gpus_per_node", 8));
  if (p.ranks_per_node < 1) r.error("gpus_per_node", "must be >= 1");
  {
    JsonReader d = r.child("device");
    const json& dj = root.at("device");
    take_sources(d, dj, p.sources, "device");
    p.device_type = d.get<std::string>("type", std::string("cuda"));
    if (p.device_type != "cuda" && p.device_type != "cpu") d.error("type", "must be \"cuda\" or \"cpu\"");
    p.memory_bytes = positive(d, "memory_bytes");
    p.memory_bandwidth = positive(d, "memory_bandwidth");
    p.kernel_overhead = d.get<double>("kernel_overhead_s", 0.0);
    p.cores_per_node = int(d.get<int64_t>("cores", 0));
    p.threads_per_rank = int(d.get<int64_t>("threads_per_rank", 1));
    if (p.cores_per_node < 0 || p.threads_per_rank < 1) d.error("cores", "cores must be >= 0, threads_per_rank >= 1");
    const json& peaks = d.raw("peak_flops");
    if (!peaks.is_object() || peaks.empty())
      d.error("peak_flops", "must be an object of dtype -> FLOP/s, e.g. {\"bf16\": 989e12}");
    for (auto it = peaks.begin(); it != peaks.end(); ++it) {
      static const char* kKnown[] = {"f32", "tf32", "bf16", "f16", "fp8"};
      if (std::find_if(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return it.key() == k; }) ==
          std::end(kKnown))
        d.error("peak_flops", fmt::format("unknown dtype '{}': use f32, tf32, bf16, f16 or fp8", it.key()));
      if (!it.value().is_number() || !(it.value().get<double>() > 0))
        d.error("peak_flops", fmt::format("'{}' must be a positive number of FLOP/s", it.key()));
      p.peak_flops[it.key()] = it.value().get<double>();
    }
    d.done();
  }
  {
    JsonReader l = r.child("links");
    const json& lj = root.at("links");
    take_sources(l, lj, p.sources, "links");
    for (const char* key : {"intra_node", "inter_node"}) {
      const JsonReader link = l.child(key);  // names the key when it is missing
      (std::string(key) == "intra_node" ? p.intra_node : p.inter_node) =
          read_link(link, lj.at(key), p.sources, std::string("links.") + key);
    }
    l.done();
  }
  if (r.has("efficiency")) {
    JsonReader e = r.child("efficiency");
    const json& ej = root.at("efficiency");
    take_sources(e, ej, p.sources, "efficiency");
    if (ej.contains("source") && ej.at("source").is_string()) p.efficiency_source = ej.at("source").get<std::string>();
    if (!e.is_null("gemm")) {
      p.gemm_efficiency = e.get<double>("gemm");
      if (!(p.gemm_efficiency > 0 && p.gemm_efficiency <= 1)) e.error("gemm", "must be in (0, 1], or null");
    } else {
      e.raw("gemm");
    }
    if (e.has("elementwise")) e.raw("elementwise");  // datasheet bandwidth is used as stated
    e.done();
  }
  if (r.has("ops")) {
    const json& ops = r.raw("ops");
    for (auto it = ops.begin(); it != ops.end(); ++it) p.op_seconds[it.key()] = it.value().get<double>();
  }
  if (r.has("op_fits")) {
    const json& fits = r.raw("op_fits");
    for (auto it = fits.begin(); it != fits.end(); ++it) {
      OpFit f;
      f.c0 = it.value().at("c0").get<double>();
      f.per_flop = it.value().at("per_flop").get<double>();
      f.per_byte = it.value().at("per_byte").get<double>();
      f.samples = it.value().value("samples", 0);
      p.op_fits[it.key()] = f;
    }
  }
  if (r.has("contention")) {
    const json& cs = r.raw("contention");
    for (auto it = cs.begin(); it != cs.end(); ++it)
      for (auto g = it.value().begin(); g != it.value().end(); ++g)
        p.contention[it.key()][std::stoi(g.key())] = g.value().get<double>();
  }
  if (r.has("collectives")) {
    const json& cs = r.raw("collectives");
    for (auto it = cs.begin(); it != cs.end(); ++it) {
      for (auto g = it.value().begin(); g != it.value().end(); ++g) {
        CollectiveFit f;
        f.alpha = g.value().at("alpha").get<double>();
        f.beta = g.value().at("beta").get<double>();
        f.samples = g.value().value("samples", 0);
        p.collectives[it.key()][std::stoi(g.key())] = f;
      }
    }
  }
  r.done();
  return p;
}
}  // namespace

HardwareProfile load_profile(const std::string& path) {
  try {
    return read_profile(path);
  } catch (const json::exception& e) {
    // The calibrated sections are read without the reader's key paths.
    DS_FAIL("{}: not a hardware profile dstrain can read ({}); see inputs/clusters/ for the format", path, e.what());
  }
}

json profile_to_json(const HardwareProfile& p) {
  json j;
  j["name"] = p.name;
  j["calibrated"] = p.calibrated;
  j["calibration"] = p.calibration;
  j["gpus_per_node"] = p.ranks_per_node;
  json d;
  d["type"] = p.device_type;
  d["memory_bytes"] = p.memory_bytes;
  d["memory_bandwidth"] = p.memory_bandwidth;
  d["peak_flops"] = p.peak_flops;
  d["kernel_overhead_s"] = p.kernel_overhead;
  if (p.cores_per_node > 0) {
    d["cores"] = p.cores_per_node;
    d["threads_per_rank"] = p.threads_per_rank;
  }
  j["device"] = d;
  j["links"]["intra_node"] = {{"bandwidth", p.intra_node.bandwidth}, {"latency", p.intra_node.latency}};
  j["links"]["inter_node"] = {{"bandwidth", p.inter_node.bandwidth}, {"latency", p.inter_node.latency}};
  j["efficiency"]["gemm"] = p.gemm_efficiency > 0 ? json(p.gemm_efficiency) : json(nullptr);
  j["efficiency"]["source"] = p.efficiency_source;
  for (auto it = p.sources.begin(); it != p.sources.end(); ++it) {
    // Sources of the device and link sections go back where they came from.
    const std::string& k = it.key();
    const size_t dot = k.rfind('.');
    if (dot == std::string::npos) {
      j[k] = it.value();
    } else {
      json* node = &j;
      size_t start = 0;
      while (true) {
        const size_t next = k.find('.', start);
        if (next == std::string::npos || next > dot) break;
        node = &(*node)[k.substr(start, next - start)];
        start = next + 1;
      }
      (*node)[k.substr(dot + 1)] = it.value();
    }
  }
  if (!p.op_seconds.empty()) j["ops"] = p.op_seconds;
  for (const auto& [k, f] : p.op_fits)
    j["op_fits"][k] = {{"c0", f.c0}, {"per_flop", f.per_flop}, {"per_byte", f.per_byte}, {"samples", f.samples}};
  for (const auto& [cls, levels] : p.contention)
    for (const auto& [n, f] : levels) j["contention"][cls][std::to_string(n)] = f;
  for (const auto& [kind, sizes] : p.collectives)
    for (const auto& [n, f] : sizes)
      j["collectives"][kind][std::to_string(n)] = {{"alpha", f.alpha}, {"beta", f.beta}, {"samples", f.samples}};
  return j;
}

double oversubscription(const HardwareProfile& hw, const std::string& cls, double ranks_on_node) {
  if (hw.device_type != "cpu") return 1;
  const double cores = hw.cores_per_node > 0 ? double(hw.cores_per_node) : 0;
  auto over = [&](double ranks) { return cores > 0 ? std::max(1.0, ranks * hw.threads_per_rank / cores) : 1.0; };
  auto it = hw.contention.find(cls);
  if (it == hw.contention.end() || it->second.empty()) return over(ranks_on_node);
  const std::map<int, double>& m = it->second;
  // The first measured count at or above ranks_on_node.
  auto hi = std::find_if(m.begin(), m.end(), [&](const auto& kv) { return double(kv.first) >= ranks_on_node; });
  if (hi == m.end()) {
    const auto& [r, f] = *m.rbegin();
    return f * over(ranks_on_node) / over(r);
  }
  if (hi == m.begin() || double(hi->first) == ranks_on_node) return hi->second;
  auto lo = std::prev(hi);
  const double w = (ranks_on_node - double(lo->first)) / double(hi->first - lo->first);
  return lo->second + w * (hi->second - lo->second);
}

double op_seconds(const HardwareProfile& hw, const TraceEvent& op, const PriceOptions& opt) {
  if (!hw.op_seconds.empty()) {
    auto it = hw.op_seconds.find(op_signature(op));
    if (it != hw.op_seconds.end()) return it->second;
  }
  const std::string cls = op_class(op);
  if (!hw.op_fits.empty()) {
    auto it = hw.op_fits.find(cls + "/" + dtype_key(op.dtype));
    if (it == hw.op_fits.end()) it = hw.op_fits.find(cls + "/f32");
    if (it != hw.op_fits.end()) return std::max(0.0, it->second.seconds(op.flops, op.bytes));
  }
  // Datasheet roofline.
  if (cls == "gemm" || cls == "attention") {
    std::string dt = dtype_key(op.dtype);
    if (opt.fp8_gemms && cls == "gemm" && peak_flops(hw, "fp8") > 0) dt = "fp8";
    double peak = peak_flops(hw, dt);
    if (peak <= 0) peak = peak_flops(hw, "f32");
    DS_CHECK(peak > 0, "{}: the profile states no peak FLOP/s for {} (device.peak_flops)", hw.file, dt);
    const double eff = hw.gemm_efficiency > 0 ? hw.gemm_efficiency : 1.0;
    return hw.kernel_overhead + std::max(op.flops / (peak * eff), op.bytes / hw.memory_bandwidth);
  }
  return hw.kernel_overhead + op.bytes / hw.memory_bandwidth;
}

double collective_seconds(const HardwareProfile& hw, const std::string& kind, double bytes, int n, bool spans_nodes) {
  if (n <= 1) return 0;
  auto k = hw.collectives.find(kind);
  if (k != hw.collectives.end() && !k->second.empty()) {
    auto g = k->second.find(n);
    if (g != k->second.end()) return std::max(0.0, g->second.alpha + g->second.beta * bytes);
    // Another group size: the nearest measured one, its bandwidth term scaled by the ring's
    // (n-1)/n and its latency term by the ring's steps.
    auto best = k->second.begin();
    for (auto it = k->second.begin(); it != k->second.end(); ++it)
      if (std::abs(it->first - n) < std::abs(best->first - n)) best = it;
    const double m = best->first;
    const double steps = (double(n) - 1) / std::max(1.0, m - 1);
    const double share = ((double(n) - 1) / n) / std::max(1e-9, (m - 1) / m);
    return std::max(0.0, best->second.alpha * steps + best->second.beta * bytes * share);
  }
  const LinkSpec& link = spans_nodes ? hw.inter_node : hw.intra_node;
  const double steps = double(n) - 1, share = (double(n) - 1) / double(n);
  if (kind == "all_reduce") return 2 * steps * link.latency + 2 * share * bytes / link.bandwidth;
  if (kind == "all_gather" || kind == "reduce_scatter" || kind == "all_to_all")
    return steps * link.latency + share * bytes / link.bandwidth;
  if (kind == "broadcast") return std::ceil(std::log2(double(n))) * link.latency + bytes / link.bandwidth;
  return link.latency + bytes / link.bandwidth;  // send
}

}  // namespace dstrain
