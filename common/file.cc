#include "common/file.h"

#include <filesystem>
#include <fstream>
#include <algorithm>
#include <string>

#include "common/printable.h"

namespace conveyor {

Result<std::string> read_file(const std::string& path, std::string_view what, std::uint64_t limit) {
  const std::string named = std::string(what) + " '" + printable(path, 200) + "'";
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Status(ErrorCode::kIo, named + " is a directory; name the file in it");
  }
  const auto too_large = [&] {
    return Status(ErrorCode::kInvalidArgument,
                  named + " is larger than the " + std::to_string(limit >> 20) + " MiB a " + std::string(what) +
                      " may hold (docs/formats.md, \"Size limits\"): is it the right file?");
  };
  // Only a regular file, whose end is known, may be larger than a text file; one whose size
  // already says it is too large is refused unread.
  if (!std::filesystem::is_regular_file(path, ec)) {
    limit = std::min(limit, kTextFileLimit);
  } else if (std::filesystem::file_size(path, ec) > limit && !ec) {
    return too_large();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(ErrorCode::kIo, "cannot open " + named);
  std::string out;
  std::string block(std::size_t{1} << 20, '\0');
  while (in) {
    in.read(block.data(), static_cast<std::streamsize>(block.size()));
    const auto got = static_cast<std::uint64_t>(in.gcount());
    if (out.size() + got > limit) return too_large();
    out.append(block.data(), got);
  }
  if (in.bad()) return Status(ErrorCode::kIo, "reading " + named + " failed");
  return out;
}

Status write_file(const std::string& path, std::string_view data, std::string_view what) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return Status(ErrorCode::kIo, "cannot write " + std::string(what) + " '" + printable(path, 200) + "'");
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!f) return Status(ErrorCode::kIo, "writing " + std::string(what) + " '" + printable(path, 200) + "' failed");
  return Status::ok();
}

}  // namespace conveyor
