// Random and mutated payloads into every decoder: Decode must return OK exactly when an
// independent reference validator (written from the format description in payload.h)
// accepts the payload, InvalidArgument otherwise, never write outside its output (checked
// with guard regions), and DecodeAdd must leave its output unchanged on error.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/status_testing.h"
#include "compression/compressor.h"
#include "compression/payload.h"
#include "compression/rng.h"
#include "gtest/gtest.h"

namespace gradmesh {
namespace {

uint64_t Le64(const std::string& p, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[at + i]);
  return v;
}

uint32_t Le32(const std::string& p, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[at + i]);
  return v;
}

bool FiniteValue(uint8_t type, const std::string& p, size_t at) {
  if (type == 0) return ((Le32(p, at) >> 23) & 0xff) != 0xff;
  const uint32_t h = static_cast<uint8_t>(p[at]) | (static_cast<uint8_t>(p[at + 1]) << 8);
  return type == 1 ? (h & 0x7c00) != 0x7c00 : (h & 0x7f80) != 0x7f80;
}

// Reference validator: true iff `p` is a well-formed payload of codec `codec` with value
// type `type` for n elements.
bool RefValid(uint8_t codec, uint8_t type, const std::string& p, uint64_t n) {
  if (p.size() < 16) return false;
  if (p[0] != 1 || static_cast<uint8_t>(p[1]) != codec || static_cast<uint8_t>(p[2]) != type) {
    return false;
  }
  const uint8_t aux = static_cast<uint8_t>(p[3]);
  if (Le32(p, 4) != 0 || Le64(p, 8) != n) return false;
  const uint64_t vb = type == 0 ? 4 : 2;
  if (codec <= 3) {  // dense
    if (aux != 0 || p.size() != 16 + n * vb) return false;
    for (uint64_t i = 0; i < n; ++i) {
      if (!FiniteValue(type, p, 16 + i * vb)) return false;
    }
    return true;
  }
  if (codec == 7) {  // qsgd
    if (aux < 1 || aux > 8) return false;
    const uint64_t bits = n * (aux + 1);
    if (p.size() != 24 + (bits + 7) / 8) return false;
    const uint32_t norm_bits = Le32(p, 16);
    float norm;
    std::memcpy(&norm, &norm_bits, 4);
    if (!std::isfinite(norm) || norm < 0 || Le32(p, 20) != 0) return false;
    if (bits % 8 != 0 && (static_cast<uint8_t>(p.back()) >> (bits % 8)) != 0) return false;
    return true;
  }
  // sparse
  if (p.size() < 32) return false;
  const uint64_t k = Le64(p, 16);
  const uint64_t ib = Le64(p, 24);
  if (k > n || ib > p.size() - 32 || p.size() - 32 - ib != k * vb) return false;
  const size_t start = 32;
  if (aux == 0) {
    if (k != n || ib != 0) return false;
  } else if (aux == 1) {
    size_t at = start;
    const size_t end = start + ib;
    uint64_t next = 0;
    for (uint64_t j = 0; j < k; ++j) {
      uint64_t v = 0;
      int len = 0;
      while (true) {
        if (at == end || len == 5) return false;
        const uint8_t byte = static_cast<uint8_t>(p[at++]);
        v |= static_cast<uint64_t>(byte & 0x7f) << (7 * len);
        ++len;
        if (!(byte & 0x80)) {
          if (len > 1 && byte == 0) return false;
          break;
        }
      }
      if (next + v >= n) return false;
      next = next + v + 1;
    }
    if (at != end) return false;
  } else if (aux == 2) {
    if (ib != (n + 7) / 8) return false;
    uint64_t count = 0;
    for (uint64_t i = 0; i < 8 * ib; ++i) {
      if ((static_cast<uint8_t>(p[start + i / 8]) >> (i % 8)) & 1) {
        if (i >= n) return false;
        ++count;
      }
    }
    if (count != k) return false;
  } else {
    return false;
  }
  for (uint64_t j = 0; j < k; ++j) {
    if (!FiniteValue(type, p, start + ib + j * vb)) return false;
  }
  return true;
}

constexpr size_t kGuard = 64;
constexpr uint32_t kSentinel = 0x7fc0deadu;

class Fuzzer {
 public:
  Fuzzer(const Compressor& codec, uint8_t codec_id, uint8_t type, size_t n)
      : codec_(codec), codec_id_(codec_id), type_(type), n_(n) {}

