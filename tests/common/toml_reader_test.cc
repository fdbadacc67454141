// conveyor's TOML parser: the TOML it reads, and what it refuses (with the line) instead of
// crashing, including the inputs that crashed toml++.
#include "common/toml_reader.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

namespace conveyor::toml {
namespace {

std::string error_of(const std::string& text) {
  try {
    parse(text);
  } catch (const TomlError& e) {
    return e.status("f.toml").message();
  }
  return "";
}

TEST(TomlReader, ReadsTablesArraysOfTablesAndEveryValueKind) {
  const Node root = parse(
      "# a comment\n"
      "name = \"a \\\"b\\\" \\u00e9\"  # trailing\n"
      "path = 'C:\\dir'\n"
      "big = 9_223_372_036_854_775_807\n"
      "small = -9223372036854775808\n"
      "hex = 0xff\n"
      "ratio = 6.02e23\n"
      "neg = -inf\n"
      "on = true\n"
      "list = [1, 2,\n  3, # comment\n]\n"
      "inline = { a = 1, b.c = \"x\" }\n"
      "text = \"\"\"\none\\\n   two\"\"\"\n"
      "[[node]]\ncount = 2\n"
      "[[node]]\ncount = 3\n"
      "[link.intra_node]\nbandwidth = \"1 GB/s\"\n"
      "[link]\nkind = 'x'\n");
  EXPECT_EQ(*root.get("name")->string(), "a \"b\" \xc3\xa9");
  EXPECT_EQ(*root.get("path")->string(), "C:\\dir");
  EXPECT_EQ(*root.get("big")->integer(), INT64_MAX);
  EXPECT_EQ(*root.get("small")->integer(), INT64_MIN);
  EXPECT_EQ(*root.get("hex")->integer(), 255);
  EXPECT_DOUBLE_EQ(*root.get("ratio")->number(), 6.02e23);
  EXPECT_TRUE(std::isinf(*root.get("neg")->number()));
  EXPECT_TRUE(*root.get("on")->boolean());
  EXPECT_EQ(root.get("list")->items().size(), 3u);
  EXPECT_EQ(*root.get("inline")->get("b")->get("c")->string(), "x");
  EXPECT_EQ(*root.get("text")->string(), "onetwo");
  ASSERT_TRUE(root.get("node")->is_array());
  EXPECT_EQ(*root.get("node")->items()[1].get("count")->integer(), 3);
  EXPECT_EQ(root.get("node")->items()[1].line(), 19);
  EXPECT_EQ(*root.get("link")->get("intra_node")->get("bandwidth")->string(), "1 GB/s");
  EXPECT_EQ(*root.get("link")->get("kind")->string(), "x");
}

TEST(TomlReader, RefusesWhatIsNotTomlNamingTheLine) {
  EXPECT_EQ(error_of("a = 1\na = 2\n"), "f.toml:2: not valid TOML: 'a' is defined twice (first on line 1)");
  EXPECT_NE(error_of("[t]\n[t]\n").find("f.toml:2: not valid TOML: [t] is defined twice"), std::string::npos);
  EXPECT_NE(error_of("x = 9223372036854775808\n").find("out of the range of a 64-bit integer"), std::string::npos);
  EXPECT_NE(error_of("x = 1e400\n").find("out of the range of a float"), std::string::npos);
  EXPECT_NE(error_of("x = 1979-05-27\n").find("dates and times"), std::string::npos);
  EXPECT_NE(error_of("x = \"open\n").find("past the end of its line"), std::string::npos);
  EXPECT_NE(error_of("x = parsec\n").find("needs quotes"), std::string::npos);
  EXPECT_NE(error_of("x = 01\n").find("leading zeros"), std::string::npos);
  EXPECT_NE(error_of("x = 1 2\n").find("end of the line"), std::string::npos);
  EXPECT_NE(error_of("a = 1\na.b = 2\n").find("already a value"), std::string::npos);
  EXPECT_NE(error_of("x = { a = 1 }\n[x]\n").find("defined twice"), std::string::npos);
  EXPECT_NE(error_of("x = \"\xff\"\n").find("not valid UTF-8"), std::string::npos);
  EXPECT_NE(error_of("x = \"\\ud800\"\n").find("no Unicode scalar value"), std::string::npos);
  EXPECT_NE(error_of(std::string(100000, '[')).find("expected a key"), std::string::npos);
  EXPECT_NE(error_of("x = " + std::string(100000, '[')).find("nest more than 64"), std::string::npos);
}

// Inputs on which Debian's toml++ 3.3 aborted or reached __builtin_unreachable (fuzz/).
TEST(TomlReader, InputsThatCrashedTomlPlusPlus) {
  EXPECT_NE(error_of("[\natency = 1\n").find("f.toml:1: not valid TOML: expected a key"), std::string::npos);
  EXPECT_NE(error_of("time\xc2\x96ut = 300\n").find("expected '='"), std::string::npos);
  EXPECT_NE(error_of("\xef\xbb\xbdx = 1\n").find("expected a key"), std::string::npos);
}

// Every way TOML nests counts toward one limit: a header of 500,000 parts (1 MB) overflowed
// the stack in Node's destructor, and a dotted key as much; a header's parts and a dotted
// key under it add up, and so do inline tables and arrays around a dotted key.
TEST(TomlReader, NestingIsBoundedHoweverItNests) {
  auto inline_tables = [](int n) {  // "{b = " n times: n inline tables, each holding the next
    std::string out;
    for (int k = 0; k < n; ++k) out += "{b = ";
    return out;
  };
  auto parts = [](int n) {
    std::string out = "a";
    for (int k = 1; k < n; ++k) out += ".a";
    return out;
  };
  for (const std::string& deep : {"[" + parts(500000) + "]\n", parts(500000) + " = 1\n", "[[" + parts(500000) + "]]\n",
                                  "[" + parts(40) + "]\n" + parts(40) + " = 1\n",
                                  "x = " + inline_tables(30) + "{" + parts(40) + " = 1}" + std::string(30, '}') + "\n",
                                  "x = " + std::string(40, '[') + "{" + parts(40) + " = 1}" + std::string(40, ']') + "\n"}) {
    EXPECT_NE(error_of(deep).find("nest more than 64 deep"), std::string::npos) << deep.substr(0, 60);
  }
  EXPECT_EQ(error_of("[" + parts(32) + "]\n" + parts(31) + " = 1\n"), "");  // 63 deep: read
}

// Lookups are by hash: 200,000 keys, and as many headers, read in linear time (each was a
// scan of the table's keys: 100,000 took a minute).
TEST(TomlReader, ManyKeysAndHeadersReadInLinearTime) {
  std::string keys, headers;
  for (int k = 0; k < 200000; ++k) {
    keys += "k" + std::to_string(k) + " = " + std::to_string(k) + "\n";
    headers += "[t" + std::to_string(k) + "]\nx = 1\n";
  }
  const Node root = parse(keys);
  ASSERT_EQ(root.keys().size(), 200000u);
  EXPECT_EQ(root.get("k199999")->integer(), 199999);
  const Node tables = parse(headers);
  EXPECT_EQ(tables.get("t123456")->get("x")->integer(), 1);
  EXPECT_NE(error_of(keys + "k7 = 1\n").find("defined twice"), std::string::npos);
}

}  // namespace
}  // namespace conveyor::toml
