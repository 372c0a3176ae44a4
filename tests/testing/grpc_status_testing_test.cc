#include "tests/testing/grpc_status_testing.h"

#include <grpcpp/support/status.h>

#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace testutil {
namespace {

TEST(GrpcHasTest, MatchesCodeAndEverySubstring) {
  const grpc::Status s(grpc::StatusCode::NOT_FOUND, "Push: job x has no tensor 3");
  EXPECT_TRUE(GrpcHas(s, absl::StatusCode::kNotFound, {}));
  EXPECT_TRUE(GrpcHas(s, absl::StatusCode::kNotFound, {"job x", "tensor 3"}));
  EXPECT_TRUE(GrpcHas(grpc::Status::OK, absl::StatusCode::kOk, {}));
}

TEST(GrpcHasTest, WrongCodeNamesBothCodes) {
  const grpc::Status s(grpc::StatusCode::INVALID_ARGUMENT, "bad chunk");
  ::testing::AssertionResult r = GrpcHas(s, absl::StatusCode::kNotFound, {"bad chunk"});
  ASSERT_FALSE(r);
  const std::string msg = r.message();
  EXPECT_NE(msg.find("expected code NOT_FOUND (5)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got INVALID_ARGUMENT (3)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bad chunk"), std::string::npos) << msg;
  EXPECT_FALSE(GrpcHas(grpc::Status::OK, absl::StatusCode::kNotFound, {}));
}

TEST(GrpcHasTest, MissingSubstringIsNamed) {
  const grpc::Status s(grpc::StatusCode::NOT_FOUND, "job x");
  ::testing::AssertionResult r = GrpcHas(s, absl::StatusCode::kNotFound, {"job x", "tensor 3"});
  ASSERT_FALSE(r);
  EXPECT_NE(std::string(r.message()).find("lacks \"tensor 3\""), std::string::npos) << r.message();
}

TEST(AbslHasTest, ChecksAbslStatusesTheSameWay) {
  EXPECT_TRUE(AbslHas(absl::NotFoundError("job x"), absl::StatusCode::kNotFound, {"job x"}));
  EXPECT_TRUE(AbslHas(absl::OkStatus(), absl::StatusCode::kOk, {}));
  EXPECT_FALSE(AbslHas(absl::NotFoundError("job x"), absl::StatusCode::kAborted, {}));
  EXPECT_FALSE(AbslHas(absl::NotFoundError("job x"), absl::StatusCode::kNotFound, {"job y"}));
}

}  // namespace
}  // namespace testutil
}  // namespace gradmesh
