// Collective backends and their registry (see collective.h).
#include "worker/allreduce/collective.h"

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "worker/allreduce/grpc_ring.h"

namespace gradmesh {
namespace {

class RingCollective final : public Collective {
 public:
  RingCollective(std::unique_ptr<RingTransport> transport, RingOptions options)
      : transport_(std::move(transport)), options_(options) {}
  int rank() const override { return transport_->rank(); }
  int size() const override { return transport_->size(); }
  absl::Status AllreduceSum(absl::Span<float> data) override {
    return RingAllreduce(transport_.get(), data, options_, &bytes_sent_);
  }
  absl::StatusOr<std::vector<std::string>> Allgather(absl::string_view mine) override {
    ASSIGN_OR_RETURN(std::vector<std::string> all,
                     RingAllgather(transport_.get(), mine, options_));
    for (int r = 0; r < size(); ++r) {
      if (r != rank()) bytes_sent_ += static_cast<int64_t>(all[r].size());
    }
    return all;
  }
  int64_t bytes_sent() const override { return bytes_sent_; }

 private:
  std::unique_ptr<RingTransport> transport_;
  const RingOptions options_;
  int64_t bytes_sent_ = 0;
};

}  // namespace

std::unique_ptr<Collective> NewRingCollective(std::unique_ptr<RingTransport> transport,
                                              RingOptions options) {
  return std::make_unique<RingCollective>(std::move(transport), options);
}

std::string ResolveBackend(const std::string& backend) {
  return backend.empty() || backend == "auto" ? "ring" : backend;
}

CollectiveRegistry CollectiveRegistry::WithBuiltins() {
  CollectiveRegistry r;
  r.Register("ring", [](const CollectiveContext& c)
                         -> absl::StatusOr<std::unique_ptr<Collective>> {
    GrpcRingOptions o;
    o.job = c.job;
    o.rank = c.rank;
    o.peers = c.peers;
    o.local = c.local;
    o.close_timeout = c.timeout;
    ASSIGN_OR_RETURN(std::unique_ptr<RingTransport> t, NewGrpcRingTransport(o));
    RingOptions ro;
    ro.timeout = c.timeout;
    ro.segment_bytes = c.segment_bytes;
    return NewRingCollective(std::move(t), ro);
  });
  r.Register("nccl", [](const CollectiveContext&) -> absl::StatusOr<std::unique_ptr<Collective>> {
    return absl::UnimplementedError(
        "allreduce.backend nccl needs a worker built with --config=cuda (this one is CPU-only); "
        "use backend ring or auto");
  });
  return r;
}

void CollectiveRegistry::Register(const std::string& name, CollectiveFactory factory) {
  factories_.Set(name, std::move(factory));
}

absl::StatusOr<std::unique_ptr<Collective>> CollectiveRegistry::Create(
    const std::string& name, const CollectiveContext& context) const {
  ASSIGN_OR_RETURN(const CollectiveFactory* f, factories_.Find(name));
  return (*f)(context);
}

}  // namespace gradmesh
