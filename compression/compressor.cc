#include "compression/compressor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/numeric.h"
#include "compression/float16.h"
#include "compression/payload.h"
#include "compression/rng.h"
#include "compression/select.h"

namespace gradmesh {

absl::StatusOr<std::unique_ptr<Compressor>> Compressor::WithDensity(double density) const {
  (void)density;
  return absl::InvalidArgumentError(
      absl::StrCat(name(), " is not a sparsifier: it has no density to change"));
}

absl::StatusOr<std::unique_ptr<Compressor>> Compressor::ComposeWith(
    const Compressor& values) const {
  return absl::InvalidArgumentError(absl::StrCat(
      "cannot compose \"", name(), "+", values.name(),
      "\": '+' combines a sparsifier (topk, topk_approx, randomk) with a value codec (fp16, "
      "bf16)"));
}

absl::Status Compressor::DecodeSparse(absl::string_view in, size_t n,
                                      std::vector<uint32_t>* indices,
                                      std::vector<float>* values) const {
  if (n > 0xffffffffu) {
    return absl::InvalidArgumentError(absl::StrCat(name(), ": DecodeSparse of ", n,
                                                   " elements (at most 4294967295 are supported)"));
  }
  values->resize(n);
  absl::Status s = Decode(in, absl::MakeSpan(*values));
  if (!s.ok()) return s;
  indices->resize(n);
  for (size_t i = 0; i < n; ++i) (*indices)[i] = static_cast<uint32_t>(i);
  return absl::OkStatus();
}

int64_t SparseCount(int64_t n, double ratio) {
  if (n <= 0) return 0;
  double x = ratio * static_cast<double>(n);
  const double nearest = std::round(x);
  if (std::fabs(x - nearest) <= 1e-9 * std::max(1.0, x)) x = nearest;
  const double k = std::ceil(x);
  if (!(k >= 1)) return 1;
  if (k >= static_cast<double>(n)) return n;
  return static_cast<int64_t>(k);
}

namespace {

// Shortest decimal that reads back as the same double ("0.01", not "0.01000000000000000021").
std::string FormatRatio(double r) {
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, r);
    if (std::strtod(buf, nullptr) == r) break;
  }
  return buf;
}

absl::Status NonFiniteInput(const std::string& codec, absl::Span<const float> in) {
  const int64_t i = FirstNonFinite(in.data(), static_cast<int64_t>(in.size()));
  return absl::InvalidArgumentError(absl::StrCat(codec, ": input element ", i, " is ",
                                                 in[static_cast<size_t>(i)],
                                                 " (codecs need finite values)"));
}

bool Aligned(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

// Checks the common header against what this decoder handles and the output size.
absl::StatusOr<PayloadHeader> CheckHeader(absl::string_view in, const std::string& decoder,
                                          CodecId codec, ValueType value_type, size_t out_size) {
  absl::StatusOr<PayloadHeader> h = ReadPayloadHeader(in);
  if (!h.ok()) return absl::InvalidArgumentError(absl::StrCat(decoder, ": ", h.status().message()));
  if (h->codec != codec || h->value_type != value_type) {
    return absl::InvalidArgumentError(absl::StrCat(
        decoder, ": payload was encoded by ", CodecIdName(static_cast<uint8_t>(h->codec)), " with ",
        ValueTypeName(static_cast<uint8_t>(h->value_type)), " values; this decoder takes ",
        CodecIdName(static_cast<uint8_t>(codec)), " with ",
        ValueTypeName(static_cast<uint8_t>(value_type))));
  }
  if (h->n != out_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(decoder, ": payload has ", h->n, " elements, the output has ", out_size));
  }
  return h;
}

absl::Status SizeMismatch(const std::string& decoder, size_t got, uint64_t expected) {
  return absl::InvalidArgumentError(
      absl::StrCat(decoder, ": payload is ", got, " bytes, its header implies ", expected,
                   got < expected ? " (truncated)" : " (trailing bytes)"));
}

