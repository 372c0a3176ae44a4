// Bounded progress history (see job_history.h).
#include "coordinator/job_history.h"

#include <algorithm>

namespace gradmesh {

void AddHistoryPoint(coordinator_state::HistoryPoint point, int capacity,
                     coordinator_state::JobHistory* history) {
  capacity = std::max(capacity, 2);
  if (history->stride() <= 0) history->set_stride(1);
  auto* points = history->mutable_points();
  if (!points->empty() && points->rbegin()->step() == point.step()) {
    coordinator_state::HistoryPoint* last = &*points->rbegin();
    last->set_t_ms(point.t_ms());
    last->set_loss(point.loss());
    last->set_accuracy(point.accuracy());
    if (point.samples_per_s() > 0) last->set_samples_per_s(point.samples_per_s());
    return;
  }
  // The previous tail (off the stride) gives way to the new latest point.
  if (!points->empty() && points->rbegin()->index() % history->stride() != 0) {
    points->RemoveLast();
  }
  point.set_index(history->offered());
  history->set_offered(history->offered() + 1);
  *points->Add() = std::move(point);
  while (points->size() > capacity) {
    history->set_stride(history->stride() * 2);
    const int n = points->size();
    int kept = 0;
    for (int i = 0; i < n; ++i) {
      if (i + 1 == n || points->Get(i).index() % history->stride() == 0) {
        points->SwapElements(kept++, i);
      }
    }
    points->DeleteSubrange(kept, n - kept);
  }
}

}  // namespace gradmesh
