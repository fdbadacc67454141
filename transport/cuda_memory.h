// What the transports ask of CUDA, through torch's device hooks (nothing from CUDA is needed
// to build, and a CPU-only torch answers no): whether this process sees a GPU, the calling
// thread's current device, and waiting until the work queued on tensors' streams is done.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <optional>
#include <vector>

namespace conveyor::transport {

/// Whether torch has CUDA and this process sees at least one GPU.
bool process_sees_a_gpu();

/// The calling thread's current CUDA device; none without a GPU.
std::optional<c10::Device> current_cuda_device();

/// Blocks until the work queued so far on the current stream of each CUDA tensor's device
/// is done (what made them), so that another engine can read their memory.
void wait_for_current_streams(const std::vector<at::Tensor>& tensors);

}  // namespace conveyor::transport