// Converts k floats to `type` at dst (any alignment). Returns -1, or the index of the first
// non-finite value.
int64_t StoreValues(ValueType type, const float* src, size_t k, char* dst,
                    std::vector<uint16_t>* scratch) {
  const int64_t n = static_cast<int64_t>(k);
  if (type == ValueType::kFloat32) {
    const int64_t bad = FirstNonFinite(src, n);
    if (bad < 0 && k > 0) std::memcpy(dst, src, 4 * k);
    return bad;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  if (!Aligned(dst, alignof(uint16_t))) {
    scratch->resize(k);
    out = scratch->data();
  }
  const int64_t bad =
      type == ValueType::kFloat16 ? FloatToHalf(src, n, out) : FloatToBFloat16(src, n, out);
  if (out != reinterpret_cast<uint16_t*>(dst) && k > 0) std::memcpy(dst, out, 2 * k);
  return bad;
}

// Converts k values of `type` at src (any alignment) to floats at dst. Returns -1, or the
// index of the first Inf/NaN.
int64_t LoadValues(ValueType type, const char* src, size_t k, float* dst,
                   std::vector<uint16_t>* scratch) {
  const int64_t n = static_cast<int64_t>(k);
  if (type == ValueType::kFloat32) {
    // Copy and check in one vectorised pass (memcpy loads: src may be unaligned).
    uint32_t bad = 0;
    for (size_t i = 0; i < k; ++i) {
      uint32_t bits;
      std::memcpy(&bits, src + 4 * i, 4);
      bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
      std::memcpy(dst + i, &bits, 4);
    }
    return bad ? FirstNonFinite(dst, n) : -1;
  }
  const uint16_t* in = reinterpret_cast<const uint16_t*>(src);
  if (!Aligned(src, alignof(uint16_t))) {
    scratch->resize(k);
    if (k > 0) std::memcpy(scratch->data(), src, 2 * k);
    in = scratch->data();
  }
  return type == ValueType::kFloat16 ? HalfToFloat(in, n, dst) : BFloat16ToFloat(in, n, dst);
}

absl::Status BadValue(const std::string& decoder, ValueType type, int64_t i) {
  return absl::InvalidArgumentError(absl::StrCat(decoder, ": value ", i, " is Inf or NaN (",
                                                 ValueTypeName(static_cast<uint8_t>(type)), ")"));
}

// ---------------------------------------------------------------------------------------
// identity, fp16, bf16

class DenseCodec : public Compressor {
 public:
  explicit DenseCodec(ValueType type) : type_(type) {}

  std::string name() const override { return ValueCodecName(type_); }
  bool biased() const override { return type_ != ValueType::kFloat32; }
  bool stochastic() const override { return false; }

  static std::string ValueCodecName(ValueType type) {
    return type == ValueType::kFloat32 ? "identity" : type == ValueType::kFloat16 ? "fp16" : "bf16";
  }

  size_t MaxEncodedSize(size_t n) const override { return kHeaderBytes + n * ValueBytes(type_); }

  absl::Status Encode(absl::Span<const float> in, uint64_t seed, std::string* out) const override {
    (void)seed;
    const size_t n = in.size();
    const size_t size = MaxEncodedSize(n);
    if (out->size() != size) out->resize(size);
    char* p = &(*out)[0];
    PayloadHeader h;
    h.codec = codec();
    h.value_type = type_;
    h.n = n;
    WritePayloadHeader(h, p);
    char* values = p + kHeaderBytes;
    int64_t bad;
    if (type_ == ValueType::kFloat32) {
      bad = CopyFinite(in.data(), n, values);
    } else {
      std::vector<uint16_t> scratch;  // only used if the string's buffer were misaligned
      bad = StoreValues(type_, in.data(), n, values, &scratch);
    }
    if (bad >= 0) return NonFiniteInput(name(), in);
    return absl::OkStatus();
  }

  absl::Status Decode(absl::string_view in, absl::Span<float> out) const override {
    absl::Status s = Validate(in, out.size());
    if (!s.ok()) return s;
    const char* src = in.data() + kHeaderBytes;
    std::vector<uint16_t> scratch;
    const int64_t bad = LoadValues(type_, src, out.size(), out.data(), &scratch);
    if (bad >= 0) return BadValue(name(), type_, bad);
    return absl::OkStatus();
  }

  absl::Status DecodeAdd(absl::string_view in, absl::Span<float> out) const override {
    absl::Status s = Validate(in, out.size());
    if (!s.ok()) return s;
    std::vector<float> values(out.size());
    std::vector<uint16_t> scratch;
    const int64_t bad =
        LoadValues(type_, in.data() + kHeaderBytes, out.size(), values.data(), &scratch);
    if (bad >= 0) return BadValue(name(), type_, bad);
    for (size_t i = 0; i < out.size(); ++i) out[i] += values[i];
    return absl::OkStatus();
  }

 private:
  CodecId codec() const {
    return type_ == ValueType::kFloat32   ? CodecId::kIdentity
           : type_ == ValueType::kFloat16 ? CodecId::kFp16
                                          : CodecId::kBf16;
  }

  absl::Status Validate(absl::string_view in, size_t n) const {
    absl::StatusOr<PayloadHeader> h = CheckHeader(in, name(), codec(), type_, n);
    if (!h.ok()) return h.status();
    if (h->aux != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": header byte 3 is ", static_cast<int>(h->aux), ", not 0"));
    }
    const uint64_t expected = kHeaderBytes + static_cast<uint64_t>(n) * ValueBytes(type_);
    if (in.size() != expected) return SizeMismatch(name(), in.size(), expected);
    return absl::OkStatus();
  }

  // Copies and checks in one vectorised pass (out: any alignment); returns as FirstNonFinite.
  static int64_t CopyFinite(const float* in, size_t n, char* out) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, in + i, 4);
      bad |= static_cast<uint32_t>((bits & 0x7f800000u) == 0x7f800000u);
      std::memcpy(out + 4 * i, &bits, 4);
    }
    return bad ? FirstNonFinite(in, static_cast<int64_t>(n)) : -1;
  }

  ValueType type_;
};

