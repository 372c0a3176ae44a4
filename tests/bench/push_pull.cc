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
// values are decoded into per-operation buffers. p50_us / p99_us are per round. With transport
// shm (unary is not measured at depth) the round goes through --shm_lanes shared-memory
// channels per shard (rpc/shm_op_channel.h) as batches of up to --shm_batch_kb.
//
// Durability cost: --durability=none,periodic,every_update --ops=push
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <deque>
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
#include "rpc/shm_op_channel.h"
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
ABSL_FLAG(int, shm_lanes, 2,
          "--depth with transport shm: shared-memory channels per client and shard, each "
          "carrying one batch of the round at a time.");
ABSL_FLAG(int64_t, shm_batch_kb, 1024,
          "--depth with transport shm: the most bytes of requests (or of answers) per batch, KiB "
          "(a larger operation goes alone).");
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

// One --depth client: a stream per shard, `depth` operations in flight per round; with
// `shm_lanes` > 0, also that many shared-memory channels per shard (rpc/shm_op_channel.h),
// which then carry the round as batches of up to `shm_batch_bytes` (at least one operation),
// each lane one batch at a time: while the shard serves one lane's batch, the client writes
// the next lane's. An operation a lane cannot take goes over the stream.
class DepthClient {
 public:
  DepthClient(const std::vector<std::string>& addresses, const RpcOptions& rpc,
              const JobLayout& layout, const Partition& partition, int32_t worker, int shm_lanes,
              size_t shm_batch_bytes)
      : layout_(layout), partition_(partition), worker_(worker), shm_batch_bytes_(shm_batch_bytes) {
    for (size_t s = 0; s < addresses.size(); ++s) {
      std::shared_ptr<grpc::Channel> channel = MakeChannel(addresses[s], rpc);
      stubs_.push_back(std::make_unique<grpc::GenericStub>(channel));
      streams_.push_back(
          std::make_unique<OpStream>(stubs_.back().get(), "/gradmesh.ParameterService/Stream",
                                     std::vector<std::pair<std::string, std::string>>()));
      PullRequest pull;
      pull.set_job(layout.job);
      pull.set_worker(worker);
      pulls_.push_back(pull.SerializeAsString());
      lanes_.emplace_back();
      if (shm_lanes == 0) continue;
      shm_stubs_.push_back(ParameterService::NewStub(channel));
      ShmOpChannel::Options o;
      // A batch of requests, or of answers: each of this shard's messages is at most its part
      // of the tensor plus framing.
      o.area_bytes = std::max(shm_batch_bytes, AnswerBytes(static_cast<int32_t>(s)));
      o.job = layout.job;
      o.shard = absl::StrCat("shard ", s, " (", addresses[s], ")");
      for (int l = 0; l < shm_lanes; ++l) {
        lanes_.back().push_back(std::make_unique<ShmOpChannel>(shm_stubs_.back().get(), o));
      }
    }
  }

  // Waits until every shared-memory lane is open; false if one is not within `timeout`.
  bool WaitLanesOpen(absl::Duration timeout) {
    const absl::Time give_up = absl::Now() + timeout;
    for (const auto& lanes : lanes_) {
      for (const auto& lane : lanes) {
        while (lane->area_bytes() == 0) {
          if (absl::Now() > give_up || lane->disabled()) return false;
          absl::SleepFor(absl::Milliseconds(5));
        }
      }
    }
    return true;
  }

