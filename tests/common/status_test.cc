#include "common/status.h"

#include <gtest/gtest.h>

namespace conveyor {
namespace {

Result<int> parse_positive(int x) {
  if (x <= 0) return Status(ErrorCode::kInvalidArgument, "expected a positive number, got " + std::to_string(x));
  return x;
}

Result<int> twice(int x) {
  CONVEYOR_ASSIGN_OR_RETURN(int v, parse_positive(x));
  return 2 * v;
}

TEST(Status, OkAndErrorCarryCodeAndMessage) {
  EXPECT_TRUE(Status::ok().is_ok());
  Status st(ErrorCode::kFormat, "bad header");
  EXPECT_FALSE(st.is_ok());
  EXPECT_EQ(st.to_string(), "format: bad header");
  EXPECT_EQ(st.with_context("graph.cvg").message(), "graph.cvg: bad header");
}

TEST(Result, PropagatesErrorsThroughAssignOrReturn) {
  EXPECT_EQ(twice(3).value(), 6);
  auto r = twice(-1);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("got -1"), std::string::npos);
}

TEST(Result, AnOkStatusIsNotAValue) {
  Result<int> r{Status::ok()};
  EXPECT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), ErrorCode::kInternal);
}

}  // namespace
}  // namespace conveyor