// ---------------------------------------------------------------------------------------
// topk, topk_approx, randomk (+fp16 / +bf16)

enum class Selector { kTopK, kTopKApprox, kRandomK };

class SparseCodec : public Compressor {
 public:
  SparseCodec(Selector selector, double density, ValueType type)
      : selector_(selector), density_(density), type_(type) {
    name_ = absl::StrCat(SelectorName(selector_), ":", FormatRatio(density_));
    if (type_ != ValueType::kFloat32) {
      absl::StrAppend(&name_, "+", DenseCodec::ValueCodecName(type_));
    }
  }

  std::string name() const override { return name_; }
  bool biased() const override {
    return selector_ != Selector::kRandomK || type_ != ValueType::kFloat32;
  }
  bool stochastic() const override { return selector_ != Selector::kTopK; }
  double density() const override { return density_; }

  static const char* SelectorName(Selector s) {
    return s == Selector::kTopK ? "topk" : s == Selector::kTopKApprox ? "topk_approx" : "randomk";
  }

  size_t MaxEncodedSize(size_t n) const override {
    size_t k = static_cast<size_t>(SparseCount(static_cast<int64_t>(n), density_));
    if (selector_ == Selector::kTopKApprox) k = std::min(n, 2 * k);
    return kSparseHeaderBytes + BitmapBytes(n) + k * ValueBytes(type_);
  }

