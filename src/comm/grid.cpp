#include "comm/grid.h"

#include "core/error.h"

namespace dstrain {

std::string_view axis_name(Axis a) {
  switch (a) {
    case Axis::Data: return "data";
    case Axis::Tensor: return "tensor";
    case Axis::Pipeline: return "pipeline";
    case Axis::Expert: return "expert";
  }
  return "?";
}

ParallelConfig ParallelConfig::from_json(const JsonReader& r) {
  ParallelConfig c;
  if (r.has("data") && r.raw("data").is_string()) {
    if (r.get<std::string>("data") != "auto") r.error("data", "must be a positive integer or \"auto\"");
  } else {
    c.data = r.get<int64_t>("data", 0);
  }
  c.tensor = r.get<int64_t>("tensor", 1);
  c.pipeline = r.get<int64_t>("pipeline", 1);
  c.expert = r.get<int64_t>("expert", 1);
  c.sequence_parallel = r.get<bool>("sequence_parallel", false);
  c.schedule = r.get<std::string>("schedule", c.schedule);
  c.virtual_stages = r.get<int64_t>("virtual_stages", c.virtual_stages);
  c.partition = r.get<std::vector<int64_t>>("partition", {});
  if (c.schedule != "1f1b" && c.schedule != "interleaved" && c.schedule != "dualpipev") {
    r.error("schedule", fmt::format("\"{}\" is not a pipeline schedule: use \"1f1b\", \"interleaved\" or \"dualpipev\"",
                                    c.schedule));
  }
  if (c.virtual_stages < 1) r.error("virtual_stages", "must be >= 1");
  if (c.schedule == "interleaved" && c.virtual_stages < 2) {
    r.error("virtual_stages", "must be >= 2 with schedule \"interleaved\" (the model chunks per pipeline rank)");
  }
  if (c.schedule == "1f1b" && c.virtual_stages != 1) {
    r.error("virtual_stages", "applies to schedule \"interleaved\"; \"1f1b\" runs one chunk per rank");
  }
  if (c.schedule == "dualpipev" && c.virtual_stages != 1 && c.virtual_stages != 2) {
    r.error("virtual_stages", "DualPipeV holds 2 chunks per rank (leave virtual_stages out)");
  }
  if (c.data < 0) r.error("data", "must be positive (or \"auto\")");
  // Silently ignored, it would leave the resolved configuration saying it is on.
  if (c.sequence_parallel && c.tensor == 1) {
    r.error("sequence_parallel", "is true, but parallel.tensor is 1: sequence parallelism splits the sequence over "
                                 "the tensor-parallel ranks; set parallel.tensor > 1, or remove sequence_parallel");
  }
  for (auto [key, v] : {std::pair{"tensor", c.tensor}, {"pipeline", c.pipeline}, {"expert", c.expert}}) {
    if (v < 1) r.error(key, "must be >= 1");
  }
  r.done();
  return c;
}

json ParallelConfig::to_json() const {
  return {{"data", data == 0 ? json("auto") : json(data)}, {"tensor", tensor}, {"pipeline", pipeline},
          {"expert", expert}, {"sequence_parallel", sequence_parallel}, {"schedule", schedule},
          {"virtual_stages", virtual_stages}, {"partition", partition}};
}

namespace {

// "2, 4, 6": the first multiples of `unit` (rank counts that work).
std::string multiples_text(int64_t unit, int count = 4) {
  std::string s;
  for (int k = 1; k <= count; ++k) s += fmt::format("{}{}", k == 1 ? "" : ", ", unit * k);
  return s + ", ...";
}

}  // namespace

std::string divisors_text(int64_t n) {
  std::string s;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0) s += fmt::format("{}{}", s.empty() ? "" : ", ", d);
  }
  return s;
}

