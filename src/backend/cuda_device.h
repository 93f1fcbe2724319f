// GPUs as the rest of dstrain sees them, in every build. A CPU-only build (the default) answers
// "no GPU" with the reason, so callers need no #ifdef; a build with -DDSTRAIN_CUDA=ON has the
// CUDA backend (backend/cuda/): its allocators and op table register on use_device().
#pragma once

#include <string>

#include "core/device.h"

namespace dstrain::cuda {

// Whether this build has the CUDA backend.
bool built();
// GPUs this process can see (CUDA_VISIBLE_DEVICES applies); 0 in a CPU-only build, without a
// driver, or without a GPU.
int device_count();
// Why this process cannot use a GPU ("this build has no CUDA backend (configure with
// -DDSTRAIN_CUDA=ON)", "no CUDA driver is installed", ...); empty when it can.
std::string unavailable_reason();
// Makes GPU `index` this process's device (cudaSetDevice) and registers the CUDA allocator, the
// pinned host allocator and the CUDA backend (once per process). Returns Device::cuda(index).
// Without a usable GPU: an error naming the reason.
Device use_device(int index);
// One line on the GPU and the software under it, e.g. "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB),
// driver 13.0, CUDA runtime 13.0, cuBLASLt 13.0.0, NCCL 2.28.3"; compared across ranks at start.
std::string describe(int index);
// Waits for every op issued on the current device (no-op without CUDA).
void synchronize();
// The GPU's PCI bus id ("0000:3b:00.0"), how NVML finds the GPU a rank uses whatever
// CUDA_VISIBLE_DEVICES says; empty without CUDA.
std::string pci_bus_id(int index);
// The GPU's dense bf16 tensor-core peak in FLOP/s from its datasheet (A100: 312 T; H100 and
// H200 SXM: 989 T; H100 PCIe: 756 T; ...), what MFU is measured against; 0 for a GPU not in the
// table (metrics.peak_tflops then gives it). `source` gets where the figure comes from.
double bf16_peak_flops(int index, std::string* source);

}  // namespace dstrain::cuda