  absl::StatusOr<std::unique_ptr<Compressor>> WithDensity(double density) const override {
    if (!(density > 0 && density <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": density ", density, " is outside (0, 1]"));
    }
    return std::unique_ptr<Compressor>(new SparseCodec(selector_, density, type_));
  }

  absl::StatusOr<std::unique_ptr<Compressor>> ComposeWith(const Compressor& values) const override {
    const std::string v = values.name();
    if (type_ == ValueType::kFloat32 && (v == "fp16" || v == "bf16")) {
      return std::unique_ptr<Compressor>(new SparseCodec(
          selector_, density_, v == "fp16" ? ValueType::kFloat16 : ValueType::kBFloat16));
    }
    return Compressor::ComposeWith(values);
  }

  absl::Status Encode(absl::Span<const float> in, uint64_t seed, std::string* out) const override {
    const size_t n = in.size();
    if (n > kMaxSelectElements) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": ", n, " elements (sparse codecs take at most 4294967295)"));
    }
    const size_t k = static_cast<size_t>(SparseCount(static_cast<int64_t>(n), density_));
    std::vector<uint32_t> idx;
    bool finite = true;
    switch (selector_) {
      case Selector::kTopK:
        finite = TopKMagnitude(in, k, &idx);
        break;
      case Selector::kTopKApprox:
        finite = ApproxTopKMagnitude(in, k, seed, &idx);
        break;
      case Selector::kRandomK:
        finite = FirstNonFinite(in.data(), static_cast<int64_t>(n)) < 0;
        RandomKIndices(n, k, seed, &idx);
        break;
    }
    if (!finite) return NonFiniteInput(name(), in);

    const size_t sent = idx.size();
    std::vector<float> values(sent);
    if (selector_ == Selector::kRandomK) {
      const float scale = static_cast<float>(static_cast<double>(n) / static_cast<double>(k));
      for (size_t j = 0; j < sent; ++j) values[j] = in[idx[j]] * scale;
    } else {
      for (size_t j = 0; j < sent; ++j) values[j] = in[idx[j]];
    }
    size_t index_bytes = 0;
    const IndexEncoding encoding = ChooseIndexEncoding(n, idx, &index_bytes);
    const size_t size = kSparseHeaderBytes + index_bytes + sent * ValueBytes(type_);
    if (out->size() != size) out->resize(size);
    char* p = &(*out)[0];
    PayloadHeader h;
    h.codec = codec();
    h.value_type = type_;
    h.aux = static_cast<uint8_t>(encoding);
    h.n = n;
    WritePayloadHeader(h, p);
    PutU64(sent, p + kHeaderBytes);
    PutU64(index_bytes, p + kHeaderBytes + 8);
    WriteIndices(encoding, n, idx, p + kSparseHeaderBytes);
    std::vector<uint16_t> scratch;
    const int64_t bad =
        StoreValues(type_, values.data(), sent, p + kSparseHeaderBytes + index_bytes, &scratch);
    if (bad >= 0) {
      // Only possible for randomk: a finite value times n/k overflowed float32.
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": input element ", idx[static_cast<size_t>(bad)], " (",
                       in[idx[static_cast<size_t>(bad)]], ") scaled by n/k overflows float32"));
    }
    return absl::OkStatus();
  }

  absl::Status Decode(absl::string_view in, absl::Span<float> out) const override {
    std::vector<uint32_t> idx;
    std::vector<float> values;
    absl::Status s = Parse(in, out.size(), &idx, &values);
    if (!s.ok()) return s;
    std::fill(out.begin(), out.end(), 0.0f);
    for (size_t j = 0; j < idx.size(); ++j) out[idx[j]] = values[j];
    return absl::OkStatus();
  }

  absl::Status DecodeAdd(absl::string_view in, absl::Span<float> out) const override {
    std::vector<uint32_t> idx;
    std::vector<float> values;
    absl::Status s = Parse(in, out.size(), &idx, &values);
    if (!s.ok()) return s;
    for (size_t j = 0; j < idx.size(); ++j) out[idx[j]] += values[j];
    return absl::OkStatus();
  }

  absl::Status DecodeSparse(absl::string_view in, size_t n, std::vector<uint32_t>* indices,
                            std::vector<float>* values) const override {
    return Parse(in, n, indices, values);
  }

 private:
  CodecId codec() const {
    return selector_ == Selector::kTopK         ? CodecId::kTopK
           : selector_ == Selector::kTopKApprox ? CodecId::kTopKApprox
                                                : CodecId::kRandomK;
  }

  // Validates the whole payload; fills the indices (valid, ascending) and finite values.
  absl::Status Parse(absl::string_view in, size_t n, std::vector<uint32_t>* idx,
                     std::vector<float>* values) const {
    const std::string& me = name_;
    absl::StatusOr<PayloadHeader> h = CheckHeader(in, me, codec(), type_, n);
    if (!h.ok()) return h.status();
    if (in.size() < kSparseHeaderBytes) {
      return SizeMismatch(me, in.size(), kSparseHeaderBytes);
    }
    const uint64_t k = GetU64(in.data() + kHeaderBytes);
    const uint64_t index_bytes = GetU64(in.data() + kHeaderBytes + 8);
    if (k > n) {
      return absl::InvalidArgumentError(
          absl::StrCat(me, ": payload sends k=", k, " of n=", n, " elements"));
    }
    const uint64_t room = in.size() - kSparseHeaderBytes;
    if (index_bytes > room) {
      return absl::InvalidArgumentError(absl::StrCat(
          me, ": index section of ", index_bytes, " bytes but only ", room, " follow the header"));
    }
    const uint64_t expected = kSparseHeaderBytes + index_bytes + k * ValueBytes(type_);
    if (in.size() != expected) return SizeMismatch(me, in.size(), expected);
    absl::Status s = ReadIndices(h->aux, n, k, in.substr(kSparseHeaderBytes, index_bytes), idx);
    if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(me, ": ", s.message()));
    values->resize(k);
    std::vector<uint16_t> scratch;
    const int64_t bad = LoadValues(type_, in.data() + kSparseHeaderBytes + index_bytes, k,
                                   values->data(), &scratch);
    if (bad >= 0) return BadValue(me, type_, bad);
    return absl::OkStatus();
  }

  Selector selector_;
  double density_;
  ValueType type_;
  std::string name_;
};

