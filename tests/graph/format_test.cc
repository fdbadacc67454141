#include "graph/format.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "test_graphs.h"

namespace conveyor::graph {
namespace {

class GraphFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("conveyor_format_test_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    path_ = (dir_ / "g.cvg").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  static TensorBlob blob(const std::string& name, std::vector<std::int64_t> shape) {
    TensorBlob b{name, "float64", shape, {}};
    std::size_t n = 1;
    for (auto d : shape) n *= static_cast<std::size_t>(d);
    b.bytes.resize(n * 8);
    for (std::size_t i = 0; i < n; ++i) {
      double x = 0.5 * static_cast<double>(i) - 1.0;
      std::memcpy(b.bytes.data() + i * 8, &x, 8);
    }
    return b;
  }

  std::string read() const {
    std::ifstream in(path_, std::ios::binary);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  void write(const std::string& bytes) const {
    std::ofstream out(path_, std::ios::binary | std::ios::trunc);
    out << bytes;
  }

  std::filesystem::path dir_;
  std::string path_;
};

TEST_F(GraphFileTest, RoundTripsGraphAndTensors) {
  Graph g = testing::mlp_graph();
  std::vector<TensorBlob> tensors = {blob("fc1.weight", {8, 4}), blob("fc1.bias", {8}),
                                     blob("fc2.weight", {3, 8}), blob("fc2.bias", {3})};
  ASSERT_TRUE(save_graph_file(path_, g, tensors).is_ok());
  auto file = load_graph_file(path_);
  ASSERT_TRUE(file.is_ok()) << file.status().to_string();
  EXPECT_EQ(file->graph.to_json(), g.to_json());
  ASSERT_EQ(file->tensors.size(), 4u);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_EQ(file->tensors[i].name, tensors[i].name);
    EXPECT_EQ(file->tensors[i].shape, tensors[i].shape);
    EXPECT_EQ(file->tensors[i].bytes, tensors[i].bytes);
  }
}

TEST_F(GraphFileTest, TruncatedFileIsReportedAsCorrupt) {
  ASSERT_TRUE(save_graph_file(path_, testing::mlp_graph(), {blob("fc1.weight", {8, 4})}).is_ok());
  std::string bytes = read();
  write(bytes.substr(0, bytes.size() - 7));
  auto file = load_graph_file(path_);
  ASSERT_FALSE(file.is_ok());
  EXPECT_EQ(file.status().code(), ErrorCode::kCorrupt);
  EXPECT_NE(file.status().message().find("truncated"), std::string::npos) << file.status().message();
}

TEST_F(GraphFileTest, FlippedByteIsCaughtByTheChecksum) {
  ASSERT_TRUE(save_graph_file(path_, testing::mlp_graph(), {blob("fc1.weight", {8, 4})}).is_ok());
  std::string bytes = read();
  bytes[bytes.size() - 3] ^= 0x10;  // inside the tensor data
  write(bytes);
  auto file = load_graph_file(path_);
  EXPECT_EQ(file.status().code(), ErrorCode::kCorrupt);
  EXPECT_NE(file.status().message().find("tensor data's checksum"), std::string::npos);

  ASSERT_TRUE(save_graph_file(path_, testing::mlp_graph(), {}).is_ok());
  bytes = read();
  bytes[60] ^= 0x01;  // inside the JSON document
  write(bytes);
  EXPECT_NE(load_graph_file(path_).status().message().find("graph document's checksum"), std::string::npos);
}

TEST_F(GraphFileTest, NewerContainerVersionIsRejected) {
  ASSERT_TRUE(save_graph_file(path_, testing::mlp_graph(), {}).is_ok());
  std::string bytes = read();
  std::uint32_t version = 9;
  std::memcpy(bytes.data() + 8, &version, 4);
  write(bytes);
  auto file = load_graph_file(path_);
  EXPECT_EQ(file.status().code(), ErrorCode::kVersion);
  EXPECT_NE(file.status().message().find("container version 9"), std::string::npos);
}

TEST_F(GraphFileTest, ForeignFilesAndMissingFiles) {
  write("PK\x03\x04 this is a zip file, not a graph");
  auto foreign = load_graph_file(path_);
  EXPECT_EQ(foreign.status().code(), ErrorCode::kFormat);
  EXPECT_NE(foreign.status().message().find("not a conveyor graph file"), std::string::npos);

  auto missing = load_graph_file((dir_ / "nope.cvg").string());
  EXPECT_EQ(missing.status().code(), ErrorCode::kIo);
}

TEST_F(GraphFileTest, RejectsTensorsWhoseBytesDoNotMatchTheirShape) {
  TensorBlob b = blob("w", {2, 2});
  b.bytes.pop_back();
  Status st = save_graph_file(path_, testing::mlp_graph(), {b});
  EXPECT_EQ(st.code(), ErrorCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(path_));
}

TEST(Crc32, MatchesTheStandardCheckValue) {
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
}

}  // namespace
}  // namespace conveyor::graph
