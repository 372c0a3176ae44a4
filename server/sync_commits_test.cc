#include "server/sync_commits.h"

#include <gtest/gtest.h>

#include <vector>

#include "common/status_testing.h"

namespace gradmesh {
namespace {

// Chunk 7 is a buffer; every other chunk a parameter.
SyncCommits Make(double clip_value = 0) {
  return SyncCommits("j", clip_value, [](int64_t idx) { return idx != 7; });
}

// A step of workers 0 and 1 over chunks 3 (a parameter) and 7 (a buffer).
struct Avg {
  std::vector<float> param = {3, -4};
  std::vector<float> buffer = {100};
  ChunkUpdate Update(int64_t step) const {
    ChunkUpdate u;
    u.chunks = {3, 7};
    u.numels = {2, 1};
    u.grads = {param.data(), buffer.data()};
    u.base_versions = {5, 5};
    u.requests = {{0, step, 11}, {1, step, 21}};
    u.lr_scale = 0.5f;
    return u;
  }
};

SyncCommit Decide(int64_t step, double coef, bool skip = false) {
  SyncCommit c;
  c.set_step(step);
  c.set_clip_coef(coef);
  c.set_skip(skip);
  return c;
}

bool Never(int64_t) { return false; }

TEST(SyncCommitsTest, PrepareReportsTheParametersSquaredNormOnly) {
  SyncCommits commits = Make();
  ASSERT_OK(commits.Prepare(Avg().Update(4)));
  const std::optional<PreparedStep> f = commits.Find(4, 1);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->grad_sq_norm(), 25.0);  // 3^2 + 4^2; the buffer's 100 is not counted.
  EXPECT_FALSE(f->nonfinite());
  EXPECT_FALSE(f->value_clipped());
  EXPECT_FALSE(commits.Find(4, 2).has_value());  // Worker 2 did not contribute.
  EXPECT_FALSE(commits.Find(5, 0).has_value());
}

TEST(SyncCommitsTest, ValueClippingComesBeforeTheNormAndSparesBuffers) {
  SyncCommits commits = Make(/*clip_value=*/3.5);
  ASSERT_OK(commits.Prepare(Avg().Update(0)));
  EXPECT_EQ(commits.Find(0, 0)->grad_sq_norm(), 3.0 * 3.0 + 3.5 * 3.5);
  EXPECT_TRUE(commits.Find(0, 0)->value_clipped());
  std::vector<std::vector<float>> applied;
  ASSERT_OK_AND_ASSIGN(SyncCommits::Outcome out,
                       commits.Commit(
                           Decide(0, 1.0), 0,
                           [&](const ChunkUpdate& u) {
                             for (size_t i = 0; i < u.chunks.size(); ++i) {
                               applied.emplace_back(u.grads[i], u.grads[i] + u.numels[i]);
                             }
                             return absl::OkStatus();
                           },
                           Never));
  EXPECT_EQ(out, SyncCommits::Outcome::kApplied);
  EXPECT_EQ(applied, (std::vector<std::vector<float>>{{3, -3.5f}, {100}}));
}

TEST(SyncCommitsTest, NonFiniteFromAWorkerFlagOrFromTheAverage) {
  SyncCommits commits = Make();
  ChunkUpdate flagged = Avg().Update(0);
  flagged.nonfinite = true;
  ASSERT_OK(commits.Prepare(flagged));
  EXPECT_TRUE(commits.Find(0, 0)->nonfinite());
  Avg inf;
  inf.buffer = {std::numeric_limits<float>::infinity()};
  ASSERT_OK(commits.Prepare(inf.Update(1)));
  EXPECT_TRUE(commits.Find(1, 0)->nonfinite());
  EXPECT_EQ(commits.Find(1, 0)->grad_sq_norm(), 25.0);
}

TEST(SyncCommitsTest, FirstCommitAppliesTheScaledStepOnceLaterOnesFindItApplied) {
  SyncCommits commits = Make();
  ASSERT_OK(commits.Prepare(Avg().Update(2)));
  int calls = 0;
  ChunkUpdate seen;
  std::vector<std::vector<float>> values;
  ApplyFn apply = [&](const ChunkUpdate& u) {
    ++calls;
    seen = u;
    values.clear();
    for (size_t i = 0; i < u.chunks.size(); ++i) {
      values.emplace_back(u.grads[i], u.grads[i] + u.numels[i]);
    }
    return absl::OkStatus();
  };
  ASSERT_OK_AND_ASSIGN(SyncCommits::Outcome first, commits.Commit(Decide(2, 0.5), 1, apply, Never));
  EXPECT_EQ(first, SyncCommits::Outcome::kApplied);
  ASSERT_EQ(calls, 1);
  // Parameters scaled by the coefficient, buffers as they were; the rest of the update kept.
  EXPECT_EQ(values, (std::vector<std::vector<float>>{{1.5f, -2}, {100}}));
  EXPECT_EQ(seen.chunks, (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(seen.base_versions, (std::vector<int64_t>{5, 5}));
  EXPECT_EQ(seen.lr_scale, 0.5f);
  ASSERT_EQ(seen.requests.size(), 2u);
  EXPECT_EQ(seen.requests[1].request_id, 21u);

  ASSERT_OK_AND_ASSIGN(SyncCommits::Outcome second,
                       commits.Commit(Decide(2, 0.5), 0, apply, Never));
  EXPECT_EQ(second, SyncCommits::Outcome::kAlreadyApplied);
  EXPECT_EQ(calls, 1);
  // Still answerable for duplicates of the step's pushes.
  EXPECT_EQ(commits.Find(2, 0)->grad_sq_norm(), 25.0);
  // A different decision (figures seen after restarts) applies nothing: the step stands.
  ASSERT_OK_AND_ASSIGN(SyncCommits::Outcome other,
                       commits.Commit(Decide(2, 0.25), 0, apply, Never));
  EXPECT_EQ(other, SyncCommits::Outcome::kAppliedOtherwise);
  ASSERT_OK_AND_ASSIGN(other, commits.Commit(Decide(2, 1, /*skip=*/true), 0, apply, Never));
  EXPECT_EQ(other, SyncCommits::Outcome::kAppliedOtherwise);
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(commits.committed(), 1);
  EXPECT_EQ(commits.skipped(), 0);
}

TEST(SyncCommitsTest, SkipAppliesAnUpdateWithTheRequestsAndNoChunks) {
  SyncCommits commits = Make();
  ASSERT_OK(commits.Prepare(Avg().Update(0)));
  ChunkUpdate seen;
  ASSERT_OK(commits
                .Commit(
                    Decide(0, 0, /*skip=*/true), 0,
                    [&](const ChunkUpdate& u) {
                      seen = u;
                      return absl::OkStatus();
                    },
                    Never)
                .status());
  EXPECT_TRUE(seen.chunks.empty());
  EXPECT_TRUE(seen.grads.empty());
  EXPECT_EQ(seen.requests.size(), 2u);
  EXPECT_EQ(commits.skipped(), 1);
}

TEST(SyncCommitsTest, BadCoefficientIsRefusedAndTheStepStaysPrepared) {
  SyncCommits commits = Make();
  ASSERT_OK(commits.Prepare(Avg().Update(0)));
  ApplyFn fail = [](const ChunkUpdate&) { return absl::InternalError("must not run"); };
  for (double bad : {0.0, -1.0, 1.5, std::nan("")}) {
    EXPECT_EQ(commits.Commit(Decide(0, bad), 0, fail, Never).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  EXPECT_EQ(commits.Commit(Decide(-1, 1), 0, fail, Never).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(commits.Find(0, 0).has_value());
  EXPECT_EQ(commits.committed(), 0);
}

TEST(SyncCommitsTest, MissingUnlessTheShardAppliedItBeforeARestart) {
  SyncCommits commits = Make();
  ApplyFn fail = [](const ChunkUpdate&) { return absl::InternalError("must not run"); };
  ASSERT_OK_AND_ASSIGN(SyncCommits::Outcome missing, commits.Commit(Decide(9, 1), 0, fail, Never));
  EXPECT_EQ(missing, SyncCommits::Outcome::kMissing);
  ASSERT_OK_AND_ASSIGN(SyncCommits::Outcome before,
                       commits.Commit(Decide(9, 1), 0, fail, [](int64_t s) { return s <= 9; }));
  EXPECT_EQ(before, SyncCommits::Outcome::kAlreadyApplied);
}

TEST(SyncCommitsTest, AFailedApplyDropsTheStepSoItIsPushedAgain) {
  SyncCommits commits = Make();
  ASSERT_OK(commits.Prepare(Avg().Update(0)));
  absl::Status st = commits
                        .Commit(
                            Decide(0, 1), 0,
                            [](const ChunkUpdate&) { return absl::DataLossError("disk"); }, Never)
                        .status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(st.message().find("commit of sync step 0"), std::string::npos) << st;
  EXPECT_FALSE(commits.Find(0, 0).has_value());
  ASSERT_OK_AND_ASSIGN(
      SyncCommits::Outcome out,
      commits.Commit(
          Decide(0, 1), 1, [](const ChunkUpdate&) { return absl::OkStatus(); }, Never));
  EXPECT_EQ(out, SyncCommits::Outcome::kMissing);
}

TEST(SyncCommitsTest, BoundedPreparedStepsAndOrphansGoWithALaterCommit) {
  SyncCommits commits = Make();
  for (int64_t s = 0; s < SyncCommits::kMaxPrepared; ++s) {
    ASSERT_OK(commits.Prepare(Avg().Update(s)));
  }
  EXPECT_EQ(commits.Prepare(Avg().Update(SyncCommits::kMaxPrepared)).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(commits
                .Commit(
                    Decide(2, 1), 0, [](const ChunkUpdate&) { return absl::OkStatus(); }, Never)
                .status());
  EXPECT_FALSE(commits.Find(0, 0).has_value());
  EXPECT_FALSE(commits.Find(1, 0).has_value());
  EXPECT_TRUE(commits.Find(3, 0).has_value());
  ASSERT_OK(commits.Prepare(Avg().Update(SyncCommits::kMaxPrepared)));
}

}  // namespace
}  // namespace gradmesh