// ---------------------------------------------------------------------------------------
// qsgd

// QSGD in blocks: a vectorisable loop computes the codes, then groups of 8 codes (exactly
// `width` bytes) are packed.
constexpr size_t kQsgdBlock = 4096;

// lowbias32 (C. Wellons): a bijective 32-bit hash with low bias; cheap 32-bit arithmetic
// that vectorises.
inline uint32_t Hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// (Not under ThreadSanitizer: see GM_MULTIVERSION in float16.cc.)
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__)
#define GM_QSGD_MULTIVERSION __attribute__((target_clones("avx2", "default")))
#else
#define GM_QSGD_MULTIVERSION
#endif

// codes[j] = level | (negative << bits) for in[0, m), where p = |x| / norm * levels (in
// [0, levels]: norm >= |x|), level = floor(p) + (u < frac(p)), and u is a 24-bit uniform
// from Hash32(element index ^ key). E[level] = p up to 2^-24 of a level.
GM_QSGD_MULTIVERSION void QsgdLevels(const float* in, size_t m, float norm, float levels, int bits,
                                     uint32_t key, uint32_t first, uint16_t* codes) {
  for (size_t j = 0; j < m; ++j) {
    const float x = in[j];
    const float p = std::min(std::fabs(x) / norm * levels, levels);
    const int32_t whole = static_cast<int32_t>(p);
    const float frac = p - static_cast<float>(whole);
    const float u =
        static_cast<float>(Hash32((first + static_cast<uint32_t>(j)) ^ key) >> 8) * 0x1p-24f;
    const int32_t level = whole + (u < frac ? 1 : 0);
    uint32_t sign;
    std::memcpy(&sign, &x, 4);
    sign = (sign >> 31) & static_cast<uint32_t>(level != 0);
    codes[j] = static_cast<uint16_t>(static_cast<uint32_t>(level) | (sign << bits));
  }
}

// Packs m codes (m a multiple of 8) of W bits, code i at bit i * W (little-endian): each
// group of 8 codes is exactly W bytes. W is a template parameter so that the shifts are
// constants.
template <int W>
void PackCodesW(const uint16_t* codes, size_t m, uint8_t* out) {
  using Word = typename std::conditional<(W <= 8), uint64_t, unsigned __int128>::type;
  for (size_t j = 0; j < m; j += 8, out += W) {
    Word acc = 0;
    for (int q = 0; q < 8; ++q) acc |= static_cast<Word>(codes[j + q]) << (q * W);
    std::memcpy(out, &acc, W);
  }
}

// The inverse: n codes (n a multiple of 8) from n * W / 8 bytes, mapped through `table`
// into out (or added to it).
template <int W>
void UnpackCodesW(const uint8_t* in, size_t n, const float* table, float* out, bool add) {
  using Word = typename std::conditional<(W <= 8), uint64_t, unsigned __int128>::type;
  constexpr uint32_t kMask = (1u << W) - 1;
  for (size_t j = 0; j < n; j += 8, in += W) {
    Word acc = 0;
    std::memcpy(&acc, in, W);
    for (int q = 0; q < 8; ++q) {
      const float v = table[static_cast<uint32_t>(acc >> (q * W)) & kMask];
      out[j + q] = add ? out[j + q] + v : v;
    }
  }
}

