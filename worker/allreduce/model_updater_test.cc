// Tests of the model side of an allreduce step (model_updater.h): two ranks as threads over an
// in-process ring, each with a model of two parameters and one buffer, as the training loop
// drives them (gradients through ParamReady during backward, the buffer's delta in grads).
// Every value is exact in float32, so the expectations are exact.
#include "worker/allreduce/model_updater.h"

#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "common/safe_path.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/allreduce/checkpoint.h"
#include "worker/allreduce/collective.h"
#include "worker/allreduce/local_ring.h"

namespace gradmesh {
namespace {

std::string TempDir() {
  const char* d = std::getenv("TEST_TMPDIR");
  return d != nullptr ? d : "/tmp";
}

OptimizerSpec SgdMomentum() {
  OptimizerSpec s;
  s.set_name("sgd");
  s.set_lr(0.5);
  s.set_momentum(0.5);  // One slot per element: the momentum buffer.
  return s;
}

// "w" (3), "b" (2), then the buffer "bn.running_mean" (2).
struct TinyModel {
  std::vector<float> w = {1, 2, 3}, b = {0, 0}, running_mean = {1, 2};
  std::vector<absl::Span<float>> entries() {
    return {absl::MakeSpan(w), absl::MakeSpan(b), absl::MakeSpan(running_mean)};
  }
  static std::vector<std::string> names() { return {"w", "b", "bn.running_mean"}; }
};

TEST(ModelUpdaterTest, OptimizerOnMeanGradientBuffersBecomeBeforePlusMeanDelta) {
  constexpr int n = 2;
  auto ring = NewLocalRing(n);
  std::vector<std::unique_ptr<Collective>> coll;
  for (auto& t : ring) coll.push_back(NewRingCollective(std::move(t), RingOptions()));
  std::vector<TinyModel> models(n);
  std::vector<std::vector<std::vector<float>>> slots(n);
  std::vector<size_t> arrays(n);
  std::vector<std::vector<float>> after_first(n);
  std::vector<absl::Status> st(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      TinyModel& m = models[r];
      absl::StatusOr<std::unique_ptr<ModelUpdater>> u =
          ModelUpdater::Create(m.entries(), TinyModel::names(), 2, SgdMomentum());
      if (!u.ok()) {
        st[r] = u.status();
        return;
      }
      // bucket_bytes 8: the parameters in buckets {1} and {0}, the buffer in a third.
      BucketReducer reducer(coll[r].get(), (*u)->numels(), 8, (*u)->num_params());
      EXPECT_EQ(reducer.buckets().size(), 3u);
      EXPECT_EQ(reducer.buckets().back().params, (std::vector<int>{2}));
      const float k = r + 1.0f;
      // Step 0. Rank r: gradients w: k*(1, 2, 4), b: (r, -r); buffer delta k*(0.5, -0.25).
      // Means: w (1.5, 3, 6), b (0.5, -0.5), buffer delta (0.75, -0.375).
      // Step 1. Buffer deltas (1, 0) and (3, 0): mean (2, 0); parameter gradients 0.
      for (int step = 0; step < 2; ++step) {
        std::vector<float> gw = {k, 2 * k, 4 * k}, gb = {1.0f * r, -1.0f * r};
        std::vector<float> delta = {0.5f * k, -0.25f * k};
        if (step == 1) {
          gw.assign(3, 0.0f);
          gb.assign(2, 0.0f);
          delta = {r == 0 ? 1.0f : 3.0f, 0.0f};
        }
        reducer.StartStep({0.0f, 0.0f});
        reducer.ParamReady(1, gb.data(), 2);  // Backward: last parameter first.
        reducer.ParamReady(0, gw.data(), 3);
        // The loop wrote the forward's new value into the mirror: before + own delta.
        for (int i = 0; i < 2; ++i) m.running_mean[i] += delta[i];
        const std::vector<absl::Span<const float>> grads = {gw, gb, delta};
        st[r] = (*u)->FinishStep(&reducer, step, grads);
        if (!st[r].ok()) return;
        if (step == 0) after_first[r] = m.running_mean;
      }
      slots[r] = {(*u)->slots(0)[0], (*u)->slots(1)[0]};
      arrays[r] = (*u)->CheckpointArrays().size();
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_OK(st[r]);
    // Buffer: (1, 2) + (0.75, -0.375), then + (2, 0); identical on both ranks.
    EXPECT_EQ(after_first[r], (std::vector<float>{1.75f, 1.625f})) << r;
    EXPECT_EQ(models[r].running_mean, (std::vector<float>{3.75f, 1.625f})) << r;
    // SGD, lr 0.5, momentum 0.5. Step 0: buf = g, p -= 0.5 g. Step 1 (g = 0): buf = 0.5 buf,
    // p -= 0.5 buf. w: (1, 2, 3) - 0.75 * (1.5, 3, 6) = (-0.125, -0.25, -1.5).
    EXPECT_EQ(models[r].w, (std::vector<float>{-0.125f, -0.25f, -1.5f})) << r;
    EXPECT_EQ(models[r].b, (std::vector<float>{-0.375f, 0.375f})) << r;
    EXPECT_EQ(slots[r][0], (std::vector<float>{0.75f, 1.5f, 3.0f})) << r;
    EXPECT_EQ(slots[r][1], (std::vector<float>{0.25f, -0.25f})) << r;
    // Three entries and one slot array per parameter: none for the buffer.
    EXPECT_EQ(arrays[r], 5u) << r;
  }
}

// Dynamic loss scaling: the gradients arrive multiplied by the scale (8). Step 0: finite, so
// the mean is divided by 8 and applied. Step 1: only rank 1's gradient overflowed (inf), yet
// both ranks see a non-finite mean and both skip the step: no optimizer (slots untouched) and
// the buffers back to their values before it: the consistent skip GradScaler gives under DDP.
TEST(ModelUpdaterTest, LossScalingUnscalesTheMeanAndEveryRankSkipsAnOverflowTogether) {
  constexpr int n = 2;
  auto ring = NewLocalRing(n);
  std::vector<std::unique_ptr<Collective>> coll;
  for (auto& t : ring) coll.push_back(NewRingCollective(std::move(t), RingOptions()));
  std::vector<TinyModel> models(n);
  std::vector<std::vector<bool>> skipped(n);
  std::vector<std::vector<float>> slot_w(n);
  std::vector<absl::Status> st(n, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      TinyModel& m = models[r];
      absl::StatusOr<std::unique_ptr<ModelUpdater>> u =
          ModelUpdater::Create(m.entries(), TinyModel::names(), 2, SgdMomentum());
      if (!u.ok()) {
        st[r] = u.status();
        return;
      }
      BucketReducer reducer(coll[r].get(), (*u)->numels(), 8, (*u)->num_params());
      const float k = r + 1.0f;
      for (int step = 0; step < 2; ++step) {
        // Unscaled: w k*(1, 2, 4), b (r, -r); the loop hands them over times 8.
        std::vector<float> gw = {8 * k, 16 * k, 32 * k}, gb = {8.0f * r, -8.0f * r};
        if (step == 1 && r == 1) gw[1] = std::numeric_limits<float>::infinity();
        std::vector<float> delta = {0.5f * k, -0.25f * k};
        (*u)->set_loss_scale(8);
        reducer.StartStep({0.0f, 0.0f});
        reducer.ParamReady(1, gb.data(), 2);
        reducer.ParamReady(0, gw.data(), 3);
        for (int i = 0; i < 2; ++i) m.running_mean[i] += delta[i];
        const std::vector<absl::Span<const float>> grads = {gw, gb, delta};
        st[r] = (*u)->FinishStep(&reducer, step, grads);
        if (!st[r].ok()) return;
        skipped[r].push_back((*u)->last_step_skipped());
      }
      slot_w[r] = (*u)->slots(0)[0];
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_OK(st[r]);
    EXPECT_EQ(skipped[r], (std::vector<bool>{false, true})) << r;
    // Step 0 as without scaling: w (1, 2, 3) - 0.5 * (1.5, 3, 6); step 1 changed nothing.
    EXPECT_EQ(models[r].w, (std::vector<float>{0.25f, 0.5f, 0.0f})) << r;
    EXPECT_EQ(models[r].b, (std::vector<float>{-0.25f, 0.25f})) << r;
    EXPECT_EQ(slot_w[r], (std::vector<float>{1.5f, 3.0f, 6.0f})) << r;
    // The buffers: averaged at step 0, (1, 2) + (0.75, -0.375); step 1 skipped, so they are
    // back to that (each rank's own forward had moved its mirror).
    EXPECT_EQ(models[r].running_mean, (std::vector<float>{1.75f, 1.625f})) << r;
  }
}

TEST(ModelUpdaterTest, CheckpointRoundTripRestoresBuffersAndSlots) {
  const std::string path = RankCheckpointPath(TempDir() + "/mu1", "job", 0).value();
  TinyModel a;
  a.w = {4, 5, 6};
  a.running_mean = {7.5f, -1};
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ModelUpdater> ua,
                       ModelUpdater::Create(a.entries(), TinyModel::names(), 2, SgdMomentum()));
  std::vector<absl::Span<const float>> arrays = ua->CheckpointArrays();
  ASSERT_EQ(arrays.size(), 5u);
  EXPECT_EQ(arrays[2].data(), a.running_mean.data());  // Entries are written from the model.
  ASSERT_OK(WriteCheckpoint(path, 12, arrays));

