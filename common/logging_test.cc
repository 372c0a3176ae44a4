#include "common/logging.h"

#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

TEST(LoggingTest, FormatsKeyValuePairsWithBaseFields) {
  Logger logger({Kv("node", "h1"), Kv("role", "server")});
  const std::string line =
      logger.Format(LogLevel::kInfo, "push", {Kv("job", "mnist"), Kv("step", 12)});
  // Timestamp first, then level and fields in order.
  const size_t pos = line.find(" INFO event=push node=h1 role=server job=mnist step=12");
  ASSERT_NE(pos, std::string::npos) << line;
  EXPECT_EQ(pos + std::string(" INFO event=push node=h1 role=server job=mnist step=12").size(),
            line.size());
}

TEST(LoggingTest, QuotesValuesThatWouldBreakParsing) {
  Logger logger({});
  const std::string line =
      logger.Format(LogLevel::kError, "e", {Kv("error", "NOT_FOUND: job \"x\" a=b"), Kv("e", "")});
  EXPECT_NE(line.find(" ERROR event=e error=\"NOT_FOUND: job \\\"x\\\" a=b\" e=\"\""),
            std::string::npos)
      << line;
}

TEST(LoggingTest, WritesWholeLinesAndFiltersLevel) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  Logger logger({Kv("role", "worker")}, f, LogLevel::kWarning);
  logger.Info("dropped");
  logger.Warning("kept", {Kv("step", 3)});
  std::rewind(f);
  char buf[512] = {0};
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const std::string out(buf, n);
  EXPECT_EQ(out.find("dropped"), std::string::npos);
  EXPECT_NE(out.find("WARN event=kept role=worker step=3\n"), std::string::npos) << out;
}

}  // namespace
}  // namespace gradmesh

namespace gradmesh {
namespace {

TEST(LoggingTest, TeeGetsEveryLineAndChildKeepsTheParentsFields) {
  std::vector<std::string> got;
  absl::Mutex mu;
  Logger::LineSink sink = [&](const std::string& line) {
    absl::MutexLock lock(&mu);
    got.push_back(line);
  };
  Logger parent({Kv("node", "w0")}, /*out=*/nullptr, LogLevel::kInfo);
  Logger child(parent, sink);
  child.Info("progress", {Kv("step", 10)});
  child.Log(LogLevel::kDebug, "hidden", {});  // Below the level: not teed either.
  parent.Info("not_teed");
  ASSERT_EQ(got.size(), 1u);
  EXPECT_NE(got[0].find(" INFO event=progress node=w0 step=10"), std::string::npos) << got[0];
  EXPECT_EQ(got[0].back(), '0');  // No newline.
}

}  // namespace
}  // namespace gradmesh
