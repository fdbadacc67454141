// Every environment variable conveyor reads is read here, so the set is easy to audit.
//   CONVEYOR_CACHE_DIR      where profiles are cached (default $XDG_CACHE_HOME/conveyor or ~/.cache/conveyor)
//   CONVEYOR_NCCL_LIBRARY   the NCCL library to open (default: found as transport/nccl_library.h says)
//   CONVEYOR_JOB_SECRET     the secret a job's processes prove they share (common/secret.h)
//   CONVEYOR_TIMEOUT, CONVEYOR_TRANSPORT, CONVEYOR_SCHEDULE, CONVEYOR_REPLAN
//                           `conveyor launch`'s defaults for its processes (its flags and a job
//                           config override them); Python reads them in each process too
#pragma once

#include <string>

namespace conveyor::env {

/// The cache directory (not created).
std::string cache_dir();

/// CONVEYOR_NCCL_LIBRARY, or empty.
std::string nccl_library();

/// CONVEYOR_JOB_SECRET, or empty.
std::string job_secret();

/// The job setting `name` (one of CONVEYOR_TIMEOUT, _TRANSPORT, _SCHEDULE, _REPLAN), or empty.
std::string job_setting(const char* name);

}  // namespace conveyor::env
