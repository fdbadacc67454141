// Every environment variable conveyor reads is read here, so the set is easy to audit.
//   CONVEYOR_CACHE_DIR   where profiles are cached (default $XDG_CACHE_HOME/conveyor or ~/.cache/conveyor)
#pragma once

#include <string>

namespace conveyor::env {

/// The cache directory (not created).
std::string cache_dir();

}  // namespace conveyor::env
