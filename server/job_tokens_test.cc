// JobTokens: open jobs when tokens are optional, UNAVAILABLE when required and not yet set,
// PERMISSION_DENIED for a missing or wrong token, and one job's token never opens another.
#include "server/job_tokens.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(JobTokensTest, OptionalTokensLeaveUnknownJobsOpen) {
  JobTokens tokens(/*required=*/false);
  EXPECT_OK(tokens.Check("a", ""));
  EXPECT_OK(tokens.Check("a", "anything"));
}

TEST(JobTokensTest, RequiredTokensMakeUnplacedJobsUnavailable) {
  JobTokens tokens(/*required=*/true);
  EXPECT_STATUS_MSG(tokens.Check("a", ""), absl::StatusCode::kUnavailable,
                    "job a is not placed on this shard");
}

TEST(JobTokensTest, OnlyTheJobsOwnTokenIsAccepted) {
  for (bool required : {false, true}) {
    JobTokens tokens(required);
    tokens.Set("a", "secret-a");
    tokens.Set("b", "secret-b");
    EXPECT_OK(tokens.Check("a", "secret-a"));
    EXPECT_OK(tokens.Check("b", "secret-b"));
    EXPECT_STATUS_MSG(tokens.Check("a", "secret-b"), absl::StatusCode::kPermissionDenied,
                      "job a: missing or wrong job token");
    EXPECT_STATUS(tokens.Check("a", ""), absl::StatusCode::kPermissionDenied);
    EXPECT_STATUS(tokens.Check("a", "secret-a2"), absl::StatusCode::kPermissionDenied);
    EXPECT_STATUS(tokens.Check("a", "secret-"), absl::StatusCode::kPermissionDenied);
    // A token can be replaced (a resubmitted job gets a new one).
    tokens.Set("a", "new");
    EXPECT_OK(tokens.Check("a", "new"));
    EXPECT_STATUS(tokens.Check("a", "secret-a"), absl::StatusCode::kPermissionDenied);
    // Withdrawn: as if never set.
    tokens.Remove("a");
    if (required) {
      EXPECT_STATUS(tokens.Check("a", "new"), absl::StatusCode::kUnavailable);
    } else {
      EXPECT_OK(tokens.Check("a", ""));
    }
    EXPECT_OK(tokens.Check("b", "secret-b"));
  }
}

}  // namespace
}  // namespace gradmesh
