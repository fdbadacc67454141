#include "common/env.h"

#include <cstdlib>
#include <string>

namespace conveyor::env {

namespace {

// Whether `name` is set to anything but "0": the switches conveyor's defaults are on for.
bool not_zero(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || std::string_view(v) != "0";
}

}  // namespace

std::string cache_dir() {
  if (const char* d = std::getenv("CONVEYOR_CACHE_DIR"); d && *d) return d;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::string(x) + "/conveyor";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/conveyor";
  return ".conveyor-cache";
}

std::string nccl_library() {
  const char* p = std::getenv("CONVEYOR_NCCL_LIBRARY");
  return p ? p : "";
}

std::string job_secret() {
  const char* s = std::getenv("CONVEYOR_JOB_SECRET");
  return s ? s : "";
}

std::string job_setting(const char* name) {
  const char* s = std::getenv(name);
  return s ? s : "";
}

int openmp_threads() {
  const char* v = std::getenv("OMP_NUM_THREADS");
  const int n = v != nullptr ? std::atoi(v) : 0;
  return n > 0 ? n : 0;
}

bool memory_meter_enabled() { return not_zero("CONVEYOR_MEMORY_METER"); }

bool message_pool_enabled() { return not_zero("CONVEYOR_MESSAGE_POOL"); }

std::size_t ucx_region_bytes() {
  const char* v = std::getenv("CONVEYOR_UCX_REGION_MB");
  const long long mb = v != nullptr ? std::atoll(v) : 1024;
  return mb > 0 ? static_cast<std::size_t>(mb) << 20 : 0;
}

bool ucx_shared_memory_allowed() { return not_zero("CONVEYOR_UCX_SHM"); }

bool ucx_cuda_allowed() { return not_zero("CONVEYOR_UCX_CUDA"); }

bool ucx_setting_given(std::string_view setting) {
  return std::getenv(("UCX_" + std::string(setting)).c_str()) != nullptr;
}

}  // namespace conveyor::env
