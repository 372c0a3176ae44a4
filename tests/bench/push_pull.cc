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
// inflight, ops, gb_per_s (payload GB/s, 1e9 bytes, summed over clients), p50_us, p99_us (per
// op).
//
// --keys=K makes each operation one step of a K-tensor model (K x size bytes, fused into one
// message per shard by the client, as in training): the same payload as one round of
// ps-lite's benchmark (40 keys issued, then awaited), so --keys=40 compares round for round.
//
// Durability cost: --durability=none,periodic,every_update --ops=push
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
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
#include "rpc/grpc_util.h"
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
ABSL_FLAG(std::string, ops, "push,pull,pushpull,fused", "Operations to measure.");
ABSL_FLAG(std::string, shards, "1,2", "Shard counts to measure.");
ABSL_FLAG(std::string, durability, "none",
          "Durability settings to measure: none, periodic, every_update (comma-separated). "
          "Durable shards keep RocksDB state in a temporary directory.");
ABSL_FLAG(int64_t, snapshot_every_updates, 1000, "Snapshot interval for durable settings.");
ABSL_FLAG(bool, fsync, false, "fsync the RocksDB WAL on every write.");
ABSL_FLAG(std::string, transports, "stream,unary",
          "Client transports to measure (GrpcParameterClientOptions.transport), in turn.");
ABSL_FLAG(int64_t, stream_max_bytes, -1,
          "GrpcParameterClientOptions.stream_max_bytes (-1: the client's default).");
ABSL_FLAG(int64_t, spin_wait_us, -1,
          "GrpcParameterClientOptions.spin_wait in µs (-1: the client's default; 0: never spin).");
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
  s->service = std::make_unique<ParameterServiceImpl>(s->shard.get());
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

// Runs `op` back to back on every client for `seconds`.
Measured Measure(const std::vector<std::unique_ptr<ParameterClient>>& clients, absl::string_view op,
                 int64_t n, int keys, double seconds) {
  const bool do_push = op == "push" || op == "pushpull";
  const bool do_pull = op == "pull" || op == "pushpull";
  const bool do_fused = op == "fused";
  const int inflight = static_cast<int>(clients.size());
  std::vector<std::vector<double>> lat(inflight);
  std::atomic<bool> failed{false};
  std::vector<std::thread> threads;
  const absl::Time start = absl::Now();
  const absl::Time end = start + absl::Seconds(seconds);
  for (int w = 0; w < inflight; ++w) {
    threads.emplace_back([&, w] {
      std::vector<float> grad(n * keys, 0.5f), params(n * keys);
      std::vector<absl::Span<const float>> grads;
      std::vector<absl::Span<float>> outs;
      for (int k = 0; k < keys; ++k) {
        grads.emplace_back(grad.data() + k * n, n);
        outs.emplace_back(params.data() + k * n, n);
      }
      int64_t step = 0;
      while (absl::Now() < end && !failed.load()) {
        const absl::Time t0 = absl::Now();
        if (do_push && !clients[w]->Push(step++, grads).ok()) failed = true;
        if (do_pull && !clients[w]->Pull(outs).ok()) failed = true;
        if (do_fused && !clients[w]->PushPull(step++, grads, outs, nullptr).ok()) failed = true;
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
  m.ops = static_cast<int64_t>(all.size());
  m.p50_us = Percentile(&all, 0.5);
  m.p99_us = Percentile(&all, 0.99);
  return m;
}

int Run() {
  RpcOptions rpc;
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int inflight = absl::GetFlag(FLAGS_inflight);
  const int keys = absl::GetFlag(FLAGS_keys);
  if (keys < 1) {
    std::fprintf(stderr, "--keys must be >= 1\n");
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
        for (absl::string_view op : absl::StrSplit(absl::GetFlag(FLAGS_ops), ',')) {
          for (size_t t = 0; t < transports.size(); ++t) {
            if (Measure(clients[t], op, n, keys, absl::GetFlag(FLAGS_warmup_seconds)).failed) {
              std::fprintf(stderr, "operation %s failed\n", std::string(op).c_str());
              return 1;
            }
            const Measured m = Measure(clients[t], op, n, keys, seconds);
            if (m.failed) {
              std::fprintf(stderr, "operation %s failed\n", std::string(op).c_str());
              return 1;
            }
            const double payload = static_cast<double>(m.ops) * keys * bytes *
                                   (op == "pushpull" || op == "fused" ? 2 : 1);
            std::printf(
                "{\"op\":\"%s\",\"bytes\":%lld,\"shards\":%d,\"durability\":\"%s\","
                "\"transport\":\"%s\",\"inflight\":%d,\"keys\":%d,\"ops\":%lld,"
                "\"gb_per_s\":%.3f,\"p50_us\":%.1f,\"p99_us\":%.1f}\n",
                std::string(op).c_str(), static_cast<long long>(bytes), num_shards,
                durability.c_str(), transports[t].c_str(), inflight, keys,
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