AxisSizes axis_sizes(const ParallelConfig& config, int W) {
  const int64_t fixed = config.tensor * config.pipeline;
  // The data axis must also hold whole expert groups: a rank count works when it is a multiple
  // of tensor x pipeline x expert.
  const int64_t unit = fixed * config.expert;
  int64_t data = config.data;
  if (data == 0) {
    if (W % fixed != 0) {
      throw Error(fmt::format("parallel layout: tensor {} x pipeline {} = {} does not divide the {} ranks of this job; "
                              "change the layout or the number of ranks (rank counts that work with this layout: {})",
                              config.tensor, config.pipeline, fixed, W, multiples_text(unit)));
    }
    data = W / fixed;
  }
  if (data * fixed != W) {
    throw Error(fmt::format("parallel layout: data {} x tensor {} x pipeline {} = {} but the job has {} ranks; make "
                            "the product equal the number of ranks (or set data to \"auto\"){}",
                            data, config.tensor, config.pipeline, data * fixed, W,
                            W % fixed == 0 ? fmt::format(": parallel.data = {} here", W / fixed)
                                           : fmt::format(": rank counts that work with tensor {} x pipeline {}: {}",
                                                         config.tensor, config.pipeline, multiples_text(unit))));
  }
  if (data % config.expert != 0) {
    throw Error(fmt::format("parallel layout: expert {} does not divide the {} data-parallel ranks (expert-parallel "
                            "ranks are carved out of the data-parallel ones); choose an expert size that divides {} "
                            "({}), or a rank count that is a multiple of {}",
                            config.expert, data, data, divisors_text(data), unit));
  }
  return {W, int(data), int(config.tensor), int(config.pipeline), int(config.expert)};
}

ProcessGrid::ProcessGrid(MPI_Comm world, const ParallelConfig& config) {
  world_ = std::make_unique<MpiCommunicator>(world, "world");
  const AxisSizes a = axis_sizes(config, world_->size());
  sizes_ = {a.data, a.tensor, a.pipeline, a.expert};
  const int r = world_->rank();
  const int tp = sizes_[size_t(Axis::Tensor)], dp = sizes_[size_t(Axis::Data)], ep = sizes_[size_t(Axis::Expert)];
  coords_[size_t(Axis::Tensor)] = r % tp;
  coords_[size_t(Axis::Data)] = (r / tp) % dp;
  coords_[size_t(Axis::Pipeline)] = r / (tp * dp);
  coords_[size_t(Axis::Expert)] = coords_[size_t(Axis::Data)] % ep;
  const int tensor = coords_[size_t(Axis::Tensor)], pipeline = coords_[size_t(Axis::Pipeline)];
  const int d = coords_[size_t(Axis::Data)], expert_group = d / ep, expert = d % ep;
  axes_[size_t(Axis::Data)] = split(pipeline * tp + tensor, d, "data");
  axes_[size_t(Axis::Tensor)] = split(pipeline * dp + d, tensor, "tensor");
  axes_[size_t(Axis::Pipeline)] = split(d * tp + tensor, pipeline, "pipeline");
  axes_[size_t(Axis::Expert)] = split((pipeline * tp + tensor) * (dp / ep) + expert_group, expert, "expert");
  expert_data_ = split((pipeline * tp + tensor) * ep + expert, expert_group, "expert_data");
  MPI_Comm node;
  DS_MPI_CHECK(MPI_Comm_split_type(world_->mpi_comm(), MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &node));
  MpiCommHandle node_comm = MpiCommHandle::adopt(node);
  DS_MPI_CHECK(MPI_Comm_rank(node_comm.get(), &local_rank_));
  DS_MPI_CHECK(MPI_Comm_size(node_comm.get(), &local_size_));
  int leader = local_rank_ == 0 ? 1 : 0;
  DS_MPI_CHECK(MPI_Allreduce(&leader, &num_nodes_, 1, MPI_INT, MPI_SUM, world_->mpi_comm()));
}

