// PyTorch state_dict writer (see state_dict.h).
#include "cli/state_dict.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace cli {

absl::Status SaveStateDict(const std::string& path, const std::vector<ExportedTensor>& tensors) {
  std::vector<char> bytes;
  try {
    c10::Dict<std::string, at::Tensor> dict;
    for (const ExportedTensor& t : tensors) {
      int64_t numel = 1;
      for (int64_t d : t.shape) numel *= d;
      if (numel != static_cast<int64_t>(t.values.size())) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", t.name, " has ", t.values.size(),
                                                       " values for ", numel, " elements"));
      }
      if (dict.contains(t.name)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor name ", t.name, " appears twice"));
      }
      at::Tensor v = torch::empty(t.shape, torch::kFloat32);
      std::memcpy(v.data_ptr<float>(), t.values.data(), t.values.size() * sizeof(float));
      dict.insert(t.name, v);
    }
    bytes = torch::pickle_save(c10::IValue(dict));
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("serialising the state_dict: ", e.what_without_backtrace()));
  }
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      const int err = errno;
      std::remove(tmp.c_str());
      return absl::InternalError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(err)));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(
        absl::StrCat("cannot rename ", tmp, " to ", path, ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

}  // namespace cli
}  // namespace gradmesh
