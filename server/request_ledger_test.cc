#include "server/request_ledger.h"

#include <optional>
#include <vector>

#include "common/status_testing.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

using Admission = RequestLedger::Admission;

// Admits, applies (as a one-push update with the given staleness) and ends a push.
void ApplyPush(RequestLedger& l, int32_t worker, int64_t step, uint64_t id, int64_t staleness = 0) {
  ASSERT_OK_AND_ASSIGN(Admission a, l.BeginPush(worker, step, id));
  ASSERT_EQ(a, Admission::kAdmitted);
  const int64_t st[] = {staleness};
  const RequestRef ref[] = {{worker, step, id}};
  l.RecordUpdate(st, ref);
  l.EndPush(worker, step, id, /*applied=*/true);
}

TEST(RequestLedgerTest, AppliedPushesAreCountedPerWorker) {
  RequestLedger l("j", 2, 8, 4);
  ApplyPush(l, 0, 0, 100);
  ApplyPush(l, 0, 1, 101, 2);
  ApplyPush(l, 1, 5, 200, 9);
  const RequestLedger::Stats s = l.stats();
  ASSERT_EQ(s.workers.size(), 2u);
  EXPECT_EQ(s.workers[0].last_step, 1);
  EXPECT_EQ(s.workers[0].pushes_applied, 2);
  EXPECT_FALSE(s.workers[0].finished);
  EXPECT_EQ(s.workers[1].last_step, 5);
  EXPECT_EQ(s.workers[1].pushes_applied, 1);
  EXPECT_EQ(s.pushes_applied, 3);
  EXPECT_EQ(s.updates_applied, 3);
  EXPECT_EQ(s.duplicates, 0);
  // Staleness 0, 2 and 9 (>= buckets - 1 lands in the last bucket).
  EXPECT_EQ(s.staleness, (std::vector<int64_t>{1, 0, 1, 1}));
  EXPECT_EQ(l.updates_applied(), 3);
  EXPECT_EQ(l.last_step(0), 1);
  EXPECT_EQ(l.last_step(1), 5);
}

TEST(RequestLedgerTest, RetriesAndOldStepsAreDuplicates) {
  RequestLedger l("j", 1, 8, 2);
  ApplyPush(l, 0, 3, 7);
  ASSERT_OK_AND_ASSIGN(Admission a, l.BeginPush(0, 4, 7));  // Same id, any step.
  EXPECT_EQ(a, Admission::kDuplicate);
  ASSERT_OK_AND_ASSIGN(a, l.BeginPush(0, 3, 8));  // New id, step already applied.
  EXPECT_EQ(a, Admission::kDuplicate);
  ASSERT_OK_AND_ASSIGN(a, l.BeginPush(0, 2, 9));
  EXPECT_EQ(a, Admission::kDuplicate);
  EXPECT_EQ(l.stats().duplicates, 3);
  EXPECT_EQ(l.stats().pushes_applied, 1);
}

TEST(RequestLedgerTest, InProgressIdOrStepIsAborted) {
  RequestLedger l("job-a", 2, 8, 2);
  ASSERT_OK_AND_ASSIGN(Admission a, l.BeginPush(1, 0, 42));
  ASSERT_EQ(a, Admission::kAdmitted);
  absl::StatusOr<Admission> again = l.BeginPush(1, 0, 42);
  EXPECT_STATUS(again, absl::StatusCode::kAborted);
  EXPECT_EQ(again.status().message(), "Push: job job-a worker 1 request 42 is still in progress");
  absl::StatusOr<Admission> other = l.BeginPush(1, 0, 43);
  EXPECT_STATUS(other, absl::StatusCode::kAborted);
  EXPECT_EQ(other.status().message(), "Push: job job-a worker 1 step 0 is already being applied");
  // Another worker is independent.
  ASSERT_OK_AND_ASSIGN(a, l.BeginPush(0, 0, 42));
  EXPECT_EQ(a, Admission::kAdmitted);
  EXPECT_EQ(l.stats().duplicates, 0);
}

TEST(RequestLedgerTest, FailedPushForgetsItsIdSoARetryIsApplied) {
  RequestLedger l("j", 1, 8, 2);
  ASSERT_OK_AND_ASSIGN(Admission a, l.BeginPush(0, 0, 5));
  ASSERT_EQ(a, Admission::kAdmitted);
  l.EndPush(0, 0, 5, /*applied=*/false);
  ASSERT_OK_AND_ASSIGN(a, l.BeginPush(0, 0, 5));
  EXPECT_EQ(a, Admission::kAdmitted);
  const int64_t st[] = {0};
  const RequestRef ref[] = {{0, 0, 5}};
  l.RecordUpdate(st, ref);
  // An update that applied the id before the push ended keeps it, even if the push failed.
  l.EndPush(0, 0, 5, /*applied=*/false);
  ASSERT_OK_AND_ASSIGN(a, l.BeginPush(0, 1, 5));
  EXPECT_EQ(a, Admission::kDuplicate);
}

