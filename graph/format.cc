#include "graph/format.h"

#include "common/file.h"
#include "common/json_reader.h"

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
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
T get(std::string_view in, std::size_t offset) {
  T v;
  std::memcpy(&v, in.data() + offset, sizeof(T));
  return v;
}

std::size_t align_up(std::size_t n) { return (n + kDataAlignment - 1) / kDataAlignment * kDataAlignment; }

// The document and tensor data a file's header announces, or nothing when they do not fit
// in it. The sizes are compared before any sum is formed: sizes near 2^64 must not wrap
// around the checks.
struct Sections {
  std::string_view text, data;
};
std::optional<Sections> sections_of(std::string_view bytes) {
  if (bytes.size() < kHeaderSize) return std::nullopt;
  const auto text_size = get<std::uint64_t>(bytes, 16);
  const auto data_size = get<std::uint64_t>(bytes, 24);
  if (text_size > bytes.size() - kHeaderSize || data_size > bytes.size() ||
      align_up(kHeaderSize + text_size) > bytes.size() - data_size) {
    return std::nullopt;
  }
  return Sections{bytes.substr(kHeaderSize, text_size), bytes.substr(align_up(kHeaderSize + text_size), data_size)};
}

// The tensor table of a graph file: each entry's bytes must lie inside `data`, match its dtype
// and shape exactly, and its name must be new. Every size is checked before it is added or
// multiplied, so a crafted entry cannot wrap around a bound.
std::vector<TensorBlob> read_tensor_table(const json& table, std::string_view data) {
  using json_reader::JsonError;
  std::vector<TensorBlob> out;
  std::set<std::string> names;
  const auto& entries = json_reader::as_array(table, "/tensors");
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::string path = "/tensors/" + std::to_string(i);
    const json& jt = entries[i];
    TensorBlob t;
    t.name = json_reader::as_string(json_reader::field(jt, path, "name"), path + "/name");
    if (!names.insert(t.name).second) {
      throw JsonError(path + "/name", "tensor '" + json_reader::printable(t.name, 80) + "' appears twice");
    }
    t.dtype = json_reader::as_string(json_reader::field(jt, path, "dtype"), path + "/dtype");
    const std::size_t elem = dtype_size(t.dtype);
    if (elem == 0) throw JsonError(path + "/dtype", "unknown dtype " + json_reader::excerpt(jt["dtype"]));
    const auto& shape = json_reader::as_array(json_reader::field(jt, path, "shape"), path + "/shape");
    std::uint64_t need = elem;
    for (std::size_t d = 0; d < shape.size(); ++d) {
      const std::int64_t size = json_reader::as_int(shape[d], path + "/shape/" + std::to_string(d));
      if (size < 0) throw JsonError(path + "/shape/" + std::to_string(d), "a size cannot be negative");
      if (size != 0 && need > data.size() / static_cast<std::uint64_t>(size)) {
        throw JsonError(path + "/shape", "the shape needs more bytes than the file's tensor data holds");
      }
      need *= static_cast<std::uint64_t>(size);
      t.shape.push_back(size);
    }
    const std::int64_t offset = json_reader::as_int(json_reader::field(jt, path, "offset"), path + "/offset");
    const std::int64_t nbytes = json_reader::as_int(json_reader::field(jt, path, "nbytes"), path + "/nbytes");
    if (offset < 0 || nbytes < 0) throw JsonError(path, "offset and nbytes cannot be negative");
    if (static_cast<std::uint64_t>(nbytes) != need) {
      throw JsonError(path + "/nbytes", std::to_string(nbytes) + " bytes, but dtype " + t.dtype + " and the shape need " +
                                            std::to_string(need));
    }
    if (static_cast<std::uint64_t>(nbytes) > data.size() ||
        static_cast<std::uint64_t>(offset) > data.size() - static_cast<std::uint64_t>(nbytes)) {
      throw JsonError(path, "tensor '" + json_reader::printable(t.name, 80) + "' lies past the end of the data (" +
                                std::to_string(data.size()) + " bytes)");
    }
    t.bytes.assign(data.substr(static_cast<std::size_t>(offset), static_cast<std::size_t>(nbytes)));
    out.push_back(std::move(t));
  }
  return out;
}

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

void fix_checksums(std::string& bytes) {
  const auto sections = sections_of(bytes);
  if (!sections) return;
  const std::uint32_t text_crc = crc32(sections->text.data(), sections->text.size());
  const std::uint32_t data_crc = crc32(sections->data.data(), sections->data.size());
  std::memcpy(bytes.data() + 32, &text_crc, 4);
  std::memcpy(bytes.data() + 36, &data_crc, 4);
}

Result<GraphFile> load_graph_file(const std::string& path) {
  CONVEYOR_ASSIGN_OR_RETURN(std::string bytes, read_file(path, "graph file", kLargeFileLimit));
  return read_graph_file(bytes, "graph file '" + path + "'");
}

Result<GraphFile> read_graph_file(std::string_view bytes, const std::string& where) {
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
  const auto sections = sections_of(bytes);
  if (!sections) {
    return Status(ErrorCode::kCorrupt, where + " is truncated: its header announces " +
                                           std::to_string(get<std::uint64_t>(bytes, 16)) + " bytes of document and " +
                                           std::to_string(get<std::uint64_t>(bytes, 24)) +
                                           " bytes of tensor data, but the file has " + std::to_string(bytes.size()));
  }
  const std::string_view text = sections->text, data = sections->data;
  if (crc32(text.data(), text.size()) != get<std::uint32_t>(bytes, 32)) {
    return Status(ErrorCode::kCorrupt, where + " is corrupted: the graph document's checksum does not match");
  }
  if (crc32(data.data(), data.size()) != get<std::uint32_t>(bytes, 36)) {
    return Status(ErrorCode::kCorrupt, where + " is corrupted: the tensor data's checksum does not match");
  }
  auto parsed = json_reader::parse_document(
      text, "the graph document",
      [&](const json& doc) -> Result<GraphFile> {
        auto graph = Graph::from_json(json_reader::field(doc, "", "graph").dump());
        if (!graph) return graph.status();
        GraphFile file{std::move(graph).value(), {}};
        file.tensors = read_tensor_table(json_reader::field(doc, "", "tensors"), data);
        return file;
      });
  if (!parsed) return parsed.status().with_context(where);
  return parsed;
}

}  // namespace conveyor::graph