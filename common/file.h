// Whole-file reads and writes with errors that name the file and what it was meant to be.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace conveyor {

/// The most a JSON document conveyor reads may hold (a plan, a profile, an op graph): 64 MiB,
/// which its reader holds in about 35 times that. docs/formats.md states the limits.
inline constexpr std::uint64_t kTextFileLimit = std::uint64_t{64} << 20;
/// The most a TOML file (a cluster file, a job config) or a secret file may hold: 16 MiB. Such
/// a file is a few hundred bytes; its reader holds up to about 90 times its size (1.5 GB).
inline constexpr std::uint64_t kConfigFileLimit = std::uint64_t{16} << 20;
/// The most a graph file (weights included) or a trace may hold: 64 GiB, and only a regular
/// file may be larger than kTextFileLimit (a device or a pipe, /dev/zero, never ends).
inline constexpr std::uint64_t kLargeFileLimit = std::uint64_t{64} << 30;

/// The bytes of `path`; `what` names the file in errors ("cannot open plan file 'p.json'").
/// A file larger than `limit` bytes is refused without reading past the limit.
Result<std::string> read_file(const std::string& path, std::string_view what, std::uint64_t limit = kTextFileLimit);

/// Replaces `path` with `data`.
Status write_file(const std::string& path, std::string_view data, std::string_view what);

}  // namespace conveyor
