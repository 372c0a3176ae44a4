// Tests of the CLI's flag parser: value forms, booleans, '_'/'-' equivalence, `--`, stopping
// at the command, and the exact errors.
#include "cli/flags.h"

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace cli {
namespace {

const std::vector<FlagSpec> kSpecs = {
    {"coordinator", true, "HOST:PORT", "address"},
    {"auth_token_file", true, "FILE", "token"},
    {"dry-run", false, "", "dry"},
    {"help", false, "", "help"},
};

TEST(FlagsTest, ValueFormsBooleansAndPositionals) {
  ASSERT_OK_AND_ASSIGN(ParsedArgs a, ParseArgs({"a", "--coordinator=h:1", "b", "--auth-token-file",
                                                "/t", "--dry_run", "-h", "--", "--not-a-flag"},
                                               kSpecs));
  EXPECT_EQ(a.positional, (std::vector<std::string>{"a", "b", "--not-a-flag"}));
  EXPECT_EQ(a.Get("coordinator"), "h:1");
  EXPECT_EQ(a.Get("auth_token_file"), "/t");  // Keyed by the spec's spelling.
  EXPECT_TRUE(a.Bool("dry-run"));
  EXPECT_TRUE(a.Bool("help"));
  EXPECT_EQ(a.Get("missing", "def"), "def");
  EXPECT_TRUE(a.rest.empty());

  ASSERT_OK_AND_ASSIGN(ParsedArgs b, ParseArgs({"--dry-run=false", "--coordinator=x",
                                                "--coordinator=y", "--coordinator="},
                                               kSpecs));
  EXPECT_TRUE(b.Has("dry-run"));
  EXPECT_FALSE(b.Bool("dry-run"));
  EXPECT_EQ(b.Get("coordinator", "def"), "");  // The last one wins, even empty.
}

TEST(FlagsTest, StopsAtTheFirstPositional) {
  ASSERT_OK_AND_ASSIGN(ParsedArgs a,
                       ParseArgs({"--coordinator", "h:1", "list", "--bogus", "x"}, kSpecs,
                                 /*stop_at_positional=*/true));
  EXPECT_EQ(a.Get("coordinator"), "h:1");
  EXPECT_TRUE(a.positional.empty());
  EXPECT_EQ(a.rest, (std::vector<std::string>{"list", "--bogus", "x"}));
}

TEST(FlagsTest, Errors) {
  EXPECT_STATUS_MSG(ParseArgs({"--bogus_flag=1"}, kSpecs), absl::StatusCode::kInvalidArgument,
                    "unknown flag --bogus_flag");
  EXPECT_STATUS_MSG(ParseArgs({"x", "--coordinator"}, kSpecs), absl::StatusCode::kInvalidArgument,
                    "flag --coordinator needs a value (--coordinator=HOST:PORT)");
  EXPECT_STATUS_MSG(ParseArgs({"--dry-run=1"}, kSpecs), absl::StatusCode::kInvalidArgument,
                    "flag --dry-run takes no value (or true/false), got \"1\"");
  EXPECT_STATUS_MSG(ParseArgs({"--=x"}, kSpecs), absl::StatusCode::kInvalidArgument,
                    "bad flag \"--=x\"");
}

TEST(FlagsTest, HelpLinesAreAligned) {
  EXPECT_EQ(FlagHelp({kSpecs[0], kSpecs[2]}),
            "  --coordinator=HOST:PORT   address\n"
            "  --dry-run                 dry\n");
}

}  // namespace
}  // namespace cli
}  // namespace gradmesh