void PackCodes(const uint16_t* codes, size_t m, int width, uint8_t* out) {
  switch (width) {
    case 2:
      return PackCodesW<2>(codes, m, out);
    case 3:
      return PackCodesW<3>(codes, m, out);
    case 4:
      return PackCodesW<4>(codes, m, out);
    case 5:
      return PackCodesW<5>(codes, m, out);
    case 6:
      return PackCodesW<6>(codes, m, out);
    case 7:
      return PackCodesW<7>(codes, m, out);
    case 8:
      return PackCodesW<8>(codes, m, out);
    default:
      return PackCodesW<9>(codes, m, out);
  }
}

void UnpackCodes(const uint8_t* in, size_t n, int width, const float* table, float* out, bool add) {
  switch (width) {
    case 2:
      return UnpackCodesW<2>(in, n, table, out, add);
    case 3:
      return UnpackCodesW<3>(in, n, table, out, add);
    case 4:
      return UnpackCodesW<4>(in, n, table, out, add);
    case 5:
      return UnpackCodesW<5>(in, n, table, out, add);
    case 6:
      return UnpackCodesW<6>(in, n, table, out, add);
    case 7:
      return UnpackCodesW<7>(in, n, table, out, add);
    case 8:
      return UnpackCodesW<8>(in, n, table, out, add);
    default:
      return UnpackCodesW<9>(in, n, table, out, add);
  }
}

class QsgdCodec : public Compressor {
 public:
  explicit QsgdCodec(int bits) : bits_(bits) {}

  std::string name() const override { return absl::StrCat("qsgd:", bits_); }
  bool biased() const override { return false; }
  bool stochastic() const override { return true; }

  static size_t CodeBytes(size_t n, int bits) {
    return static_cast<size_t>((static_cast<uint64_t>(n) * (bits + 1) + 7) / 8);
  }

  size_t MaxEncodedSize(size_t n) const override { return kQsgdHeaderBytes + CodeBytes(n, bits_); }

