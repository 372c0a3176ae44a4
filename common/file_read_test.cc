#include "common/file_read.h"

#include <fstream>
#include <string>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(ReadFileUpToTest, ReadsUpToTheLimitAndRefusesMore) {
  const std::string path = testing::TempDir() + "/read_up_to.txt";
  std::ofstream(path) << std::string(100, 'x');
  ASSERT_OK_AND_ASSIGN(const std::string all, ReadFileUpTo(path, 100, "spec file"));
  EXPECT_EQ(all, std::string(100, 'x'));
  EXPECT_STATUS_MSG(ReadFileUpTo(path, 99, "spec file"), absl::StatusCode::kInvalidArgument,
                    "spec file " + path + " is larger than 99 bytes");
  // A file that never ends is refused after the limit, not read forever.
  EXPECT_STATUS_MSG(ReadFileUpTo("/dev/zero", 1 << 20, "token file"),
                    absl::StatusCode::kInvalidArgument,
                    "token file /dev/zero is larger than 1048576 bytes");
  EXPECT_STATUS(ReadFileUpTo(path + ".missing", 100, "spec file"), absl::StatusCode::kNotFound);
  std::ofstream(path).close();
  ASSERT_OK_AND_ASSIGN(const std::string empty, ReadFileUpTo(path, 100, "spec file"));
  EXPECT_EQ(empty, "");
}

}  // namespace
}  // namespace gradmesh
