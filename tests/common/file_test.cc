// read_file bounds what it reads: a file larger than its limit, or a device that never ends
// (/dev/zero), is refused, naming the limit, without reading past it.
#include "common/file.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace conveyor {
namespace {

TEST(ReadFile, ANeverEndingDeviceIsRefusedAtTheTextLimit) {
  auto read = read_file("/dev/zero", "plan file");
  ASSERT_FALSE(read.is_ok());
  EXPECT_NE(read.status().message().find("larger than the 256 MiB a plan file may hold"), std::string::npos)
      << read.status().message();
  // A graph file's larger limit is only for regular files: a device still stops at 256 MiB.
  auto graph = read_file("/dev/zero", "graph file", kLargeFileLimit);
  ASSERT_FALSE(graph.is_ok());
  EXPECT_NE(graph.status().message().find("256 MiB"), std::string::npos) << graph.status().message();
}

TEST(ReadFile, ARegularFileReadsWholeUpToItsLimit) {
  const auto path = std::filesystem::temp_directory_path() / "conveyor_file_test.txt";
  ASSERT_TRUE(write_file(path.string(), std::string(3 << 20, 'x'), "test file").is_ok());
  auto whole = read_file(path.string(), "test file");
  ASSERT_TRUE(whole.is_ok());
  EXPECT_EQ(whole->size(), std::size_t{3} << 20);
  auto refused = read_file(path.string(), "test file", std::uint64_t{2} << 20);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("larger than the 2 MiB a test file may hold"), std::string::npos);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace conveyor
