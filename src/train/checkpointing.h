// When and where checkpoints are written, and which one a run resumes from. A checkpoint is
// written under a temporary name, flushed, renamed; the `latest` marker moves only after
// that; old checkpoints are removed only once a newer one is complete (keep the last K and
// every M-th step). With async saving, training continues while a background thread writes
// a snapshot taken at a step boundary; only the snapshot stalls the step.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "comm/grid.h"
#include "core/buffer.h"
#include "io/checkpoint.h"

namespace dstrain {

struct CheckpointConfig {
  std::string dir;              // "" = output.dir/checkpoints
  int64_t interval_steps = 0;   // 0 = not by steps
  double interval_minutes = 0;  // 0 = not by time
  int64_t keep_last = 3;        // newest checkpoints kept
  int64_t keep_every = 0;       // also keep steps that are multiples of this (0 = none)
  bool async = true;
  bool save_final = true;       // a checkpoint after the last step
  bool check_free_space = true;  // refuse a save the directory has no room for (statvfs, ulimit -f)

  static CheckpointConfig from_json(const JsonReader& r);
  json to_json() const;
};

class CheckpointManager {
 public:
  // Checkpoint I/O runs on its own duplicate of the world communicator.
  CheckpointManager(CheckpointConfig config, ProcessGrid& grid);
  ~CheckpointManager();  // waits for a save in flight

  const CheckpointConfig& config() const { return config_; }
  std::string path_for(int64_t step) const;
  MPI_Comm io_comm() const { return io_comm_.get(); }

  // Writes the checkpoint of `state.step` from the flat buffers: synchronously, or from a
  // snapshot on a background thread. Returns the seconds the caller was held up.
  double save(const ParamRegistry& reg, const CheckpointBuffers& live, const TrainState& state);
  // Completes a save in flight; its error, if any, is raised here on every rank.
  void wait();
  bool in_flight() const { return writer_.joinable(); }

  // Checkpoint files of the directory, newest step first (names step_NNNNNNNN.h5).
  std::vector<std::string> list() const;
  // The checkpoint file name the `latest` marker holds ("" when there is no marker): the
  // newest checkpoint the run completed, whether or not its file is still there.
  std::string latest() const;

  // Bytes free for a new file in a directory (statvfs); tests replace it to fake a full disk.
  std::function<int64_t(const std::string& dir)> free_bytes;
  // Bytes a checkpoint of these buffers takes on disk, metadata included (an upper bound).
  static int64_t size_on_disk(const ParamRegistry& reg, const CheckpointBuffers& bufs, const TrainState& state);

 private:
  void write_and_publish(const ParamRegistry& reg, CheckpointBuffers bufs, TrainState state, int threads);
  void rotate(int64_t newest_step) const;
  // Refuses, on every rank alike (rank 0 decides), a save that cannot fit.
  void check_room(int64_t step, int64_t need);
  // "CAUSE on DIR: checkpoint step N not written; step M is the newest valid one".
  std::string not_written(const std::string& cause, int64_t step) const;
  // At a missed watchdog deadline during a write: whether storage ran out, said as above.
  std::string explain_stall(int64_t step, int64_t need) const;

  CheckpointConfig config_;
  ProcessGrid& grid_;
  MpiCommHandle io_comm_;
  Buffer snap_values_, snap_m_, snap_v_;
  std::vector<Buffer> snap_extra_;  // the extra groups' snapshots
  std::thread writer_;
  std::string writer_error_;
  int64_t newest_step_ = -1;  // of the newest complete checkpoint in the directory (-1: none)
};

}  // namespace dstrain
