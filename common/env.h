// Every environment variable conveyor's C++ reads is read here, so the set is easy to audit;
// docs/environment.md lists them all, with those the Python package reads. Each function is
// named for what it returns and says which variable gives it.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace conveyor::env {

/// The cache directory (not created): CONVEYOR_CACHE_DIR, else $XDG_CACHE_HOME/conveyor, else
/// ~/.cache/conveyor.
std::string cache_dir();

/// CONVEYOR_NCCL_LIBRARY, or empty.
std::string nccl_library();

/// CONVEYOR_JOB_SECRET, or empty.
std::string job_secret();

/// The job setting `name` (one of CONVEYOR_TIMEOUT, _TRANSPORT, _SCHEDULE, _REPLAN), or empty.
std::string job_setting(const char* name);

/// OMP_NUM_THREADS as a positive number, or 0 where it is unset or not one (`conveyor launch`
/// shares the cores out among its processes, fewer where the caller asked for fewer).
int openmp_threads();

/// Whether host memory is metered (runtime/memory_meter.h): unless CONVEYOR_MEMORY_METER=0.
bool memory_meter_enabled();

/// Whether large message buffers come from a pool (transport/message_buffer.h): unless
/// CONVEYOR_MESSAGE_POOL=0 (every buffer fresh, to measure the pool).
bool message_pool_enabled();

/// The bytes of a process's outbound UCX message region: CONVEYOR_UCX_REGION_MB mebibytes
/// (default 1024); 0 when that is not positive (no region).
std::size_t ucx_region_bytes();

/// Whether UCX peers on one host may talk through shared memory: unless CONVEYOR_UCX_SHM=0.
bool ucx_shared_memory_allowed();

/// Whether UCX may move CUDA tensors from and into device memory: unless CONVEYOR_UCX_CUDA=0.
bool ucx_cuda_allowed();

/// Whether the user set UCX's own variable UCX_<setting> (say "TLS"): then conveyor leaves
/// that setting to UCX, which reads the variable itself.
bool ucx_setting_given(std::string_view setting);

}  // namespace conveyor::env
