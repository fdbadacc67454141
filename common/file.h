// Whole-file reads and writes with errors that name the file and what it was meant to be.
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"

namespace conveyor {

/// The bytes of `path`; `what` names the file in errors ("cannot open plan file 'p.json'").
Result<std::string> read_file(const std::string& path, std::string_view what);

/// Replaces `path` with `data`.
Status write_file(const std::string& path, std::string_view data, std::string_view what);

}  // namespace conveyor
