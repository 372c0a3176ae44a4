#include "worker/core/examples.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gradmesh {

int ElemSize(ElemType type) {
  switch (type) {
    case ElemType::kFloat64:
    case ElemType::kInt64:
      return 8;
    case ElemType::kFloat32:
    case ElemType::kInt32:
      return 4;
    case ElemType::kFloat16:
    case ElemType::kBFloat16:
    case ElemType::kInt16:
      return 2;
    case ElemType::kInt8:
    case ElemType::kUInt8:
    case ElemType::kBool:
      return 1;
  }
  return 1;  // Unreachable for valid enumerators.
}

const char* ElemTypeName(ElemType type) {
  switch (type) {
    case ElemType::kFloat32:
      return "float32";
    case ElemType::kFloat64:
      return "float64";
    case ElemType::kFloat16:
      return "float16";
    case ElemType::kBFloat16:
      return "bfloat16";
    case ElemType::kInt64:
      return "int64";
    case ElemType::kInt32:
      return "int32";
    case ElemType::kInt16:
      return "int16";
    case ElemType::kInt8:
      return "int8";
    case ElemType::kUInt8:
      return "uint8";
    case ElemType::kBool:
      return "bool";
  }
  return "unknown";
}

bool TargetsCompatible(const FieldMeta& a, const FieldMeta& b) {
  if (a.dims != b.dims) return false;
  if (a.type == b.type) return true;
  if (IsFloating(a.type) || IsFloating(b.type)) return IsFloating(a.type) && IsFloating(b.type);
  return a.type != ElemType::kBool && b.type != ElemType::kBool;
}

bool TestFitsTraining(const ExampleSource& train, const ExampleSource& test) {
  return train.x() == test.x() && TargetsCompatible(train.y(), test.y());
}

bool IsFloating(ElemType type) {
  return type == ElemType::kFloat32 || type == ElemType::kFloat64 || type == ElemType::kFloat16 ||
         type == ElemType::kBFloat16;
}

int64_t FieldMeta::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

int64_t FieldMeta::sample_bytes() const { return numel() * ElemSize(type); }

std::string FieldMeta::Describe() const {
  return absl::StrCat(ElemTypeName(type), "[", absl::StrJoin(dims, ","), "]");
}

}  // namespace gradmesh
