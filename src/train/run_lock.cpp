#include "train/run_lock.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <csignal>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "comm/environment.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "core/log.h"

namespace dstrain {
namespace fs = std::filesystem;

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A process on this host with that pid exists (or we may not signal it: it exists too).
bool alive_here(int64_t pid) { return pid > 0 && (::kill(pid_t(pid), 0) == 0 || errno != ESRCH); }

}  // namespace

RunLock::RunLock(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  DS_CHECK(!ec, "cannot create the directory '{}': {}; choose a writable output.dir / checkpoint.dir", dir,
           ec.message());
  const fs::path lock = fs::path(dir) / "dstrain.lock";
  path_ = lock.string();
  const std::string host = host_name();
  const int64_t pid = ::getpid();
  char started[32] = {};
  const std::time_t now = std::time(nullptr);
  std::strftime(started, sizeof(started), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  // A requeued Slurm job keeps its id but may run on another node: its earlier run, killed
  // without a chance to remove the lock, is recognised by the id.
  // Steps of one incarnation share the restart count, so two of them are still refused.
  const char* job_env = std::getenv("SLURM_JOB_ID");
  const char* restart_env = std::getenv("SLURM_RESTART_COUNT");
  const std::string job = job_env ? job_env : "";
  const int64_t restart = restart_env ? std::atoll(restart_env) : 0;
  json me = {{"host", host}, {"pid", pid}, {"started", started}};
  if (!job.empty()) {
    me["slurm_job_id"] = job;
    me["slurm_restart_count"] = restart;
  }
  content_ = me.dump() + "\n";

  // Written whole under a private name, then linked to the lock's name: link() fails when the
  // lock exists, so exactly one of two runs started at once gets it, and never a partial file.
  const fs::path mine = fs::path(dir) / fmt::format(".dstrain.lock.{}.{}", host, pid);
  {
    std::ofstream out(mine);
    out << content_;
    out.close();
    DS_CHECK(out.good(), "cannot write '{}': the directory '{}' is not writable; choose a writable output.dir / "
             "checkpoint.dir", mine.string(), dir);
  }
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (::link(mine.c_str(), lock.c_str()) == 0) {
      fs::remove(mine, ec);
      return;
    }
    const int err = errno;
    if (err != EEXIST) {
      fs::remove(mine, ec);
      DS_FAIL("cannot create the lock file '{}': {}", path_, std::strerror(err));
    }
    const std::string theirs = read_text(lock);
    json owner;
    try {
      owner = parse_json(theirs, "lock file '" + path_ + "'", kDataJson);
    } catch (const Error&) {
      // Damaged or being written: an owner unknown, which is not taken over below.
    }
    if (!owner.is_object()) owner = json::object();
    const std::string their_host = owner.value("host", std::string("?"));
    const int64_t their_pid = owner.value("pid", int64_t(-1));
    const std::string their_job = owner.value("slurm_job_id", std::string());
    const bool same_job =
        !job.empty() && their_job == job && owner.value("slurm_restart_count", int64_t(0)) < restart;
    if (same_job || (their_host == host && their_pid > 0 && !alive_here(their_pid))) {
      // The owner was killed without removing its lock. Moved aside first and checked, so that
      // a lock another run has just taken is not removed in its place.
      const fs::path aside = mine.string() + ".stale";
      fs::rename(lock, aside, ec);
      if (!ec && read_text(aside) == theirs) {
        fs::remove(aside, ec);
        log::warn("'{}' was left by dstrain pid {} on {}, which is no longer running (started {}{}): taking it over",
                  path_, their_pid, their_host, owner.value("started", std::string("?")),
                  same_job ? ", before Slurm job " + job + " was requeued" : "");
        continue;
      }
      if (!ec) {
        // Not the stale lock any more: put the new owner's back (should a third run hold the
        // name by now, the next attempt reports that one).
        (void)::link(aside.c_str(), lock.c_str());
        fs::remove(aside, ec);
      }
      continue;
    }
    fs::remove(mine, ec);
    DS_FAIL("'{}' is in use by another dstrain run (host {}, pid {}, started {}; lock file '{}'): two runs in one "
            "directory would overwrite each other's checkpoints and metrics. Wait for that run to end or choose "
            "another output.dir / checkpoint.dir; if that run is gone{}, remove '{}'",
            dir, their_host, their_pid, owner.value("started", std::string("?")), path_,
            their_host == host ? "" : " (it ran on another host, whose processes cannot be checked from here)",
            path_);
  }
  fs::remove(mine, ec);
  DS_FAIL("could not take the lock file '{}': other runs keep taking it; start one run at a time", path_);
}

RunLock::~RunLock() {
  std::error_code ec;
  if (read_text(path_) == content_) fs::remove(path_, ec);
}

}  // namespace dstrain
