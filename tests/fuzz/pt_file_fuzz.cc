// Fuzz target: .pt dataset files (worker/core/tensor_files.h), which a worker opens from a
// dataset directory others may write to: zip central directory, local headers, the pickle
// machine over data.pkl, tensor sizes and strides against the storage entries.
//
// Input: the file. Checked: a refusal is INVALID_ARGUMENT; an opened source has samples of
// at least one byte, at most as many as the file could hold, every one of which reads back
// (up to a bound) and Read(size()) is OUT_OF_RANGE.
#include <stdlib.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tests/fuzz/fuzz_util.h"
#include "worker/core/examples.h"
#include "worker/core/tensor_files.h"

namespace gradmesh {
namespace {

// A directory of its own holding the one file train.pt.
const std::string& ScratchDir() {
  static const std::string* dir = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string d = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/pt_fuzz.XXXXXX");
    FUZZ_CHECK(mkdtemp(d.data()) != nullptr, "mkdtemp");
    return new std::string(d);
  }();
  return *dir;
}

void Check(const std::string& file) {
  const std::string path = ScratchDir() + "/train.pt";
  FILE* f = std::fopen(path.c_str(), "wb");
  FUZZ_CHECK(f != nullptr, path);
  FUZZ_CHECK(std::fwrite(file.data(), 1, file.size(), f) == file.size(), "write");
  std::fclose(f);
  absl::StatusOr<std::unique_ptr<ExampleSource>> source = OpenTensorFiles(ScratchDir(), "train");
  if (!source.ok()) {
    FUZZ_CHECK(source.status().code() == absl::StatusCode::kInvalidArgument,
               source.status().ToString());
    return;
  }
  const ExampleSource& s = **source;
  const int64_t xb = s.x().sample_bytes(), yb = s.y().sample_bytes();
  FUZZ_CHECK(xb > 0 && yb > 0, s.Describe());
  FUZZ_CHECK(s.size() >= 0 && s.size() <= static_cast<int64_t>(file.size()) / xb,
             absl::StrCat(s.Describe(), " from ", file.size(), " bytes"));
  std::vector<uint8_t> x(static_cast<size_t>(xb)), y(static_cast<size_t>(yb));
  for (int64_t i = 0; i < s.size() && i < 4096; ++i) {
    const absl::Status st = s.Read(i, x.data(), y.data());
    FUZZ_CHECK(st.ok(), st.ToString());
  }
  FUZZ_CHECK(s.Read(s.size(), x.data(), y.data()).code() == absl::StatusCode::kOutOfRange,
             "Read(size())");
}

}  // namespace
}  // namespace gradmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gradmesh::Check(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
