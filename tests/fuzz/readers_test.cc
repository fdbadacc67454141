// Every reader against hostile files: the seed corpus still reads (so the fuzzers start from
// valid files), every input the fuzzers or an attacker ever crashed a reader with is refused
// with a short, printable error (fuzz/regressions/READER/, plus the crash classes below).
#include "fuzz/readers.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "common/file.h"
#include "graph/format.h"

namespace conveyor::fuzz {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

const fs::path kFuzzDir = fs::path(CONVEYOR_SOURCE_ROOT) / "fuzz";

// An error a user can read: short, printable, naming what is wrong.
void expect_clean_error(const Status& st, const std::string& what, const std::string& needle = "") {
  ASSERT_FALSE(st.is_ok()) << what << " was accepted";
  EXPECT_LE(st.message().size(), 4200u) << what;
  for (char c : st.message()) {
    ASSERT_TRUE(static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f) << what << ": " << st.message();
  }
  if (!needle.empty()) {
    EXPECT_NE(st.message().find(needle), std::string::npos) << what << ": " << st.message();
  }
}

TEST(FuzzCorpus, EverySeedReads) {
  int seeds = 0;
  for (const auto& reader : reader_names()) {
    for (const auto& entry : fs::directory_iterator(kFuzzDir / "corpus" / reader)) {
      auto bytes = read_file(entry.path().string(), "seed");
      ASSERT_TRUE(bytes.is_ok());
      const Status st = read_as(reader, *bytes);
      EXPECT_TRUE(st.is_ok()) << entry.path() << ": " << st.to_string();
      ++seeds;
    }
  }
  EXPECT_GE(seeds, 16);
}

TEST(FuzzRegressions, EveryCrashFoundIsRefusedCleanly) {
  for (const auto& reader : reader_names()) {
    const fs::path dir = kFuzzDir / "regressions" / reader;
    if (!fs::exists(dir)) continue;
    for (const auto& entry : fs::directory_iterator(dir)) {
      auto bytes = read_file(entry.path().string(), "regression");
      ASSERT_TRUE(bytes.is_ok());
      expect_clean_error(read_as(reader, *bytes), entry.path().string());
    }
  }
}

// The seed graph file with its tensor table edited by `edit`, sizes and checksums redone.
std::string edited_graph_file(const std::function<void(json&)>& edit) {
  auto bytes = read_file((kFuzzDir / "corpus" / "graph_file" / "mlp.cvg").string(), "seed");
  EXPECT_TRUE(bytes.is_ok());
  std::uint64_t text_size = 0, data_size = 0;
  std::memcpy(&text_size, bytes->data() + 16, 8);
  std::memcpy(&data_size, bytes->data() + 24, 8);
  const std::size_t data_at = (40 + text_size + 63) / 64 * 64;
  json doc = json::parse(bytes->substr(40, text_size));
  edit(doc);
  const std::string text = doc.dump();
  std::string out = bytes->substr(0, 40);
  const std::uint64_t new_size = text.size();
  std::memcpy(out.data() + 16, &new_size, 8);
  out += text;
  out.append((40 + text.size() + 63) / 64 * 64 - out.size(), '\0');
  out += bytes->substr(data_at, data_size);
  graph::fix_checksums(out);
  return out;
}

TEST(FuzzRegressions, GraphFileTensorTableCannotReachOutsideTheData) {
  auto with = [](const char* key, json value) {
    return edited_graph_file([&](json& d) { d["tensors"][0][key] = value; });
  };
  EXPECT_TRUE(read_as("graph_file", edited_graph_file([](json&) {})).is_ok());
  expect_clean_error(read_as("graph_file", with("offset", -(1 << 20))), "offset -2^20", "cannot be negative");
  expect_clean_error(read_as("graph_file", with("offset", -4096)), "offset -4096", "cannot be negative");
  expect_clean_error(read_as("graph_file", with("nbytes", -1)), "nbytes -1");
  expect_clean_error(read_as("graph_file", with("nbytes", UINT64_MAX)), "nbytes 2^64-1", "out of range");
  expect_clean_error(read_as("graph_file", with("offset", INT64_MAX)), "offset 2^63-1", "past the end");
  expect_clean_error(read_as("graph_file", with("dtype", "float64x")), "unknown dtype", "unknown dtype");
  expect_clean_error(read_as("graph_file", with("shape", json::array({1 << 30, 1 << 30, 1 << 30}))), "huge shape",
                     "more bytes than");
  expect_clean_error(read_as("graph_file", with("shape", json::array({3}))), "shape disagreeing with nbytes", "need");
  expect_clean_error(read_as("graph_file", edited_graph_file([](json& d) { d["tensors"][1]["name"] = d["tensors"][0]["name"]; })),
                     "duplicate tensor names", "appears twice");
  expect_clean_error(read_as("graph_file", edited_graph_file([](json& d) { d["graph"]["values"][6]["id"] = (1LL << 32) + 6; })),
                     "value id 2^32+6", "from 0 to 2147483647");
}

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(FuzzRegressions, DeepNestingHugeNumbersAndLongValuesInEveryJsonReader) {
  for (const char* reader : {"graph_document", "op_graph", "profile", "plan"}) {
    const std::string what = reader;
    expect_clean_error(read_as(reader, "{\"format\": " + nested(100000) + "}"), what + " nested 10^5 deep", "nests");
    expect_clean_error(read_as(reader, "{\"format\": 1e400}"), what + " with 1e400", "not valid JSON");
    expect_clean_error(read_as(reader, "{\"format\": \"" + std::string(1 << 20, 'x') + "\"}"), what + " with a 1 MB string");
    expect_clean_error(read_as(reader, "{\"format\": \"\xff\xfe\"}"), what + " with bytes that are not UTF-8");
  }
}

TEST(FuzzRegressions, PlansThatCannotBeRun) {
  auto seed = read_file((kFuzzDir / "corpus" / "plan" / "mlp.json").string(), "seed");
  ASSERT_TRUE(seed.is_ok());
  const json plan = json::parse(*seed);
  auto with = [&](const std::function<void(json&)>& edit) {
    json p = plan;
    edit(p);
    return p.dump();
  };
  expect_clean_error(read_as("plan", with([](json& p) { p["stages"][0]["ops"] = json::array(); })), "empty stage",
                     "at least one operator");
  expect_clean_error(read_as("plan", with([](json& p) { p["stages"][0]["shares"] = std::vector<double>(100000, 1.0); })),
                     "10^5 shares", "one share per replica");
  expect_clean_error(read_as("plan", with([](json& p) { p["stages"][0]["ops"][0] = 1LL << 40; })), "op id 2^40",
                     "from 0 to 2147483647");
  expect_clean_error(read_as("plan", with([](json& p) { p["batch"] = (1LL << 32) + 4; })), "batch 2^32+4", "/batch");
}

TEST(FuzzRegressions, JobConfigsNamingWhatCannotWork) {
  expect_clean_error(read_as("job_config", "[job]\nplan = \"/\"\n"), "plan naming a directory", "no such readable file");
  expect_clean_error(read_as("job_config", "[job]\ntrace = \"/nonexistent/dir/t.pftrace\"\n"), "trace in a missing folder",
                     "does not exist");
  expect_clean_error(read_as("job_config", "[job]\nmaster_addr = \"1 parsec\"\n"), "master_addr 1 parsec",
                     "not a host name");
  expect_clean_error(read_as("job_config", "[job]\ntimeout = 1e300\n"), "timeout 1e300", "604800");
  expect_clean_error(read_as("job_config", "[job]\ntimeout = 1e-300\n"), "timeout 1e-300", "0.001");
  expect_clean_error(read_as("cluster", "[[node]]\ncount = 1048576\ndevices = 1048576\nmemory = 1\n"), "2^40 devices",
                     "more than 2^20 devices");
}

}  // namespace
}  // namespace conveyor::fuzz
