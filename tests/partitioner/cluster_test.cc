#include "partitioner/cluster.h"

#include <gtest/gtest.h>

namespace conveyor::partitioner {
namespace {

constexpr const char* kToml = R"(name = "mixed"

[[node]]
count = 2
devices = 8
memory = "80 GiB"

[[node]]
devices = 4
memory = "40GB"
speed = 0.5

[link.intra_node]
bandwidth = "300 GB/s"
latency = "5 us"

[link.inter_node]
bandwidth = "100 Gbit/s"
latency = "20us"
)";

TEST(Cluster, ParsesNodesLinksAndUnits) {
  auto c = Cluster::from_toml(kToml);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  EXPECT_EQ(c->name, "mixed");
  EXPECT_EQ(c->nodes, 3);
  ASSERT_EQ(c->devices.size(), 20u);
  EXPECT_DOUBLE_EQ(c->devices[0].memory_bytes, 80.0 * 1024 * 1024 * 1024);
  EXPECT_EQ(c->devices[8].node, 1);
  EXPECT_EQ(c->devices[19].node, 2);
  EXPECT_DOUBLE_EQ(c->devices[19].speed, 0.5);
  EXPECT_DOUBLE_EQ(c->devices[19].memory_bytes, 40e9);
  EXPECT_DOUBLE_EQ(c->intra_node.bandwidth_bytes_per_s, 300e9);
  EXPECT_DOUBLE_EQ(c->inter_node.bandwidth_bytes_per_s, 12.5e9);
  EXPECT_DOUBLE_EQ(c->inter_node.latency_s, 20e-6);
  EXPECT_TRUE(c->same_node(0, 7));
  EXPECT_FALSE(c->same_node(7, 8));
}

void expect_error(const std::string& toml, const std::string& needle) {
  auto c = Cluster::from_toml(toml, "job.toml");
  ASSERT_FALSE(c.is_ok()) << toml;
  EXPECT_EQ(c.status().code(), ErrorCode::kFormat);
  EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().message();
}

TEST(Cluster, ErrorsNameTheLineAndWhatIsExpected) {
  std::string t = kToml;
  auto with = [&](const std::string& from, const std::string& to) {
    std::string d = t;
    d.replace(d.find(from), from.size(), to);
    return d;
  };
  expect_error(with("memory = \"80 GiB\"", "memroy = \"80 GiB\""), "job.toml:6: unknown key 'memroy' in [[node]]");
  expect_error(with("\"80 GiB\"", "\"80 parsecs\""), "job.toml:6: memory: '80 parsecs' is not a size");
  expect_error(with("count = 2", "count = 0"), "job.toml:4: count in [[node]] must be a positive integer");
  expect_error(with("speed = 0.5", "speed = -1"), "job.toml:11: speed must be a number > 0");
  expect_error(with("\"300 GB/s\"", "\"fast\""), "job.toml:14: bandwidth: 'fast' is not a bandwidth");
  expect_error(with("[link.inter_node]", "[link.between]"), "unknown key 'between' in [link]");
  expect_error(with("name = \"mixed\"", "name = [1"), "not valid TOML");
  expect_error("name = \"x\"\n", "missing [[node]]");
  expect_error("[[node]]\ndevices = 2\nmemory = 1e9\n", "missing tables [link.intra_node]");
}

TEST(Cluster, UnitParsers) {
  EXPECT_DOUBLE_EQ(*parse_bytes("1.5e9"), 1.5e9);
  EXPECT_DOUBLE_EQ(*parse_bytes("2 MiB"), 2.0 * 1024 * 1024);
  EXPECT_DOUBLE_EQ(*parse_bandwidth("8 Gbit/s"), 1e9);
  EXPECT_DOUBLE_EQ(*parse_duration("1.5 ms"), 1.5e-3);
  EXPECT_FALSE(parse_duration("5 minutes").is_ok());
  EXPECT_EQ(human_bytes(1536), "1.5 KiB");
}

}  // namespace
}  // namespace conveyor::partitioner
