#include "common/env.h"

#include <cstdlib>

namespace conveyor::env {

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

}  // namespace conveyor::env
