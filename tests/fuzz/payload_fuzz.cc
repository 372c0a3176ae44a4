// Fuzz target: codec payloads (compression/payload.h, every built-in Compressor's Decode,
// DecodeAdd and DecodeSparse, and the "changes" pull payload of compression/changes.h), the
// bytes a shard takes from a push and a worker from a pull.
//
// Input: byte 0 picks the decoder (a codec spec, or "changes"), bytes 1-2 the element count n
// (0..1024), the rest is the payload. Checked: nothing is written outside the output (guard
// elements); Decode, DecodeAdd and DecodeSparse agree on whether the payload is valid and on
// its values; a decoded vector is finite; DecodeAdd and DecodeChanges leave the output
// unchanged on error.
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compression/changes.h"
#include "compression/compressor.h"
#include "compression/payload.h"
#include "tests/fuzz/fuzz_util.h"

namespace gradmesh {
namespace {

constexpr const char* kSpecs[] = {
    "identity",    "fp16",   "bf16",   "topk:0.1", "topk:0.5+fp16", "topk_approx:0.05+bf16",
    "randomk:0.3", "qsgd:1", "qsgd:4", "qsgd:8"};
constexpr size_t kNumSpecs = sizeof(kSpecs) / sizeof(kSpecs[0]);
constexpr size_t kGuard = 8;
constexpr float kGuardValue = -12345.5f;

const std::vector<std::unique_ptr<Compressor>>& Codecs() {
  static const auto* codecs = [] {
    auto* v = new std::vector<std::unique_ptr<Compressor>>;
    const CompressorRegistry registry = CompressorRegistry::WithBuiltins();
    for (const char* spec : kSpecs) v->push_back(registry.Create(spec).value());
    return v;
  }();
  return *codecs;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

void CheckGuards(const std::vector<float>& buf, size_t n, const char* what) {
  for (size_t i = n; i < n + kGuard; ++i) {
    FUZZ_CHECK(std::memcmp(&buf[i], &kGuardValue, sizeof(float)) == 0,
               absl::StrCat(what, " wrote past element ", n));
  }
}

void FuzzCodec(const Compressor& codec, size_t n, absl::string_view payload, const char* spec) {
  std::vector<float> out(n + kGuard, kGuardValue);
  const absl::Status decoded = codec.Decode(payload, absl::MakeSpan(out.data(), n));
  CheckGuards(out, n, spec);
  // DecodeAdd onto a pattern: unchanged on error, pattern + decoded on success.
  std::vector<float> add(n + kGuard, kGuardValue);
  for (size_t i = 0; i < n; ++i) add[i] = static_cast<float>(i % 7) - 3.0f;
  const std::vector<float> before = add;
  const absl::Status added = codec.DecodeAdd(payload, absl::MakeSpan(add.data(), n));
  CheckGuards(add, n, spec);
  FUZZ_CHECK(decoded.ok() == added.ok(), absl::StrCat(spec, ": Decode says ", decoded.ToString(),
                                                      ", DecodeAdd ", added.ToString()));
  std::vector<uint32_t> indices;
  std::vector<float> values;
  const absl::Status sparse = codec.DecodeSparse(payload, n, &indices, &values);
  FUZZ_CHECK(decoded.ok() == sparse.ok(), absl::StrCat(spec, ": Decode says ", decoded.ToString(),
                                                       ", DecodeSparse ", sparse.ToString()));
  if (!decoded.ok()) {
    FUZZ_CHECK(decoded.code() == absl::StatusCode::kInvalidArgument, decoded.ToString());
    FUZZ_CHECK(SameBits(add, before), absl::StrCat(spec, ": DecodeAdd changed out on error"));
    return;
  }
  std::vector<float> scattered(n, 0.0f);
  FUZZ_CHECK(indices.size() == values.size(), spec);
  for (size_t j = 0; j < indices.size(); ++j) {
    FUZZ_CHECK(indices[j] < n, absl::StrCat(spec, ": sparse index ", indices[j], " >= ", n));
    scattered[indices[j]] = values[j];
  }
  for (size_t i = 0; i < n; ++i) {
    FUZZ_CHECK(std::isfinite(out[i]), absl::StrCat(spec, ": non-finite element ", i));
    FUZZ_CHECK(add[i] == before[i] + out[i], absl::StrCat(spec, ": DecodeAdd element ", i));
    FUZZ_CHECK(scattered[i] == out[i], absl::StrCat(spec, ": DecodeSparse element ", i));
  }
}

void FuzzChanges(size_t n, absl::string_view payload) {
  std::vector<float> held(n);
  for (size_t i = 0; i < n; ++i) held[i] = 0.25f * static_cast<float>(i);
  const std::vector<float> before = held;
  const absl::Status st = DecodeChanges(payload, absl::MakeSpan(held));
  if (!st.ok()) {
    FUZZ_CHECK(st.code() == absl::StatusCode::kDataLoss, st.ToString());
    FUZZ_CHECK(SameBits(held, before), "DecodeChanges changed values on error");
    return;
  }
  for (size_t i = 0; i < n; ++i) {
    FUZZ_CHECK(std::isfinite(held[i]), absl::StrCat("changes: non-finite element ", i));
  }
}

}  // namespace
}  // namespace gradmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gradmesh::FuzzInput in(data, size);
  const size_t which = in.Byte() % (gradmesh::kNumSpecs + 1);
  const size_t n = in.U16() % 1025;
  const absl::string_view payload = in.Rest();
  (void)gradmesh::ReadPayloadHeader(payload);
  if (which == gradmesh::kNumSpecs) {
    gradmesh::FuzzChanges(n, payload);
  } else {
    gradmesh::FuzzCodec(*gradmesh::Codecs()[which], n, payload, gradmesh::kSpecs[which]);
  }
  return 0;
}
