// NamedRegistry: the name -> factory map behind every strategy registry (optimizers,
// consistency modes, models, codecs), and its one "unknown name" error:
//   unknown optimizer "adagrad" (known: adam, adamw, sgd)
//
// Registries are plain values (built by each module's WithBuiltins()), never process-wide.
//
// Thread safety: const methods may be called concurrently; Set/Add must not race with
// anything.
#ifndef GRADMESH_COMMON_REGISTRY_H_
#define GRADMESH_COMMON_REGISTRY_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"

namespace gradmesh {

template <typename Factory>
class NamedRegistry {
 public:
  // `kind` names the entries in errors ("optimizer", "consistency mode", ...).
  explicit NamedRegistry(std::string kind) : kind_(std::move(kind)) {}

  // Adds or replaces.
  void Set(const std::string& name, Factory factory) { factories_[name] = std::move(factory); }

  // Adds; InvalidArgument for an empty name or factory, AlreadyExists if the name is taken.
  absl::Status Add(const std::string& name, Factory factory) {
    if (name.empty() || !factory) {
      return absl::InvalidArgumentError(
          absl::StrCat("registering a ", kind_, " needs a name and a factory"));
    }
    if (!factories_.emplace(name, std::move(factory)).second) {
      return absl::AlreadyExistsError(absl::StrCat(kind_, " \"", name, "\" already registered"));
    }
    return absl::OkStatus();
  }

  // Registered names, sorted.
  std::vector<std::string> Names() const {
    std::vector<std::string> out;
    for (const auto& kv : factories_) out.push_back(kv.first);
    return out;
  }

  bool Contains(absl::string_view name) const { return factories_.find(name) != factories_.end(); }

  // The factory for `name`, or InvalidArgument:
  //   unknown <kind> "<shown_as or name>" (known: a, b[; hint])
  absl::StatusOr<const Factory*> Find(absl::string_view name, absl::string_view shown_as = {},
                                      absl::string_view hint = {}) const {
    auto it = factories_.find(name);
    if (it != factories_.end()) return &it->second;
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown ", kind_, " \"", shown_as.empty() ? name : shown_as, "\" (known: ",
        absl::StrJoin(Names(), ", "), hint.empty() ? "" : absl::StrCat("; ", hint), ")"));
  }

 private:
  std::string kind_;
  std::map<std::string, Factory, std::less<>> factories_;
};

}  // namespace gradmesh

#endif  // GRADMESH_COMMON_REGISTRY_H_
