// LogTail: line and byte bounds, sequence numbers, Since with limits, long lines cut.
#include "common/log_tail.h"

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

using Lines = std::vector<LogTail::Line>;

TEST(LogTailTest, KeepsTheLastLinesWithinTheLineBound) {
  LogTail tail({/*max_lines=*/3, /*max_bytes=*/1000, /*max_line_bytes=*/100});
  for (int i = 1; i <= 5; ++i) EXPECT_EQ(tail.Append("line" + std::to_string(i)), i);
  EXPECT_EQ(tail.size(), 3u);
  EXPECT_EQ(tail.bytes(), 15u);
  EXPECT_EQ(tail.last_sequence(), 5);
  EXPECT_EQ(tail.Since(0), (Lines{{3, "line3"}, {4, "line4"}, {5, "line5"}}));
  EXPECT_EQ(tail.Since(4), (Lines{{5, "line5"}}));
  EXPECT_EQ(tail.Since(5), Lines{});
}

TEST(LogTailTest, KeepsTheByteBound) {
  LogTail tail({/*max_lines=*/100, /*max_bytes=*/10, /*max_line_bytes=*/100});
  tail.Append("aaaa");
  tail.Append("bbbb");
  tail.Append("cccc");  // 12 bytes > 10: "aaaa" goes.
  EXPECT_EQ(tail.bytes(), 8u);
  EXPECT_EQ(tail.Since(0), (Lines{{2, "bbbb"}, {3, "cccc"}}));
  tail.Append("0123456789");  // Exactly the bound: only it remains.
  EXPECT_EQ(tail.Since(0), (Lines{{4, "0123456789"}}));
}

TEST(LogTailTest, SinceTakesTheOldestWithinItsLimits) {
  LogTail tail({});
  for (int i = 1; i <= 6; ++i) tail.Append(std::string(i, 'x'));
  EXPECT_EQ(tail.Since(0, /*max_lines=*/2), (Lines{{1, "x"}, {2, "xx"}}));
  EXPECT_EQ(tail.Since(2, 10, /*max_bytes=*/7), (Lines{{3, "xxx"}, {4, "xxxx"}}));
  EXPECT_EQ(tail.Since(2, 10, /*max_bytes=*/2), Lines{});
}

TEST(LogTailTest, AppendAsTakesTheCallersSequenceIfItIncreases) {
  LogTail tail({});
  EXPECT_EQ(tail.AppendAs(10, "a"), 10);
  EXPECT_EQ(tail.AppendAs(12, "b"), 12);
  EXPECT_EQ(tail.AppendAs(5, "c"), 13);  // Not above 12: raised.
  EXPECT_EQ(tail.Append("d"), 14);
  EXPECT_EQ(tail.Since(11), (Lines{{12, "b"}, {13, "c"}, {14, "d"}}));
}

TEST(LogTailTest, CutsLongLines) {
  LogTail tail({/*max_lines=*/10, /*max_bytes=*/100, /*max_line_bytes=*/8});
  tail.Append("0123456789abc");
  EXPECT_EQ(tail.Since(0), (Lines{{1, "01234..."}}));
  EXPECT_EQ(tail.bytes(), 8u);
}

TEST(LogTailTest, DefaultBoundsAre200LinesAnd64KiB) {
  LogTail tail({});
  for (int i = 0; i < 1000; ++i) tail.Append(std::string(100, 'y'));
  EXPECT_EQ(tail.size(), 200u);
  EXPECT_EQ(tail.bytes(), 20000u);
  for (int i = 0; i < 1000; ++i) tail.Append(std::string(1000, 'z'));
  EXPECT_EQ(tail.size(), 65u);  // 65 * 1000 <= 65536 < 66 * 1000.
  EXPECT_EQ(tail.last_sequence(), 2000);
  EXPECT_EQ(tail.Since(0).front().first, 1936);
}

}  // namespace
}  // namespace gradmesh
