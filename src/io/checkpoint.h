// Parallel HDF5 checkpoints: one self-describing file per checkpoint, written collectively by
// every rank through MPI-IO. Each tensor is a dataset of its global shape under its Hugging
// Face name; each rank writes and reads the rows the current partition gives it, so a file
// restarts on any number of ranks. The format is documented in docs of README ("Checkpoints").
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/json_reader.h"
#include "io/sharded_state.h"
#include "state/params.h"

namespace dstrain {

inline constexpr const char* kCheckpointFormat = "dstrain-checkpoint";
inline constexpr int64_t kCheckpointFormatVersion = 1;

// Everything but the tensors that a checkpoint restores.
struct TrainState {
  int64_t step = 0;              // optimizer steps taken
  int64_t consumed_samples = 0;  // windows of the global batches so far
  int64_t consumed_tokens = 0;
  int64_t optimizer_steps = 0;   // AdamW's step count (bias correction)
  json scheduler;                // {"type", "params", "last_batch_iteration"}
  json rng;                      // counter-based generators: seeds and counters
  json data;                     // the data position and what it refers to
  json config;                   // the resolved run configuration
  json layout;                   // the parallel layout that wrote the file
  json environment;              // the build, libraries and CPUs of the job (null: not recorded)
  json loss_scaler;              // fp16's loss scaler (LossScaler::state; null: not an fp16 run)
};

// The flat buffers a checkpoint writes, and what of the file's tensors lies where in them
// (io/sharded_state.h): every rank writes the rows of its pieces that it is the writing replica
// of, so that the pieces of all ranks write every element of every tensor once. exp_avg and
// exp_avg_sq may be null together, when a file holds the model only. `reg` (the file's
// registry) gives only names, global shapes and kinds. Null pieces: whole tensors in the
// registry's layout on every rank of the communicator, rank r of N writing rows block r of
// each (ShardedState::whole(reg, r, N)).
// A group of the file's tensors beyond the model and AdamW's moments (asynchronous
// aggregation's outer state, the other replicas' own weights and moments): every tensor of the
// registry under `path`, from (or into) `data` laid out as `pieces` says (null: the main
// pieces). A rank that holds none of the group gives pieces without a piece (and no data).
struct CheckpointGroup {
  std::string path;  // e.g. "gradient_sync/outer_params", "gradient_sync/replica_1/model"
  float* data = nullptr;
  std::shared_ptr<const ShardedState> pieces;
  // Reading: whether this rank's pieces count in the group's checksum verification (false for
  // a rank that reads a copy of what other ranks' pieces already cover once).
  bool verify = true;
};

struct CheckpointBuffers {
  const float* values = nullptr;
  const float* exp_avg = nullptr;
  const float* exp_avg_sq = nullptr;
  std::shared_ptr<const ShardedState> pieces;
  std::vector<CheckpointGroup> extra;
};

// Where read_checkpoint puts what it reads: each rank its whole pieces (every replica reads
// its block), from the file's global tensors whatever layout wrote them. Null pieces: whole
// tensors in the registry's layout.
struct CheckpointTargets {
  float* values = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  std::shared_ptr<const ShardedState> pieces;
  std::vector<CheckpointGroup> extra;
  bool verify = true;  // the model and moment groups: as CheckpointGroup::verify
};

// A write that failed for lack of storage: the disk or quota is full (ENOSPC, EDQUOT), or
// the file outgrew the process's file size limit (EFBIG, `ulimit -f`). Raised alike on every
// rank; the partial file is removed.
class StorageFullError : public Error {
 public:
  StorageFullError(std::string cause, const std::string& what) : Error(what), cause_(std::move(cause)) {}
  // What ran out, for a message that names the directory: "no space left" or "the file
  // size limit (ulimit -f) was reached".
  const std::string& cause() const { return cause_; }

 private:
  std::string cause_;
};

// Writes `path` collectively over `comm` (every rank calls it with the same state).
// `threads` bounds the OpenMP threads used for checksums (1 for a background writer, which
// must not compete with training). The metadata goes first; then each rank writes its rows
// on its own, and the ranks agree on the outcome before the file is closed, so a write that
// fails on one rank (a full disk) fails on every rank instead of leaving the others blocked.
void write_checkpoint(const std::string& path, MPI_Comm comm, const ParamRegistry& reg, const CheckpointBuffers& bufs,
                      const TrainState& state, int threads = 0);

// An upper bound of the bytes a checkpoint of these buffers takes on disk, metadata included
// (from the registry's global shapes).
int64_t checkpoint_size_bound(const ParamRegistry& reg, const CheckpointBuffers& bufs, const TrainState& state);

// Raises the same Error on every rank of `comm` when any rank's `error` is not empty: the
// message of the lowest rank that failed.
void throw_if_any_rank_failed(MPI_Comm comm, const std::string& error);

// Reads `path` collectively over `comm` into the registry's values and, when given, the
// moments. Every tensor's checksum is verified; any failure (missing tensor, wrong shape,
// checksum, HDF5 error on any rank) throws the same error on every rank.
TrainState read_checkpoint(const std::string& path, MPI_Comm comm, ParamRegistry& reg, float* exp_avg,
                           float* exp_avg_sq);
TrainState read_checkpoint(const std::string& path, MPI_Comm comm, ParamRegistry& reg, const CheckpointTargets& into);

// What `dstrain-ckpt info` shows: read by one process, checksums verified.
struct CheckpointTensorInfo {
  std::string group;  // "model", "optimizer/exp_avg", ...
  std::string name;
  Shape shape;
  uint32_t stored_crc = 0, computed_crc = 0;
  bool ok() const { return stored_crc == computed_crc; }
};
struct CheckpointInfo {
  TrainState state;
  std::string version, build, created;
  std::vector<CheckpointTensorInfo> tensors;
  // Every attribute and non-tensor dataset has a checksum in files written since dstrain
  // sealed its metadata; older files have none (`metadata_sealed` false).
  bool metadata_sealed = false;
  size_t metadata_fields = 0;
  // Fields that fail their checksum or contradict each other, each naming the field.
  std::vector<std::string> metadata_problems;
};
CheckpointInfo inspect_checkpoint(const std::string& path, bool verify = true);

// CRC-32 (zlib's) of byte ranges, hashed in chunks over up to `threads` OpenMP threads (0: all)
// and combined in order, so each value is that of one pass over its range.
std::vector<uint32_t> crc32_many(const std::vector<std::pair<const void*, size_t>>& ranges, int threads = 0);
uint32_t crc32_of(const void* data, size_t bytes, int threads = 0);
// The CRC-32 of the concatenation of two ranges from theirs.
uint32_t crc32_concat(uint32_t crc_a, uint32_t crc_b, size_t bytes_b);

}  // namespace dstrain
