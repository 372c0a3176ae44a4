// In-process ring: one mutex-guarded queue per rank (see local_ring.h).
#include "worker/allreduce/local_ring.h"

#include <deque>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace gradmesh {
namespace {

struct Inbox {
  absl::Mutex mu;
  std::deque<std::shared_ptr<std::string>> queue ABSL_GUARDED_BY(mu);
  bool sender_closed ABSL_GUARDED_BY(mu) = false;
};

class LocalTransport final : public RingTransport {
 public:
  LocalTransport(int rank, int n, std::shared_ptr<Inbox> in, std::shared_ptr<Inbox> out)
      : rank_(rank), n_(n), in_(std::move(in)), out_(std::move(out)) {}
  ~LocalTransport() override {
    absl::MutexLock lock(&out_->mu);
    out_->sender_closed = true;
  }

  int rank() const override { return rank_; }
  int size() const override { return n_; }

  absl::Status Send(absl::Span<const char> data) override {
    auto copy = std::make_shared<std::string>(data.data(), data.size());
    absl::MutexLock lock(&out_->mu);
    out_->queue.push_back(std::move(copy));
    return absl::OkStatus();
  }

  absl::StatusOr<RingMessage> Recv(absl::Time deadline) override {
    absl::MutexLock lock(&in_->mu);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(in_->mu) {
      return !in_->queue.empty() || in_->sender_closed;
    };
    in_->mu.AwaitWithDeadline(absl::Condition(&ready), deadline);
    if (in_->queue.empty()) {
      const std::string prev = PeerName((rank_ + n_ - 1) % n_);
      if (in_->sender_closed) return absl::UnavailableError(prev + " closed its ring link");
      return absl::DeadlineExceededError(absl::StrCat("nothing from ", prev, " in time"));
    }
    std::shared_ptr<std::string> msg = std::move(in_->queue.front());
    in_->queue.pop_front();
    RingMessage out;
    out.pieces.emplace_back(msg->data(), msg->size());
    out.owner = std::move(msg);
    return out;
  }

  std::string PeerName(int rank) const override { return absl::StrCat("rank ", rank); }

 private:
  const int rank_, n_;
  const std::shared_ptr<Inbox> in_, out_;
};

}  // namespace

std::vector<std::unique_ptr<RingTransport>> NewLocalRing(int n) {
  std::vector<std::shared_ptr<Inbox>> inboxes(n);
  for (auto& b : inboxes) b = std::make_shared<Inbox>();
  std::vector<std::unique_ptr<RingTransport>> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(std::make_unique<LocalTransport>(r, n, inboxes[r], inboxes[(r + 1) % n]));
  }
  return out;
}

}  // namespace gradmesh
