// The meta device (core/device.h): tensors with shapes and no memory, ops that run nothing.
// Code that runs on it allocates every buffer it would allocate on a real device, through the
// same Buffers, so the allocator's accounting (core/buffer.h, memory_stats(DeviceType::Meta))
// says what it would hold, by category and at its peak, in no time and no memory. The memory
// model (train/memory_model.h) runs a rank's layers, optimizer and schedule on it.
//
// What the device cannot know it is told: values read back to the host come back as zeros, and
// the MoE layers, whose expert GEMMs take their shapes from the routing, assume balanced loads
// (every expert gets the same share of the routed rows).
#pragma once

namespace dstrain::meta {

// Registers the meta backend and its allocator, once per process (later calls do nothing).
// Its address space is reserved but never committed: touching a meta tensor's memory from the
// host faults, so a host read that the model would make on a real device shows up at once.
void ensure_registered();

}  // namespace dstrain::meta
