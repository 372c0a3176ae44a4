// Tests of the transport-independent ring all-reduce and all-gather (ring.h) over the
// in-process transport, one thread per rank.
#include "worker/allreduce/ring.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "worker/allreduce/local_ring.h"

namespace gradmesh {
namespace {

// Runs fn(rank, transport) on one thread per rank; returns each rank's status.
std::vector<absl::Status> RunRanks(std::vector<std::unique_ptr<RingTransport>>& ring,
                                   const std::function<absl::Status(int, RingTransport*)>& fn) {
  std::vector<absl::Status> st(ring.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < ring.size(); ++r) {
    threads.emplace_back([&, r] { st[r] = fn(static_cast<int>(r), ring[r].get()); });
  }
  for (auto& t : threads) t.join();
  return st;
}

// Integer-valued inputs (exact in float32 for these magnitudes), different on every rank.
float Input(int rank, int64_t i) { return static_cast<float>((i % 101) * (rank + 1) - 7 * rank); }

TEST(RingChunkRangeTest, CoversTheBufferInOrder) {
  for (int n = 1; n <= 5; ++n) {
    for (int64_t len : {0, 1, 2, 3, 4, 5, 7, 10, 11}) {
      int64_t next = 0;
      for (int c = 0; c < n; ++c) {
        const ChunkRange r = RingChunkRange(len, n, c);
        EXPECT_EQ(r.begin, next) << "n=" << n << " len=" << len << " c=" << c;
        EXPECT_GE(r.end, r.begin);
        EXPECT_LE(r.end - r.begin, len / n + 1);
        next = r.end;
      }
      EXPECT_EQ(next, len);
    }
  }
}

class RingAllreduceTest : public ::testing::TestWithParam<int> {};

TEST_P(RingAllreduceTest, ExactSumsForAwkwardLengthsAndSegments) {
  const int n = GetParam();
  for (int64_t len : {0, 1, 2, 3, 5, 7, 13, 64, 1001, 100003}) {
    for (int64_t segment_bytes : {4, 12, 40, 4096, 512 << 10}) {
      if (len > 2000 && segment_bytes < 4096) continue;  // Millions of messages: slow.
      SCOPED_TRACE(absl::StrCat("n=", n, " len=", len, " segment_bytes=", segment_bytes));
      auto ring = NewLocalRing(n);
      std::vector<std::vector<float>> bufs(n, std::vector<float>(len));
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < len; ++i) bufs[r][i] = Input(r, i);
      }
      RingOptions options;
      options.segment_bytes = segment_bytes;
      options.timeout = absl::Seconds(10);
      std::vector<int64_t> sent(n, 0);
      auto st = RunRanks(ring, [&](int r, RingTransport* t) {
        return RingAllreduce(t, absl::MakeSpan(bufs[r]), options, &sent[r]);
      });
      for (int r = 0; r < n; ++r) ASSERT_OK(st[r]) << "rank " << r;
      int64_t total_sent = 0;
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < len; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q) want += Input(q, i);
          ASSERT_EQ(bufs[r][i], want) << "rank " << r << " element " << i;
        }
        total_sent += sent[r];
      }
      // Every element leaves each of n-1 ranks twice (reduce-scatter and all-gather) in all:
      // the sum over ranks is 2 (n-1) L floats.
      EXPECT_EQ(total_sent, n == 1 ? 0 : int64_t{2} * (n - 1) * len * 4);
    }
  }
}

TEST_P(RingAllreduceTest, RanksEndBitIdenticalWithNonIntegerValues) {
  const int n = GetParam();
  const int64_t len = 10007;
  auto ring = NewLocalRing(n);
  std::mt19937 rng(n);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<std::vector<float>> bufs(n, std::vector<float>(len));
  std::vector<double> exact(len, 0);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < len; ++i) {
      bufs[r][i] = dist(rng) * 1000;
      exact[i] += bufs[r][i];
    }
  }
  RingOptions options;
  options.segment_bytes = 1000;
  auto st = RunRanks(ring, [&](int r, RingTransport* t) {
    return RingAllreduce(t, absl::MakeSpan(bufs[r]), options);
  });
  for (int r = 0; r < n; ++r) ASSERT_OK(st[r]);
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(std::memcmp(bufs[r].data(), bufs[0].data(), len * sizeof(float)), 0)
        << "rank " << r << " differs from rank 0";
  }
  for (int64_t i = 0; i < len; ++i) ASSERT_NEAR(bufs[0][i], exact[i], 1e-3) << i;
}

