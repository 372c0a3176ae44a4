#include "common/status.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status UseMacros(int x, int* out) {
  ASSIGN_OR_RETURN(int h, Half(x));
  RETURN_IF_ERROR(h > 10 ? absl::OutOfRangeError("too big") : absl::OkStatus());
  *out = h;
  return absl::OkStatus();
}

TEST(StatusTest, Macros) {
  int out = 0;
  EXPECT_STATUS_MSG(UseMacros(3, &out), absl::StatusCode::kInvalidArgument, "odd");
  EXPECT_STATUS(UseMacros(40, &out), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(out, 0);
  ASSERT_OK(UseMacros(8, &out));
  EXPECT_EQ(out, 4);
}

TEST(StatusTest, NamesAndAnnotate) {
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kNotFound), "NOT_FOUND");
  absl::Status s = Annotate(absl::NotFoundError("no job"), "shard 1");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(s.message(), "shard 1: no job");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "x").ok());
}

}  // namespace
}  // namespace gradmesh
