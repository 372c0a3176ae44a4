// The name rule (common/job_name.h) on valid and hostile names.
#include "common/job_name.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(JobNameTest, AcceptsDnsLabels) {
  for (const std::string& name :
       std::vector<std::string>{"a", "0", "job-1", "mnist-mlp", "e2e-crash-periodic", "a-b-c",
                                std::string(63, 'x'), "9lives", "x" + std::string(61, '-') + "y"}) {
    EXPECT_TRUE(IsValidName(name)) << name;
    EXPECT_TRUE(IsValidJobName(name)) << name;
    EXPECT_TRUE(CheckName("job", name).ok()) << name;
  }
}

TEST(JobNameTest, RefusesEverythingElse) {
  const std::string hostile[] = {
      "",
      ".",
      "..",
      "/",
      "a/b",
      "a/../../b",
      "../etc",
      std::string(64, 'a'),
      std::string(300, 'a'),
      "j\xc3\xb6"
      "b",                         // "jöb"
      "\xef\xbd\x8a\xef\xbd\x8f",  // fullwidth "ｊｏ"
      "Job",
      "JOB",
      "my.job",
      "my_job",
      "-job",
      "job-",
      "-",
      "a b",
      std::string("a\0b", 3),
      "a\nb",
      "a\\b",
  };
  for (const std::string& name : hostile) {
    EXPECT_FALSE(IsValidName(name)) << name;
    absl::Status st = CheckName("job spec: name", name);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(st.message().find("job spec: name"), absl::string_view::npos) << st;
    EXPECT_NE(st.message().find(kNameRule), absl::string_view::npos) << st;
  }
}

TEST(JobNameTest, LongNamesAreQuotedInPart) {
  absl::Status st = CheckName("InitJob: job", std::string(300, 'q'));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message().find(std::string(81, 'q')), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("(300 bytes)"), absl::string_view::npos) << st;
}

TEST(JobNameTest, NameFromHostFollowsTheRule) {
  EXPECT_EQ(NameFromHost("vm"), "vm");
  EXPECT_EQ(NameFromHost("Worker_1.Example.com"), "worker-1");
  EXPECT_EQ(NameFromHost("-gpu-node-7-"), "gpu-node-7");
  EXPECT_EQ(NameFromHost(""), "node");
  EXPECT_EQ(NameFromHost("___"), "node");
  EXPECT_EQ(NameFromHost(".example.com"), "node");
  EXPECT_EQ(NameFromHost("j\xc3\xb6"
                         "b"),
            "j--b");
  EXPECT_EQ(NameFromHost(std::string(300, 'h')), std::string(63, 'h'));
  EXPECT_EQ(NameFromHost(std::string(62, 'h') + "_x"), std::string(62, 'h'));
  for (const std::string& h : std::vector<std::string>{"vm", "Worker_1.Example.com", "", "-a-",
                                                       std::string(300, '-') + "x"}) {
    EXPECT_TRUE(IsValidName(NameFromHost(h))) << h;
  }
}

}  // namespace
}  // namespace gradmesh
