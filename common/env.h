// Every environment variable conveyor reads is read here, so the set is easy to audit.
//   CONVEYOR_CACHE_DIR      where profiles are cached (default $XDG_CACHE_HOME/conveyor or ~/.cache/conveyor)
//   CONVEYOR_NCCL_LIBRARY   the NCCL library to open (default: found as transport/nccl_library.h says)
//   CONVEYOR_JOB_SECRET     the secret a job's processes prove they share (common/secret.h)
#pragma once

#include <string>

namespace conveyor::env {

/// The cache directory (not created).
std::string cache_dir();

/// CONVEYOR_NCCL_LIBRARY, or empty.
std::string nccl_library();

/// CONVEYOR_JOB_SECRET, or empty.
std::string job_secret();

}  // namespace conveyor::env