  void Check(const std::string& p) {
    ++checked_;
    std::vector<uint32_t> buf(n_ + 2 * kGuard, kSentinel);
    float* out = reinterpret_cast<float*>(buf.data() + kGuard);
    const absl::Status s = codec_.Decode(p, absl::MakeSpan(out, n_));
    const bool want = RefValid(codec_id_, type_, p, n_);
    ASSERT_TRUE(s.ok() || s.code() == absl::StatusCode::kInvalidArgument) << s;
    ASSERT_EQ(s.ok(), want) << codec_.name() << " n=" << n_ << " status " << s << " size "
                            << p.size();
    for (size_t i = 0; i < kGuard; ++i) {
      ASSERT_EQ(buf[i], kSentinel) << "wrote before the output";
      ASSERT_EQ(buf[kGuard + n_ + i], kSentinel) << "wrote after the output";
    }
    valid_ += s.ok();
    std::vector<uint32_t> idx;
    std::vector<float> values;
    const absl::Status sparse = codec_.DecodeSparse(p, n_, &idx, &values);
    ASSERT_EQ(sparse.ok(), s.ok()) << sparse;
    if (s.ok()) {
      std::vector<float> rebuilt(n_, 0.0f);
      for (size_t j = 0; j < idx.size(); ++j) {
        ASSERT_LT(idx[j], n_);
        rebuilt[idx[j]] = values[j];
      }
      for (size_t i = 0; i < n_; ++i) ASSERT_EQ(rebuilt[i], out[i]) << i;
    }
    std::vector<float> base(n_);
    for (size_t i = 0; i < n_; ++i) base[i] = static_cast<float>(i) * 0.25f - 3.0f;
    std::vector<uint32_t> acc(n_ + 2 * kGuard, kSentinel);
    float* accp = reinterpret_cast<float*>(acc.data() + kGuard);
    if (n_ > 0) std::memcpy(accp, base.data(), 4 * n_);
    const absl::Status a = codec_.DecodeAdd(p, absl::MakeSpan(accp, n_));
    ASSERT_EQ(a.ok(), s.ok()) << a;
    for (size_t i = 0; i < kGuard; ++i) {
      ASSERT_EQ(acc[i], kSentinel);
      ASSERT_EQ(acc[kGuard + n_ + i], kSentinel);
    }
    for (size_t i = 0; i < n_; ++i) {
      if (s.ok()) {
        ASSERT_TRUE(std::isfinite(out[i])) << i;
        ASSERT_EQ(accp[i], base[i] + out[i]) << i;
      } else {
        ASSERT_EQ(accp[i], base[i]) << "DecodeAdd changed the output on error";
      }
    }
  }

  int checked() const { return checked_; }
  int valid() const { return valid_; }

 private:
  const Compressor& codec_;
  uint8_t codec_id_;
  uint8_t type_;
  size_t n_;
  int checked_ = 0;
  int valid_ = 0;
};

std::string RandomBytes(Rng& rng, size_t len) {
  std::string s(len, '\0');
  for (char& c : s) c = static_cast<char>(rng.Next());
  return s;
}

