// "changes" pulls (PullRequest.codec "changes", common/tensor_wire.h EncodeChanges /
// DecodeChanges, Shard::Pull's per-worker `sent` state, the client's held versions), over real
// gRPC on 127.0.0.1 with in-process shards, raw stubs and the real GrpcParameterClient.
//
// What must hold, exactly (bit for bit, byte counts to the byte):
//   * A first pull (nothing held) is dense; afterwards each chunk is sent as the entries that
//     differ from what the worker holds (varint count, varint gaps, float32 values), or dense
//     when that payload would not be smaller; the client's values equal the shard's.
//   * The shard sends changes only against the version it last sent to that worker: any other
//     held version (a lost response, a client that reset, a restarted shard) gets the chunk
//     dense, never changes against values the worker does not hold.
//   * A restarted (durable) shard has no `sent` state: each chunk once dense, then changes.
//   * Unknown pull codecs are INVALID_ARGUMENT naming the accepted ones.
#include <grpcpp/client_context.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/status.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/partitioner.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.grpc.pb.h"
#include "proto/gradmesh.pb.h"
#include "rpc/grpc_util.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "server/shard_store.h"
#include "tests/testing/loopback.h"
#include "tests/testing/subprocess.h"
#include "worker/ps/parameter_client.h"

namespace gradmesh {
namespace {

// Shared loopback helpers (tests/testing/loopback.h).
using namespace ::gradmesh::loopback;  // NOLINT(build/namespaces)

constexpr int kShards = 2;

// ---------------------------------------------------------------------------------------------
// Helpers.

// a[10], b[1], c[12345] (13 chunks, the last of 345), d[3x7]; chunks of 1000; sgd lr 1.
JobLayout Layout(const std::string& job, int32_t num_workers = 2) {
  JobLayout l;
  l.job = job;
  l.tensors = {Tensor("a", {10}), Tensor("b", {1}), Tensor("c", {12345}), Tensor("d", {3, 7})};
  l.chunk_elems = 1000;
  l.optimizer.set_name("sgd");
  l.optimizer.set_lr(1.0);  // values -= gradient, exactly; zero entries leave values as they are
  l.num_workers = num_workers;
  return l;
}

// sgd lr 1: want -= grad.
Values Apply(Values v, const Values& grad) {
  for (size_t t = 0; t < v.size(); ++t) {
    for (size_t i = 0; i < v[t].size(); ++i) v[t][i] -= grad[t][i];
  }
  return v;
}

int64_t VarintSize(uint64_t v) {
  int64_t n = 1;
  while (v >= 128) {
    v >>= 7;
    ++n;
  }
  return n;
}

// Independent reference of a chunk's "changes" payload size from `held` to `now`, or the dense
// size when that payload would not be smaller (the shard then sends it dense). *dense_out tells
// which.
int64_t ChunkPullBytes(const ChunkInfo& c, const Values& held, const Values& now,
                       bool* dense_out = nullptr) {
  const int64_t dense = c.numel * 4;
  int64_t count = 0, bytes = 0, prev = -1;
  for (int64_t i = 0; i < c.numel; ++i) {
    if (BitsOf(held[c.tensor][c.offset + i]) != BitsOf(now[c.tensor][c.offset + i])) {
      bytes += VarintSize(static_cast<uint64_t>(i - prev - 1)) + 4;
      prev = i;
      ++count;
    }
  }
  bytes += VarintSize(static_cast<uint64_t>(count));
  const bool is_dense = bytes >= dense;
  if (dense_out != nullptr) *dense_out = is_dense;
  return is_dense ? dense : bytes;
}
int64_t PullBytes(const Partition& p, const Values& held, const Values& now) {
  int64_t sum = 0;
  for (const ChunkInfo& c : p.chunks()) sum += ChunkPullBytes(c, held, now);
  return sum;
}

// Held versions, keyed by partition chunk index.
using Held = std::map<int64_t, int64_t>;

// A "changes" pull request for every chunk shard `s` owns, with the held versions (-1 absent).
PullRequest ChangesRequest(const JobLayout& l, const Partition& p, int32_t s, int32_t worker,
                           const Held& held, const std::string& codec = "changes") {
  PullRequest r;
  r.set_job(l.job);
  r.set_worker(worker);
  r.set_codec(codec);
  for (int64_t idx : p.shard_chunks(s)) {
    ChunkData* c = r.add_chunks();
    c->set_tensor(p.chunks()[idx].tensor);
    c->set_chunk(p.chunks()[idx].chunk);
    auto it = held.find(idx);
    c->set_version(it == held.end() ? -1 : it->second);
  }
  return r;
}

// Gradient zero everywhere except at `entries` ((tensor, index) -> value).
Values Sparse(const JobLayout& l, std::initializer_list<std::pair<std::pair<int, int>, float>> e) {
  Values g = Zeros(l);
  for (const auto& [ti, v] : e) g[ti.first][ti.second] = v;
  return g;
}

// Fixture: kShards (two) memory-only shards and a raw stub to each.
class ChangesPullTest : public TwoShardFixture {
 protected:
  std::unique_ptr<ParameterClient> Client(const JobLayout& l, int32_t worker,
                                          const std::string& pull_codec) {
    auto c = NewGrpcParameterClient(l, ClientOptions(Addrs(), worker, pull_codec));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(c).value() : nullptr;
  }

