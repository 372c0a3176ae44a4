// PyTorch state_dict writer (see state_dict.h).
#include "cli/state_dict.h"

#include <torch/serialize.h>
#include <torch/torch.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace cli {
namespace {

// Integer elements: the stored float32 rounded to the nearest integer (halves away from zero)
// and clamped to T's range. Shards hold integer buffers exactly below 2^24; rounding only
// removes float noise, clamping keeps an out-of-range value defined.
template <typename T>
at::Tensor IntegerTensor(const ExportedTensor& t, at::ScalarType type) {
  at::Tensor v = torch::empty(t.shape, torch::TensorOptions().dtype(type));
  T* out = v.data_ptr<T>();
  const double lo = static_cast<double>(std::numeric_limits<T>::min());
  const double hi = static_cast<double>(std::numeric_limits<T>::max());
  for (size_t i = 0; i < t.values.size(); ++i) {
    const double r = std::round(static_cast<double>(t.values[i]));
    out[i] = r <= lo   ? std::numeric_limits<T>::min()
             : r >= hi ? std::numeric_limits<T>::max()
                       : static_cast<T>(r);
  }
  return v;
}

// The tensor in its model element type (t.dtype): float32 as stored; float64 exactly;
// float16/bfloat16 rounded to nearest even (torch's conversion); integers rounded; bool != 0.
absl::StatusOr<at::Tensor> ModelTensor(const ExportedTensor& t) {
  at::Tensor f = torch::empty(t.shape, torch::kFloat32);
  if (!t.values.empty()) {
    std::memcpy(f.data_ptr<float>(), t.values.data(), t.values.size() * sizeof(float));
  }
  switch (t.dtype) {
    case DTYPE_UNSPECIFIED:
    case FLOAT32:
      return f;
    case FLOAT64:
      return f.to(torch::kFloat64);
    case FLOAT16:
      return f.to(torch::kFloat16);
    case BFLOAT16:
      return f.to(torch::kBFloat16);
    case INT64:
      return IntegerTensor<int64_t>(t, torch::kInt64);
    case INT32:
      return IntegerTensor<int32_t>(t, torch::kInt32);
    case INT16:
      return IntegerTensor<int16_t>(t, torch::kInt16);
    case INT8:
      return IntegerTensor<int8_t>(t, torch::kInt8);
    case UINT8:
      return IntegerTensor<uint8_t>(t, torch::kUInt8);
    case BOOL: {
      at::Tensor v = torch::empty(t.shape, torch::kBool);
      bool* out = v.data_ptr<bool>();
      for (size_t i = 0; i < t.values.size(); ++i) out[i] = t.values[i] != 0.0f;
      return v;
    }
    default:
      break;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor ", t.name, " has dtype ", static_cast<int>(t.dtype), ", which export cannot write"));
}

}  // namespace

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
      absl::StatusOr<at::Tensor> v = ModelTensor(t);
      if (!v.ok()) return v.status();
      dict.insert(t.name, *std::move(v));
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
