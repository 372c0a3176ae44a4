#include "server/consistency.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gradmesh {
namespace {

class AsyncPolicy final : public ConsistencyPolicy {
 public:
  std::string name() const override { return "async"; }
  absl::Status OnPush(int32_t, int64_t, const std::function<void(float)>& apply) override {
    apply(1.0f);
    return absl::OkStatus();
  }
  absl::Status BeforePull(int32_t, int64_t) override { return absl::OkStatus(); }
};

}  // namespace

ConsistencyRegistry ConsistencyRegistry::WithBuiltins() {
  ConsistencyRegistry r;
  r.Register("async", [](const ConsistencyConfig&)
                          -> absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> {
    return std::unique_ptr<ConsistencyPolicy>(new AsyncPolicy());
  });
  return r;
}

void ConsistencyRegistry::Register(const std::string& name, Factory factory) {
  factories_[name] = std::move(factory);
}

std::vector<std::string> ConsistencyRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& kv : factories_) out.push_back(kv.first);
  return out;
}

absl::StatusOr<std::unique_ptr<ConsistencyPolicy>> ConsistencyRegistry::Create(
    const ConsistencyConfig& config) const {
  auto it = factories_.find(config.name);
  if (it == factories_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown consistency mode \"", config.name,
                                                   "\" (known: ", absl::StrJoin(names(), ", "),
                                                   ")"));
  }
  if (config.num_workers <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers must be > 0, got ", config.num_workers));
  }
  return it->second(config);
}

}  // namespace gradmesh