  // Issues `depth` operations `op` on every shard, waits for all; false if one failed.
  bool Round(absl::string_view op, int depth, const float* grad, std::vector<float>* params) {
    const bool push = op != "pull", pull = op == "pull" || op == "pushpull";
    const bool fused = op == "fused";
    const int shards = static_cast<int>(streams_.size());
    auto st = std::make_shared<State>();
    for (int d = 0; d < depth; ++d) {
      float* out = params->data() + static_cast<int64_t>(d) * partition_.tensor_numel(0);
      for (int32_t s = 0; s < shards; ++s) {
        if (push) {
          std::vector<PushChunkRef> refs;
          for (int64_t idx : partition_.shard_chunks(s)) {
            const ChunkInfo& c = partition_.chunks()[idx];
            refs.push_back({c.tensor, c.chunk, 0, grad + c.offset, c.numel, "", {}});
          }
          st->msgs.push_back({s, StreamOp::kPush, fused, out});
          st->reqs.push_back(EncodePushRequest(layout_.job, worker_, step_++, next_id_++, refs,
                                               false, fused ? absl::string_view(pulls_[s]) : ""));
        }
        if (pull) {
          st->msgs.push_back({s, StreamOp::kPull, true, out});
          grpc::Slice slice(pulls_[s].data(), pulls_[s].size());
          st->reqs.push_back(grpc::ByteBuffer(&slice, 1));
        }
      }
    }
    st->resps.resize(st->reqs.size());
    st->left = st->reqs.size();
    for (auto& lanes : lanes_) st->lane_busy.emplace_back(lanes.size(), 0);
    if (lanes_.empty() || lanes_[0].empty()) {
      std::vector<size_t> last(shards, 0);  // Each shard's last message: it ends the burst.
      for (size_t i = 0; i < st->msgs.size(); ++i) last[st->msgs[i].shard] = i;
      for (size_t i = 0; i < st->msgs.size(); ++i)
        SendOnStream(st, i, i != last[st->msgs[i].shard]);
    } else {
      SendOnLanes(st);
    }
    absl::MutexLock lock(&st->mu);
    st->mu.Await(absl::Condition(
        +[](size_t* n) { return *n == 0; }, &st->left));
    return st->ok;
  }

 private:
  struct Msg {
    int32_t shard;
    StreamOp op;
    bool decode;  // Its answer carries pulled values, for `out`.
    float* out;
  };
  // A round's messages, shared with their completions: the last one may still be unlocking
  // `mu` as Round returns.
  struct State {
    std::vector<Msg> msgs;
    std::vector<grpc::ByteBuffer> reqs, resps;
    absl::Mutex mu;
    size_t left ABSL_GUARDED_BY(mu) = 0;
    int64_t completed ABSL_GUARDED_BY(mu) = 0;
    bool ok ABSL_GUARDED_BY(mu) = true;
    // Per shard and lane: operations of its batch not yet completed.
    std::vector<std::vector<size_t>> lane_busy ABSL_GUARDED_BY(mu);
  };

  // The completion of message `at` (of lane `lane` of its shard, or -1: the stream).
  std::function<void(grpc::Status)> Done(const std::shared_ptr<State>& st, size_t at, int lane) {
    return [this, st, at, lane](grpc::Status status) {
      const Msg& m = st->msgs[at];
      const bool good = status.ok() && (!m.decode || Decode(st->resps[at], m.shard, m.out));
      st->resps[at] = grpc::ByteBuffer();  // A lane's answers are lent until all are dropped.
      absl::MutexLock lock(&st->mu);
      st->ok = st->ok && good;
      --st->left;
      ++st->completed;
      if (lane >= 0) --st->lane_busy[m.shard][lane];
    };
  }

  void SendOnStream(const std::shared_ptr<State>& st, size_t at, bool more) {
    const Msg& m = st->msgs[at];
    streams_[m.shard]->Call(m.op, st->reqs[at], &st->resps[at], Done(st, at, -1), more);
  }

  // The largest answer shard `s` gives one message (its part of the tensor, pulled).
  size_t AnswerBytes(int32_t s) const {
    size_t bytes = 256;
    for (int64_t idx : partition_.shard_chunks(s)) {
      bytes += static_cast<size_t>(partition_.chunks()[idx].numel) * 4 + 64;
    }
    return bytes;
  }

