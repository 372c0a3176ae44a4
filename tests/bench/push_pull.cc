// Push/pull goodput and latency of the parameter service on loopback.
//
//   bazel run -c opt //tests/bench:push_pull [-- --seconds=2 --inflight=4
//   --transports=stream,unary]
//
// Starts 1 and 2 in-process shards on 127.0.0.1 (real gRPC over TCP), registers a job with one
// float32 tensor of each size (4 KiB, 256 KiB, 4 MiB; with 2 shards the tensor is split
// evenly between them, as large tensors are in training), and runs `--inflight` clients
// concurrently, each doing back-to-back operations:
//   push:     gradients applied with SGD on the shard(s)
//   pull:     current values fetched
//   pushpull: a push followed by a pull (two round trips)
//   fused:    a push that asks for the values after it (PushRequest.pull, ParameterClient::
//             PushPull: one round trip; a training step's exchange in the ps modes)
// Each configuration is measured with each client transport of --transports (stream: one
// ParameterService.Stream per client and shard; unary: one call per operation), in turn.
// Prints one JSON object per line: op, bytes (payload per op), shards, durability, transport,
// http2_window_kb (--http2_window_kb: 0 = gRPC's probed HTTP/2 windows, N = a fixed N KiB window
// on the shards and clients, rpc/rpc_options.h), inflight, ops, gb_per_s (payload GB/s, 1e9 bytes,
// summed over clients), p50_us, p99_us (per op).
//
// --keys=K makes each operation one step of a K-tensor model (K x size bytes, fused into one
// message per shard by the client, as in training): the same payload as one round of
// ps-lite's benchmark (40 keys issued, then awaited), so --keys=40 compares round for round.
//
// --depth=D is ps-lite's own workload: each client is one thread that issues D operations
// (one message per shard each) over its long-lived ParameterService.Stream per shard without
// waiting, then waits for all D (one "round"), as ps-lite's benchmark issues its 40 keys and
// then waits for them. pushpull then issues each push and pull together, as ps-lite does.
// It drives the transport (rpc/op_stream.h) directly, the layer ps-lite's KVWorker is; pulled
// values are decoded into per-operation buffers. p50_us / p99_us are per round.
//
// Durability cost: --durability=none,periodic,every_update --ops=push
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/daemon.h"
#include "common/partitioner.h"
#include "proto/gradmesh.pb.h"
#include "rpc/grpc_util.h"
#include "rpc/op_stream.h"
#include "rpc/rpc_options.h"
#include "rpc/tensor_wire.h"
#include "server/parameter_service.h"
#include "server/shard.h"
#include "server/shard_store.h"
#include "worker/ps/parameter_client.h"

ABSL_FLAG(double, seconds, 2.0, "Measurement time per configuration.");
ABSL_FLAG(int, inflight, 4, "Concurrent clients (operations in flight).");
ABSL_FLAG(std::string, sizes, "4096,262144,4194304", "Payload sizes in bytes (per tensor).");
ABSL_FLAG(int, keys, 1,
          "Tensors in the job, each `size` bytes; one operation pushes or pulls all of them (one "
          "training step of a K-layer model, fused into one message per shard as the worker "
          "does; ps-lite's benchmark issues its 40 keys as 40 messages, then waits for all).");
ABSL_FLAG(int, depth, 0,
          "0: each client does one operation at a time through ParameterClient. D > 0: each "
          "client keeps D operations in flight over its stream (ps-lite's workload: one worker, "
          "40 keys issued, then awaited; --inflight=1 --depth=40 --keys=1).");
ABSL_FLAG(std::string, ops, "push,pull,pushpull,fused", "Operations to measure.");
ABSL_FLAG(std::string, shards, "1,2", "Shard counts to measure.");
ABSL_FLAG(std::string, durability, "none",
          "Durability settings to measure: none, periodic, every_update (comma-separated). "
          "Durable shards keep RocksDB state in a temporary directory.");
ABSL_FLAG(int64_t, snapshot_every_updates, 1000, "Snapshot interval for durable settings.");
ABSL_FLAG(bool, fsync, false, "fsync the RocksDB WAL on every write.");
ABSL_FLAG(int64_t, shm_spin_us, 0,
          "transport shm: the shards' --shm_spin_us (how long a channel's thread spins for the "
          "next request; 0 = block at once).");
ABSL_FLAG(std::string, transports, "stream,unary",
          "Client transports to measure (GrpcParameterClientOptions.transport: stream, unary, "
          "shm), in turn.");
