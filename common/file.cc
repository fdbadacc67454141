#include "common/file.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace conveyor {

Result<std::string> read_file(const std::string& path, std::string_view what) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return Status(ErrorCode::kIo, std::string(what) + " '" + path + "' is a directory; name the file in it");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(ErrorCode::kIo, "cannot open " + std::string(what) + " '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return Status(ErrorCode::kIo, "reading " + std::string(what) + " '" + path + "' failed");
  return ss.str();
}

Status write_file(const std::string& path, std::string_view data, std::string_view what) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return Status(ErrorCode::kIo, "cannot write " + std::string(what) + " '" + path + "'");
  f.write(data.data(), static_cast<std::streamsize>(data.size()));
  if (!f) return Status(ErrorCode::kIo, "writing " + std::string(what) + " '" + path + "' failed");
  return Status::ok();
}

}  // namespace conveyor
