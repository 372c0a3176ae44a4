#include "tests/testing/subprocess.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <fstream>

#include "absl/time/clock.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace testutil {
namespace {

std::string Dir() {
  auto dir = MakeTestDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
  EXPECT_TRUE(dir.ok()) << dir.status();
  return dir.ok() ? *dir : TestTmpDir();
}

TEST(SubprocessTest, ReportsExitCode) {
  ASSERT_OK_AND_ASSIGN(auto p, Subprocess::Start({"/bin/sh", "-c", "exit 3"}));
  EXPECT_GT(p->pid(), 0);
  ASSERT_OK_AND_ASSIGN(int code, p->Wait(absl::Seconds(10)));
  EXPECT_EQ(code, 3);
  // Waiting again returns the same result; signalling a reaped child is refused.
  ASSERT_OK_AND_ASSIGN(int again, p->Wait(absl::ZeroDuration()));
  EXPECT_EQ(again, 3);
  EXPECT_FALSE(p->Running());
  EXPECT_STATUS(p->Signal(SIGTERM), absl::StatusCode::kFailedPrecondition);
}

TEST(SubprocessTest, ExitZeroAndPathLookup) {
  ASSERT_OK_AND_ASSIGN(auto p, Subprocess::Start({"true"}));
  ASSERT_OK_AND_ASSIGN(int code, p->Wait(absl::Seconds(10)));
  EXPECT_EQ(code, 0);
}

TEST(SubprocessTest, ReportsKillingSignal) {
  ASSERT_OK_AND_ASSIGN(auto p, Subprocess::Start({"/bin/sleep", "30"}));
  EXPECT_TRUE(p->Running());
  ASSERT_OK(p->Signal(SIGKILL));
  ASSERT_OK_AND_ASSIGN(int code, p->Wait(absl::Seconds(10)));
  EXPECT_EQ(code, -SIGKILL);

  ASSERT_OK_AND_ASSIGN(auto q, Subprocess::Start({"/bin/sleep", "30"}));
  ASSERT_OK(q->Signal(SIGTERM));
  ASSERT_OK_AND_ASSIGN(int term, q->Wait(absl::Seconds(10)));
  EXPECT_EQ(term, -SIGTERM);
}

TEST(SubprocessTest, WaitTimesOutAndDestructorKills) {
  pid_t pid = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto p, Subprocess::Start({"/bin/sleep", "30"}));
    pid = p->pid();
    const absl::Time start = absl::Now();
    EXPECT_STATUS(p->Wait(absl::Milliseconds(200)), absl::StatusCode::kDeadlineExceeded);
    EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    EXPECT_TRUE(p->Running());
  }
  // Killed and reaped: the pid no longer exists (not even as a zombie).
  errno = 0;
  EXPECT_EQ(kill(pid, 0), -1);
  EXPECT_EQ(errno, ESRCH);
}

TEST(SubprocessTest, RedirectsOutputAndSetsEnvironment) {
  const std::string log = Dir() + "/out.log";
  setenv("GRADMESH_SUBPROCESS_TEST_OLD", "old", 1);
  ASSERT_OK_AND_ASSIGN(
      auto p, Subprocess::Start({"/bin/sh", "-c",
                                 "echo out=$GM_A; echo err=$GRADMESH_SUBPROCESS_TEST_OLD >&2; "
                                 "echo home=${HOME:+set}; read x; echo stdin=$?"},
                                {{"GM_A", "a b"}, {"GRADMESH_SUBPROCESS_TEST_OLD", "new"}}, log));
  EXPECT_EQ(p->log_path(), log);
  ASSERT_OK_AND_ASSIGN(int code, p->Wait(absl::Seconds(10)));
  EXPECT_EQ(code, 0);
  const std::string text = ReadFile(log);
  EXPECT_NE(text.find("out=a b\n"), std::string::npos) << text;
  EXPECT_NE(text.find("err=new\n"), std::string::npos) << text;
  // stdin is /dev/null: `read` hits end of file at once.
  EXPECT_NE(text.find("stdin=1\n"), std::string::npos) << text;
  unsetenv("GRADMESH_SUBPROCESS_TEST_OLD");
}