ABSL_FLAG(int64_t, stream_max_bytes, -1,
          "GrpcParameterClientOptions.stream_max_bytes (-1: the client's default).");
ABSL_FLAG(int64_t, spin_wait_us, -1,
          "GrpcParameterClientOptions.spin_wait in µs (-1: the client's default; 0: never spin).");
ABSL_FLAG(int64_t, http2_window_kb, 0,
          "RpcOptions.http2_window_bytes of the shards and clients, KiB, as the daemons' "
          "--http2_window_kb (0: gRPC's probed windows; N: a fixed N KiB window).");
ABSL_FLAG(bool, mutex_deadlock_detection, false,
          "Leave absl::Mutex deadlock detection on (the daemons turn it off; for an A/B run).");
ABSL_FLAG(double, warmup_seconds, 0.5,
          "Untimed run of each configuration before it is measured (first-touch page faults, "
          "allocator and connection warm-up would otherwise favour whatever runs second).");

namespace gradmesh {
namespace {

struct ShardServer {
  std::unique_ptr<Shard> shard;
  std::unique_ptr<ParameterServiceImpl> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

std::unique_ptr<ShardServer> StartShard(const RpcOptions& rpc, const std::string& data_dir) {
  auto s = std::make_unique<ShardServer>();
  ShardOptions options;
  if (!data_dir.empty()) {
    ShardStore::Options so;
    so.fsync = absl::GetFlag(FLAGS_fsync);
    options.store = std::move(ShardStore::Open(data_dir, so).value());
  }
  s->shard = std::move(Shard::Create(options).value());
  ShmChannelOptions shm;
  shm.spin = absl::Microseconds(absl::GetFlag(FLAGS_shm_spin_us));
  s->service = std::make_unique<ParameterServiceImpl>(s->shard.get(), nullptr, shm);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  ConfigureServerBuilder(rpc, &builder);
  builder.RegisterService(s->service.get());
  s->server = builder.BuildAndStart();
  s->address = absl::StrCat("127.0.0.1:", port);
  return s;
}

double Percentile(std::vector<double>* v, double q) {
  if (v->empty()) return 0;
  std::sort(v->begin(), v->end());
  return (*v)[std::min(v->size() - 1, static_cast<size_t>(q * v->size()))];
}

struct Measured {
  int64_t ops = 0;
  double wall_s = 0;
  double p50_us = 0, p99_us = 0;
  bool failed = false;
};

// Runs `clients` threads for `seconds`, each calling its `one()` (made by `make(w)` on that
// thread; false: it failed) back to back; each call counts `per_call` operations, and the
// latencies are per call.
Measured TimeClients(int clients, double seconds, int64_t per_call,
                     const std::function<std::function<bool()>(int)>& make) {
  std::vector<std::vector<double>> lat(clients);
  std::atomic<bool> failed{false};
  std::vector<std::thread> threads;
  // Each client's buffers (up to depth x size: 160 MiB at 40 x 4 MiB) are allocated and
  // filled before the clock starts, as ps-lite's benchmark does.
  std::vector<std::function<bool()>> ones;
  for (int w = 0; w < clients; ++w) ones.push_back(make(w));
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(seconds);
  for (int w = 0; w < clients; ++w) {
    threads.emplace_back([&, w] {
      const std::function<bool()>& one = ones[w];
      while (absl::Now() < end && !failed.load()) {
        const absl::Time t0 = absl::Now();
        if (!one()) failed = true;
        lat[w].push_back(absl::ToDoubleMicroseconds(absl::Now() - t0));
      }
    });
  }
  for (auto& th : threads) th.join();
  Measured m;
  m.wall_s = absl::ToDoubleSeconds(absl::Now() - start);
  m.failed = failed;
  std::vector<double> all;
  for (auto& l : lat) all.insert(all.end(), l.begin(), l.end());
  m.ops = static_cast<int64_t>(all.size()) * per_call;
  m.p50_us = Percentile(&all, 0.5);
  m.p99_us = Percentile(&all, 0.99);
  return m;
}

// Runs `op` back to back on every client for `seconds`.
Measured Measure(const std::vector<std::unique_ptr<ParameterClient>>& clients, absl::string_view op,
                 int64_t n, int keys, double seconds) {
  const bool do_push = op == "push" || op == "pushpull";
  const bool do_pull = op == "pull" || op == "pushpull";
  const bool do_fused = op == "fused";
  struct Buffers {
    std::vector<float> grad, params;
    std::vector<absl::Span<const float>> grads;
    std::vector<absl::Span<float>> outs;
    int64_t step = 0;
  };
  return TimeClients(static_cast<int>(clients.size()), seconds, 1, [&](int w) {
    auto b = std::make_shared<Buffers>();
    b->grad.assign(n * keys, 0.5f);
    b->params.resize(n * keys);
    for (int k = 0; k < keys; ++k) {
      b->grads.emplace_back(b->grad.data() + k * n, n);
      b->outs.emplace_back(b->params.data() + k * n, n);
    }
    return [&, w, b] {
      bool ok = true;
      if (do_push) ok = clients[w]->Push(b->step++, b->grads).ok() && ok;
      if (do_pull) ok = clients[w]->Pull(b->outs).ok() && ok;
      if (do_fused) ok = clients[w]->PushPull(b->step++, b->grads, b->outs, nullptr).ok() && ok;
      return ok;
    };
  });
}

// One --depth client: a stream per shard, `depth` operations in flight per round.
class DepthClient {
 public:
  DepthClient(const std::vector<std::string>& addresses, const RpcOptions& rpc,
              const JobLayout& layout, const Partition& partition, int32_t worker)
      : layout_(layout), partition_(partition), worker_(worker) {
    for (const std::string& addr : addresses) {
      stubs_.push_back(std::make_unique<grpc::GenericStub>(MakeChannel(addr, rpc)));
      streams_.push_back(
          std::make_unique<OpStream>(stubs_.back().get(), "/gradmesh.ParameterService/Stream",
                                     std::vector<std::pair<std::string, std::string>>()));
      PullRequest pull;
      pull.set_job(layout.job);
      pull.set_worker(worker);
      pulls_.push_back(pull.SerializeAsString());
    }
  }

