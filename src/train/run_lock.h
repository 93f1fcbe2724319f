// Keeps two dstrain runs out of one directory: a lock file naming its owner's host and pid,
// created atomically and removed when the run ends (error exits included).
#pragma once

#include <string>

namespace dstrain {

class RunLock {
 public:
  // Takes `dir`/dstrain.lock, creating `dir`. Throws Error naming the owner (host, pid, start
  // time) when another run holds it. A lock whose owner is gone from this host (a run that
  // was killed), or was an earlier run of this Slurm job (a requeue, perhaps on another node),
  // is taken over with a note in the log.
  explicit RunLock(const std::string& dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string content_;  // what this process wrote: removed only while still ours
};

}  // namespace dstrain
