#include "common/file.h"

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <string>

namespace conveyor {

Result<std::string> read_file(const std::string& path, std::string_view what, std::uint64_t limit) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Status(ErrorCode::kIo, std::string(what) + " '" + path + "' is a directory; name the file in it");
  }
  // Only a regular file, whose end is known, may be larger than a text file.
  if (!std::filesystem::is_regular_file(path, ec)) limit = std::min(limit, kTextFileLimit);
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(ErrorCode::kIo, "cannot open " + std::string(what) + " '" + path + "'");
  std::string out;
  std::string block(std::size_t{1} << 20, '\0');
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    const auto got = static_cast<std::uint64_t>(in.gcount());
    if (out.size() + got > limit) {
      return Status(ErrorCode::kInvalidArgument,
                    std::string(what) + " '" + path + "' is larger than the " + std::to_string(limit >> 20) +
                        " MiB a " + std::string(what) + " may hold (docs/formats.md, \"Size limits\"): is it the right file?");
    }
    out.append(block.data(), got);
  }
  if (in.bad()) return Status(ErrorCode::kIo, "reading " + std::string(what) + " '" + path + "' failed");
  return out;
}

Status write_file(const std::string& path, std::string_view data, std::string_view what) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return Status(ErrorCode::kIo, "cannot write " + std::string(what) + " '" + path + "'");
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!f) return Status(ErrorCode::kIo, "writing " + std::string(what) + " '" + path + "' failed");
  return Status::ok();
}

}  // namespace conveyor