  TinyModel b;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ModelUpdater> ub,
                       ModelUpdater::Create(b.entries(), TinyModel::names(), 2, SgdMomentum()));
  ASSERT_OK_AND_ASSIGN(RankCheckpoint c, ReadCheckpoint(path));
  EXPECT_EQ(c.step, 12);
  ASSERT_TRUE(ub->Fits(c));
  ASSERT_OK(ub->Restore(c, path));
  EXPECT_EQ(b.w, (std::vector<float>{4, 5, 6}));
  EXPECT_EQ(b.b, (std::vector<float>{0, 0}));
  EXPECT_EQ(b.running_mean, (std::vector<float>{7.5f, -1}));
  EXPECT_EQ(ub->slots(0)[0], (std::vector<float>{0, 0, 0}));

  // The restored buffer is the value before the next step: one rank, delta (0.5, 0.5).
  auto ring = NewLocalRing(1);
  std::unique_ptr<Collective> coll = NewRingCollective(std::move(ring[0]), RingOptions());
  BucketReducer reducer(coll.get(), ub->numels(), 0, ub->num_params());
  reducer.StartStep({0, 0});
  std::vector<float> gw = {0, 0, 0}, gb = {0, 0}, delta = {0.5f, 0.5f};
  reducer.ParamReady(1, gb.data(), 2);
  reducer.ParamReady(0, gw.data(), 3);
  b.running_mean = {8, -0.5f};
  ASSERT_OK(ub->FinishStep(&reducer, 12, {gw, gb, delta}));
  EXPECT_EQ(b.running_mean, (std::vector<float>{8, -0.5f}));
}

