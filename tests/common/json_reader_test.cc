// Reading JSON documents: the depth limit, and time linear in the document.
#include "common/json_reader.h"

#include <gtest/gtest.h>

#include <string>

namespace conveyor::json_reader {
namespace {

TEST(JsonReader, NestingPastTheLimitIsRefusedAndAtItRead) {
  const std::string at_limit = std::string(kMaxDepth, '[') + std::string(kMaxDepth, ']');
  EXPECT_TRUE(parse_json(at_limit, "doc").is_ok());
  for (const std::string& deep : {std::string(kMaxDepth + 1, '[') + std::string(kMaxDepth + 1, ']'),
                                  std::string(1000000, '['), "{\"a\":" + std::string(200, '[')}) {
    auto r = parse_json(deep, "doc");
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find("nests arrays and objects more than"), std::string::npos)
        << r.status().message();
  }
  auto bad = parse_json("{\"a\": [1, 2", "doc");
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("doc is not valid JSON"), std::string::npos) << bad.status().message();
}

// An array of a million objects reads (it was quadratic: nlohmann's depth callback walked the
// parent at each object's end; bench/reader_scaling prints the times).
TEST(JsonReader, AnArrayOfAMillionObjectsReads) {
  std::string text = "[";
  for (int k = 0; k < 1000000; ++k) text += k ? ",{\"v\":1}" : "{\"v\":1}";
  text += "]";
  auto r = parse_json(text, "doc");
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  EXPECT_EQ(r->size(), 1000000u);
}

}  // namespace
}  // namespace conveyor::json_reader