  // Issues `depth` operations `op` on every shard, waits for all; false if one failed.
  bool Round(absl::string_view op, int depth, const float* grad, std::vector<float>* params) {
    const bool push = op != "pull", pull = op == "pull" || op == "pushpull";
    const bool fused = op == "fused";
    const int per = static_cast<int>(push) + static_cast<int>(pull);  // Messages per shard.
    const int shards = static_cast<int>(streams_.size());
    // Shared with the completions: the last one may still be unlocking `mu` as this returns.
    struct State {
      absl::Mutex mu;
      int left = 0;
      bool ok = true;
      std::vector<grpc::ByteBuffer> reqs, resps;
    };
    auto st = std::make_shared<State>();
    st->reqs.resize(static_cast<size_t>(depth) * shards * per);
    st->resps.resize(st->reqs.size());
    st->left = static_cast<int>(st->reqs.size());
    size_t i = 0;
    for (int d = 0; d < depth; ++d) {
      float* out = params->data() + static_cast<int64_t>(d) * partition_.tensor_numel(0);
      for (int32_t s = 0; s < shards; ++s) {
        auto done = [this, st, out, s](size_t at, bool decode) {
          return [this, st, out, s, at, decode](grpc::Status status) {
            const bool good = status.ok() && (!decode || Decode(st->resps[at], s, out));
            absl::MutexLock lock(&st->mu);
            st->ok = st->ok && good;
            --st->left;
          };
        };
        if (push) {
          std::vector<PushChunkRef> refs;
          for (int64_t idx : partition_.shard_chunks(s)) {
            const ChunkInfo& c = partition_.chunks()[idx];
            refs.push_back({c.tensor, c.chunk, 0, grad + c.offset, c.numel, "", {}});
          }
          st->reqs[i] = EncodePushRequest(layout_.job, worker_, step_++, next_id_++, refs, false,
                                          fused ? absl::string_view(pulls_[s]) : "");
          streams_[s]->Call(StreamOp::kPush, st->reqs[i], &st->resps[i], done(i, fused),
                            pull || d + 1 < depth);
          ++i;
        }
        if (pull) {
          grpc::Slice slice(pulls_[s].data(), pulls_[s].size());
          st->reqs[i] = grpc::ByteBuffer(&slice, 1);
          streams_[s]->Call(StreamOp::kPull, st->reqs[i], &st->resps[i], done(i, true),
                            d + 1 < depth);
          ++i;
        }
      }
    }
    absl::MutexLock lock(&st->mu);
    st->mu.Await(absl::Condition(
        +[](int* n) { return *n == 0; }, &st->left));
    return st->ok;
  }

