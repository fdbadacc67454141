// The graph file: a small binary container holding the graph JSON document and,
// optionally, the bytes of its parameters, buffers and constants. Layout in docs/formats.md.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "graph/ir.h"

namespace conveyor::graph {

/// Version of the container layout (independent of the graph document's version).
inline constexpr std::uint32_t kContainerVersion = 1;
/// The file's first eight bytes.
inline constexpr std::string_view kContainerMagic = "CNVYGRPH";

/// A tensor's bytes, contiguous, in the machine's byte order.
struct TensorBlob {
  std::string name;
  std::string dtype;  ///< "float32", "int64", ...
  std::vector<std::int64_t> shape;
  std::string bytes;
};

/// What a graph file holds.
struct GraphFile {
  Graph graph;
  std::vector<TensorBlob> tensors;  ///< empty when saved without weights
};

/// Bytes per element of a dtype name, or 0 when the name is unknown.
std::size_t dtype_size(std::string_view dtype);

/// Writes `graph` and `tensors` to `path` (atomically: a temporary file, then rename).
Status save_graph_file(const std::string& path, const Graph& graph,
                       const std::vector<TensorBlob>& tensors);

/// Reads and checks a graph file: magic, versions, sizes, checksums, then the graph itself.
Result<GraphFile> load_graph_file(const std::string& path);

/// Checks and decodes the bytes of a graph file; `where` names them in errors ("graph file 'x'").
Result<GraphFile> read_graph_file(std::string_view bytes, const std::string& where);

/// Rewrites the checksums in the header of graph-file bytes to match their contents, where
/// the header's sizes fit the bytes (for fuzzing the reader past its checksums).
void fix_checksums(std::string& bytes);

/// CRC-32 (IEEE 802.3) of a byte range.
std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t seed = 0);

}  // namespace conveyor::graph
