// AddHistoryPoint: bounds, downsampling by stride doubling, the tail, same-step updates.
#include "coordinator/job_history.h"

#include <vector>

#include "gtest/gtest.h"

namespace gradmesh {
namespace {

coordinator_state::HistoryPoint Point(int64_t step, double loss = 1.0, double rate = 100) {
  coordinator_state::HistoryPoint p;
  p.set_t_ms(1000 + step);
  p.set_step(step);
  p.set_loss(loss);
  p.set_accuracy(-1);
  p.set_samples_per_s(rate);
  return p;
}

std::vector<int64_t> Steps(const coordinator_state::JobHistory& h) {
  std::vector<int64_t> out;
  for (const auto& p : h.points()) out.push_back(p.step());
  return out;
}

TEST(JobHistoryTest, DownsamplesToCapacityKeepingFirstAndLatest) {
  coordinator_state::JobHistory h;
  const std::vector<std::vector<int64_t>> want = {
      {10},         {10, 20},         {10, 20, 30},     {10, 20, 30, 40},
      {10, 30, 50}, {10, 30, 50, 60}, {10, 30, 50, 70}, {10, 50, 80},
      {10, 50, 90}, {10, 50, 90, 100}};
  const std::vector<int64_t> strides = {1, 1, 1, 1, 2, 2, 2, 4, 4, 4};
  for (int i = 1; i <= 10; ++i) {
    AddHistoryPoint(Point(i * 10), /*capacity=*/4, &h);
    EXPECT_EQ(Steps(h), want[i - 1]) << "after step " << i * 10;
    EXPECT_EQ(h.stride(), strides[i - 1]) << "after step " << i * 10;
    EXPECT_EQ(h.offered(), i);
  }
  // Indices: multiples of the stride, then the tail (index 9).
  ASSERT_EQ(h.points_size(), 4);
  EXPECT_EQ(h.points(0).index(), 0);
  EXPECT_EQ(h.points(1).index(), 4);
  EXPECT_EQ(h.points(2).index(), 8);
  EXPECT_EQ(h.points(3).index(), 9);
  EXPECT_EQ(h.points(3).t_ms(), 1100);
}

TEST(JobHistoryTest, NeverExceedsCapacity) {
  coordinator_state::JobHistory h;
  for (int i = 1; i <= 100000; ++i) {
    AddHistoryPoint(Point(i), kDefaultHistoryCapacity, &h);
    ASSERT_LE(h.points_size(), kDefaultHistoryCapacity);
  }
  EXPECT_EQ(h.offered(), 100000);
  EXPECT_EQ(h.stride(), 512);  // 240 points cover 100000 offers at 512 apart.
  EXPECT_EQ(h.points(0).step(), 1);
  EXPECT_EQ(h.points(h.points_size() - 1).step(), 100000);
  EXPECT_EQ(h.points_size(), 100000 / 512 + 1 + 1);  // 0, 512, ..., 99840, then the tail.
}

TEST(JobHistoryTest, SameStepUpdatesTheLatestPoint) {
  coordinator_state::JobHistory h;
  AddHistoryPoint(Point(10, 0.5, 200), 4, &h);
  coordinator_state::HistoryPoint end = Point(10, 0.25, 0);  // Finished ranks: no rate.
  end.set_accuracy(0.97);
  AddHistoryPoint(end, 4, &h);
  ASSERT_EQ(h.points_size(), 1);
  EXPECT_EQ(h.offered(), 1);
  EXPECT_EQ(h.points(0).loss(), 0.25);
  EXPECT_EQ(h.points(0).accuracy(), 0.97);
  EXPECT_EQ(h.points(0).samples_per_s(), 200);
}

TEST(JobHistoryTest, CapacityBelowTwoIsTwo) {
  coordinator_state::JobHistory h;
  for (int i = 1; i <= 5; ++i) AddHistoryPoint(Point(i), 0, &h);
  EXPECT_EQ(Steps(h), (std::vector<int64_t>{1, 5}));
}

}  // namespace
}  // namespace gradmesh