// on_final reports every element exactly once, and only once its final sum is in place; with
// either wire format (small integers are exact in fp16 too, partial sums included).
TEST_P(RingAllreduceTest, FinalRangesCoverEveryElementOnceAfterItsSumIsFinal) {
  const int n = GetParam();
  for (RingCodec codec : {RingCodec::kNone, RingCodec::kFp16}) {
    for (int64_t len : {0, 1, 7, 1001, 30011}) {
      SCOPED_TRACE(absl::StrCat("n=", n, " len=", len, " fp16=", codec == RingCodec::kFp16));
      auto ring = NewLocalRing(n);
      std::vector<std::vector<float>> bufs(n, std::vector<float>(len));
      std::vector<float> want(len, 0);
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < len; ++i) {
          bufs[r][i] = Input(r, i);
          want[i] += Input(r, i);
        }
      }
      RingOptions options;
      options.segment_bytes = 4000;
      options.codec = codec;
      std::vector<std::vector<int>> seen(n, std::vector<int>(len, 0));
      std::vector<int64_t> early_mismatch(n, -1);
      std::vector<int64_t> sent(n, 0);
      auto st = RunRanks(ring, [&](int r, RingTransport* t) {
        FinalRangeFn on_final = [&, r](int64_t b, int64_t e) {
          EXPECT_LT(b, e);
          for (int64_t i = b; i < e; ++i) {
            ++seen[r][i];
            if (bufs[r][i] != want[i] && early_mismatch[r] < 0) early_mismatch[r] = i;
          }
        };
        return RingAllreduce(t, absl::MakeSpan(bufs[r]), options, &sent[r], &on_final);
      });
      for (int r = 0; r < n; ++r) {
        ASSERT_OK(st[r]) << "rank " << r;
        EXPECT_EQ(early_mismatch[r], -1) << "rank " << r << " reported a range before its sum";
        for (int64_t i = 0; i < len; ++i) {
          ASSERT_EQ(seen[r][i], 1) << "rank " << r << " element " << i;
          ASSERT_EQ(bufs[r][i], want[i]) << "rank " << r << " element " << i;
        }
        // fp16 sends 2 bytes per element where float32 sends 4.
        int64_t total = 0;
        for (int q = 0; q < n; ++q) total += sent[q];
        EXPECT_EQ(total,
                  n == 1 ? 0 : int64_t{2} * (n - 1) * len * (codec == RingCodec::kFp16 ? 2 : 4));
      }
    }
  }
}

// fp16 on the wire: every rank ends with the same bits, within fp16 rounding of the exact sum.
TEST_P(RingAllreduceTest, Fp16RanksEndBitIdenticalWithinHalfPrecision) {
  const int n = GetParam();
  const int64_t len = 10007;
  auto ring = NewLocalRing(n);
  std::mt19937 rng(n);
  std::uniform_real_distribution<float> dist(-1, 1);
  std::vector<std::vector<float>> bufs(n, std::vector<float>(len));
  std::vector<double> exact(len, 0), magnitude(len, 0);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < len; ++i) {
      bufs[r][i] = dist(rng) * 100;
      exact[i] += bufs[r][i];
      magnitude[i] += std::fabs(bufs[r][i]);
    }
  }
  RingOptions options;
  options.segment_bytes = 1000;
  options.codec = RingCodec::kFp16;
  auto st = RunRanks(ring, [&](int r, RingTransport* t) {
    return RingAllreduce(t, absl::MakeSpan(bufs[r]), options);
  });
  for (int r = 0; r < n; ++r) ASSERT_OK(st[r]);
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(std::memcmp(bufs[r].data(), bufs[0].data(), len * sizeof(float)), 0)
        << "rank " << r << " differs from rank 0";
  }
  // Each input and each of the n partial sums is rounded once to fp16 (relative 2^-11).
  int64_t changed = 0;
  for (int64_t i = 0; i < len; ++i) {
    if (n == 1) {
      ASSERT_EQ(bufs[0][i], static_cast<float>(exact[i])) << "one rank: nothing is encoded";
      continue;
    }
    ASSERT_NEAR(bufs[0][i], exact[i], (n + 1) * magnitude[i] * std::ldexp(1.0, -11)) << i;
    if (bufs[0][i] != static_cast<float>(exact[i])) ++changed;
  }
  if (n > 1) EXPECT_GT(changed, len / 2) << "the values did not go through fp16";
}