  // Raw dense pull (codec "", no chunk list) of every shard as worker `worker`.
  Values RawDense(const JobLayout& l, int32_t worker) {
    Partition p = MakePartition(l, kShards);
    Values v = Zeros(l);
    for (int32_t s = 0; s < kShards; ++s) {
      PullRequest r;
      r.set_job(l.job);
      r.set_worker(worker);
      PullResponse resp;
      grpc::Status st = stubs_[s]->Pull(Ctx().get(), r, &resp);
      EXPECT_TRUE(st.ok()) << st.error_message();
      const auto& owned = p.shard_chunks(s);
      EXPECT_EQ(resp.chunks_size(), static_cast<int>(owned.size()));
      for (int i = 0; i < resp.chunks_size() && i < static_cast<int>(owned.size()); ++i) {
        const ChunkInfo& c = p.chunks()[owned[i]];
        const ChunkData& d = resp.chunks(i);
        EXPECT_EQ(d.codec(), "");
        EXPECT_EQ(d.data().size(), static_cast<size_t>(c.numel * 4));
        std::memcpy(v[c.tensor].data() + c.offset, d.data().data(),
                    std::min<size_t>(d.data().size(), c.numel * 4));
      }
    }
    return v;
  }

  // Raw "changes" pull from shard `s`: applies each chunk to *held_values (dense overwrite or
  // DecodeChanges semantics, reimplemented here), updates *held, returns each chunk's codec by
  // partition index, and the payload sizes in *bytes.
  std::map<int64_t, std::string> RawChanges(Stub* stub, const JobLayout& l, int32_t s,
                                            int32_t worker, Held* held, Values* held_values,
                                            int64_t* bytes = nullptr,
                                            const Held* request_held = nullptr) {
    Partition p = MakePartition(l, kShards);
    PullResponse resp;
    grpc::Status st = stub->Pull(
        Ctx().get(), ChangesRequest(l, p, s, worker, request_held ? *request_held : *held), &resp);
    EXPECT_TRUE(st.ok()) << st.error_message();
    std::map<int64_t, std::string> codecs;
    const auto& owned = p.shard_chunks(s);
    EXPECT_EQ(resp.chunks_size(), static_cast<int>(owned.size()));
    for (int i = 0; i < resp.chunks_size() && i < static_cast<int>(owned.size()); ++i) {
      const ChunkInfo& c = p.chunks()[owned[i]];
      const ChunkData& d = resp.chunks(i);
      EXPECT_EQ(d.tensor(), c.tensor);
      EXPECT_EQ(d.chunk(), c.chunk);
      codecs[owned[i]] = d.codec();
      (*held)[owned[i]] = d.version();
      if (bytes != nullptr) *bytes += static_cast<int64_t>(d.data().size());
      float* dst = (*held_values)[c.tensor].data() + c.offset;
      if (d.codec().empty()) {
        EXPECT_EQ(d.data().size(), static_cast<size_t>(c.numel * 4));
        std::memcpy(dst, d.data().data(), std::min<size_t>(d.data().size(), c.numel * 4));
      } else {
        EXPECT_EQ(d.codec(), "changes");
        EXPECT_OK(DecodeChangesRef(d.data(), dst, c.numel));
      }
    }
    return codecs;
  }

