#include "transport/cuda_memory.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <set>

namespace conveyor::transport {

bool process_sees_a_gpu() {
  static const bool sees = [] {
    // The CUDA runtime's count through torch's hooks (as transport/nccl.cc asks).
    return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) && at::detail::getCUDAHooks().hasCUDA() &&
           at::detail::getCUDAHooks().getNumGPUs() > 0;
  }();
  return sees;
}

std::optional<c10::Device> current_cuda_device() {
  if (!process_sees_a_gpu()) return std::nullopt;
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice();
}

void wait_for_current_streams(const std::vector<at::Tensor>& tensors) {
  std::set<c10::DeviceIndex> devices;
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) devices.insert(t.device().index());
  }
  if (devices.empty()) return;
  const auto* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  for (c10::DeviceIndex d : devices) cuda->synchronizeStream(cuda->getStream(c10::Device(c10::DeviceType::CUDA, d)));
}

}  // namespace conveyor::transport
