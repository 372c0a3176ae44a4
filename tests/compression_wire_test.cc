// Compression on the wire, over real gRPC on 127.0.0.1: in-process shard servers (as in
// ps_service_test), raw stubs and the worker's GrpcParameterClient with push/pull codecs.
//
// What must hold, exactly (bit for bit, no tolerances):
//   * A compressed push changes each chunk on its shard by exactly decode(encode(chunk's
//     gradient)), computed here with the same codecs (CompressorRegistry) on each chunk's
//     slice (common/partitioner.h), with the client's seed formula for stochastic codecs; the
//     client's byte counters are the payload sizes and the float32 size.
//   * Error feedback through the client matches an ErrorFeedback mirrored here step by step
//     (also with DGC momentum and warm-up), so applied + residual == T * g exactly, every
//     coordinate is eventually sent, and for topk:0.5 the residual's L1 norm stays within
//     ||g||_1 (the top half of |acc| holds at least half of its mass).
//   * Malformed payloads are INVALID_ARGUMENT naming the chunk and the codec, and leave both
//     shards byte-identical (the whole request is validated before anything is applied).
//   * Pulls in fp16/bf16 return exactly the round-to-nearest-even (clamped) narrowing of the
//     shard's float32 values, checked against an independent reference here; other pull
//     codecs are INVALID_ARGUMENT. The client's pull counters are exact.
//   * The client refuses unusable codec options up front.
#include <grpcpp/client_context.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/status.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "compression/compressor.h"
#include "compression/error_feedback.h"
#include "compression/payload.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.grpc.pb.h"
#include "proto/gradmesh.pb.h"
#include "rpc/grpc_util.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "tests/testing/grpc_status_testing.h"
#include "tests/testing/loopback.h"
#include "worker/ps/parameter_client.h"