TEST(RequestLedgerTest, DedupeWindowKeepsTheLastIds) {
  RequestLedger l("j", 1, 2, 2);
  ApplyPush(l, 0, 0, 10);
  ApplyPush(l, 0, 1, 11);
  ApplyPush(l, 0, 2, 12);  // Evicts 10.
  ASSERT_OK_AND_ASSIGN(Admission a, l.BeginPush(0, 3, 10));
  EXPECT_EQ(a, Admission::kAdmitted);
  l.EndPush(0, 3, 10, false);
  ASSERT_OK_AND_ASSIGN(a, l.BeginPush(0, 3, 11));
  EXPECT_EQ(a, Admission::kDuplicate);
}

TEST(RequestLedgerTest, OneUpdateCanCompleteSeveralPushes) {
  RequestLedger l("j", 3, 8, 3);
  for (int32_t w = 0; w < 3; ++w) {
    ASSERT_OK_AND_ASSIGN(Admission a, l.BeginPush(w, 0, 100 + w));
    ASSERT_EQ(a, Admission::kAdmitted);
  }
  const int64_t st[] = {1, 0};  // Two chunks.
  const RequestRef refs[] = {{0, 0, 100}, {1, 0, 101}, {2, 0, 102}};
  l.RecordUpdate(st, refs);
  const RequestLedger::Stats s = l.stats();
  EXPECT_EQ(s.updates_applied, 1);
  EXPECT_EQ(s.pushes_applied, 3);
  EXPECT_EQ(s.staleness, (std::vector<int64_t>{1, 1, 0}));
  for (int32_t w = 0; w < 3; ++w) EXPECT_EQ(s.workers[w].last_step, 0);
}

TEST(RequestLedgerTest, FinishIsCountedOnceAndAllFinishedHonoursCounted) {
  RequestLedger l("j", 3, 8, 2);
  ApplyPush(l, 1, 0, 1);
  EXPECT_EQ(l.MarkFinished(1), std::optional<int64_t>(1));
  EXPECT_EQ(l.MarkFinished(1), std::nullopt);
  EXPECT_FALSE(l.AllFinished({true, true, true}));
  EXPECT_TRUE(l.AllFinished({false, true, false}));
  EXPECT_EQ(l.MarkFinished(0), std::optional<int64_t>(0));
  EXPECT_TRUE(l.AllFinished({true, true, false}));
  std::vector<int64_t> pushed;
  std::vector<bool> finished;
  l.Clocks(&pushed, &finished);
  EXPECT_EQ(pushed, (std::vector<int64_t>{0, 1, 0}));
  EXPECT_EQ(finished, (std::vector<bool>{true, true, false}));
}

TEST(RequestLedgerTest, SnapshotRoundTrip) {
  RequestLedger l("j", 2, 8, 3);
  ApplyPush(l, 0, 0, 10, 1);
  ApplyPush(l, 0, 1, 11);
  ApplyPush(l, 1, 0, 20, 5);
  ASSERT_OK_AND_ASSIGN(Admission a, l.BeginPush(0, 2, 11));
  ASSERT_EQ(a, Admission::kDuplicate);
  l.MarkFinished(1);
  state::JobSnapshot snap;
  l.SaveTo(&snap);
  EXPECT_EQ(snap.seq(), 3);
  ASSERT_EQ(snap.workers_size(), 2);
  EXPECT_EQ(snap.workers(0).last_step(), 1);
  EXPECT_EQ(snap.workers(0).pushes_applied(), 2);
  EXPECT_FALSE(snap.workers(0).finished());
  EXPECT_EQ(std::vector<uint64_t>(snap.workers(0).recent_ids().begin(),
                                  snap.workers(0).recent_ids().end()),
            (std::vector<uint64_t>{10, 11}));
  EXPECT_TRUE(snap.workers(1).finished());
  EXPECT_EQ(snap.pushes_applied(), 3);
  EXPECT_EQ(snap.duplicates(), 1);
  EXPECT_EQ(std::vector<int64_t>(snap.staleness().begin(), snap.staleness().end()),
            (std::vector<int64_t>{1, 1, 1}));

  RequestLedger r("j", 2, 8, 3);
  r.RestoreFrom(snap);
  state::JobSnapshot again;
  r.SaveTo(&again);
  EXPECT_EQ(again.SerializeAsString(), snap.SerializeAsString());
  ASSERT_OK_AND_ASSIGN(a, r.BeginPush(0, 5, 10));  // Restored ids are still duplicates.
  EXPECT_EQ(a, Admission::kDuplicate);
  EXPECT_EQ(r.updates_applied(), 3);
}

TEST(RequestLedgerTest, RestoreIgnoresExtraWorkersAndBuckets) {
  state::JobSnapshot snap;
  snap.set_seq(7);
  for (int w = 0; w < 3; ++w) snap.add_workers()->set_last_step(w + 4);
  for (int b = 0; b < 5; ++b) snap.add_staleness(b + 1);
  RequestLedger l("j", 2, 8, 2);
  l.RestoreFrom(snap);
  const RequestLedger::Stats s = l.stats();
  ASSERT_EQ(s.workers.size(), 2u);
  EXPECT_EQ(s.workers[1].last_step, 5);
  EXPECT_EQ(s.staleness, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(s.updates_applied, 7);
}

}  // namespace
}  // namespace gradmesh