TEST(CompressorFuzzTest, DecodersAcceptExactlyTheValidPayloads) {
  const char* const specs[] = {
      "identity",    "fp16",   "bf16",   "topk:0.1", "topk:0.5+fp16", "topk_approx:0.05+bf16",
      "randomk:0.3", "qsgd:1", "qsgd:4", "qsgd:8"};
  const CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  Rng rng(2024);
  int total = 0, total_valid = 0;
  for (const char* spec : specs) {
    const std::unique_ptr<Compressor> codec = registry.Create(spec).value();
    for (size_t n : {0u, 1u, 7u, 64u, 301u}) {
      // The codec id and value type this decoder takes, from one of its own payloads.
      std::string own;
      ASSERT_OK(codec->Encode(std::vector<float>(n, 1.0f), 1, &own));
      const uint8_t codec_id = static_cast<uint8_t>(own[1]);
      const uint8_t type = static_cast<uint8_t>(own[2]);
      Fuzzer f(*codec, codec_id, type, n);

      // 1. Random byte strings.
      for (int i = 0; i < 300; ++i) f.Check(RandomBytes(rng, rng.Uniform(100)));
      // 2. A valid header with random fields and body.
      for (int i = 0; i < 1500; ++i) {
        std::string p = own.substr(0, 16);
        p[3] = static_cast<char>(rng.Uniform(4) == 0 ? rng.Next() : rng.Uniform(3));
        if (codec_id == 7) p[3] = static_cast<char>(rng.Uniform(10));
        if (rng.Uniform(8) == 0) p[8] = static_cast<char>(p[8] + 1);  // wrong n
        if (codec_id >= 4 && codec_id <= 6) {
          std::string k(8, '\0'), ib(8, '\0');
          PutU64(rng.Uniform(n + 3), &k[0]);
          const uint64_t index_bytes = rng.Uniform(2 * n / 8 + 12);
          PutU64(index_bytes, &ib[0]);
          p += k + ib;
          std::string body = RandomBytes(rng, index_bytes);
          // Make the index section plausible now and then: small gaps, sparse bitmaps.
          if (rng.Uniform(2)) {
            for (char& c : body)
              c = static_cast<char>(rng.Uniform(4) == 0 ? rng.Uniform(256) : rng.Uniform(3));
          }
          p += body;
          const uint64_t value_bytes = GetU64(k.data()) * (type == 0 ? 4 : 2);
          p += RandomBytes(rng, rng.Uniform(3) == 0 ? rng.Uniform(value_bytes + 4) : value_bytes);
        } else {
          const size_t body =
              codec_id == 7 ? 8 + (n * (p[3] + 1) + 7) / 8 : n * (type == 0 ? 4 : 2);
          p += RandomBytes(rng, rng.Uniform(3) == 0 ? rng.Uniform(body + 4) : body);
          if (codec_id == 7 && p.size() >= 24 && rng.Uniform(2)) {
            const float norm = static_cast<float>(rng.Uniform(1000)) / 7;
            std::memcpy(&p[16], &norm, 4);
            PutU32(0, &p[20]);
          }
        }
        f.Check(p);
      }
      // 3. Sparse payloads built field by field: k varints, now and then non-canonical,
      //    overlong, out of range or short; exact section sizes; finite or special values.
      if (codec_id >= 4 && codec_id <= 6) {
        for (int i = 0; i < 1500; ++i) {
          const uint64_t k = rng.Uniform(n + 2);
          std::string idx;
          for (uint64_t j = 0; j < k; ++j) {
            const uint64_t gap = rng.Uniform(8) == 0 ? rng.Uniform(n + 3) : rng.Uniform(3);
            uint64_t v = gap;
            const int pad = rng.Uniform(40) == 0 ? 1 + static_cast<int>(rng.Uniform(5)) : 0;
            int len = 0;
            do {
              uint8_t byte = v & 0x7f;
              v >>= 7;
              if (v || pad > len) byte |= 0x80;
              idx.push_back(static_cast<char>(byte));
              ++len;
            } while (v || pad >= len);
          }
          if (rng.Uniform(20) == 0 && !idx.empty()) idx.pop_back();
          if (rng.Uniform(20) == 0) idx.push_back(static_cast<char>(rng.Uniform(3)));
          std::string p = own.substr(0, 16);
          p[3] = static_cast<char>(IndexEncoding::kDeltaVarint);
          std::string field(8, '\0');
          PutU64(k, &field[0]);
          p += field;
          PutU64(idx.size(), &field[0]);
          p += field;
          p += idx;
          for (uint64_t j = 0; j < k; ++j) {
            const bool special = rng.Uniform(100) == 0;
            if (type == 0) {
              const float v = special ? INFINITY : static_cast<float>(rng.Uniform(100));
              p.append(reinterpret_cast<const char*>(&v), 4);
            } else {
              const uint16_t v =
                  special ? 0x7f80 | 0x7c00 : static_cast<uint16_t>(rng.Uniform(0x3c00));
              p.append(reinterpret_cast<const char*>(&v), 2);
            }
          }
          f.Check(p);
        }
      }
      // 4. Mutations of valid payloads.
      for (int trial = 0; trial < 20; ++trial) {
        std::vector<float> x(n);
        for (float& v : x) v = (static_cast<float>(rng.Uniform(2001)) - 1000) / 37;
        std::string valid;
        ASSERT_OK(codec->Encode(x, rng.Next(), &valid));
        f.Check(valid);
        for (size_t cut = 0; cut < valid.size(); cut += 1 + valid.size() / 40) {
          f.Check(valid.substr(0, cut));
        }
        f.Check(valid + RandomBytes(rng, 1 + rng.Uniform(3)));
        for (int m = 0; m < 40; ++m) {
          std::string p = valid;
          const int flips = 1 + static_cast<int>(rng.Uniform(3));
          for (int b = 0; b < flips && !p.empty(); ++b) {
            const size_t at = rng.Uniform(p.size());
            if (rng.Uniform(2)) {
              p[at] = static_cast<char>(p[at] ^ (1 << rng.Uniform(8)));
            } else {
              p[at] = static_cast<char>(rng.Next());
            }
          }
          f.Check(p);
        }
        if (codec_id >= 4 && codec_id <= 6 && valid.size() >= 32) {
          for (int field : {16, 24}) {
            for (int delta : {-1, 1}) {
              std::string p = valid;
              PutU64(GetU64(&p[field]) + delta, &p[field]);
              f.Check(p);
            }
          }
        }
      }
      total += f.checked();
      total_valid += f.valid();
    }
  }
  // Thousands of payloads, a good share of them valid (so the OK path is exercised too).
  EXPECT_GT(total, 50000);
  EXPECT_GT(total_valid, 1000);
  std::printf("checked %d payloads, %d valid\n", total, total_valid);
}

}  // namespace
}  // namespace gradmesh