namespace gradmesh {
namespace {

// Shared loopback helpers (tests/testing/loopback.h).
using namespace ::gradmesh::loopback;  // NOLINT(build/namespaces)
using testutil::AbslHas;
using testutil::GrpcHas;

constexpr absl::StatusCode kInvalid = absl::StatusCode::kInvalidArgument;

// ---------------------------------------------------------------------------------------------
// Helpers (as in ps_service_test).

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

JobLayout MakeLayout(const std::string& job, std::vector<TensorSpec> tensors, int64_t chunk_elems,
                     int32_t num_workers = 1) {
  JobLayout l;
  l.job = job;
  l.tensors = std::move(tensors);
  l.chunk_elems = chunk_elems;
  l.optimizer.set_name("sgd");
  l.optimizer.set_lr(1.0);  // values -= decoded gradient, exactly
  l.num_workers = num_workers;
  return l;
}

// Odd sizes spanning both shards: 10, 1, 12345 (13 chunks, the last of 345), 3x7.
JobLayout OddLayout(const std::string& job, int32_t num_workers = 1) {
  return MakeLayout(
      job, {Tensor("a", {10}), Tensor("b", {1}), Tensor("c", {12345}), Tensor("d", {3, 7})},
      /*chunk_elems=*/1000, num_workers);
}

uint32_t Hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// Irregular gradients (not representable in fp16/bf16, distinct magnitudes, both signs).
Values IrregularGrad(const JobLayout& l, uint32_t salt) {
  Values g = Zeros(l);
  for (size_t t = 0; t < g.size(); ++t) {
    for (size_t i = 0; i < g[t].size(); ++i) {
      const uint32_t h = Hash(static_cast<uint32_t>(t * 1000003 + i) ^ (salt * 0x9e3779b9u));
      g[t][i] = (static_cast<float>(h % 2000001) - 1000000.0f) * 1.37e-6f;
    }
  }
  return g;
}

// Dyadic gradients: multiples of 1/8 in [-4, 4], never 0, so sums over a few dozen steps
// are exact in float32.
Values DyadicGrad(const JobLayout& l) {
  Values g = Zeros(l);
  for (size_t t = 0; t < g.size(); ++t) {
    for (size_t i = 0; i < g[t].size(); ++i) {
      const int v = static_cast<int>(Hash(static_cast<uint32_t>(t * 7919 + i)) % 64) - 32;
      g[t][i] = static_cast<float>(v >= 0 ? v + 1 : v) / 8.0f;
    }
  }
  return g;
}

std::unique_ptr<Compressor> MakeCodec(const std::string& spec) {
  auto c = CompressorRegistry::WithBuiltins().Create(spec);
  EXPECT_TRUE(c.ok()) << spec << ": " << c.status();
  return c.ok() ? std::move(c).value() : nullptr;
}

// The seed GrpcParameterClient gives a chunk's encoding (worker/parameter_client.cc).
uint64_t ClientSeed(uint64_t seed, int32_t worker, int64_t step, int64_t chunk_index) {
  return seed ^ (static_cast<uint64_t>(worker) << 48) ^
         (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull) ^ static_cast<uint64_t>(chunk_index);
}

absl::Span<const float> Slice(const Values& v, const ChunkInfo& c) {
  return absl::MakeConstSpan(v[c.tensor]).subspan(c.offset, c.numel);
}

// Fixture: two shards and a raw stub to each.
class CompressionWireTest : public TwoShardFixture {
 protected:
  // Values of every tensor, read back densely through a plain client.
  Values PullDense(const JobLayout& layout) {
    auto client = NewGrpcParameterClient(layout, ClientOptions(Addrs()));
    EXPECT_OK(client);
    Values v = Zeros(layout);
    if (client.ok()) {
      EXPECT_OK((*client)->Pull(Spans(v)));
    }
    return v;
  }
};

// ---------------------------------------------------------------------------------------------
// 1. One push through the real client, per codec: the shard applies exactly the decoding.

struct OnePushCase {
  std::string codec;
  bool error_feedback;
};

// What one push of `grad` at `step` by `worker` (fresh client: zero residuals, so error
// feedback does not change the first payload) does to `init`; adds the payload sizes to
// *wire.
Values ExpectedAfterOnePush(const Partition& p, const Compressor& codec, const Values& init,
                            const Values& grad, uint64_t seed, int32_t worker, int64_t step,
                            int64_t* wire, int64_t* sent_nonzero) {
  Values want = init;
  std::string payload;
  for (size_t idx = 0; idx < p.chunks().size(); ++idx) {
    const ChunkInfo& c = p.chunks()[idx];
    EXPECT_OK(codec.Encode(Slice(grad, c), ClientSeed(seed, worker, step, idx), &payload));
    *wire += static_cast<int64_t>(payload.size());
    std::vector<float> dec(c.numel, -1.0f);
    EXPECT_OK(codec.Decode(payload, absl::MakeSpan(dec)));
    for (int64_t j = 0; j < c.numel; ++j) {
      float& w = want[c.tensor][c.offset + j];
      w = w - dec[j];
      if (dec[j] != 0) ++*sent_nonzero;
    }
  }
  return want;
}

void PrintTo(const OnePushCase& c, std::ostream* os) {
  *os << c.codec << (c.error_feedback ? " with" : " without") << " error feedback";
}

class OnePushTest : public CompressionWireTest,
                    public ::testing::WithParamInterface<OnePushCase> {};

TEST_P(OnePushTest, ShardAppliesExactlyTheDecodedPayload) {
  const OnePushCase& tc = GetParam();
  // Worker 1 of 2, a seed and a step that are not defaults: all enter the seed formula.
  const JobLayout layout = OddLayout("push", /*num_workers=*/2);
  const Partition p = MakePartition(layout, 2);
  const Values init = OddInit(layout);
  const Values grad = IrregularGrad(layout, 1);
  constexpr uint64_t kSeed = 0xfeedbeef12345ull;
  constexpr int32_t kWorker = 1;
  constexpr int64_t kStep = 37;

  GrpcParameterClientOptions o = ClientOptions(Addrs(), kWorker);
  o.push_codec = tc.codec;
  o.error_feedback = tc.error_feedback;
  o.seed = kSeed;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  ASSERT_OK(client->InitJob(ConstSpans(init)));
  ASSERT_OK(client->Push(kStep, ConstSpans(grad)));

  std::unique_ptr<Compressor> codec = MakeCodec(tc.codec);
  ASSERT_NE(codec, nullptr);
  int64_t wire = 0, sent = 0;
  const Values want =
      ExpectedAfterOnePush(p, *codec, init, grad, kSeed, kWorker, kStep, &wire, &sent);
  const Values got = PullDense(layout);
  EXPECT_TRUE(SameBits(got, want)) << tc.codec;
  EXPECT_EQ(client->bytes_pushed(), wire);
  EXPECT_EQ(client->raw_bytes_pushed(), TotalElems(layout) * 4);
  EXPECT_LT(client->bytes_pushed(), client->raw_bytes_pushed());
  EXPECT_GT(sent, 0);
  if (codec->density() < 1) {
    // Exactly k = SparseCount(numel, ratio) elements of each chunk were sent (topk; none of
    // the chosen gradients is 0).
    int64_t k = 0;
    for (const ChunkInfo& c : p.chunks()) k += SparseCount(c.numel, codec->density());
    if (tc.codec.rfind("topk:", 0) == 0) {
      EXPECT_EQ(sent, k);
    }
  }
  // Every chunk was updated once (sparse payloads included), for worker 1 at step 37.
  for (int s = 0; s < 2; ++s) {
    const JobInfoResponse info = RawInfo(stubs_[s].get(), layout.job);
    EXPECT_EQ(info.pushes_applied(), 1);
    EXPECT_EQ(info.workers(kWorker).last_step(), kStep);
    int64_t updates = 0;
    for (int64_t n : info.staleness_histogram()) updates += n;
    EXPECT_EQ(updates, static_cast<int64_t>(p.shard_chunks(s).size()));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, OnePushTest,
    ::testing::Values(OnePushCase{"topk:0.01", false}, OnePushCase{"topk:0.01", true},
                      OnePushCase{"fp16", false}, OnePushCase{"bf16", false},
                      OnePushCase{"fp16", true}, OnePushCase{"topk:0.01+fp16", false},
                      OnePushCase{"topk:0.01+bf16", false}, OnePushCase{"qsgd:4", false},
                      OnePushCase{"qsgd:1", false}, OnePushCase{"topk_approx:0.05", false},
                      OnePushCase{"randomk:0.05", false}),
    [](const ::testing::TestParamInfo<OnePushCase>& info) {
      std::string name;
      for (char ch : info.param.codec) {
        name += (std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_');
      }
      return name + (info.param.error_feedback ? "_ef" : "_noef");
    });

// Exact byte counts for the dense codecs: 16-byte header + 2 bytes per element, per chunk.
TEST_F(CompressionWireTest, Fp16PushBytesAreHeaderPlusTwoBytesPerElement) {
  const JobLayout layout = OddLayout("fp16bytes");
  const Partition p = MakePartition(layout, 2);
  GrpcParameterClientOptions o = ClientOptions(Addrs());
  o.push_codec = "fp16";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  ASSERT_OK(client->InitJob(ConstSpans(OddInit(layout))));
  const Values grad = IrregularGrad(layout, 2);
  ASSERT_OK(client->Push(0, ConstSpans(grad)));
  ASSERT_OK(client->Push(1, ConstSpans(grad)));
  const int64_t chunks = static_cast<int64_t>(p.chunks().size());
  EXPECT_EQ(chunks, 1 + 1 + 13 + 1);
  EXPECT_EQ(client->bytes_pushed(),
            2 * (static_cast<int64_t>(kHeaderBytes) * chunks + 2 * TotalElems(layout)));
  EXPECT_EQ(client->raw_bytes_pushed(), 2 * 4 * TotalElems(layout));
}

// ---------------------------------------------------------------------------------------------
// 2. Error feedback through the client, mirrored exactly.

struct EfCase {
  std::string codec;
  float momentum;
  int64_t warmup_steps;
  int steps;
};

void PrintTo(const EfCase& c, std::ostream* os) {
  *os << c.codec << " momentum " << c.momentum << " warmup " << c.warmup_steps << ", " << c.steps
      << " steps";
}

class ErrorFeedbackTest : public CompressionWireTest,
                          public ::testing::WithParamInterface<EfCase> {};

TEST_P(ErrorFeedbackTest, ShardStateMatchesMirroredErrorFeedbackEveryStep) {
  const EfCase& tc = GetParam();
  const JobLayout layout = OddLayout("ef");
  const Partition p = MakePartition(layout, 2);
  const Values init = OddInit(layout);
  const Values g = DyadicGrad(layout);

  GrpcParameterClientOptions o = ClientOptions(Addrs());
  o.push_codec = tc.codec;
  o.error_feedback = true;
  o.ef_momentum = tc.momentum;
  o.warmup_steps = tc.warmup_steps;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  ASSERT_OK(client->InitJob(ConstSpans(init)));

  // The mirror: one ErrorFeedback per chunk, the warm-up density per step.
  std::unique_ptr<Compressor> codec = MakeCodec(tc.codec);
  ASSERT_NE(codec, nullptr);
  ErrorFeedbackOptions efo;
  efo.momentum = tc.momentum;
  std::vector<std::unique_ptr<ErrorFeedback>> mirror;
  for (const ChunkInfo& c : p.chunks()) {
    mirror.push_back(std::make_unique<ErrorFeedback>(c.numel, efo));
  }
  Values want = init;
  int64_t wire = 0;
  std::vector<int64_t> wire_per_step, sent_per_step, want_sent_per_step;
  std::string payload;
  for (int step = 0; step < tc.steps; ++step) {
    ASSERT_OK(client->Push(step, ConstSpans(g)));
    const double d = WarmupDensity(codec->density(), {tc.warmup_steps, 4}, step);
    std::unique_ptr<Compressor> step_codec;
    if (d != codec->density()) {
      ASSERT_OK_AND_ASSIGN(step_codec, codec->WithDensity(d));
    }
    const Compressor& sc = step_codec != nullptr ? *step_codec : *codec;
    int64_t step_wire = 0, sent = 0, want_sent = 0;
    for (size_t idx = 0; idx < p.chunks().size(); ++idx) {
      const ChunkInfo& c = p.chunks()[idx];
      ASSERT_OK(mirror[idx]->Compress(sc, Slice(g, c), ClientSeed(1, 0, step, idx), &payload));
      step_wire += static_cast<int64_t>(payload.size());
      if (sc.density() < 1) {
        sent += static_cast<int64_t>(GetU64(payload.data() + kHeaderBytes));  // k
        want_sent += SparseCount(c.numel, d);
      }
      std::vector<float> dec(c.numel);
      // The shard decodes with the target-density codec.
      ASSERT_OK(codec->Decode(payload, absl::MakeSpan(dec)));
      for (int64_t j = 0; j < c.numel; ++j) {
        float& w = want[c.tensor][c.offset + j];
        w = w - dec[j];
      }
    }
    wire += step_wire;
    wire_per_step.push_back(step_wire);
    sent_per_step.push_back(sent);
    want_sent_per_step.push_back(want_sent);
    EXPECT_EQ(sent, want_sent) << "step " << step;
    const Values got = PullDense(layout);
    ASSERT_TRUE(SameBits(got, want)) << "after step " << step;
    ASSERT_EQ(client->bytes_pushed(), wire) << "after step " << step;
  }
  EXPECT_EQ(client->raw_bytes_pushed(), int64_t{4} * TotalElems(layout) * tc.steps);

  // Mass conservation (plain error feedback; every value here is a multiple of 1/8 well
  // inside float32's exact range): applied + residual == T * g, exactly.
  if (tc.momentum == 0) {
    for (size_t idx = 0; idx < p.chunks().size(); ++idx) {
      const ChunkInfo& c = p.chunks()[idx];
      const absl::Span<const float> r = mirror[idx]->residual();
      for (int64_t j = 0; j < c.numel; ++j) {
        const float applied = init[c.tensor][c.offset + j] - want[c.tensor][c.offset + j];
        ASSERT_EQ(applied + r[j], static_cast<float>(tc.steps) * g[c.tensor][c.offset + j])
            << "tensor " << c.tensor << " element " << c.offset + j;
      }
    }
  }
  // Warm-up (8 steps, 4 stages of 2): densities 0.01^(1/5), 0.01^(2/5), 0.01^(3/5),
  // 0.01^(4/5), then 0.01; the elements sent per step fall stage by stage.
  if (tc.warmup_steps > 0) {
    ASSERT_EQ(tc.warmup_steps, 8);
    ASSERT_GT(tc.steps, tc.warmup_steps);
    for (int s = 0; s < tc.steps; ++s) {
      const int stage = std::min(s / 2, 4);
      EXPECT_DOUBLE_EQ(WarmupDensity(0.01, {8, 4}, s),
                       stage < 4 ? std::pow(0.01, (stage + 1) / 5.0) : 0.01)
          << s;
      if (s > 0) {
        if (s % 2 == 0 && s <= 8) {
          EXPECT_LT(sent_per_step[s], sent_per_step[s - 1]) << s;
        } else {
          EXPECT_EQ(sent_per_step[s], sent_per_step[s - 1]) << s;
        }
      }
    }
    // Step 0 sends ~40% of each chunk, the target 1%: the payloads shrink accordingly.
    EXPECT_GT(sent_per_step[0], 30 * sent_per_step[8]);
    EXPECT_GT(wire_per_step[0], 10 * wire_per_step[8]);
  }
}

INSTANTIATE_TEST_SUITE_P(Codecs, ErrorFeedbackTest,
                         ::testing::Values(EfCase{"topk:0.01", 0.0f, 0, 20},
                                           EfCase{"topk:0.01+fp16", 0.0f, 0, 12},
                                           EfCase{"fp16", 0.0f, 0, 6},
                                           EfCase{"topk:0.01", 0.9f, 0, 12},
                                           EfCase{"topk:0.01", 0.0f, 8, 12}),
                         [](const ::testing::TestParamInfo<EfCase>& info) {
                           std::string name;
                           for (char ch : info.param.codec) {
                             name += (std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_');
                           }
                           if (info.param.momentum > 0) name += "_momentum";
                           if (info.param.warmup_steps > 0) name += "_warmup";
                           return name;
                         });

// Constant gradient, topk:0.5 on two 8-element tensors (one per shard): each step sends half
// of each chunk; the residual's L1 norm stays within ||g||_1, and every coordinate is sent.
TEST_F(CompressionWireTest, TopkHalfWithErrorFeedbackSendsEveryCoordinateAndBoundsResidual) {
  const JobLayout layout = MakeLayout("half", {Tensor("x", {8}), Tensor("y", {2, 4})}, 1000);
  const Partition p = MakePartition(layout, 2);
  ASSERT_EQ(p.shard_chunks(0).size(), 1u);
  ASSERT_EQ(p.shard_chunks(1).size(), 1u);
  const Values init = {{0, 0, 0, 0, 0, 0, 0, 0}, {100, 100, 100, 100, 100, 100, 100, 100}};
  // x: distinct magnitudes, alternating signs (the smallest needs 6 steps); y: ties.
  const Values g = {{0.125f, -0.25f, 0.375f, -0.5f, 0.625f, -0.75f, 0.875f, -1.0f},
                    {1.0f, 0.875f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f, 0.125f}};
  GrpcParameterClientOptions o = ClientOptions(Addrs());
  o.push_codec = "topk:0.5";
  o.error_feedback = true;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client, NewGrpcParameterClient(layout, o));
  ASSERT_OK(client->InitJob(ConstSpans(init)));

  constexpr int kSteps = 12;
  std::vector<std::vector<int>> first_sent = {std::vector<int>(8, -1), std::vector<int>(8, -1)};
  Values prev = init;
  for (int step = 0; step < kSteps; ++step) {
    ASSERT_OK(client->Push(step, ConstSpans(g)));
    const Values got = PullDense(layout);
    for (int t = 0; t < 2; ++t) {
      double l1_g = 0, l1_r = 0;
      int moved = 0;
      for (int i = 0; i < 8; ++i) {
        if (got[t][i] != prev[t][i]) {
          ++moved;
          if (first_sent[t][i] < 0) first_sent[t][i] = step;
          // A sent coordinate receives its whole accumulated value: a multiple of g.
          const float q = (prev[t][i] - got[t][i]) / g[t][i];
          EXPECT_EQ(q, std::round(q)) << "tensor " << t << " element " << i;
          EXPECT_GE(q, 1.0f);
        }
        const float applied = init[t][i] - got[t][i];
        const float residual = static_cast<float>(step + 1) * g[t][i] - applied;  // exact
        l1_g += std::fabs(g[t][i]);
        l1_r += std::fabs(residual);
        // Nothing is over-sent: applied and residual have g's sign (or are 0).
        EXPECT_GE(applied * g[t][i], 0.0f);
        EXPECT_GE(residual * g[t][i], 0.0f);
      }
      EXPECT_EQ(moved, 4) << "step " << step << " tensor " << t << ": k = 4 of 8";
      EXPECT_LE(l1_r, l1_g) << "step " << step << " tensor " << t;
    }
    prev = got;
  }
  for (int t = 0; t < 2; ++t) {
    for (int i = 0; i < 8; ++i) {
      EXPECT_GE(first_sent[t][i], 0) << "tensor " << t << " element " << i << " never sent";
    }
  }
  // The largest coordinates go first; x's smallest (1/8 among up to 1) waits longest.
  EXPECT_EQ(first_sent[0][7], 0);
  EXPECT_EQ(first_sent[0][0], 5);
  EXPECT_EQ(first_sent[1][0], 0);
  EXPECT_EQ(first_sent[1][1], 0);
}

// ---------------------------------------------------------------------------------------------
// 3. Malformed payloads over a raw stub: INVALID_ARGUMENT naming chunk and codec; no change.

TEST_F(CompressionWireTest, MalformedPayloadsAreInvalidArgumentAndChangeNothing) {
  const JobLayout layout = OddLayout("badpayload");
  const Partition p = MakePartition(layout, 2);
  const Values init = OddInit(layout);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                       NewGrpcParameterClient(layout, ClientOptions(Addrs())));
  ASSERT_OK(client->InitJob(ConstSpans(init)));
  const Values grad = IrregularGrad(layout, 3);

  // Two full 1000-element chunks of tensor c on shard 0, and one dense chunk there.
  std::vector<ChunkInfo> full;
  for (int64_t idx : p.shard_chunks(0)) {
    const ChunkInfo& c = p.chunks()[idx];
    if (c.tensor == 2 && c.numel == 1000) full.push_back(c);
  }
  ASSERT_GE(full.size(), 3u);
  const ChunkInfo a = full[0], b = full[1], dense = full[2];
  auto where = [](const ChunkInfo& c) {
    return absl::StrCat("job badpayload tensor 2 (c) chunk ", c.chunk);
  };

  std::unique_ptr<Compressor> topk = MakeCodec("topk:0.01");
  std::unique_ptr<Compressor> fp16 = MakeCodec("fp16");
  ASSERT_NE(topk, nullptr);
  ASSERT_NE(fp16, nullptr);
  std::string topk_a, topk_b, fp16_b;
  ASSERT_OK(topk->Encode(Slice(grad, a), 0, &topk_a));
  ASSERT_OK(topk->Encode(Slice(grad, b), 0, &topk_b));
  ASSERT_OK(fp16->Encode(Slice(grad, b), 0, &fp16_b));

  const std::string before0 = Snapshot(stubs_[0].get(), layout.job);
  const std::string before1 = Snapshot(stubs_[1].get(), layout.job);
  constexpr uint64_t kRequestId = 77;
  struct Part {
    ChunkInfo c;
    std::string codec;
    std::string data;
    DType dtype;
  };
  auto push = [&](const std::vector<Part>& chunks) {
    PushRequest r;
    r.set_job(layout.job);
    r.set_worker(0);
    r.set_step(1);
    r.set_request_id(kRequestId);
    for (const Part& part : chunks) {
      ChunkData* d = r.add_chunks();
      d->set_tensor(part.c.tensor);
      d->set_chunk(part.c.chunk);
      d->set_dtype(part.dtype);
      d->set_codec(part.codec);
      d->set_data(part.data);
    }
    return RawPush(stubs_[0].get(), r);
  };
  auto unchanged = [&]() {
    EXPECT_TRUE(Snapshot(stubs_[0].get(), layout.job) == before0);
    EXPECT_TRUE(Snapshot(stubs_[1].get(), layout.job) == before1);
  };

  // Unknown codec: the message lists the known ones.
  EXPECT_TRUE(GrpcHas(push({{a, "zstd", topk_a, FLOAT32}}), kInvalid,
                      {where(a), "unknown codec \"zstd\"", "known: ", "fp16", "topk"}));
  unchanged();
  EXPECT_TRUE(
      GrpcHas(push({{a, "topk:0.01+zstd", topk_a, FLOAT32}}), kInvalid, {where(a), "zstd"}));
  EXPECT_TRUE(GrpcHas(push({{a, "topk:7", topk_a, FLOAT32}}), kInvalid, {where(a), "topk"}));
  unchanged();

  // Truncated topk payload (one byte short), and only its header.
  EXPECT_TRUE(GrpcHas(push({{a, "topk:0.01", topk_a.substr(0, topk_a.size() - 1), FLOAT32}}),
                      kInvalid, {where(a), "malformed \"topk:0.01\" payload", "truncated"}));
  EXPECT_TRUE(GrpcHas(push({{a, "topk:0.01", topk_a.substr(0, 20), FLOAT32}}), kInvalid,
                      {where(a), "\"topk:0.01\""}));
  EXPECT_TRUE(
      GrpcHas(push({{a, "topk:0.01", "", FLOAT32}}), kInvalid, {where(a), "\"topk:0.01\""}));
  // Trailing bytes.
  EXPECT_TRUE(GrpcHas(push({{a, "topk:0.01", topk_a + "x", FLOAT32}}), kInvalid,
                      {where(a), "\"topk:0.01\"", "trailing bytes"}));
  unchanged();

  // A payload for a tensor of another size: numel - 1 and numel + 1 elements.
  {
    std::vector<float> shorter(Slice(grad, a).begin(), Slice(grad, a).end() - 1);
    std::vector<float> longer(Slice(grad, a).begin(), Slice(grad, a).end());
    longer.push_back(1.0f);
    std::string s1, s2, s3;
    ASSERT_OK(topk->Encode(shorter, 0, &s1));
    ASSERT_OK(topk->Encode(longer, 0, &s2));
    ASSERT_OK(fp16->Encode(shorter, 0, &s3));
    EXPECT_TRUE(
        GrpcHas(push({{a, "topk:0.01", s1, FLOAT32}}), kInvalid,
                {where(a), "\"topk:0.01\"", "payload has 999 elements, the output has 1000"}));
    EXPECT_TRUE(GrpcHas(push({{a, "topk:0.01", s2, FLOAT32}}), kInvalid,
                        {where(a), "payload has 1001 elements, the output has 1000"}));
    EXPECT_TRUE(GrpcHas(push({{a, "fp16", s3, FLOAT32}}), kInvalid,
                        {where(a), "\"fp16\"", "payload has 999 elements"}));
  }
  unchanged();

  // topk indices out of range: encoded for a 2000-element tensor whose largest elements are
  // at 3 and 1500 (delta-varint indices), then the header's n patched to 1000.
  {
    std::vector<float> big(2 * a.numel, 0.0f);
    big[3] = 4.0f;
    big[a.numel + 500] = 5.0f;
    std::unique_ptr<Compressor> two = MakeCodec("topk:0.001");  // k = 2 of 2000
    std::string s;
    ASSERT_OK(two->Encode(big, 0, &s));
    ASSERT_EQ(s[3], static_cast<char>(IndexEncoding::kDeltaVarint));
    PutU64(static_cast<uint64_t>(a.numel), &s[8]);
    EXPECT_TRUE(GrpcHas(push({{a, "topk:0.01", s, FLOAT32}}), kInvalid,
                        {where(a), "\"topk:0.01\"", "index 1500", "out of range [0, 1000)"}));
  }
  unchanged();

  // Garbage bytes, a payload of another codec, a NaN value.
  EXPECT_TRUE(GrpcHas(push({{a, "fp16", std::string(2016, '\x07'), FLOAT32}}), kInvalid,
                      {where(a), "malformed \"fp16\" payload"}));
  EXPECT_TRUE(GrpcHas(push({{a, "topk:0.01", "not a payload at all, just garbage", FLOAT32}}),
                      kInvalid, {where(a), "malformed \"topk:0.01\" payload"}));
  EXPECT_TRUE(GrpcHas(push({{b, "bf16", fp16_b, FLOAT32}}), kInvalid,
                      {where(b), "\"bf16\"", "encoded by fp16"}));
  EXPECT_TRUE(GrpcHas(push({{b, "fp16", topk_b, FLOAT32}}), kInvalid,
                      {where(b), "\"fp16\"", "encoded by topk"}));
  {
    std::string nan = fp16_b;
    nan[kHeaderBytes + 2 * 17] = '\x00';
    nan[kHeaderBytes + 2 * 17 + 1] = '\x7e';  // fp16 quiet NaN, element 17
    EXPECT_TRUE(GrpcHas(push({{b, "fp16", nan, FLOAT32}}), kInvalid,
                        {where(b), "\"fp16\"", "value 17 is Inf or NaN"}));
  }
  unchanged();

  // dtype FLOAT16 (or BFLOAT16) with a codec: the payload describes itself, dtype must be
  // FLOAT32.
  EXPECT_TRUE(GrpcHas(push({{b, "fp16", fp16_b, FLOAT16}}), kInvalid,
                      {where(b), "dtype FLOAT16", "codec \"fp16\""}));
  EXPECT_TRUE(GrpcHas(push({{a, "topk:0.01", topk_a, BFLOAT16}}), kInvalid,
                      {where(a), "dtype BFLOAT16", "codec \"topk:0.01\""}));
  unchanged();

  // A valid payload for one chunk and a malformed one for another, in either order: the
  // error names the bad chunk and nothing is applied.
  const std::string truncated_b = topk_b.substr(0, topk_b.size() - 2);
  EXPECT_TRUE(
      GrpcHas(push({{a, "topk:0.01", topk_a, FLOAT32}, {b, "topk:0.01", truncated_b, FLOAT32}}),
              kInvalid, {where(b), "\"topk:0.01\""}));
  EXPECT_TRUE(
      GrpcHas(push({{b, "topk:0.01", truncated_b, FLOAT32}, {a, "topk:0.01", topk_a, FLOAT32}}),
              kInvalid, {where(b), "\"topk:0.01\""}));
  EXPECT_TRUE(GrpcHas(push({{a, "topk:0.01", topk_a, FLOAT32},
                            {dense, "", Bytes(Slice(grad, dense).data(), dense.numel), FLOAT32},
                            {b, "zstd", fp16_b, FLOAT32}}),
                      kInvalid, {where(b), "zstd"}));
  unchanged();
  for (int s = 0; s < 2; ++s) {
    const JobInfoResponse info = RawInfo(stubs_[s].get(), layout.job);
    EXPECT_EQ(info.pushes_applied(), 0);
    EXPECT_EQ(info.workers(0).last_step(), -1);
  }

  // The failures did not consume the request id: the same id with valid payloads of three
  // kinds in one request is applied, each chunk by exactly its decoding.
  ASSERT_TRUE(push({{a, "topk:0.01", topk_a, FLOAT32},
                    {dense, "", Bytes(Slice(grad, dense).data(), dense.numel), FLOAT32},
                    {b, "fp16", fp16_b, FLOAT32}})
                  .ok());
  Values want = init;
  {
    std::vector<float> dec_a(a.numel), dec_b(b.numel);
    ASSERT_OK(topk->Decode(topk_a, absl::MakeSpan(dec_a)));
    ASSERT_OK(fp16->Decode(fp16_b, absl::MakeSpan(dec_b)));
    for (int64_t j = 0; j < a.numel; ++j) {
      float& w = want[2][a.offset + j];
      w = w - dec_a[j];
    }
    for (int64_t j = 0; j < b.numel; ++j) {
      float& w = want[2][b.offset + j];
      w = w - dec_b[j];
    }
    for (int64_t j = 0; j < dense.numel; ++j) {
      float& w = want[2][dense.offset + j];
      w = w - grad[2][dense.offset + j];
    }
  }
  EXPECT_TRUE(SameBits(PullDense(layout), want));
  EXPECT_TRUE(Snapshot(stubs_[1].get(), layout.job) == before1);
  EXPECT_EQ(RawInfo(stubs_[0].get(), layout.job).pushes_applied(), 1);
}

// ---------------------------------------------------------------------------------------------
// 4. Pulls in fp16 / bf16.

// Reference narrowing, independent of compression/float16: round to nearest even on the
// format's grid (in double, where the scaling is exact), clamped to the largest finite value.
float RefFp16(float x) {
  const double a = std::fabs(static_cast<double>(x));
  double q;
  if (a < std::ldexp(1.0, -14)) {
    q = std::nearbyint(a / std::ldexp(1.0, -24)) * std::ldexp(1.0, -24);
  } else {
    int e;
    std::frexp(a, &e);  // a in [2^(e-1), 2^e)
    const double ulp = std::ldexp(1.0, e - 1 - 10);
    q = std::nearbyint(a / ulp) * ulp;
  }
  q = std::min(q, 65504.0);
  return static_cast<float>(std::signbit(x) ? -q : q);
}

float RefBf16(float x) {
  const uint32_t u = BitsOf(x);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t mag = u & 0x7fffffffu;
  uint32_t r = (mag + 0x7fffu + ((mag >> 16) & 1u)) & 0xffff0000u;
  if (r >= 0x7f800000u) r = 0x7f7f0000u;  // would round to Inf: clamp
  return FromBits(sign | r);
}

// Values that exercise the narrowing: ties, subnormals, clamping, signed zeros, then
// irregular values over a wide exponent range.
Values PullInit(const JobLayout& layout) {
  Values v = Zeros(layout);
  const std::vector<float> special = {0.0f,
                                      -0.0f,
                                      1.0f,
                                      -1.0f,
                                      2049.0f,
                                      2051.0f,
                                      -4097.0f,
                                      1.0f + 0x1p-11f,
                                      1.0f + 3 * 0x1p-11f,
                                      1.0f + 0x1p-8f,
                                      1.0f + 3 * 0x1p-8f,
                                      -(1.0f + 0x1p-8f),
                                      0x1p-25f,
                                      0x1.0002p-25f,
                                      0x1p-24f,
                                      0x1.8p-24f,
                                      0x1p-15f,
                                      1e-7f,
                                      -3e-6f,
                                      6.1e-5f,
                                      65504.0f,
                                      65519.0f,
                                      65520.0f,
                                      -65536.0f,
                                      1e6f,
                                      -1e30f,
                                      3.39e38f,
                                      0x1.fe8p127f,
                                      std::numeric_limits<float>::max(),
                                      -std::numeric_limits<float>::max(),
                                      1e-40f,
                                      -1e-45f,
                                      std::numeric_limits<float>::min(),
                                      0.1f,
                                      1.0f / 3.0f};
  size_t k = 0;
  for (size_t t = 0; t < v.size(); ++t) {
    for (size_t i = 0; i < v[t].size(); ++i, ++k) {
      if (k < special.size()) {
        v[t][i] = special[k];
        continue;
      }
      const uint32_t h = Hash(static_cast<uint32_t>(k) * 2654435761u);
      const float m = 1.0f + static_cast<float>(h & 0xffffff) * 0x1p-24f;
      const int e = static_cast<int>((h >> 24) % 48) - 30;  // 2^-30 .. 2^17
      v[t][i] = std::ldexp((h & 1u) ? -m : m, e);
    }
  }
  return v;
}

TEST(ReferenceNarrowing, KnownValues) {
  EXPECT_EQ(RefFp16(2049.0f), 2048.0f);
  EXPECT_EQ(RefFp16(2051.0f), 2052.0f);
  EXPECT_EQ(RefFp16(1.0f + 0x1p-11f), 1.0f);
  EXPECT_EQ(RefFp16(1.0f + 3 * 0x1p-11f), 1.0f + 0x1p-9f);
  EXPECT_EQ(RefFp16(0x1p-25f), 0.0f);
  EXPECT_EQ(RefFp16(0x1.0002p-25f), 0x1p-24f);
  EXPECT_EQ(RefFp16(65519.0f), 65504.0f);
  EXPECT_EQ(RefFp16(-1e30f), -65504.0f);
  EXPECT_TRUE(std::signbit(RefFp16(-1e-40f)));
  EXPECT_EQ(RefBf16(1.0f + 0x1p-8f), 1.0f);
  EXPECT_EQ(RefBf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);
  EXPECT_EQ(RefBf16(std::numeric_limits<float>::max()), 0x1.fep127f);
  EXPECT_EQ(RefBf16(-3.39e38f), -0x1.fep127f);
}

JobLayout PullLayout(const std::string& job) {
  return MakeLayout(job, {Tensor("p", {3000}), Tensor("q", {7}), Tensor("r", {2, 1000})}, 1000);
}

TEST_F(CompressionWireTest, RawPullInFp16AndBf16IsTheRoundedValues) {
  const JobLayout layout = PullLayout("pull");
  const Partition p = MakePartition(layout, 2);
  const Values init = PullInit(layout);
  for (int s = 0; s < 2; ++s) {
    InitJobResponse resp;
    grpc::Status st = stubs_[s]->InitJob(Ctx().get(), MakeInitRequest(layout, 2, s, init), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  // A push first, so that versions are not all 0.
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                         NewGrpcParameterClient(layout, ClientOptions(Addrs())));
    ASSERT_OK(client->Push(0, ConstSpans(Zeros(layout))));
  }
  for (const std::string spec : {"fp16", "bf16"}) {
    SCOPED_TRACE(spec);
    std::unique_ptr<Compressor> codec = MakeCodec(spec);
    ASSERT_NE(codec, nullptr);
    float (*ref)(float) = spec == "fp16" ? RefFp16 : RefBf16;
    for (int s = 0; s < 2; ++s) {
      PullRequest dense_req;
      dense_req.set_job(layout.job);
      PullResponse dense;
      ASSERT_TRUE(RawPull(stubs_[s].get(), dense_req, &dense).ok());
      PullRequest req = dense_req;
      req.set_codec(spec);
      PullResponse resp;
      grpc::Status st = RawPull(stubs_[s].get(), req, &resp);
      ASSERT_TRUE(st.ok()) << st.error_message();
      ASSERT_EQ(resp.chunks_size(), dense.chunks_size());
      ASSERT_EQ(resp.chunks_size(), static_cast<int>(p.shard_chunks(s).size()));
      for (int i = 0; i < resp.chunks_size(); ++i) {
        const ChunkData& c = resp.chunks(i);
        const ChunkInfo& info = p.chunks()[p.shard_chunks(s)[i]];
        SCOPED_TRACE(absl::StrCat("shard ", s, " chunk (", c.tensor(), ",", c.chunk(), ")"));
        EXPECT_EQ(c.tensor(), info.tensor);
        EXPECT_EQ(c.chunk(), info.chunk);
        EXPECT_EQ(c.version(), 1);
        EXPECT_EQ(c.codec(), spec);
        EXPECT_EQ(c.dtype(), FLOAT32);
        ASSERT_EQ(c.data().size(), kHeaderBytes + 2 * static_cast<size_t>(info.numel));
        const std::vector<float> values = Floats(dense.chunks(i).data());
        ASSERT_EQ(values.size(), static_cast<size_t>(info.numel));
        // The shard's float32 values are the initial ones, except that the (zero-gradient)
        // update flushed subnormal parameters to zero (server/optimizer.cc, FlushDenormals).
        for (int64_t j = 0; j < info.numel; ++j) {
          const float want = init[info.tensor][info.offset + j];
          if (want != 0.0f && std::fabs(want) < std::numeric_limits<float>::min()) {
            ASSERT_EQ(values[j], 0.0f) << "subnormal " << want << " not flushed";
          } else {
            ASSERT_EQ(BitsOf(values[j]), BitsOf(want));
          }
        }
        std::vector<float> decoded(info.numel);
        ASSERT_OK(codec->Decode(c.data(), absl::MakeSpan(decoded)));
        for (int64_t j = 0; j < info.numel; ++j) {
          ASSERT_EQ(BitsOf(decoded[j]), BitsOf(ref(values[j])))
              << "element " << j << ": " << values[j] << " -> " << decoded[j] << ", want "
              << ref(values[j]);
        }
      }
    }
    // Named chunks with a codec: those chunks, in the order asked.
    {
      const int64_t i0 = p.shard_chunks(0).back(), i1 = p.shard_chunks(0).front();
      PullRequest req;
      req.set_job(layout.job);
      req.set_codec(spec);
      for (int64_t idx : {i0, i1}) {
        ChunkData* d = req.add_chunks();
        d->set_tensor(p.chunks()[idx].tensor);
        d->set_chunk(p.chunks()[idx].chunk);
      }
      PullResponse resp;
      ASSERT_TRUE(RawPull(stubs_[0].get(), req, &resp).ok());
      ASSERT_EQ(resp.chunks_size(), 2);
      int i = 0;
      for (int64_t idx : {i0, i1}) {
        const ChunkInfo& info = p.chunks()[idx];
        const ChunkData& c = resp.chunks(i++);
        EXPECT_EQ(c.tensor(), info.tensor);
        EXPECT_EQ(c.chunk(), info.chunk);
        EXPECT_EQ(c.codec(), spec);
        std::vector<float> decoded(info.numel);
        ASSERT_OK(codec->Decode(c.data(), absl::MakeSpan(decoded)));
        for (int64_t j = 0; j < info.numel; ++j) {
          float want = init[info.tensor][info.offset + j];
          // Flushed by the zero-gradient update (see above).
          if (std::fabs(want) < std::numeric_limits<float>::min()) want = 0.0f;
          ASSERT_EQ(decoded[j], ref(want));
        }
      }
    }
  }
  // Any other pull codec is refused (parameters may be narrowed, never sparsified or
  // randomised), and the state is unchanged.
  const std::string before0 = Snapshot(stubs_[0].get(), layout.job);
  for (const std::string spec :
       {"topk:0.01", "zstd", "qsgd:4", "identity", "fp16+bf16", "topk:0.01+fp16", "FP16"}) {
    PullRequest req;
    req.set_job(layout.job);
    req.set_codec(spec);
    PullResponse resp;
    EXPECT_TRUE(GrpcHas(RawPull(stubs_[0].get(), req, &resp), kInvalid,
                        {"job pull", absl::StrCat("codec \"", spec, "\""), "fp16, bf16"}))
        << spec;
    EXPECT_EQ(resp.chunks_size(), 0);
  }
  EXPECT_TRUE(Snapshot(stubs_[0].get(), layout.job) == before0);
}

TEST_F(CompressionWireTest, RealClientPullsFp16AndBf16WithExactByteCounts) {
  const JobLayout layout = PullLayout("clientpull");
  const Partition p = MakePartition(layout, 2);
  const Values init = PullInit(layout);
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                         NewGrpcParameterClient(layout, ClientOptions(Addrs())));
    ASSERT_OK(client->InitJob(ConstSpans(init)));
  }
  const int64_t chunks = static_cast<int64_t>(p.chunks().size());
  const int64_t total = TotalElems(layout);
  for (const std::string spec : {"fp16", "bf16"}) {
    SCOPED_TRACE(spec);
    float (*ref)(float) = spec == "fp16" ? RefFp16 : RefBf16;
    GrpcParameterClientOptions o = ClientOptions(Addrs());
    o.pull_codec = spec;
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                         NewGrpcParameterClient(layout, o));
    Values want = init;
    for (auto& t : want) {
      for (float& x : t) x = ref(x);
    }
    Values got = Zeros(layout);
    for (auto& t : got) std::fill(t.begin(), t.end(), -7.0f);
    ASSERT_OK(client->Pull(Spans(got)));
    EXPECT_TRUE(SameBits(got, want));
    EXPECT_EQ(client->raw_bytes_pulled(), 4 * total);
    EXPECT_EQ(client->bytes_pulled(), static_cast<int64_t>(kHeaderBytes) * chunks + 2 * total);
    EXPECT_EQ(2 * client->bytes_pulled(),
              client->raw_bytes_pulled() + 2 * static_cast<int64_t>(kHeaderBytes) * chunks);
    ASSERT_OK(client->Pull(Spans(got)));
    EXPECT_TRUE(SameBits(got, want));
    EXPECT_EQ(client->bytes_pulled(),
              2 * (static_cast<int64_t>(kHeaderBytes) * chunks + 2 * total));
    EXPECT_EQ(client->raw_bytes_pulled(), 8 * total);
    EXPECT_EQ(client->bytes_pushed(), 0);
  }
  // A compressed pull records the versions too: a push after it is not stale.
  {
    GrpcParameterClientOptions o = ClientOptions(Addrs());
    o.pull_codec = "bf16";
    o.push_codec = "topk:0.01";
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<ParameterClient> client,
                         NewGrpcParameterClient(layout, o));
    Values got = Zeros(layout);
    ASSERT_OK(client->Push(0, ConstSpans(IrregularGrad(layout, 9))));  // from version 0
    ASSERT_OK(client->Pull(Spans(got)));                               // now at version 1
    ASSERT_OK(client->Push(1, ConstSpans(IrregularGrad(layout, 10))));
    int64_t stale = 0, updates = 0;
    for (int s = 0; s < 2; ++s) {
      const JobInfoResponse info = RawInfo(stubs_[s].get(), layout.job);
      for (int i = 0; i < info.staleness_histogram_size(); ++i) {
        updates += info.staleness_histogram(i);
        if (i > 0) stale += info.staleness_histogram(i);
      }
    }
    EXPECT_EQ(updates, 2 * chunks);
    EXPECT_EQ(stale, 0);
  }
}