  // Independent decoder of the documented format (varint count, varint gaps, float32 values).
  static absl::Status DecodeChangesRef(const std::string& b, float* dst, int64_t n) {
    size_t pos = 0;
    auto varint = [&](uint64_t* out) {
      uint64_t v = 0;
      for (int shift = 0; pos < b.size() && shift < 64; shift += 7) {
        const uint8_t byte = static_cast<uint8_t>(b[pos++]);
        v |= static_cast<uint64_t>(byte & 0x7f) << shift;
        if ((byte & 0x80) == 0) {
          *out = v;
          return true;
        }
      }
      return false;
    };
    uint64_t count;
    if (!varint(&count)) return absl::DataLossError("count");
    std::vector<int64_t> idx;
    int64_t prev = -1;
    for (uint64_t k = 0; k < count; ++k) {
      uint64_t gap;
      if (!varint(&gap)) return absl::DataLossError("gap");
      prev = prev + 1 + static_cast<int64_t>(gap);
      if (prev >= n) return absl::DataLossError("index");
      idx.push_back(prev);
    }
    if (b.size() - pos != 4 * count) return absl::DataLossError("value bytes");
    for (uint64_t k = 0; k < count; ++k) std::memcpy(dst + idx[k], b.data() + pos + 4 * k, 4);
    return absl::OkStatus();
  }

