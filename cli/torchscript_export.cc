// TorchScript module export (see torchscript_export.h).
#include "cli/torchscript_export.h"

#include <torch/script.h>
#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gradmesh {
namespace cli {
namespace {

std::string ShapeString(c10::IntArrayRef shape) {
  return absl::StrCat("[", absl::StrJoin(shape.begin(), shape.end(), ","), "]");
}

// Copies `from` into `to` (the module's tensor, in place: the module keeps its dtype).
absl::Status CopyInto(const ExportedTensor& from, at::Tensor to) {
  int64_t numel = 1;
  for (int64_t d : from.shape) numel *= d;
  if (numel != static_cast<int64_t>(from.values.size())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", from.name, " has ",
                                                   from.values.size(), " values for shape ",
                                                   ShapeString(from.shape)));
  }
  if (to.sizes() != c10::IntArrayRef(from.shape)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "tensor ", from.name, ": the module's is ", ShapeString(to.sizes()), ", the job's ",
        ShapeString(from.shape), " (was the job trained with this module?)"));
  }
  // from_blob does not copy; copy_ converts to the module tensor's dtype.
  at::Tensor src =
      torch::from_blob(const_cast<float*>(from.values.data()), from.shape, torch::kFloat32);
  torch::NoGradGuard no_grad;
  to.copy_(src);
  return absl::OkStatus();
}

absl::StatusOr<torch::jit::Module> LoadModule(const std::string& module_bytes) {
  try {
    std::istringstream in(module_bytes);
    return torch::jit::load(in, torch::Device(torch::kCPU));  // Saved on a GPU or not.
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("the job's module is not a TorchScript module: ", e.what_without_backtrace()));
  }
}

// The module's frozen parameters, by name: requires_grad off while others have it on (the
// worker's rule, worker/model.h: it does not train or exchange them).
std::map<std::string, at::Tensor> FrozenParameters(const torch::jit::Module& module) {
  std::map<std::string, at::Tensor> frozen;
  bool any_trainable = false;
  for (const auto& p : module.named_parameters(/*recurse=*/true)) {
    if (p.value.requires_grad()) {
      any_trainable = true;
    } else {
      frozen.emplace(p.name, p.value);
    }
  }
  if (!any_trainable) frozen.clear();  // Then the worker trains them all.
  return frozen;
}

// The module's parameters, then its buffers, by name; a tensor held under an earlier name
// too goes to `tied` (alias, first name) instead.
std::vector<std::pair<std::string, at::Tensor>> ModuleTensors(const torch::jit::Module& module,
                                                              std::vector<TiedName>* tied) {
  std::vector<std::pair<std::string, at::Tensor>> targets;
  std::map<const c10::TensorImpl*, std::string> first;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    if (!t.defined()) return;
    auto [it, fresh] = first.emplace(t.unsafeGetTensorImpl(), name);
    if (fresh) {
      targets.emplace_back(name, t);
    } else {
      tied->push_back({name, it->second});
    }
  };
  for (const auto& p : module.named_parameters(/*recurse=*/true)) add(p.name, p.value);
  for (const auto& b : module.named_buffers(/*recurse=*/true)) add(b.name, b.value);
  return targets;
}

}  // namespace

absl::StatusOr<std::vector<TiedName>> TiedTensorNames(const std::string& module_bytes) {
  try {
    absl::StatusOr<torch::jit::Module> module = LoadModule(module_bytes);
    if (!module.ok()) return module.status();
    std::vector<TiedName> tied;
    ModuleTensors(*module, &tied);
    return tied;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("reading the job's TorchScript module: ", e.what()));
  }
}

absl::StatusOr<std::vector<ExportedTensor>> FrozenTensors(const std::string& module_bytes) {
  try {
    absl::StatusOr<torch::jit::Module> module = LoadModule(module_bytes);
    if (!module.ok()) return module.status();
    std::vector<ExportedTensor> out;
    for (const auto& [name, value] : FrozenParameters(*module)) {
      ExportedTensor t;
      t.name = name;
      t.shape.assign(value.sizes().begin(), value.sizes().end());
      const at::Tensor f = value.detach().to(torch::kCPU, torch::kFloat32).contiguous();
      t.values.assign(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
      t.dtype = value.scalar_type() == torch::kFloat64    ? FLOAT64
                : value.scalar_type() == torch::kFloat16  ? FLOAT16
                : value.scalar_type() == torch::kBFloat16 ? BFLOAT16
                                                          : FLOAT32;
      out.push_back(std::move(t));
    }
    return out;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("reading the job's TorchScript module: ", e.what()));
  }
}

absl::StatusOr<TorchScriptExportResult> SaveTorchScriptWithWeights(
    const std::string& module_bytes, const std::vector<ExportedTensor>& tensors,
    const std::string& path) {
  std::map<std::string, const ExportedTensor*> by_name;
  for (const ExportedTensor& t : tensors) {
    if (!by_name.emplace(t.name, &t).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name ", t.name, " appears twice"));
    }
  }
  TorchScriptExportResult result;
  const std::string tmp = absl::StrCat(path, ".tmp");
  try {
    absl::StatusOr<torch::jit::Module> loaded = LoadModule(module_bytes);
    if (!loaded.ok()) return loaded.status();
    torch::jit::Module& module = *loaded;
    // A tied tensor is written once, under its first name: the alias is the same tensor.
    std::vector<TiedName> tied;
    const std::vector<std::pair<std::string, at::Tensor>> targets = ModuleTensors(module, &tied);
    // Frozen parameters keep the module's values unless the export has them.
    const std::map<std::string, at::Tensor> frozen = FrozenParameters(module);
    std::vector<std::string> missing;
    std::set<std::string> used;
    for (const auto& [name, tensor] : targets) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        if (frozen.count(name) == 0) missing.push_back(name);
        continue;
      }
      used.insert(name);
    }
    if (!missing.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the job's model does not cover ", missing.size(), " of the module's ",
                       targets.size(), " parameters and buffers: ", absl::StrJoin(missing, ", ")));
    }
    for (const auto& [name, tensor] : targets) {
      if (used.count(name) == 0) continue;  // Frozen, kept.
      if (absl::Status s = CopyInto(*by_name.at(name), tensor); !s.ok()) return s;
    }
    result.tensors = static_cast<int64_t>(used.size());
    result.frozen_kept = static_cast<int64_t>(targets.size() - used.size());
    for (const ExportedTensor& t : tensors) {
      if (used.count(t.name) == 0) result.unused.push_back(t.name);
    }
    module.save(tmp);
  } catch (const c10::Error& e) {
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("writing the TorchScript module to ", tmp, ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("writing the TorchScript module to ", tmp, ": ", e.what()));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(err)));
  }
  return result;
}

}  // namespace cli
}  // namespace gradmesh