// ---------------------------------------------------------------------------------------------
// 5. The client refuses unusable codec options.

TEST(CompressionClientOptionsTest, BadCodecOptionsAreInvalidArgument) {
  const JobLayout layout = OddLayout("opts");
  auto make = [&](const std::string& push, const std::string& pull, float momentum) {
    GrpcParameterClientOptions o = ClientOptions({"127.0.0.1:1"});
    o.push_codec = push;
    o.pull_codec = pull;
    o.ef_momentum = momentum;
    return NewGrpcParameterClient(layout, o).status();
  };
  EXPECT_TRUE(AbslHas(make("bogus", "", 0), kInvalid, {"push codec", "unknown codec \"bogus\""}));
  EXPECT_TRUE(AbslHas(make("topk:0", "", 0), kInvalid, {"push codec"}));
  EXPECT_TRUE(AbslHas(make("topk:1.5", "", 0), kInvalid, {"push codec"}));
  EXPECT_TRUE(AbslHas(make("qsgd:9", "", 0), kInvalid, {"push codec", "qsgd"}));
  EXPECT_TRUE(AbslHas(make("fp16+topk:0.1", "", 0), kInvalid, {"push codec", "compose"}));
  EXPECT_TRUE(AbslHas(make("topk:0.1+fp16+bf16", "", 0), kInvalid, {"push codec"}));
  EXPECT_TRUE(AbslHas(make("", "topk:0.1", 0), kInvalid,
                      {"pull codec \"topk:0.1\"", "not one of \"\", fp16, bf16"}));
  EXPECT_TRUE(AbslHas(make("", "qsgd:4", 0), kInvalid, {"pull codec \"qsgd:4\""}));
  EXPECT_TRUE(AbslHas(make("", "zstd", 0), kInvalid, {"pull codec \"zstd\""}));
  EXPECT_TRUE(AbslHas(make("", "identity", 0), kInvalid, {"pull codec \"identity\""}));
  EXPECT_TRUE(AbslHas(make("topk:0.01", "", 1.5f), kInvalid, {"momentum", "[0, 1)"}));
  EXPECT_TRUE(AbslHas(make("topk:0.01", "", 1.0f), kInvalid, {"momentum"}));
  EXPECT_TRUE(AbslHas(make("topk:0.01", "", -0.1f), kInvalid, {"momentum"}));
  EXPECT_TRUE(AbslHas(make("topk:0.01", "", std::nanf("")), kInvalid, {"momentum"}));
  // Good ones (the client connects lazily: no server needed).
  for (const std::string push : {"", "identity", "fp16", "bf16", "topk:0.01", "topk:0.01+fp16",
                                 "topk_approx:0.1+bf16", "randomk:0.5", "qsgd:8"}) {
    EXPECT_OK(make(push, "", 0)) << push;
  }
  EXPECT_OK(make("topk:0.001", "fp16", 0.9f));
  EXPECT_OK(make("", "bf16", 0));
}

}  // namespace
}  // namespace gradmesh
