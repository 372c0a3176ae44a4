// Helpers for tests that run parameter-server shards in process over real gRPC on 127.0.0.1:
// layouts and values, InitJob requests as the real client builds them, raw RPC wrappers, and
// an in-process shard server (memory-only or durable). Shared by tests/ps_service_test.cc,
// tests/compression_wire_test.cc and tests/changes_pull_test.cc.
#ifndef GRADMESH_TESTS_TESTING_LOOPBACK_H_
#define GRADMESH_TESTS_TESTING_LOOPBACK_H_

#include <grpcpp/client_context.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/partitioner.h"
#include "gtest/gtest.h"
#include "proto/gradmesh.grpc.pb.h"
#include "proto/gradmesh.pb.h"
#include "rpc/grpc_util.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "server/shard_store.h"
#include "worker/ps/parameter_client.h"

namespace gradmesh {
namespace loopback {

using Stub = ParameterService::Stub;
using Values = std::vector<std::vector<float>>;  // One vector per tensor, layout order.

inline std::string Bytes(const float* v, size_t n) {
  return std::string(reinterpret_cast<const char*>(v), n * sizeof(float));
}

inline std::string Bytes(const std::vector<float>& v) { return Bytes(v.data(), v.size()); }

inline std::vector<float> Floats(const std::string& b) {
  std::vector<float> v(b.size() / sizeof(float));
  std::memcpy(v.data(), b.data(), v.size() * sizeof(float));
  return v;
}

inline uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Element-wise equality of the bit patterns, reporting the first difference.
inline ::testing::AssertionResult SameBits(const Values& got, const Values& want) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " tensors vs " << want.size();
  }
  for (size_t t = 0; t < got.size(); ++t) {
    if (got[t].size() != want[t].size()) {
      return ::testing::AssertionFailure()
             << "tensor " << t << " sizes " << got[t].size() << " vs " << want[t].size();
    }
    for (size_t i = 0; i < got[t].size(); ++i) {
      if (BitsOf(got[t][i]) != BitsOf(want[t][i])) {
        return ::testing::AssertionFailure()
               << "tensor " << t << " element " << i << ": got " << got[t][i] << " ("
               << absl::StrFormat("0x%08x", BitsOf(got[t][i])) << "), want " << want[t][i] << " ("
               << absl::StrFormat("0x%08x", BitsOf(want[t][i])) << ")";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

inline int64_t Numel(const TensorSpec& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) n *= d;
  return n;
}

inline TensorSpec Tensor(const std::string& name, std::initializer_list<int64_t> shape) {
  TensorSpec t;
  t.set_name(name);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

inline std::vector<int64_t> Numels(const JobLayout& l) {
  std::vector<int64_t> n;
  for (const TensorSpec& t : l.tensors) n.push_back(Numel(t));
  return n;
}

inline int64_t TotalElems(const JobLayout& l) {
  int64_t n = 0;
  for (int64_t x : Numels(l)) n += x;
  return n;
}

inline Partition MakePartition(const JobLayout& l, int32_t num_shards) {
  auto p = Partition::Create(Numels(l), l.chunk_elems, num_shards,
                             static_cast<ChunkPlacement>(l.placement));
  EXPECT_TRUE(p.ok()) << p.status();
  return std::move(p).value();
}

inline std::vector<absl::Span<const float>> ConstSpans(const Values& v) {
  std::vector<absl::Span<const float>> out;
  for (const auto& t : v) out.emplace_back(t);
  return out;
}

inline std::vector<absl::Span<float>> Spans(Values& v) {
  std::vector<absl::Span<float>> out;
  for (auto& t : v) out.emplace_back(absl::MakeSpan(t));
  return out;
}

inline Values Zeros(const JobLayout& l) {
  Values v;
  for (int64_t n : Numels(l)) v.emplace_back(n, 0.0f);
  return v;
}

// InitJob request for shard `shard` of `num_shards`, as the real client builds it (the
// layout's consistency, durability, staleness damping and barrier timeout included).
inline InitJobRequest MakeInitRequest(const JobLayout& l, int32_t num_shards, int32_t shard,
                                      const Values& init) {
  InitJobRequest r;
  r.set_job(l.job);
  for (const TensorSpec& t : l.tensors) *r.add_tensors() = t;
  r.set_chunk_elems(l.chunk_elems);
  r.set_placement(l.placement);
  r.set_num_shards(num_shards);
  r.set_shard_index(shard);
  *r.mutable_optimizer() = l.optimizer;
  r.set_consistency(l.consistency);
  r.set_num_workers(l.num_workers);
  *r.mutable_durability() = l.durability;
  r.set_staleness_damping(l.staleness_damping);
  r.set_barrier_timeout_s(l.barrier_timeout_s);
  Partition p = MakePartition(l, num_shards);
  for (int64_t idx : p.shard_chunks(shard)) {
    const ChunkInfo& c = p.chunks()[idx];
    ChunkData* d = r.add_initial();
    d->set_tensor(c.tensor);
    d->set_chunk(c.chunk);
    d->set_dtype(FLOAT32);
    d->set_data(Bytes(init[c.tensor].data() + c.offset, c.numel));
  }
  return r;
}

inline std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return ctx;
}

inline grpc::Status RawPull(Stub* stub, const PullRequest& req, PullResponse* resp) {
  return stub->Pull(Ctx().get(), req, resp);
}

inline JobInfoResponse RawInfo(Stub* stub, const std::string& job) {
  JobInfoRequest req;
  req.set_job(job);
  JobInfoResponse resp;
  grpc::Status st = stub->GetJobInfo(Ctx().get(), req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  return resp;
}

// Initial value of element i of tensor t: (1000 * t + i) / 4, exact in float32.
inline Values OddInit(const JobLayout& l) {
  Values v = Zeros(l);
  for (size_t t = 0; t < v.size(); ++t) {
    for (size_t i = 0; i < v[t].size(); ++i) v[t][i] = static_cast<float>(1000 * t + i) * 0.25f;
  }
  return v;
}

// Client options with short deadlines and backoff; `pull_codec` "" pulls dense float32.
inline GrpcParameterClientOptions ClientOptions(std::vector<std::string> servers,
                                                int32_t worker = 0,
                                                const std::string& pull_codec = "") {
  GrpcParameterClientOptions o;
  o.servers = std::move(servers);
  o.worker = worker;
  o.pull_codec = pull_codec;
  o.rpc_deadline = absl::Seconds(10);
  o.max_attempts = 3;
  o.initial_backoff = absl::Milliseconds(10);
  o.max_backoff = absl::Milliseconds(50);
  return o;
}

// One in-process shard server.
struct TestServer {
  std::unique_ptr<Shard> shard;
  std::unique_ptr<ParameterServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  std::string addr;

  // Shuts the server down (1 s grace) and destroys service and shard, as a crash-free process
  // exit would; a durable shard's store can then be reopened. Idempotent.
  void Stop() {
    if (server != nullptr) {
      server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
      server->Wait();
      server.reset();
    }
    service.reset();
    shard.reset();
  }
  ~TestServer() { Stop(); }
};

// Sends a push on a raw stub; `resp` may be null.
inline grpc::Status RawPush(Stub* stub, const PushRequest& req, PushResponse* resp = nullptr) {
  PushResponse scratch;
  return stub->Push(Ctx().get(), req, resp != nullptr ? resp : &scratch);
}

// All chunks a shard owns for `job`, as one comparable byte string (tensor, chunk, version,
// dtype, codec and raw data of each chunk, in the shard's order).
inline std::string Snapshot(Stub* stub, const std::string& job) {
  PullRequest req;
  req.set_job(job);
  PullResponse resp;
  grpc::Status st = RawPull(stub, req, &resp);
  EXPECT_TRUE(st.ok()) << st.error_message();
  std::string out;
  for (const ChunkData& c : resp.chunks()) {
    absl::StrAppend(&out, "[", c.tensor(), ",", c.chunk(), ",v", c.version(), ",d", c.dtype(), ",c",
                    c.codec(), ",n", c.data().size(), "]", c.data());
  }
  return out;
}

// Starts a server over a shard made with `options` on 127.0.0.1:`port` (0 = any free port).
// Returns null on failure (a shard that cannot be made is also a test failure).
// `tokens` (not owned, may be null: no per-job check) and `shm` configure the service.
inline std::unique_ptr<TestServer> StartShardServer(ShardOptions options,
                                                    RpcOptions rpc = RpcOptions(), int port = 0,
                                                    const JobTokens* tokens = nullptr,
                                                    ShmChannelOptions shm = {}) {
  auto s = std::make_unique<TestServer>();
  auto shard = Shard::Create(std::move(options));
  EXPECT_TRUE(shard.ok()) << shard.status();
  if (!shard.ok()) return nullptr;
  s->shard = std::move(shard).value();
  s->service = std::make_unique<ParameterServiceImpl>(s->shard.get(), tokens, shm);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", port), grpc::InsecureServerCredentials(),
                           &s->port);
  ConfigureServerBuilder(rpc, &builder);
  builder.RegisterService(s->service.get());
  s->server = builder.BuildAndStart();
  if (s->server == nullptr || s->port == 0) return nullptr;
  s->addr = absl::StrCat("127.0.0.1:", s->port);
  return s;
}

// A memory-only shard server on 127.0.0.1:`port` (0 = any free port). Null on failure.
inline std::unique_ptr<TestServer> StartServer(RpcOptions rpc = RpcOptions(), int port = 0) {
  return StartShardServer(ShardOptions(), std::move(rpc), port);
}

// A durable shard server whose store is (re)opened in `store_dir`: after Stop(), a new one on
// the same directory recovers the jobs. Null on failure (a store that cannot be opened is also
// a test failure).
inline std::unique_ptr<TestServer> StartDurableServer(const std::string& store_dir,
                                                      RpcOptions rpc = RpcOptions(), int port = 0) {
  ShardOptions options;
  auto store = ShardStore::Open(store_dir, {});
  EXPECT_TRUE(store.ok()) << store.status();
  if (!store.ok()) return nullptr;
  options.store = std::move(store).value();
  return StartShardServer(std::move(options), std::move(rpc), port);
}

// Fixture: two in-process shards and a raw stub to each.
class TwoShardFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int s = 0; s < 2; ++s) {
      servers_.push_back(StartServer());
      ASSERT_NE(servers_.back(), nullptr);
      stubs_.push_back(ParameterService::NewStub(MakeChannel(servers_.back()->addr, RpcOptions())));
    }
  }

  std::vector<std::string> Addrs() const {
    std::vector<std::string> a;
    for (const auto& s : servers_) a.push_back(s->addr);
    return a;
  }

  std::vector<std::unique_ptr<TestServer>> servers_;
  std::vector<std::unique_ptr<Stub>> stubs_;
};

}  // namespace loopback
}  // namespace gradmesh

#endif  // GRADMESH_TESTS_TESTING_LOOPBACK_H_
