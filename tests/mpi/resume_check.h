// Shared by the MPI tests: stopping a run and resuming it from its checkpoint must equal the
// uninterrupted run, bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {

// Trains the run of `files` uninterrupted, then again for `stop_at` steps ending with a
// checkpoint and resumed from it (--resume auto), `overrides` applied to all of them. The
// losses, the weights (routing biases included) and AdamW's moments must be bitwise equal.
inline void expect_resume_is_bitwise(const RunFiles& files, ProcessGrid& grid, int stop_at,
                                     std::vector<std::string> overrides = {}) {
  const auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), overrides.begin(), overrides.end());
    return files.config(more);
  };
  const auto dir_of = [&](const char* name) { return "checkpoint.dir=" + json((files.dir() / name).string()).dump(); };
  Trainer full(with({dir_of("full")}), grid);
  full.init_weights("");
  full.train();
  std::vector<double> losses;
  {
    Trainer a(with({"train.max_steps=" + std::to_string(stop_at), "checkpoint.save_final=true", dir_of("split")}),
              grid);
    a.init_weights("");
    a.train();  // ends with the final checkpoint, completed before train() returns
    for (const StepRecord& r : a.history()) losses.push_back(r.loss);
  }
  Trainer b(with({dir_of("split")}), grid);
  ASSERT_TRUE(b.resume("auto"));
  EXPECT_EQ(b.step(), stop_at);
  b.train();
  for (const StepRecord& r : b.history()) losses.push_back(r.loss);
  ASSERT_EQ(losses.size(), full.history().size());
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i], full.history()[i].loss) << "loss of step " << i + 1;
  // The whole weights (at ZeRO stage 3 the persistent ones), and the optimizer state: AdamW's
  // whole moments, or ZeRO's shards with their masters.
  std::vector<std::pair<const Buffer*, const Buffer*>> pairs = {
      {&full.model().params().values(), &b.model().params().values()}};
  pairs.push_back({&full.optimizer().master(), &b.optimizer().master()});
  pairs.push_back({&full.optimizer().exp_avg(), &b.optimizer().exp_avg()});
  pairs.push_back({&full.optimizer().exp_avg_sq(), &b.optimizer().exp_avg_sq()});
  EXPECT_EQ(full.optimizer_steps(), b.optimizer_steps());
  for (const auto& [x, y] : pairs) {
    EXPECT_EQ(0, std::memcmp(x->data(), y->data(), x->nbytes())) << x->label() << " differs after resuming";
  }
  // The fp16 loss scaler continues as it was (a disabled one is the same anyway).
  EXPECT_EQ(full.loss_scaler().state(), b.loss_scaler().state());
  for (size_t i = 0; i < b.history().size(); ++i) {
    const StepRecord& x = full.history()[size_t(stop_at) + i];
    const StepRecord& y = b.history()[i];
    EXPECT_EQ(x.loss_scale, y.loss_scale) << "loss scale of step " << y.step;
    EXPECT_EQ(x.overflow, y.overflow) << "overflow at step " << y.step;
    EXPECT_EQ(x.lr, y.lr) << "learning rate of step " << y.step;
  }
}

}  // namespace dstrain
