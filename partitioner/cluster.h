// The machines a plan runs on: nodes of devices with memory and relative speed, and the
// links within and between nodes. Read from a TOML file (docs/formats.md). Torch-free.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace conveyor::partitioner {

/// The most devices a cluster file or a plan describes (docs/formats.md, "Size limits").
inline constexpr std::size_t kMostDevices = std::size_t{1} << 20;

/// One device of a cluster: its memory, relative speed and node.
struct Device {
  int node = 0;              ///< index of its machine
  int local = 0;             ///< index within the machine
  double memory_bytes = 0;
  double speed = 1;          ///< relative to the device the profile was measured on
};

/// A link between devices: bandwidth and latency.
struct Link {
  double bandwidth_bytes_per_s = 0;  ///< 0: free (no transfer cost)
  double latency_s = 0;
};

/// The devices a plan is made for, and the links between them.
struct Cluster {
  std::string name;
  std::vector<Device> devices;  ///< node-major: the planner places stages on consecutive devices
  int nodes = 0;
  Link intra_node;              ///< between devices of one node (NVLink, shared memory)
  Link inter_node;              ///< between nodes (InfiniBand, Ethernet)

  /// Parses the TOML description; errors name the line and what is expected there.
  static Result<Cluster> from_toml(std::string_view text, const std::string& source = "cluster file");
  /// `nodes` identical nodes of `per_node` devices.
  static Cluster uniform(int nodes, int per_node, double memory_bytes, double speed, Link intra, Link inter);

  bool same_node(int a, int b) const { return devices[a].node == devices[b].node; }
  /// The link between two devices.
  const Link& link(int a, int b) const { return same_node(a, b) ? intra_node : inter_node; }
  std::string summary() const;
};

Result<Cluster> load_cluster(const std::string& path);

/// "80 GiB", "80GB", "1.5e9" (bytes). Errors say what forms are accepted.
Result<double> parse_bytes(std::string_view text);
/// "300 GB/s", "100 Gbit/s", "2.5e10" (bytes per second).
Result<double> parse_bandwidth(std::string_view text);
/// "5 us", "1.5 ms", "2 s", "20 ns" (seconds).
Result<double> parse_duration(std::string_view text);

/// "1.5 GiB" style, for tables.
std::string human_bytes(double bytes);
/// "12.3 ms" style.
std::string human_seconds(double seconds);

}  // namespace conveyor::partitioner