TEST(ModelUpdaterTest, CheckpointWithoutBuffersStillLoadsAndMismatchesAreRefused) {
  // A model without buffers: the layout written before buffers existed (entries, then each
  // parameter's slots) is unchanged.
  std::vector<float> w = {0, 0}, b = {0};
  ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<ModelUpdater> u,
      ModelUpdater::Create({absl::MakeSpan(w), absl::MakeSpan(b)}, {"w", "b"}, 2, SgdMomentum()));
  RankCheckpoint old;
  old.step = 3;
  old.arrays = {{1, 2}, {3}, {0.5f, 0.25f}, {-1}};
  ASSERT_TRUE(u->Fits(old));
  ASSERT_OK(u->Restore(old, "old.ckpt"));
  EXPECT_EQ(w, (std::vector<float>{1, 2}));
  EXPECT_EQ(b, (std::vector<float>{3}));
  EXPECT_EQ(u->slots(0)[0], (std::vector<float>{0.5f, 0.25f}));
  EXPECT_EQ(u->slots(1)[0], (std::vector<float>{-1}));

  // A wrong slot size is refused, naming the entry, and changes nothing.
  RankCheckpoint bad = old;
  bad.arrays[0] = {9, 9};
  bad.arrays[3] = {1, 1};
  EXPECT_STATUS_MSG(u->Restore(bad, "bad.ckpt"), absl::StatusCode::kFailedPrecondition,
                    "checkpoint bad.ckpt holds 2 values for an optimizer slot of b");
  EXPECT_EQ(w, (std::vector<float>{1, 2}));

  // The same old checkpoint does not fit the model once it has a buffer (4 arrays, not 5).
  TinyModel m;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ModelUpdater> with_buffer,
                       ModelUpdater::Create(m.entries(), TinyModel::names(), 2, SgdMomentum()));
  EXPECT_FALSE(with_buffer->Fits(old));
  EXPECT_STATUS_MSG(with_buffer->Restore(old, "old.ckpt"), absl::StatusCode::kFailedPrecondition,
                    "holds 4 arrays, the model needs 3 entries and 2 optimizer slot arrays");
}

TEST(ModelUpdaterTest, NumParamsOutOfRangeIsInvalid) {
  TinyModel m;
  EXPECT_STATUS_MSG(ModelUpdater::Create(m.entries(), TinyModel::names(), 4, SgdMomentum()),
                    absl::StatusCode::kInvalidArgument, "3 entries has num_params 4");
}

}  // namespace
}  // namespace gradmesh