 private:
  // Copies shard `s`'s pulled chunks (a PullResponse, or a PushResponse carrying one) into
  // `out` (the tensor's values).
  bool Decode(const grpc::ByteBuffer& resp, int32_t s, float* out) const {
    grpc::ByteBuffer pulled;
    bool found = true;
    const grpc::ByteBuffer* body = &resp;
    if (resp.Length() > 0 && !FindMessageField(resp, 4, &pulled, &found).ok()) return false;
    if (found && pulled.Length() > 0) body = &pulled;
    int got = 0;
    absl::Status st =
        DecodePullResponse(*body,
                           [&](int32_t tensor, int32_t chunk, int64_t, int32_t, absl::string_view,
                               int64_t bytes) -> absl::StatusOr<char*> {
                             const int64_t idx = partition_.Find(tensor, chunk);
                             if (idx < 0 || partition_.chunks()[idx].numel * 4 != bytes) {
                               return absl::DataLossError("unexpected chunk");
                             }
                             ++got;
                             return reinterpret_cast<char*>(out + partition_.chunks()[idx].offset);
                           });
    return st.ok() && got == static_cast<int>(partition_.shard_chunks(s).size());
  }

  const JobLayout& layout_;
  const Partition& partition_;
  const int32_t worker_;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  std::vector<std::unique_ptr<OpStream>> streams_;
  std::vector<std::string> pulls_;  // Each shard's encoded PullRequest.
  int64_t step_ = 0;
  uint64_t next_id_ = uint64_t{1} << 40;  // Apart from ParameterClient's request ids.
};

// Runs rounds of `depth` operations back to back on every client for `seconds`; ops counts
// operations (depth per round), latencies are per round.
Measured MeasureDepth(std::vector<std::unique_ptr<DepthClient>>* clients, absl::string_view op,
                      int64_t n, int depth, double seconds) {
  return TimeClients(static_cast<int>(clients->size()), seconds, depth, [&](int w) {
    auto grad = std::make_shared<std::vector<float>>(n, 0.5f);
    auto params = std::make_shared<std::vector<float>>(n * depth);
    return [&, w, grad, params] {
      return (*clients)[w]->Round(op, depth, grad->data(), params.get());
    };
  });
}

int Run() {
  RpcOptions rpc;
  absl::StatusOr<int64_t> window = Http2WindowBytesFromKb(absl::GetFlag(FLAGS_http2_window_kb));
  if (!window.ok()) {
    std::fprintf(stderr, "%s\n", window.status().ToString().c_str());
    return 2;
  }
  rpc.http2_window_bytes = *window;
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int inflight = absl::GetFlag(FLAGS_inflight);
  const int keys = absl::GetFlag(FLAGS_keys);
  if (keys < 1) {
    std::fprintf(stderr, "--keys must be >= 1\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_depth) < 0 || (absl::GetFlag(FLAGS_depth) > 0 && keys != 1)) {
    std::fprintf(stderr, "--depth must be >= 0, and --keys 1 when it is > 0\n");
    return 2;
  }
  int job_id = 0;
  for (absl::string_view durability_s : absl::StrSplit(absl::GetFlag(FLAGS_durability), ',')) {
    const std::string durability(durability_s);
    for (absl::string_view shards_s : absl::StrSplit(absl::GetFlag(FLAGS_shards), ',')) {
      const int num_shards = std::stoi(std::string(shards_s));
      std::vector<std::unique_ptr<ShardServer>> servers;
      std::vector<std::string> addresses;
      std::vector<std::string> dirs;
      for (int s = 0; s < num_shards; ++s) {
        std::string dir;
        if (durability != "none") {
          std::string tmpl = "/tmp/gradmesh-bench.XXXXXX";
          dir = mkdtemp(tmpl.data());
          dirs.push_back(dir);
        }
        servers.push_back(StartShard(rpc, dir));
        addresses.push_back(servers.back()->address);
      }
      for (absl::string_view size_s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',')) {
        const int64_t bytes = std::stoll(std::string(size_s));
        const int64_t n = bytes / 4;
        JobLayout layout;
        layout.job = absl::StrCat("bench", job_id++);
        for (int k = 0; k < keys; ++k) {
          TensorSpec t;
          t.set_name(keys == 1 ? "w" : absl::StrCat("w", k));
          t.add_shape(n);
          layout.tensors.push_back(t);
        }
        layout.chunk_elems = (n + num_shards - 1) / num_shards;
        layout.optimizer.set_name("sgd");
        layout.optimizer.set_lr(1e-6);
        layout.num_workers = inflight;
        layout.durability.set_mode(durability);
        layout.durability.set_snapshot_every_updates(absl::GetFlag(FLAGS_snapshot_every_updates));
        layout.durability.set_snapshot_every_seconds(30);
        std::vector<std::string> transports = absl::StrSplit(absl::GetFlag(FLAGS_transports), ',');
        std::vector<std::vector<std::unique_ptr<ParameterClient>>> clients(transports.size());
        for (size_t t = 0; t < transports.size(); ++t) {
          for (int w = 0; w < inflight; ++w) {
            GrpcParameterClientOptions co;
            co.servers = addresses;
            co.worker = w;
            co.rpc = rpc;
            co.transport = transports[t];
            if (absl::GetFlag(FLAGS_spin_wait_us) >= 0) {
              co.spin_wait = absl::Microseconds(absl::GetFlag(FLAGS_spin_wait_us));
            }
            if (absl::GetFlag(FLAGS_stream_max_bytes) >= 0) {
              co.stream_max_bytes = absl::GetFlag(FLAGS_stream_max_bytes);
            }
            clients[t].push_back(std::move(NewGrpcParameterClient(layout, co).value()));
          }
        }
        std::vector<float> init(n, 1.0f);
        absl::Status st = clients[0][0]->InitJob(
            std::vector<absl::Span<const float>>(keys, absl::Span<const float>(init)));
        if (!st.ok()) {
          std::fprintf(stderr, "InitJob failed: %s\n", st.ToString().c_str());
          return 1;
        }
        const int depth = absl::GetFlag(FLAGS_depth);
        const Partition partition = Partition::Create({n}, layout.chunk_elems, num_shards).value();
        std::vector<std::unique_ptr<DepthClient>> depth_clients;
        if (depth > 0) {
          transports = {"stream"};
          for (int w = 0; w < inflight; ++w) {
            depth_clients.push_back(
                std::make_unique<DepthClient>(addresses, rpc, layout, partition, w));
          }
        }
        auto measure = [&](size_t t, absl::string_view op, double secs) {
          return depth > 0 ? MeasureDepth(&depth_clients, op, n, depth, secs)
                           : Measure(clients[t], op, n, keys, secs);
        };
        for (absl::string_view op : absl::StrSplit(absl::GetFlag(FLAGS_ops), ',')) {
          for (size_t t = 0; t < transports.size(); ++t) {
            if (measure(t, op, absl::GetFlag(FLAGS_warmup_seconds)).failed) {
              std::fprintf(stderr, "operation %s failed\n", std::string(op).c_str());
              return 1;
            }
            const Measured m = measure(t, op, seconds);
            if (m.failed) {
              std::fprintf(stderr, "operation %s failed\n", std::string(op).c_str());
              return 1;
            }
            const double payload = static_cast<double>(m.ops) * keys * bytes *
                                   (op == "pushpull" || op == "fused" ? 2 : 1);
            std::printf(
                "{\"op\":\"%s\",\"bytes\":%lld,\"shards\":%d,\"durability\":\"%s\","
                "\"transport\":\"%s\",\"http2_window_kb\":%lld,\"inflight\":%d,\"depth\":%d,"
                "\"keys\":%d,\"ops\":%lld,\"gb_per_s\":%.3f,\"p50_us\":%.1f,\"p99_us\":%.1f}\n",
                std::string(op).c_str(), static_cast<long long>(bytes), num_shards,
                durability.c_str(), transports[t].c_str(),
                static_cast<long long>(rpc.http2_window_bytes >> 10), inflight, depth, keys,
                static_cast<long long>(m.ops), payload / m.wall_s / 1e9, m.p50_us, m.p99_us);
            std::fflush(stdout);
          }
        }
      }
      for (auto& s : servers) s->server->Shutdown();
      servers.clear();
      // Left behind, the state (log files, RocksDB) of every run would be written back to
      // disk meanwhile, and dirty pages would throttle later runs' writes.
      for (const std::string& dir : dirs) {
        std::error_code ec;
        std::filesystem::remove_all(dir, ec);
      }
    }
  }
  return 0;
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  gradmesh::TuneAllocatorForLargeMessages();  // As the daemons do.
  if (!absl::GetFlag(FLAGS_mutex_deadlock_detection)) gradmesh::DisableMutexDeadlockDetection();
  return gradmesh::Run();
}