  absl::Status Encode(absl::Span<const float> in, uint64_t seed, std::string* out) const override {
    const size_t n = in.size();
    // Sum of squares in double (cannot overflow for finite floats), four accumulators.
    double acc[4] = {0, 0, 0, 0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      for (int q = 0; q < 4; ++q) acc[q] += static_cast<double>(in[i + q]) * in[i + q];
    }
    for (; i < n; ++i) acc[0] += static_cast<double>(in[i]) * in[i];
    const double sumsq = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    if (!std::isfinite(sumsq)) return NonFiniteInput(name(), in);
    const double norm_d = std::sqrt(sumsq);
    // Rounded up, so that |x| / norm <= 1 for every element.
    float norm = static_cast<float>(norm_d);
    if (static_cast<double>(norm) < norm_d) norm = std::nextafter(norm, INFINITY);
    if (!std::isfinite(norm)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": the input's L2 norm ", norm_d, " does not fit in float32"));
    }

    const size_t size = MaxEncodedSize(n);
    if (out->size() != size) out->resize(size);
    char* p = &(*out)[0];
    PayloadHeader h;
    h.codec = CodecId::kQsgd;
    h.value_type = ValueType::kQsgdCodes;
    h.aux = static_cast<uint8_t>(bits_);
    h.n = n;
    WritePayloadHeader(h, p);
    std::memcpy(p + kHeaderBytes, &norm, 4);
    PutU32(0, p + kHeaderBytes + 4);
    uint8_t* codes = reinterpret_cast<uint8_t*>(p + kQsgdHeaderBytes);
    if (norm == 0) {
      std::memset(codes, 0, CodeBytes(n, bits_));
      return absl::OkStatus();
    }

    const int width = bits_ + 1;
    const float levels = static_cast<float>((1 << bits_) - 1);
    const uint32_t key = static_cast<uint32_t>(Rng::Finalize(seed));
    uint16_t block[kQsgdBlock];
    for (size_t j = 0; j < n; j += kQsgdBlock) {
      const size_t m = std::min(kQsgdBlock, n - j);
      QsgdLevels(in.data() + j, m, norm, levels, bits_, key, static_cast<uint32_t>(j), block);
      const size_t padded = (m + 7) & ~size_t{7};
      std::fill(block + m, block + padded, uint16_t{0});
      const size_t bytes = (m * width + 7) / 8;
      if (bytes == padded * width / 8) {
        PackCodes(block, padded, width, codes);
      } else {  // the last block's final group is partial: pack it aside
        uint8_t tail[kQsgdBlock * 2];
        PackCodes(block, padded, width, tail);
        std::memcpy(codes, tail, bytes);
      }
      codes += bytes;
    }
    return absl::OkStatus();
  }

  absl::Status Decode(absl::string_view in, absl::Span<float> out) const override {
    float table[512];
    int bits = 0;
    absl::Status s = Parse(in, out.size(), table, &bits);
    if (!s.ok()) return s;
    Unpack(in, bits, table, out, /*add=*/false);
    return absl::OkStatus();
  }

  absl::Status DecodeAdd(absl::string_view in, absl::Span<float> out) const override {
    float table[512];
    int bits = 0;
    absl::Status s = Parse(in, out.size(), table, &bits);
    if (!s.ok()) return s;
    Unpack(in, bits, table, out, /*add=*/true);
    return absl::OkStatus();
  }

 private:
  // Validates everything (every code of a valid-length payload is meaningful) and fills the
  // code -> value table (2^(bits + 1) entries).
  absl::Status Parse(absl::string_view in, size_t n, float* table, int* bits_out) const {
    const std::string me = name();
    absl::StatusOr<PayloadHeader> h = CheckHeader(in, me, CodecId::kQsgd, ValueType::kQsgdCodes, n);
    if (!h.ok()) return h.status();
    const int bits = h->aux;
    if (bits < 1 || bits > 8) {
      return absl::InvalidArgumentError(
          absl::StrCat(me, ": payload has ", bits, " bits per level (valid: 1-8)"));
    }
    const uint64_t expected = kQsgdHeaderBytes + CodeBytes(n, bits);
    if (in.size() != expected) return SizeMismatch(me, in.size(), expected);
    float norm;
    std::memcpy(&norm, in.data() + kHeaderBytes, 4);
    if (!std::isfinite(norm) || norm < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(me, ": norm ", norm, " is not a finite non-negative number"));
    }
    if (GetU32(in.data() + kHeaderBytes + 4) != 0) {
      return absl::InvalidArgumentError(absl::StrCat(me, ": reserved bytes 20-23 are not 0"));
    }
    const uint64_t used_bits = static_cast<uint64_t>(n) * (bits + 1);
    if (used_bits % 8 != 0) {
      const uint8_t last = static_cast<uint8_t>(in.back());
      if ((last >> (used_bits % 8)) != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(me, ": padding bits after the last code are not 0"));
      }
    }
    const int levels = (1 << bits) - 1;
    for (int level = 0; level <= levels; ++level) {
      // <= norm <= FLT_MAX, so finite.
      const float v = static_cast<float>(static_cast<double>(norm) * level / levels);
      table[level] = v;
      table[level | (1 << bits)] = level == 0 ? 0.0f : -v;
    }
    *bits_out = bits;
    return absl::OkStatus();
  }

  static void Unpack(absl::string_view in, int bits, const float* table, absl::Span<float> out,
                     bool add) {
    const uint8_t* codes = reinterpret_cast<const uint8_t*>(in.data() + kQsgdHeaderBytes);
    const int width = bits + 1;
    const size_t n = out.size();
    const size_t whole = n & ~size_t{7};
    UnpackCodes(codes, whole, width, table, out.data(), add);
    if (whole < n) {  // the final partial group: only the remaining bytes exist
      const size_t m = n - whole;
      uint8_t tail[16] = {};
      std::memcpy(tail, codes + whole / 8 * width, (m * width + 7) / 8);
      float group[8] = {};
      for (size_t q = 0; q < m; ++q) group[q] = out[whole + q];
      UnpackCodes(tail, 8, width, table, group, add);
      for (size_t q = 0; q < m; ++q) out[whole + q] = group[q];
    }
  }

  int bits_;
};

