// The checks a run makes before it trains: that every rank was started alike (configuration,
// files, weights), that the model's state fits each rank's memory, that the inputs are what
// they claim and the outputs can be written. Each failure is an error on every rank that names
// the file, key or rank and says what to do.
#pragma once

#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/grid.h"
#include "core/json_reader.h"
#include "model/model_config.h"
#include "state/params.h"
#include "train/run_config.h"

namespace dstrain {

// A model whose state per rank (model_state_bytes_per_rank) cannot fit the rank's memory
// budget is an error that says so, before anything is allocated.
void check_model_state_fits(const RunConfig& config, const ProcessGrid& grid);

// Every rank must train the same thing: a rank whose resolved configuration differs from
// rank 0's (another file, other overrides) is an error on every rank.
void check_same_config(Communicator& world, const RunConfig& c);

bool is_hdf5_file(const std::string& path);

// Dotted keys whose values differ between two JSON objects.
void json_diff(const json& a, const json& b, const std::string& prefix, std::vector<std::string>& out);

// "rank r (host h): value" for rank 0 and the ranks whose value differs from rank 0's, the
// first few of them: a job of a thousand ranks must not bury the message.
std::string differing_ranks(const std::vector<std::string>& values, const std::vector<std::string>& hosts);

// Rank 0's `message` on every rank; thrown everywhere when not empty.
void throw_if_root_failed(Communicator& world, const std::string& message);

// Weights with a NaN or Inf cannot be trained from: every step would be skipped.
void check_finite_weights(const ParamRegistry& reg, const std::string& source);

// xxh3 of every parameter's values, in registry order.
std::vector<int64_t> weight_hashes(const ParamRegistry& reg);

// Every rank must start from the same weights: ranks that loaded different files (another
// directory, a stale copy on a node-local disk) would train a model spliced from both, since
// each checkpoint writes the rows of its own rank. `mine` (weight_hashes) is compared over
// `world`; with skip_experts the routed experts are left out (ranks of an expert group hold
// different ones).
void check_same_weights(Communicator& world, const ParamRegistry& reg, std::vector<int64_t> mine,
                        const std::string& source, bool skip_experts = false);

// What identifies a checkpoint file cheaply: its size and the hash of its first and last MiB.
std::string file_fingerprint(const std::string& path);

// Ranks that read one checkpoint collectively must name the same file, and that name must be
// the same file everywhere (not differing copies on node-local disks): otherwise each rank
// reads its rows from another file and the checksums, combined over the ranks, fail.
void check_same_file_on_every_rank(Communicator& world, const std::string& option, const std::string& path);

// "" when the checkpoint holds the model's tensors with the model's shapes; otherwise what
// differs, in terms of the model configuration. A file that cannot be read is left to the
// load, which says why.
std::string model_mismatch(const std::string& path, const ParamRegistry& reg, const ModelConfig& model);

// Hugging Face weights are written after the last step: a directory that cannot take them
// must stop the run before it trains, not after.
void check_writable_dir(const std::string& dir, const char* what);

}  // namespace dstrain
