// How a GPU test behaves where no GPU is usable. By default it skips, by name and with the
// reason (ctest reports it as skipped, never as passed), so that a run on a machine without a
// GPU says what it did not check. With DSTRAIN_REQUIRE_GPU=1 in the environment (the GPU check,
// validation/device/check.sh, sets it) the same situation is a failure: a machine whose GPU is
// invisible to dstrain cannot report that every GPU test passed.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string_view>

#include "backend/cuda_device.h"

namespace dstrain::testing {

// Whether DSTRAIN_REQUIRE_GPU asks for a GPU (set and neither empty nor "0").
inline bool gpu_required() {
  const char* v = std::getenv("DSTRAIN_REQUIRE_GPU");
  return v && *v && std::string_view(v) != "0";
}

}  // namespace dstrain::testing

// First statement of a GPU test: skips it (or fails it under DSTRAIN_REQUIRE_GPU=1) when this
// process cannot use a GPU.
#define DSTRAIN_SKIP_WITHOUT_GPU()                                                                         \
  do {                                                                                                     \
    if (::dstrain::cuda::device_count() == 0) {                                                            \
      if (::dstrain::testing::gpu_required()) {                                                            \
        FAIL() << "DSTRAIN_REQUIRE_GPU is set, but this process cannot use a GPU: "                        \
               << ::dstrain::cuda::unavailable_reason();                                                   \
      }                                                                                                    \
      GTEST_SKIP() << "no GPU: " << ::dstrain::cuda::unavailable_reason();                                 \
    }                                                                                                      \
  } while (0)
