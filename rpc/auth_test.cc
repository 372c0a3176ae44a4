// Tests of common/auth.h: token files, constant-time comparison and the bearer-header check
// (the check over real gRPC is in coordinator/service_test.cc).
#include "rpc/auth.h"

#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

std::string WriteFile(const std::string& name, const std::string& content) {
  const std::string path = std::string(::testing::TempDir()) + "/" + name;
  std::ofstream(path, std::ios::binary) << content;
  return path;
}

TEST(ReadTokenFileTest, TrimsWhitespace) {
  ASSERT_OK_AND_ASSIGN(std::string token, ReadTokenFile(WriteFile("t1", "  s3cr3t-Token\n\n")));
  EXPECT_EQ(token, "s3cr3t-Token");
}

TEST(ReadTokenFileTest, EmptyOrBlankFileIsAnError) {
  EXPECT_STATUS_MSG(ReadTokenFile(WriteFile("t2", "")), absl::StatusCode::kInvalidArgument,
                    "is empty");
  EXPECT_STATUS_MSG(ReadTokenFile(WriteFile("t3", " \n\t\n")), absl::StatusCode::kInvalidArgument,
                    "is empty");
}

TEST(ReadTokenFileTest, InnerWhitespaceIsAnError) {
  EXPECT_STATUS_MSG(ReadTokenFile(WriteFile("t4", "two words\n")),
                    absl::StatusCode::kInvalidArgument, "without spaces");
}

TEST(ReadTokenFileTest, MissingFileIsNotFound) {
  EXPECT_STATUS_MSG(ReadTokenFile("/nonexistent/dir/token"), absl::StatusCode::kNotFound,
                    "cannot read token file /nonexistent/dir/token");
}

TEST(ReadTokenFileTest, ADirectoryIsNamedAsOne) {
  const std::string dir = std::string(::testing::TempDir());
  EXPECT_STATUS_MSG(ReadTokenFile(dir), absl::StatusCode::kInvalidArgument,
                    "token file " + dir + " is a directory; name the file holding the token");
}

TEST(ConstantTimeEqualsTest, ComparesContentAndLength) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "ab"));
  EXPECT_FALSE(ConstantTimeEquals("ab", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
}

class CheckBearerTokenTest : public ::testing::Test {
 protected:
  absl::Status Check(std::initializer_list<std::pair<std::string, std::string>> headers) {
    storage_.assign(headers.begin(), headers.end());
    std::multimap<grpc::string_ref, grpc::string_ref> md;
    for (const auto& kv : storage_) md.emplace(kv.first, kv.second);
    return CheckBearerToken(md, "tok123");
  }
  std::vector<std::pair<std::string, std::string>> storage_;
};

TEST_F(CheckBearerTokenTest, AcceptsTheRightToken) {
  EXPECT_OK(Check({{"authorization", "Bearer tok123"}, {"other", "x"}}));
}

TEST_F(CheckBearerTokenTest, RejectsMissingMalformedAndWrong) {
  const auto kUnauth = absl::StatusCode::kUnauthenticated;
  EXPECT_STATUS_MSG(Check({}), kUnauth, "missing or wrong API token");
  EXPECT_STATUS_MSG(Check({{"authorization", "tok123"}}), kUnauth, "missing or wrong API token");
  EXPECT_STATUS_MSG(Check({{"authorization", "Basic tok123"}}), kUnauth, "missing or wrong");
  EXPECT_STATUS_MSG(Check({{"authorization", "Bearer tok124"}}), kUnauth, "missing or wrong");
  EXPECT_STATUS_MSG(Check({{"authorization", "Bearer tok1234"}}), kUnauth, "missing or wrong");
  EXPECT_STATUS_MSG(Check({{"authorization", "Bearer "}}), kUnauth, "missing or wrong");
  EXPECT_STATUS_MSG(Check({{"authorization", "Bearer tok123"}, {"authorization", "Bearer x"}}),
                    kUnauth, "missing or wrong");
}

}  // namespace
}  // namespace gradmesh