  void RawPush(Stub* stub, const JobLayout& l, int32_t s, int32_t worker, int64_t step,
               const Values& grad) {
    Partition p = MakePartition(l, kShards);
    PushRequest r;
    r.set_job(l.job);
    r.set_worker(worker);
    r.set_step(step);
    r.set_request_id(static_cast<uint64_t>(step) * 100 + worker + 1);
    for (int64_t idx : p.shard_chunks(s)) {
      const ChunkInfo& c = p.chunks()[idx];
      ChunkData* d = r.add_chunks();
      d->set_tensor(c.tensor);
      d->set_chunk(c.chunk);
      d->set_dtype(FLOAT32);
      d->set_data(Bytes(grad[c.tensor].data() + c.offset, c.numel));
    }
    PushResponse resp;
    grpc::Status st = stub->Push(Ctx().get(), r, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_FALSE(resp.duplicate());
  }
};

// ---------------------------------------------------------------------------------------------
// 1. The real client: first pull dense, then only the changes of a sparse update.

TEST_F(ChangesPullTest, ClientFirstPullDenseThenExactChanges) {
  const JobLayout l = Layout("client");
  const Partition p = MakePartition(l, kShards);
  const Values init = OddInit(l);
  auto w0 = Client(l, 0, "changes");
  ASSERT_NE(w0, nullptr);
  ASSERT_OK(w0->InitJob(ConstSpans(init)));

  Values params = Zeros(l);
  ASSERT_OK(w0->Pull(Spans(params)));
  EXPECT_TRUE(SameBits(params, init));
  const int64_t raw_all = 4 * TotalElems(l);
  EXPECT_EQ(w0->raw_bytes_pulled(), raw_all);
  EXPECT_EQ(w0->bytes_pulled(), raw_all);  // nothing held: every chunk dense

  // A sparse gradient through the same client (dense push; zero entries change nothing).
  const Values grad = Sparse(l, {{{0, 3}, 1.0f},
                                 {{2, 5}, 0.5f},
                                 {{2, 5001}, 2.0f},
                                 {{2, 5002}, -0.25f},
                                 {{2, 12344}, -1.0f},
                                 {{3, 20}, 3.0f}});
  const Values want = Apply(init, grad);
  ASSERT_OK(w0->Push(1, ConstSpans(grad)));
  ASSERT_OK(w0->Pull(Spans(params)));
  EXPECT_TRUE(SameBits(params, want));
  EXPECT_TRUE(SameBits(params, RawDense(l, 1)));  // what the shards hold, read by another rank
  const int64_t delta = PullBytes(p, init, want);
  // 16 chunks: 5 with changes (a: 6; c0: 6; c5: 1 + 2 gaps + 8 = 11; c12: index 344 needs a
  // 2-byte gap, 7; d: 6), 11 with none (1 byte each).
  EXPECT_EQ(p.chunks().size(), 16u);
  EXPECT_EQ(delta, 6 + 6 + 11 + 7 + 6 + 11);
  EXPECT_EQ(w0->bytes_pulled(), raw_all + delta);
  EXPECT_EQ(w0->raw_bytes_pulled(), 2 * raw_all);

  // Nothing changed: 1 byte per chunk.
  ASSERT_OK(w0->Pull(Spans(params)));
  EXPECT_TRUE(SameBits(params, want));
  EXPECT_EQ(w0->bytes_pulled(), raw_all + delta + 16);

  // A second sparse update on top.
  const Values grad2 = Sparse(l, {{{1, 0}, 0.5f}, {{2, 999}, 1.0f}, {{2, 1000}, 1.0f}});
  const Values want2 = Apply(want, grad2);
  ASSERT_OK(w0->Push(2, ConstSpans(grad2)));
  ASSERT_OK(w0->Pull(Spans(params)));
  EXPECT_TRUE(SameBits(params, want2));
  EXPECT_EQ(w0->bytes_pulled(), raw_all + delta + 16 + PullBytes(p, want, want2));
  EXPECT_EQ(w0->raw_bytes_pulled(), 4 * raw_all);
}

// ---------------------------------------------------------------------------------------------
// 2. Two workers: worker 1 pushes, worker 0 pulls changes; a fully changed chunk comes dense.

TEST_F(ChangesPullTest, TwoWorkersFullyChangedChunkComesDense) {
  const JobLayout l = Layout("two");
  const Partition p = MakePartition(l, kShards);
  const Values init = OddInit(l);
  auto w0 = Client(l, 0, "changes");
  auto w1 = Client(l, 1, "");
  ASSERT_NE(w0, nullptr);
  ASSERT_NE(w1, nullptr);
  ASSERT_OK(w0->InitJob(ConstSpans(init)));
  ASSERT_OK(w1->InitJob(ConstSpans(init)));

  Values params = Zeros(l);
  ASSERT_OK(w0->Pull(Spans(params)));
  ASSERT_TRUE(SameBits(params, init));
  const int64_t after_first = w0->bytes_pulled();

  // Worker 1 changes every entry of a[10] and d[3x7] and one of c.
  Values grad = Sparse(l, {{{2, 7777}, 0.75f}});
  for (float& g : grad[0]) g = 0.5f;
  for (float& g : grad[3]) g = -2.0f;
  const Values want = Apply(init, grad);
  ASSERT_OK(w1->Push(1, ConstSpans(grad)));

  ASSERT_OK(w0->Pull(Spans(params)));
  EXPECT_TRUE(SameBits(params, want));
  int dense_chunks = 0;
  for (const ChunkInfo& c : p.chunks()) {
    bool dense = false;
    ChunkPullBytes(c, init, want, &dense);
    dense_chunks += dense;
  }
  EXPECT_EQ(dense_chunks, 2);  // a and d
  // a dense (40), d dense (84), c's chunk 7 with one change (1 + 2 + 4), 13 chunks unchanged.
  EXPECT_EQ(PullBytes(p, init, want), 40 + 84 + 7 + 13);
  EXPECT_EQ(w0->bytes_pulled() - after_first, 40 + 84 + 7 + 13);

  // The same seen through a raw stub as worker 1: per-chunk codecs.
  Held held;
  Values mirror = Zeros(l);
  for (int s = 0; s < kShards; ++s) {
    for (const auto& [idx, codec] : RawChanges(stubs_[s].get(), l, s, 1, &held, &mirror)) {
      EXPECT_EQ(codec, "") << "first pull, chunk " << idx;
    }
  }
  EXPECT_TRUE(SameBits(mirror, want));
  Values grad2 = Zeros(l);
  for (float& g : grad2[0]) g = 0.25f;  // all of a changes again
  const Values want2 = Apply(want, grad2);
  ASSERT_OK(w1->Push(2, ConstSpans(grad2)));
  for (int s = 0; s < kShards; ++s) {
    int64_t bytes = 0;
    const auto codecs = RawChanges(stubs_[s].get(), l, s, 1, &held, &mirror, &bytes);
    for (const auto& [idx, codec] : codecs) {
      if (p.chunks()[idx].tensor == 0) {
        EXPECT_EQ(codec, "") << "fully changed chunk " << idx;
      } else {
        EXPECT_EQ(codec, "changes") << "unchanged chunk " << idx;
      }
    }
  }
  EXPECT_TRUE(SameBits(mirror, want2));
  ASSERT_OK(w0->Pull(Spans(params)));
  EXPECT_TRUE(SameBits(params, want2));
}

// ---------------------------------------------------------------------------------------------
// 3. Raw stub: held version must be the one the shard last sent this worker.

TEST_F(ChangesPullTest, HeldVersionMismatchIsDenseMatchIsOneByte) {
  const JobLayout l = Layout("raw");
  const Partition p = MakePartition(l, kShards);
  const Values init = OddInit(l);
  for (int s = 0; s < kShards; ++s) {
    InitJobResponse r;
    grpc::Status st = stubs_[s]->InitJob(Ctx().get(), MakeInitRequest(l, kShards, s, init), &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  // Version 2 on every chunk: two pushes by worker 1.
  const Values g = Sparse(l, {{{2, 1}, 1.0f}});
  for (int s = 0; s < kShards; ++s) {
    RawPush(stubs_[s].get(), l, s, 1, 1, g);
    RawPush(stubs_[s].get(), l, s, 1, 2, g);
  }
  const Values want = Apply(Apply(init, g), g);

  for (int s = 0; s < kShards; ++s) {
    SCOPED_TRACE(absl::StrCat("shard ", s));
    // Claims version 2 (current) but the shard never sent this worker anything: dense.
    Held claimed;
    for (int64_t idx : p.shard_chunks(s)) claimed[idx] = 2;
    Held held;
    Values v = Zeros(l);
    for (const auto& [idx, codec] :
         RawChanges(stubs_[s].get(), l, s, 0, &held, &v, nullptr, &claimed)) {
      EXPECT_EQ(codec, "") << idx;
      EXPECT_EQ(held[idx], 2);
    }
    // Held version not what was last sent (1, 3, 0): dense again.
    for (int64_t wrong : {1, 3, 0}) {
      Held bad;
      for (int64_t idx : p.shard_chunks(s)) bad[idx] = wrong;
      Held h2;
      for (const auto& [idx, codec] :
           RawChanges(stubs_[s].get(), l, s, 0, &h2, &v, nullptr, &bad)) {
        EXPECT_EQ(codec, "") << "held " << wrong << " chunk " << idx;
      }
    }
    // Matching version, nothing changed: "changes" with one byte, count 0.
    PullResponse resp;
    grpc::Status st = stubs_[s]->Pull(Ctx().get(), ChangesRequest(l, p, s, 0, held), &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(resp.chunks_size(), static_cast<int>(p.shard_chunks(s).size()));
    for (const ChunkData& c : resp.chunks()) {
      EXPECT_EQ(c.codec(), "changes");
      EXPECT_EQ(c.data(), std::string(1, '\0'));
      EXPECT_EQ(c.version(), 2);
      EXPECT_EQ(c.dtype(), FLOAT32);
    }
    // Another worker's sent state is separate: worker 1 never pulled, so it gets dense.
    Held h1;
    Values v1 = Zeros(l);
    for (const auto& [idx, codec] :
         RawChanges(stubs_[s].get(), l, s, 1, &h1, &v1, nullptr, &held)) {
      EXPECT_EQ(codec, "") << idx;
    }
    // A chunk subset in the request is honoured (only those chunks come back).
    PullRequest one = ChangesRequest(l, p, s, 0, held);
    while (one.chunks_size() > 1) one.mutable_chunks()->RemoveLast();
    PullResponse r1;
    st = stubs_[s]->Pull(Ctx().get(), one, &r1);
    ASSERT_TRUE(st.ok()) << st.error_message();
    ASSERT_EQ(r1.chunks_size(), 1);
    EXPECT_EQ(r1.chunks(0).codec(), "changes");
    EXPECT_EQ(r1.chunks(0).data(), std::string(1, '\0'));
  }
  Values dense = RawDense(l, 0);
  EXPECT_TRUE(SameBits(dense, want));
}

// ---------------------------------------------------------------------------------------------
// 4. Lost response: the client did not apply a changes answer and asks again with its old
//    version: dense, exact.

TEST_F(ChangesPullTest, LostResponseGetsDenseAgain) {
  const JobLayout l = Layout("lost");
  const Partition p = MakePartition(l, kShards);
  const Values init = OddInit(l);
  for (int s = 0; s < kShards; ++s) {
    InitJobResponse r;
    grpc::Status st = stubs_[s]->InitJob(Ctx().get(), MakeInitRequest(l, kShards, s, init), &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  Held held;
  Values v = Zeros(l);
  for (int s = 0; s < kShards; ++s) RawChanges(stubs_[s].get(), l, s, 0, &held, &v);
  ASSERT_TRUE(SameBits(v, init));
  const Held old = held;  // all 0

  const Values g = Sparse(l, {{{0, 9}, 1.0f}, {{2, 3000}, -1.5f}, {{3, 0}, 0.125f}});
  const Values want = Apply(init, g);
  for (int s = 0; s < kShards; ++s) RawPush(stubs_[s].get(), l, s, 1, 1, g);

  // Applied pull: changes, exact.
  Held applied = held;
  Values got = v;
  int64_t bytes = 0;
  for (int s = 0; s < kShards; ++s) {
    for (const auto& [idx, codec] : RawChanges(stubs_[s].get(), l, s, 0, &applied, &got, &bytes)) {
      EXPECT_EQ(codec, "changes") << idx;
    }
  }
  EXPECT_TRUE(SameBits(got, want));
  EXPECT_EQ(bytes, PullBytes(p, init, want));

  // Lost: the client still holds `init` at version 0 and asks with it.
  Held lost = old;
  Values stale = v;
  for (int s = 0; s < kShards; ++s) {
    for (const auto& [idx, codec] : RawChanges(stubs_[s].get(), l, s, 0, &lost, &stale)) {
      EXPECT_EQ(codec, "") << idx;
      EXPECT_EQ(lost[idx], 1);
    }
  }
  EXPECT_TRUE(SameBits(stale, want));
  // From there, changes again (none: 1 byte each).
  bytes = 0;
  for (int s = 0; s < kShards; ++s) {
    for (const auto& [idx, codec] : RawChanges(stubs_[s].get(), l, s, 0, &lost, &stale, &bytes)) {
      EXPECT_EQ(codec, "changes") << idx;
    }
  }
  EXPECT_EQ(bytes, static_cast<int64_t>(p.chunks().size()));
  EXPECT_TRUE(SameBits(stale, want));
}

// ---------------------------------------------------------------------------------------------
// 5. Restart of a durable shard: sent state is not persisted, so each chunk once dense.

TEST_F(ChangesPullTest, RestartedDurableShardSendsDenseOnceThenChanges) {
  // Own durable shards (the fixture's are memory-only).
  std::vector<std::string> dirs;
  std::vector<std::unique_ptr<TestServer>> servers;
  std::vector<std::unique_ptr<Stub>> stubs;
  for (int s = 0; s < kShards; ++s) {
    ASSERT_OK_AND_ASSIGN(std::string dir, testutil::MakeUniqueTestDir(absl::StrCat("shard", s)));
    dirs.push_back(dir);
    servers.push_back(StartDurableServer(dirs.back()));
    ASSERT_NE(servers.back(), nullptr);
    stubs.push_back(ParameterService::NewStub(MakeChannel(servers.back()->addr, RpcOptions())));
  }
  JobLayout l = Layout("durable");
  l.durability.set_mode("every_update");  // InitJob asks for every update to be stored
  l.durability.set_snapshot_every_updates(1000000);
  const Partition p = MakePartition(l, kShards);
  const Values init = OddInit(l);
  for (int s = 0; s < kShards; ++s) {
    InitJobResponse r;
    grpc::Status st = stubs[s]->InitJob(Ctx().get(), MakeInitRequest(l, kShards, s, init), &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  Held held;
  Values v = Zeros(l);
  for (int s = 0; s < kShards; ++s) RawChanges(stubs[s].get(), l, s, 0, &held, &v);
  const Values g = Sparse(l, {{{2, 10}, 1.0f}, {{2, 11000}, 2.0f}, {{0, 0}, -1.0f}});
  for (int s = 0; s < kShards; ++s) RawPush(stubs[s].get(), l, s, 1, 1, g);
  const Values want = Apply(init, g);
  for (int s = 0; s < kShards; ++s) {
    for (const auto& [idx, codec] : RawChanges(stubs[s].get(), l, s, 0, &held, &v)) {
      EXPECT_EQ(codec, "changes") << idx;
    }
  }
  ASSERT_TRUE(SameBits(v, want));

  // Restart shard 0 from its RocksDB directory (shard 1 keeps running).
  stubs[0].reset();
  servers[0]->Stop();
  servers[0] = StartDurableServer(dirs[0]);
  ASSERT_NE(servers[0], nullptr);
  stubs[0] = ParameterService::NewStub(MakeChannel(servers[0]->addr, RpcOptions()));

  // Values and versions survived; the held versions match, but shard 0 does not know what it
  // sent: dense for each of its chunks. Shard 1: changes (nothing changed, 1 byte).
  for (int s = 0; s < kShards; ++s) {
    int64_t bytes = 0;
    for (const auto& [idx, codec] : RawChanges(stubs[s].get(), l, s, 0, &held, &v, &bytes)) {
      EXPECT_EQ(codec, s == 0 ? "" : "changes") << "shard " << s << " chunk " << idx;
      EXPECT_EQ(held[idx], 1);
    }
    int64_t want_bytes = 0;
    for (int64_t idx : p.shard_chunks(s)) want_bytes += s == 0 ? 4 * p.chunks()[idx].numel : 1;
    EXPECT_EQ(bytes, want_bytes) << "shard " << s;
  }
  EXPECT_TRUE(SameBits(v, want));

  // Later pulls: changes everywhere, exact after another sparse update.
  const Values g2 = Sparse(l, {{{2, 12}, 1.0f}, {{3, 5}, 0.5f}});
  for (int s = 0; s < kShards; ++s) RawPush(stubs[s].get(), l, s, 1, 2, g2);
  const Values want2 = Apply(want, g2);
  int64_t bytes = 0;
  for (int s = 0; s < kShards; ++s) {
    for (const auto& [idx, codec] : RawChanges(stubs[s].get(), l, s, 0, &held, &v, &bytes)) {
      EXPECT_EQ(codec, "changes") << "shard " << s << " chunk " << idx;
      EXPECT_EQ(held[idx], 2);
    }
  }
  EXPECT_EQ(bytes, PullBytes(p, want, want2));
  EXPECT_TRUE(SameBits(v, want2));

  // The real client against the restarted shards: first pull dense, then changes.
  auto c =
      NewGrpcParameterClient(l, ClientOptions({servers[0]->addr, servers[1]->addr}, 1, "changes"));
  ASSERT_OK(c.status());
  Values params = Zeros(l);
  ASSERT_OK((*c)->Pull(Spans(params)));
  EXPECT_TRUE(SameBits(params, want2));
  EXPECT_EQ((*c)->bytes_pulled(), 4 * TotalElems(l));
  ASSERT_OK((*c)->Pull(Spans(params)));
  EXPECT_EQ((*c)->bytes_pulled(), 4 * TotalElems(l) + static_cast<int64_t>(p.chunks().size()));
}

// ---------------------------------------------------------------------------------------------
// 6. Unknown codecs are still refused.

TEST_F(ChangesPullTest, BadCodecRejected) {
  const JobLayout l = Layout("bad");
  const Partition p = MakePartition(l, kShards);
  const Values init = OddInit(l);
  for (int s = 0; s < kShards; ++s) {
    InitJobResponse r;
    grpc::Status st = stubs_[s]->InitJob(Ctx().get(), MakeInitRequest(l, kShards, s, init), &r);
    ASSERT_TRUE(st.ok()) << st.error_message();
  }
  for (const std::string bad : {"changez", "Changes", "changes:1", "topk:0.01"}) {
    for (bool with_chunks : {false, true}) {
      PullRequest r = ChangesRequest(l, p, 0, 0, {}, bad);
      if (!with_chunks) r.clear_chunks();
      PullResponse resp;
      grpc::Status st = stubs_[0]->Pull(Ctx().get(), r, &resp);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << bad;
      EXPECT_NE(st.error_message().find("changes"), std::string::npos) << st.error_message();
      EXPECT_NE(st.error_message().find(bad), std::string::npos) << st.error_message();
    }
  }
  auto c = NewGrpcParameterClient(l, ClientOptions(Addrs(), 0, "changez"));
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("changes"), std::string::npos) << c.status();
  // The refused codec changed nothing: a changes pull still starts dense.
  Held held;
  Values v = Zeros(l);
  for (int s = 0; s < kShards; ++s) {
    for (const auto& [idx, codec] : RawChanges(stubs_[s].get(), l, s, 0, &held, &v)) {
      EXPECT_EQ(codec, "") << idx;
    }
  }
  EXPECT_TRUE(SameBits(v, init));
}

}  // namespace
}  // namespace gradmesh
