// Whole-file reads and writes with errors that name the file and what it was meant to be.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace conveyor {

/// The most a text file conveyor reads may hold (a plan, a cluster, a job config, a profile,
/// an op graph, a secret): 256 MiB. docs/formats.md states the limits.
inline constexpr std::uint64_t kTextFileLimit = std::uint64_t{256} << 20;
/// The most a graph file (weights included) or a trace may hold: 64 GiB, and only a regular
/// file may be larger than kTextFileLimit (a device or a pipe, /dev/zero, never ends).
inline constexpr std::uint64_t kLargeFileLimit = std::uint64_t{64} << 30;

/// The bytes of `path`; `what` names the file in errors ("cannot open plan file 'p.json'").
/// A file larger than `limit` bytes is refused without reading past the limit.
Result<std::string> read_file(const std::string& path, std::string_view what, std::uint64_t limit = kTextFileLimit);

/// Replaces `path` with `data`.
Status write_file(const std::string& path, std::string_view data, std::string_view what);

}  // namespace conveyor