std::unique_ptr<MpiCommunicator> ProcessGrid::split(int color, int key, std::string_view name) const {
  MPI_Comm c;
  DS_MPI_CHECK(MPI_Comm_split(world_->mpi_comm(), color, key, &c));
  return MpiCommunicator::adopt(MpiCommHandle::adopt(c), std::string(name));
}

std::string ProcessGrid::describe() const {
  return fmt::format("{} rank{} on {} node{} ({} per node): data {} x tensor {} x pipeline {}, expert {} within data",
                     world_size(), world_size() == 1 ? "" : "s", num_nodes_, num_nodes_ == 1 ? "" : "s", local_size_,
                     sizes_[0], sizes_[1], sizes_[2], sizes_[3]);
}

void ProcessGrid::wrap_communicators(const std::string& key, const Wrap& wrap) {
  if (key == wrap_key_) return;
  // The old wrappers go first (they refer to the MPI communicators, which stay).
  wrapped_world_.reset();
  wrapped_expert_data_.reset();
  for (auto& w : wrapped_axes_) w.reset();
  for (auto& w : wrapped_replica_) w.reset();
  wrap_key_ = key;
  wrap_ = wrap;
  if (!wrap) return;
  wrapped_world_ = wrap(*world_);
  for (int a = 0; a < kNumAxes; ++a) wrapped_axes_[size_t(a)] = wrap(*axes_[size_t(a)]);
  wrapped_expert_data_ = wrap(*expert_data_);
  for (size_t i = 0; i < replica_comms_.size(); ++i) {
    if (replica_comms_[i]) wrapped_replica_[i] = wrap(*replica_comms_[i]);
  }
}

std::vector<int> ProcessGrid::node_of_ranks(int ranks_per_node) {
  const int W = world_size(), r = world_rank();
  std::vector<int> node(static_cast<size_t>(W));
  int mine = 0;
  if (ranks_per_node > 0) {
    mine = r / ranks_per_node;
  } else {
    MPI_Comm shared;
    DS_MPI_CHECK(MPI_Comm_split_type(world_->mpi_comm(), MPI_COMM_TYPE_SHARED, r, MPI_INFO_NULL, &shared));
    MpiCommHandle h = MpiCommHandle::adopt(shared);
    DS_MPI_CHECK(MPI_Allreduce(&r, &mine, 1, MPI_INT, MPI_MIN, h.get()));
  }
  DS_MPI_CHECK(MPI_Allgather(&mine, 1, MPI_INT, node.data(), 1, MPI_INT, world_->mpi_comm()));
  return node;
}

void ProcessGrid::split_replicas(int S) {
  const int dp = size(Axis::Data), ep = size(Axis::Expert), tp = size(Axis::Tensor);
  DS_CHECK(S >= 1 && dp % S == 0 && S % ep == 0,
           "replicas of {} data-parallel ranks: it must divide the data axis ({}) and be a multiple of the expert "
           "axis ({})",
           S, dp, ep);
  if (S == data_per_replica() && (replica_comms_[0] || S == dp)) return;
  for (auto& w : wrapped_replica_) w.reset();
  for (auto& c : replica_comms_) c.reset();
  replica_size_ = S == dp ? 0 : S;
  if (S == dp) return;
  const int R = dp / S, d = coord(Axis::Data), q = d / S, i = d % S, e = d % ep;
  const int place = coord(Axis::Pipeline) * tp + coord(Axis::Tensor);
  replica_comms_[0] = split(place * R + q, i, "replica_data");
  replica_comms_[1] = split((place * R + q) * ep + e, i / ep, "replica_expert_data");
  replica_comms_[2] = split(q, world_rank(), "replica");
  replica_comms_[3] = split(place * S + i, q, "across_replicas");
  replica_comms_[4] = split(place * S + i, q, "across_replicas_bulk");
  if (wrap_) {
    for (size_t k = 0; k < replica_comms_.size(); ++k) wrapped_replica_[k] = wrap_(*replica_comms_[k]);
  }
}

}  // namespace dstrain
