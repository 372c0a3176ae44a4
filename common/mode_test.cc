#include "common/mode.h"

#include <gtest/gtest.h>

#include "common/status_testing.h"

namespace gradmesh {
namespace {

TEST(ModeTest, ParsesEveryModeAndItsAliases) {
  EXPECT_EQ(*ParseMode("async"), Mode::kAsync);
  EXPECT_EQ(*ParseMode("ps"), Mode::kAsync);
  EXPECT_EQ(*ParseMode("ssp:0"), Mode::kSsp);
  EXPECT_EQ(*ParseMode("ssp:12"), Mode::kSsp);
  EXPECT_EQ(*ParseMode("sync"), Mode::kSync);
  EXPECT_EQ(*ParseMode("gossip"), Mode::kGossip);
  EXPECT_EQ(*ParseMode("allreduce"), Mode::kAllreduce);
  EXPECT_EQ(*ParseMode("diloco"), Mode::kDiloco);
}

TEST(ModeTest, RefusesUnknownModesNamingTheKnownOnes) {
  EXPECT_STATUS_MSG(ParseMode("localsgd"), absl::StatusCode::kInvalidArgument,
                    "mode \"localsgd\" is not one of async (or ps), ssp:<staleness>, sync, "
                    "gossip, allreduce, diloco");
  EXPECT_STATUS_MSG(ParseMode(""), absl::StatusCode::kInvalidArgument, "mode \"\"");
  EXPECT_STATUS_MSG(ParseMode("ssp:-1"), absl::StatusCode::kInvalidArgument,
                    "must be an integer >= 0");
  EXPECT_STATUS(ParseMode("ssp:x"), absl::StatusCode::kInvalidArgument);
  EXPECT_STATUS(ParseMode("ssp"), absl::StatusCode::kInvalidArgument);
}

TEST(ModeTest, NamesRoundTripAndPsModes) {
  for (Mode m : {Mode::kAsync, Mode::kSync, Mode::kGossip, Mode::kAllreduce, Mode::kDiloco}) {
    EXPECT_EQ(*ParseMode(ModeName(m)), m);
  }
  EXPECT_EQ(ModeName(Mode::kSsp), "ssp");
  EXPECT_TRUE(IsPsMode(Mode::kAsync));
  EXPECT_TRUE(IsPsMode(Mode::kSsp));
  EXPECT_TRUE(IsPsMode(Mode::kSync));
  EXPECT_FALSE(IsPsMode(Mode::kGossip));
  EXPECT_FALSE(IsPsMode(Mode::kAllreduce));
  EXPECT_TRUE(IsPsMode(Mode::kDiloco));
  EXPECT_TRUE(UsesSyncBarrier(Mode::kSync));
  EXPECT_TRUE(UsesSyncBarrier(Mode::kDiloco));
  EXPECT_FALSE(UsesSyncBarrier(Mode::kAsync));
}

}  // namespace
}  // namespace gradmesh