  // Hands the round's messages to the lanes as they become free, each shard's in order.
  void SendOnLanes(const std::shared_ptr<State>& st) {
    std::vector<std::deque<size_t>> queues(lanes_.size());
    for (size_t i = 0; i < st->msgs.size(); ++i) queues[st->msgs[i].shard].push_back(i);
    while (true) {
      bool queued = false;
      int64_t completed;
      {
        absl::MutexLock lock(&st->mu);
        completed = st->completed;
      }
      for (size_t s = 0; s < lanes_.size(); ++s) {
        for (size_t l = 0; l < lanes_[s].size() && !queues[s].empty(); ++l) {
          SendBatch(st, static_cast<int32_t>(s), static_cast<int>(l), &queues[s]);
        }
        queued = queued || !queues[s].empty();
      }
      if (!queued) return;
      std::pair<State*, int64_t> seen(st.get(), completed);
      absl::MutexLock lock(&st->mu);
      st->mu.Await(absl::Condition(
          +[](std::pair<State*, int64_t>* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->first->completed != w->second;  // A lane may have come free.
          },
          &seen));
    }
  }

  // Sends the front of `queue` as one batch on lane `l` of shard `s` if it is free: as many
  // messages as fit the batch bytes (at least one); over the stream if the lane cannot take them.
  void SendBatch(const std::shared_ptr<State>& st, int32_t s, int l, std::deque<size_t>* queue) {
    {
      absl::MutexLock lock(&st->mu);
      if (st->lane_busy[s][l] > 0) return;
    }
    const size_t room = std::max(shm_batch_bytes_, AnswerBytes(s));
    std::vector<ShmOpChannel::Item> items;
    std::vector<size_t> taken;
    size_t request_bytes = 0, answer_bytes = 0;
    while (!queue->empty() && items.size() < kMaxStreamBatch) {
      const size_t at = queue->front();
      // Framing (call, tag, length), the alignment pad (up to 65) and the batch element's tag
      // and length.
      const size_t req = st->reqs[at].Length() + 96;
      const size_t ans = st->msgs[at].decode ? AnswerBytes(s) : 64;
      if (!items.empty() && (request_bytes + req > room || answer_bytes + ans > room)) break;
      request_bytes += req;
      answer_bytes += ans;
      items.push_back({st->msgs[at].op, &st->reqs[at], &st->resps[at], Done(st, at, l)});
      taken.push_back(at);
      queue->pop_front();
    }
    {
      absl::MutexLock lock(&st->mu);
      st->lane_busy[s][l] = items.size();  // Before its completions can run.
    }
    if (lanes_[s][l]->CallBatch(&items)) return;
    {
      absl::MutexLock lock(&st->mu);
      st->lane_busy[s][l] = 0;
    }
    // Not open, or broken: the lane's batch goes over the stream.
    for (size_t i = 0; i < taken.size(); ++i) SendOnStream(st, taken[i], i + 1 < taken.size());
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
  std::vector<std::unique_ptr<ParameterService::Stub>> shm_stubs_;
  std::vector<std::vector<std::unique_ptr<ShmOpChannel>>> lanes_;  // Per shard.
  const size_t shm_batch_bytes_;
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
        if (absl::GetFlag(FLAGS_depth) > 0) {  // Unary calls cannot keep operations in flight.
          transports.erase(std::remove(transports.begin(), transports.end(), "unary"),
                           transports.end());
          if (transports.empty()) transports = {"stream"};
        }
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
        // Per transport: the depth clients (stream, or shm: lanes of shared memory).
        std::vector<std::vector<std::unique_ptr<DepthClient>>> depth_clients(transports.size());
        for (size_t t = 0; depth > 0 && t < transports.size(); ++t) {
          const int lanes = transports[t] == "shm" ? absl::GetFlag(FLAGS_shm_lanes) : 0;
          for (int w = 0; w < inflight; ++w) {
            depth_clients[t].push_back(std::make_unique<DepthClient>(
                addresses, rpc, layout, partition, w, lanes,
                static_cast<size_t>(absl::GetFlag(FLAGS_shm_batch_kb)) << 10));
            if (!depth_clients[t].back()->WaitLanesOpen(absl::Seconds(10))) {
              std::fprintf(stderr, "shared-memory lanes did not open\n");
              return 1;
            }
          }
        }
        auto measure = [&](size_t t, absl::string_view op, double secs) {
          return depth > 0 ? MeasureDepth(&depth_clients[t], op, n, depth, secs)
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
