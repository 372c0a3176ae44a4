// Helpers shared by the fuzz targets of tests/fuzz/ (see fuzz.bzl): a check that aborts with
// a message (so libFuzzer and the gcc regression driver both report it as a crash), and a
// reader that takes typed values off the front of the input.
//
// Thread safety: FuzzInput is used by one thread; FUZZ_CHECK is reentrant.
#ifndef GRADMESH_TESTS_FUZZ_FUZZ_UTIL_H_
#define GRADMESH_TESTS_FUZZ_FUZZ_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/string_view.h"

// Aborts with the failed condition and `what` (anything streamable into a std::string) when
// `cond` is false. Fuzz targets use it for the properties they check.
#define FUZZ_CHECK(cond, what)                                                              \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(what).c_str());                                              \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)

namespace gradmesh {

// Consumes an input from the front: fixed-size values (zero once the input is used up) and
// the rest as bytes.
class FuzzInput {
 public:
  FuzzInput(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  uint8_t Byte() {
    if (size_ == 0) return 0;
    --size_;
    return *data_++;
  }
  uint32_t U16() { return Byte() | (static_cast<uint32_t>(Byte()) << 8); }
  absl::string_view Rest() const {
    return absl::string_view(reinterpret_cast<const char*>(data_), size_);
  }

 private:
  const uint8_t* data_;
  size_t size_;
};

}  // namespace gradmesh

#endif  // GRADMESH_TESTS_FUZZ_FUZZ_UTIL_H_