TEST_P(RingAllreduceTest, AllgatherReturnsEveryRanksBytesInRankOrder) {
  const int n = GetParam();
  auto ring = NewLocalRing(n);
  std::vector<std::vector<std::string>> got(n);
  auto st = RunRanks(ring, [&](int r, RingTransport* t) -> absl::Status {
    // Different lengths, including empty.
    ASSIGN_OR_RETURN(got[r], RingAllgather(t, std::string(r * 3, 'a' + r), RingOptions()));
    return absl::OkStatus();
  });
  for (int r = 0; r < n; ++r) {
    ASSERT_OK(st[r]);
    ASSERT_EQ(got[r].size(), static_cast<size_t>(n));
    for (int q = 0; q < n; ++q) EXPECT_EQ(got[r][q], std::string(q * 3, 'a' + q));
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, RingAllreduceTest, ::testing::Values(1, 2, 3, 4, 5));

// Hands every received message over in pieces of 1..7 bytes, cutting floats apart, as a
// network transport may.
class FragmentingTransport final : public RingTransport {
 public:
  explicit FragmentingTransport(std::unique_ptr<RingTransport> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  absl::Status Send(absl::Span<const char> data) override { return inner_->Send(data); }
  absl::StatusOr<RingMessage> Recv(absl::Time deadline) override {
    ASSIGN_OR_RETURN(RingMessage msg, inner_->Recv(deadline));
    RingMessage out;
    out.owner = msg.owner;
    for (absl::Span<const char> p : msg.pieces) {
      size_t at = 0;
      while (at < p.size()) {
        const size_t take = std::min(p.size() - at, 1 + (next_++ % 7));
        out.pieces.push_back(p.subspan(at, take));
        at += take;
      }
    }
    return out;
  }
  std::string PeerName(int rank) const override { return inner_->PeerName(rank); }

 private:
  std::unique_ptr<RingTransport> inner_;
  size_t next_ = 0;
};

TEST(RingAllreduceFragmentsTest, PiecesSplitInsideFloatsAddUpExactly) {
  const int n = 3;
  auto inner = NewLocalRing(n);
  std::vector<std::unique_ptr<RingTransport>> ring;
  for (auto& t : inner) ring.push_back(std::make_unique<FragmentingTransport>(std::move(t)));
  const int64_t len = 9001;  // Several staging blocks per message.
  std::vector<std::vector<float>> bufs(n, std::vector<float>(len));
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < len; ++i) bufs[r][i] = Input(r, i);
  }
  RingOptions options;
  options.segment_bytes = 16 << 10;
  auto st = RunRanks(ring, [&](int r, RingTransport* t) {
    return RingAllreduce(t, absl::MakeSpan(bufs[r]), options);
  });
  for (int r = 0; r < n; ++r) ASSERT_OK(st[r]);
  for (int r = 0; r < n; ++r) {
    for (int64_t i = 0; i < len; ++i) {
      ASSERT_EQ(bufs[r][i], Input(0, i) + Input(1, i) + Input(2, i)) << r << " " << i;
    }
  }
}

TEST(RingAllreduceErrorsTest, LengthMismatchIsInternalNamingThePreviousRank) {
  auto ring = NewLocalRing(2);
  std::vector<float> a(10, 1), b(12, 1);
  RingOptions options;
  options.timeout = absl::Milliseconds(300);
  auto st = RunRanks(ring, [&](int r, RingTransport* t) {
    return RingAllreduce(t, absl::MakeSpan(r == 0 ? a : b), options);
  });
  // Rank 0 expects 5 floats of chunk 1 and gets 6 from rank 1, and vice versa.
  EXPECT_STATUS_MSG(st[0], absl::StatusCode::kInternal, "rank 1 sent 24 bytes where 20");
  EXPECT_STATUS_MSG(st[1], absl::StatusCode::kInternal, "rank 0 sent 20 bytes where 24");
}

TEST(RingAllreduceErrorsTest, ClosedPeerIsUnavailableAndSilentPeerTimesOut) {
  auto ring = NewLocalRing(3);
  ring[1].reset();  // Rank 1 is gone: rank 2 hears its link close, rank 0 hears nothing.
  std::vector<float> buf0(30, 1), buf2(30, 1);
  RingOptions options;
  options.timeout = absl::Milliseconds(200);
  absl::Status st0, st2;
  const absl::Time start = absl::Now();
  std::thread t0([&] { st0 = RingAllreduce(ring[0].get(), absl::MakeSpan(buf0), options); });
  std::thread t2([&] { st2 = RingAllreduce(ring[2].get(), absl::MakeSpan(buf2), options); });
  t0.join();
  t2.join();
  EXPECT_STATUS_MSG(st2, absl::StatusCode::kUnavailable, "rank 1 closed its ring link");
  // Rank 0 waits for rank 2, which gives up on rank 1 without sending.
  EXPECT_STATUS_MSG(st0, absl::StatusCode::kDeadlineExceeded, "nothing from rank 2 in time");
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(RingAllreduceErrorsTest, Fp16NonFiniteInputIsInvalidArgument) {
  auto ring = NewLocalRing(2);
  std::vector<float> a(10, 1), b(10, 1);
  a[3] = std::nanf("");  // In rank 0's own chunk (elements 0-4), encoded first.
  RingOptions options;
  options.codec = RingCodec::kFp16;
  options.timeout = absl::Milliseconds(300);
  auto st = RunRanks(ring, [&](int r, RingTransport* t) {
    return RingAllreduce(t, absl::MakeSpan(r == 0 ? a : b), options);
  });
  EXPECT_STATUS_MSG(st[0], absl::StatusCode::kInvalidArgument, "element 3 is nan");
  EXPECT_FALSE(st[1].ok());
}

}  // namespace
}  // namespace gradmesh
