#include "graph/format.h"

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace conveyor::graph {
namespace {

using nlohmann::json;

constexpr std::size_t kHeaderSize = 40;
constexpr std::size_t kDataAlignment = 64;

std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}

template <typename T>
void put(std::string& out, T v) {
  char buf[sizeof(T)];
  std::memcpy(buf, &v, sizeof(T));
  out.append(buf, sizeof(T));
}

template <typename T>
T get(const std::string& in, std::size_t offset) {
  T v;
  std::memcpy(&v, in.data() + offset, sizeof(T));
  return v;
}

std::size_t align_up(std::size_t n) { return (n + kDataAlignment - 1) / kDataAlignment * kDataAlignment; }

}  // namespace

std::uint32_t crc32(const void* data, std::size_t size, std::uint32_t seed) {
  static const auto table = make_crc_table();
  std::uint32_t c = seed ^ 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::size_t dtype_size(std::string_view dtype) {
  if (dtype == "float64" || dtype == "int64" || dtype == "complex64" || dtype == "uint64") return 8;
  if (dtype == "float32" || dtype == "int32" || dtype == "uint32") return 4;
  if (dtype == "float16" || dtype == "bfloat16" || dtype == "int16" || dtype == "uint16") return 2;
  if (dtype == "int8" || dtype == "uint8" || dtype == "bool" || dtype == "float8_e4m3fn" ||
      dtype == "float8_e5m2") {
    return 1;
  }
  if (dtype == "complex128") return 16;
  return 0;
}

Status save_graph_file(const std::string& path, const Graph& graph,
                       const std::vector<TensorBlob>& tensors) {
  json table = json::array();
  std::vector<std::size_t> offsets;
  std::size_t offset = 0;
  for (const auto& t : tensors) {
    std::size_t numel = 1;
    for (auto d : t.shape) numel *= static_cast<std::size_t>(d);
    std::size_t elem = dtype_size(t.dtype);
    if (elem == 0) {
      return Status(ErrorCode::kInvalidArgument,
                    "tensor '" + t.name + "' has dtype '" + t.dtype + "' which the graph file cannot store");
    }
    if (numel * elem != t.bytes.size()) {
      return Status(ErrorCode::kInvalidArgument,
                    "tensor '" + t.name + "' has " + std::to_string(t.bytes.size()) +
                        " bytes but its shape and dtype need " + std::to_string(numel * elem));
    }
    offset = align_up(offset);
    offsets.push_back(offset);
    table.push_back({{"name", t.name}, {"dtype", t.dtype}, {"shape", t.shape},
                     {"offset", offset}, {"nbytes", t.bytes.size()}});
    offset += t.bytes.size();
  }
  json doc = {{"graph", json::parse(graph.to_json())}, {"tensors", std::move(table)}};
  std::string text = doc.dump();
  std::string data(offset, '\0');
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (!t.bytes.empty()) std::memcpy(data.data() + offsets[i], t.bytes.data(), t.bytes.size());
  }

  std::string header;
  header.append(kContainerMagic);
  put<std::uint32_t>(header, kContainerVersion);
  put<std::uint32_t>(header, 0);  // flags
  put<std::uint64_t>(header, text.size());
  put<std::uint64_t>(header, data.size());
  put<std::uint32_t>(header, crc32(text.data(), text.size()));
  put<std::uint32_t>(header, crc32(data.data(), data.size()));
  CONVEYOR_CHECK(header.size() == kHeaderSize);

  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Status(ErrorCode::kIo, "cannot open '" + tmp + "' for writing");
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    std::string pad(align_up(kHeaderSize + text.size()) - (kHeaderSize + text.size()), '\0');
    out.write(pad.data(), static_cast<std::streamsize>(pad.size()));
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    out.flush();
    if (!out) return Status(ErrorCode::kIo, "writing '" + tmp + "' failed (disk full?)");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Status(ErrorCode::kIo, "cannot rename '" + tmp + "' to '" + path + "': " + ec.message());
  return Status::ok();
}

Result<GraphFile> load_graph_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status(ErrorCode::kIo, "cannot open graph file '" + path + "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string bytes = std::move(ss).str();
  const std::string where = "graph file '" + path + "'";

  if (bytes.size() < kContainerMagic.size() ||
      std::string_view(bytes).substr(0, kContainerMagic.size()) != kContainerMagic) {
    return Status(ErrorCode::kFormat,
                  where + " is not a conveyor graph file (it does not start with \"CNVYGRPH\")");
  }
  if (bytes.size() < kHeaderSize) {
    return Status(ErrorCode::kCorrupt, where + " is truncated: its header is incomplete");
  }
  auto version = get<std::uint32_t>(bytes, 8);
  if (version > kContainerVersion) {
    return Status(ErrorCode::kVersion,
                  where + " has container version " + std::to_string(version) +
                      " but this conveyor reads versions up to " + std::to_string(kContainerVersion) +
                      "; upgrade conveyor or save the graph again with this version");
  }
  auto text_size = get<std::uint64_t>(bytes, 16);
  auto data_size = get<std::uint64_t>(bytes, 24);
  auto text_crc = get<std::uint32_t>(bytes, 32);
  auto data_crc = get<std::uint32_t>(bytes, 36);
  std::size_t data_at = align_up(kHeaderSize + text_size);
  if (text_size > bytes.size() || data_size > bytes.size() || data_at + data_size > bytes.size()) {
    return Status(ErrorCode::kCorrupt,
                  where + " is truncated: expected " + std::to_string(data_at + data_size) +
                      " bytes, found " + std::to_string(bytes.size()));
  }
  if (crc32(bytes.data() + kHeaderSize, text_size) != text_crc) {
    return Status(ErrorCode::kCorrupt, where + " is corrupted: the graph document's checksum does not match");
  }
  if (crc32(bytes.data() + data_at, data_size) != data_crc) {
    return Status(ErrorCode::kCorrupt, where + " is corrupted: the tensor data's checksum does not match");
  }
  json doc;
  try {
    doc = json::parse(bytes.begin() + kHeaderSize, bytes.begin() + kHeaderSize + text_size);
  } catch (const json::exception& e) {
    return Status(ErrorCode::kFormat, where + ": the graph document is not valid JSON: " + e.what());
  }
  if (!doc.is_object() || !doc.contains("graph") || !doc.contains("tensors")) {
    return Status(ErrorCode::kFormat, where + ": expected fields 'graph' and 'tensors'");
  }
  auto graph = Graph::from_json(doc["graph"].dump());
  if (!graph) return graph.status().with_context(where);
  GraphFile file{std::move(graph).value(), {}};
  try {
    for (const auto& jt : doc["tensors"]) {
      TensorBlob t;
      t.name = jt.at("name").get<std::string>();
      t.dtype = jt.at("dtype").get<std::string>();
      t.shape = jt.at("shape").get<std::vector<std::int64_t>>();
      auto offset = jt.at("offset").get<std::size_t>();
      auto nbytes = jt.at("nbytes").get<std::size_t>();
      if (offset + nbytes > data_size) {
        return Status(ErrorCode::kCorrupt, where + ": tensor '" + t.name + "' lies past the end of the data");
      }
      t.bytes.assign(bytes.data() + data_at + offset, nbytes);
      file.tensors.push_back(std::move(t));
    }
  } catch (const json::exception& e) {
    return Status(ErrorCode::kFormat, where + ": malformed tensor table: " + e.what());
  }
  return file;
}

}  // namespace conveyor::graph