TEST(SubprocessTest, StartFailures) {
  EXPECT_STATUS(Subprocess::Start({}), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS_MSG(Subprocess::Start({"/nonexistent/gradmesh_nothing"}),
                    absl::StatusCode::kNotFound, "/nonexistent/gradmesh_nothing");
  EXPECT_STATUS(Subprocess::Start({"gradmesh_no_such_program_in_path"}),
                absl::StatusCode::kNotFound);
  EXPECT_STATUS(Subprocess::Start({"/bin/true"}, {}, "/nonexistent/dir/log"),
                absl::StatusCode::kInternal);
}

TEST(WaitForPortFileTest, ReadsPortTimesOutAndNoticesExit) {
  const std::string dir = Dir();
  const std::string path = dir + "/port";
  {
    std::ofstream out(path);
    out << "43210\n";
  }
  ASSERT_OK_AND_ASSIGN(int port, WaitForPortFile(path, absl::Seconds(1)));
  EXPECT_EQ(port, 43210);

  EXPECT_STATUS(WaitForPortFile(dir + "/missing", absl::Milliseconds(100)),
                absl::StatusCode::kDeadlineExceeded);

  ASSERT_OK_AND_ASSIGN(auto p, Subprocess::Start({"/bin/sh", "-c", "exit 7"}));
  EXPECT_STATUS_MSG(WaitForPortFile(dir + "/never", absl::Seconds(30), p.get()),
                    absl::StatusCode::kFailedPrecondition, "(7)");

  // Written late by a child, atomically as the daemons do.
  ASSERT_OK_AND_ASSIGN(auto w,
                       Subprocess::Start({"/bin/sh", "-c",
                                          "sleep 0.2; echo 5555 > " + dir + "/late.tmp; mv " + dir +
                                              "/late.tmp " + dir + "/late"}));
  ASSERT_OK_AND_ASSIGN(int late, WaitForPortFile(dir + "/late", absl::Seconds(10), w.get()));
  EXPECT_EQ(late, 5555);
}

TEST(LogFieldTest, ParsesPlainAndQuotedValues) {
  const std::string line =
      "2026-11-22T00:41:24.537Z ERROR event=bad_arguments role=worker steps=1404 "
      "error=\"INVALID_ARGUMENT: unknown field \\\"optimiser\\\" in job spec\" empty=\"\" "
      "step=7 path=\"a\\\\b\" multi=\"x\\ny\"";
  EXPECT_EQ(LogField(line, "event"), "bad_arguments");
  EXPECT_EQ(LogField(line, "role"), "worker");
  EXPECT_EQ(LogField(line, "steps"), "1404");
  EXPECT_EQ(LogField(line, "step"), "7");
  EXPECT_EQ(LogField(line, "error"), "INVALID_ARGUMENT: unknown field \"optimiser\" in job spec");
  EXPECT_EQ(LogField(line, "empty"), "");
  EXPECT_EQ(LogField(line, "path"), "a\\b");
  EXPECT_EQ(LogField(line, "multi"), "x\ny");
  EXPECT_EQ(LogField(line, "ERROR"), std::nullopt);
  EXPECT_EQ(LogField(line, "missing"), std::nullopt);
  EXPECT_EQ(LogField(line, "ste"), std::nullopt);
  EXPECT_EQ(LogField("", "a"), std::nullopt);
  EXPECT_EQ(LogField("a=1 a=2", "a"), "1");
}

TEST(LinesWithTest, SelectsMatchingLines) {
  const std::string text = "a event=progress\nb event=done x=1\r\n\nc event=done x=2";
  const std::vector<std::string> lines = LinesWith(text, "event=done");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], "b event=done x=1");
  EXPECT_EQ(lines[1], "c event=done x=2");
  EXPECT_TRUE(LinesWith(text, "nothing").empty());
  EXPECT_EQ(LastLines("1\n2\n3\n", 2), "2\n3");
  EXPECT_EQ(LastLines("1\n2", 5), "1\n2");
}

TEST(RunfilePathTest, FindsOwnDataAndRejectsMissing) {
  ASSERT_OK_AND_ASSIGN(std::string self, RunfilePath("tests/testing/subprocess_test.cc"));
  EXPECT_NE(ReadFile(self).find("RunfilePathTest"), std::string::npos);
  EXPECT_STATUS(RunfilePath("tests/testing/no_such_file"), absl::StatusCode::kNotFound);
  EXPECT_FALSE(TestTmpDir().empty());
}

TEST(WriteFileTest, WritesReplacesAndReportsFailure) {
  const std::string path = Dir() + "/w.txt";
  ASSERT_OK(WriteFile(path, std::string("a\0b\n", 4)));
  EXPECT_EQ(ReadFile(path), std::string("a\0b\n", 4));
  ASSERT_OK(WriteFile(path, "c"));  // truncates
  EXPECT_EQ(ReadFile(path), "c");
  EXPECT_STATUS_MSG(WriteFile(Dir() + "/no_such_dir/x", "y"), absl::StatusCode::kInternal,
                    "no_such_dir/x");
}

TEST(PtrsTest, KeepsOrderAndNulls) {
  std::vector<std::unique_ptr<Subprocess>> procs;
  EXPECT_TRUE(Ptrs(procs).empty());
  ASSERT_OK_AND_ASSIGN(auto a, Subprocess::Start({"true"}));
  ASSERT_OK_AND_ASSIGN(auto b, Subprocess::Start({"true"}));
  Subprocess* const pa = a.get();
  Subprocess* const pb = b.get();
  procs.push_back(std::move(a));
  procs.push_back(nullptr);
  procs.push_back(std::move(b));
  EXPECT_EQ(Ptrs(procs), (std::vector<Subprocess*>{pa, nullptr, pb}));
}

TEST(MakeUniqueTestDirTest, EachCallMakesANewEmptyDirectory) {
  ASSERT_OK_AND_ASSIGN(std::string a, MakeUniqueTestDir("store"));
  ASSERT_OK_AND_ASSIGN(std::string b, MakeUniqueTestDir("store"));
  EXPECT_NE(a, b);
  EXPECT_EQ(a.rfind(TestTmpDir() + "/store.", 0), 0u) << a;
  struct stat st;
  ASSERT_EQ(stat(a.c_str(), &st), 0) << a;
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  std::ofstream(a + "/f") << "x";
  EXPECT_EQ(ReadFile(a + "/f"), "x");
  EXPECT_EQ(ReadFile(b + "/f"), "");  // b is not a reuse of a
  EXPECT_STATUS(MakeUniqueTestDir("no_such_dir/store"), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace testutil
}  // namespace gradmesh
