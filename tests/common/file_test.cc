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
  EXPECT_NE(read.status().message().find("larger than the 64 MiB a plan file may hold"), std::string::npos)
      << read.status().message();
  // A graph file's larger limit is only for regular files: a device still stops at 64 MiB.
  auto graph = read_file("/dev/zero", "graph file", kLargeFileLimit);
  ASSERT_FALSE(graph.is_ok());
  EXPECT_NE(graph.status().message().find("64 MiB"), std::string::npos) << graph.status().message();
}

TEST(ReadFile, ARegularFileWhoseSizeIsOverTheLimitIsRefusedUnread) {
  // A sparse file of 300 MiB: its size says it all (read, it took a second and 256 MiB).
  const auto path = std::filesystem::temp_directory_path() / "conveyor_file_test_sparse.toml";
  std::filesystem::remove(path);
  { std::FILE* f = std::fopen(path.string().c_str(), "w"); ASSERT_NE(f, nullptr); std::fclose(f); }
  std::filesystem::resize_file(path, std::uint64_t{300} << 20);
  auto read = read_file(path.string(), "job config", kConfigFileLimit);
  ASSERT_FALSE(read.is_ok());
  EXPECT_NE(read.status().message().find("larger than the 16 MiB a job config may hold"), std::string::npos)
      << read.status().message();
  std::filesystem::remove(path);
}

TEST(ReadFile, APathIsQuotedPrintable) {
  auto read = read_file("/no/such\x1b[2J\x07" "file", "plan file");
  ASSERT_FALSE(read.is_ok());
  EXPECT_EQ(read.status().message().find('\x1b'), std::string::npos) << read.status().message();
  EXPECT_NE(read.status().message().find("/no/such?[2J?file"), std::string::npos) << read.status().message();
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