absl::StatusOr<double> ParseRatio(absl::string_view name, absl::string_view param) {
  double r = 0;
  if (param.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " needs a ratio in (0, 1], e.g. \"", name, ":0.01\""));
  }
  if (param.find_first_of(" \t\n") != absl::string_view::npos || !absl::SimpleAtod(param, &r) ||
      !(r > 0 && r <= 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ratio \"", param, "\" is not a number in (0, 1]"));
  }
  return r;
}

CompressorRegistry::Factory DenseFactory(ValueType type) {
  return [type](absl::string_view param) -> absl::StatusOr<std::unique_ptr<Compressor>> {
    if (!param.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(DenseCodec::ValueCodecName(type),
                                                     " takes no parameter (got \"", param, "\")"));
    }
    return std::unique_ptr<Compressor>(new DenseCodec(type));
  };
}

CompressorRegistry::Factory SparseFactory(Selector selector) {
  return [selector](absl::string_view param) -> absl::StatusOr<std::unique_ptr<Compressor>> {
    absl::StatusOr<double> r = ParseRatio(SparseCodec::SelectorName(selector), param);
    if (!r.ok()) return r.status();
    return std::unique_ptr<Compressor>(new SparseCodec(selector, *r, ValueType::kFloat32));
  };
}

}  // namespace

CompressorRegistry CompressorRegistry::WithBuiltins() {
  CompressorRegistry r;
  r.Register("identity", DenseFactory(ValueType::kFloat32));
  r.Register("fp16", DenseFactory(ValueType::kFloat16));
  r.Register("bf16", DenseFactory(ValueType::kBFloat16));
  r.Register("topk", SparseFactory(Selector::kTopK));
  r.Register("topk_approx", SparseFactory(Selector::kTopKApprox));
  r.Register("randomk", SparseFactory(Selector::kRandomK));
  r.Register("qsgd", [](absl::string_view param) -> absl::StatusOr<std::unique_ptr<Compressor>> {
    int bits = 0;
    if (param.find_first_of(" \t\n") != absl::string_view::npos ||
        !absl::SimpleAtoi(param, &bits) || bits < 1 || bits > 8) {
      return absl::InvalidArgumentError(
          absl::StrCat("qsgd needs a bit count in [1, 8], e.g. \"qsgd:4\" (got \"", param, "\")"));
    }
    return std::unique_ptr<Compressor>(new QsgdCodec(bits));
  });
  return r;
}

void CompressorRegistry::Register(const std::string& name, Factory factory) {
  factories_.Set(name, std::move(factory));
}

std::vector<std::string> CompressorRegistry::names() const { return factories_.Names(); }

absl::StatusOr<std::unique_ptr<Compressor>> CompressorRegistry::Create(
    absl::string_view spec) const {
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, '+');
  if (parts.size() > 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codec spec \"", spec, "\" composes more than two codecs (form: sparsifier+values)"));
  }
  std::vector<std::unique_ptr<Compressor>> codecs;
  for (absl::string_view part : parts) {
    const size_t colon = part.find(':');
    const absl::string_view name = part.substr(0, colon);
    const absl::string_view param =
        colon == absl::string_view::npos ? absl::string_view() : part.substr(colon + 1);
    auto factory = factories_.Find(name);
    if (!factory.ok()) return factory.status();
    if (colon != absl::string_view::npos && param.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("codec spec \"", part, "\" has an empty parameter after ':'"));
    }
    absl::StatusOr<std::unique_ptr<Compressor>> c = (**factory)(param);
    if (!c.ok()) return c.status();
    codecs.push_back(std::move(c).value());
  }
  if (codecs.size() == 1) return std::move(codecs[0]);
  return codecs[0]->ComposeWith(*codecs[1]);
}

absl::Status ValidatePushCodec(const std::string& push) {
  if (push.empty() || push == "auto") return absl::OkStatus();
  absl::StatusOr<std::unique_ptr<Compressor>> c = CompressorRegistry::WithBuiltins().Create(push);
  if (!c.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: compression.push: \"", push, "\" ", c.status().message()));
  }
  return absl::OkStatus();
}

}  // namespace gradmesh
