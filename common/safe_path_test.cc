// JoinUnder / CheckPathComponent (common/safe_path.h) on hostile components.
#include "common/safe_path.h"

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(SafePathTest, JoinsSafeComponents) {
  EXPECT_EQ(*JoinUnder("/tmp/ck", "job-1"), "/tmp/ck/job-1");
  EXPECT_EQ(*JoinUnder("/tmp/ck/", "rank-0.ckpt"), "/tmp/ck/rank-0.ckpt");
  EXPECT_EQ(*JoinUnder("", "x"), "x");
  EXPECT_EQ(*JoinUnder("d", std::string(255, 'a')), "d/" + std::string(255, 'a'));
  // Not a name rule: dots inside, Unicode and uppercase are one component each.
  EXPECT_EQ(*JoinUnder("d", "a..b"), "d/a..b");
  EXPECT_EQ(*JoinUnder("d", "J\xc3\xb6"), "d/J\xc3\xb6");
}

TEST(SafePathTest, RefusesComponentsThatLeaveTheDirectory) {
  const std::pair<std::string, std::string> cases[] = {
      {"", "is empty"},
      {".", "would not name an entry"},
      {"..", "would not name an entry"},
      {"/", "contains '/'"},
      {"a/b", "contains '/'"},
      {"a/../../b", "contains '/'"},
      {"/etc/passwd", "contains '/'"},
      {std::string("a\0b", 3), "NUL"},
      {"a\nb", "control character"},
      {std::string(256, 'a'), "256 bytes long"},
      {std::string(300, 'a'), "300 bytes long"},
  };
  for (const auto& [component, why] : cases) {
    absl::StatusOr<std::string> p = JoinUnder("/data/ckpt", component);
    ASSERT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << component;
    EXPECT_NE(p.status().message().find(why), absl::string_view::npos) << p.status();
    EXPECT_NE(p.status().message().find("/data/ckpt"), absl::string_view::npos) << p.status();
    EXPECT_EQ(CheckPathComponent(component).code(), absl::StatusCode::kInvalidArgument);
  }
}

// A rank's checkpoint file (allreduce, gossip): names that would leave the checkpoint directory
// (or break the name rule) are refused before any path is built.
TEST(RankCheckpointPathTest, RefusesUnsafeJobNames) {
  const std::string hostile[] = {"..",
                                 ".",
                                 "/",
                                 "a/b",
                                 "a/../../b",
                                 "../../etc",
                                 "",
                                 std::string(64, 'a'),
                                 std::string(300, 'a'),
                                 "j\xc3\xb6"
                                 "b",
                                 "\xef\xbd\x8a\xef\xbd\x8f",
                                 "Job",
                                 "my.job",
                                 "my_job",
                                 "-job",
                                 std::string("a\0b", 3)};
  for (const std::string& job : hostile) {
    absl::StatusOr<std::string> p = RankCheckpointPath("/data/ckpt", job, 0);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << job;
    EXPECT_NE(p.status().message().find("checkpoint: job"), absl::string_view::npos) << p.status();
  }
  EXPECT_EQ(RankCheckpointPath("/data/ckpt", "job-1", -1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RankCheckpointPath("/data/ckpt", std::string(63, 'a'), 7).value(),
            "/data/ckpt/" + std::string(63, 'a') + "/rank-7.ckpt");
}

}  // namespace
}  // namespace gradmesh
