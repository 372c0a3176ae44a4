// Benchmark: gradmesh's ring all-reduce (tcp and grpc transports) against PyTorch's gloo,
// on 127.0.0.1.
//
//   bazel run -c opt //tests/bench:allreduce [-- --nps=2,4 --sizes=4096,...,67108864
//                                               --transports=grpc,tcp]
//
// For each process count n (--nps) it starts n real processes (this binary re-executed with
// --rank), each serving a CollectiveServiceImpl on its own port like gradmesh_worker does and
// running RingAllreduce over the gRPC ring transport, then over the TCP transport connected
// through that gRPC ring (tcp_ring.h, as allreduce jobs do); then the same sizes with
// tests/bench/gloo_allreduce.py (torch.distributed gloo, run with --python). For every size:
// warm-up (checked: n ranks of ones sum to n), a barrier, `iters` timed all-reduces (chosen
// so each size moves about --budget_bytes), and the time of one all-reduce is the slowest
// rank's mean. One JSON line per (impl, n, size), impl gradmesh_grpc, gradmesh_tcp or gloo:
//
//   {"impl":"gradmesh_tcp","np":2,"bytes":1048576,"iters":100,"time_us":...,
//    "algbw_gbps":...,"busbw_gbps":...}
//
// algbw = bytes / time, busbw = algbw * 2 (n - 1) / n, as nccl-tests defines them
// (GB = 1e9 bytes).
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/daemon.h"
#include "worker/allreduce/collective_service.h"
#include "worker/allreduce/grpc_ring.h"
#include "worker/allreduce/ring.h"
#include "worker/allreduce/tcp_ring.h"

ABSL_FLAG(std::string, nps, "2,4", "Process counts to measure.");
ABSL_FLAG(std::string, sizes, "4096,16384,65536,262144,1048576,4194304,16777216,67108864",
          "All-reduce sizes in bytes (multiples of 4).");
ABSL_FLAG(int64_t, segment_bytes, 2 << 20, "Ring segment size, bytes (RingOptions' default).");
ABSL_FLAG(std::string, transports, "grpc,tcp",
          "Ring transports to measure: grpc (CollectiveService streams) and/or tcp "
          "(tcp_ring.h, connected over the gRPC ring).");
ABSL_FLAG(int64_t, socket_buffer_bytes, -1,
          "tcp transport: SO_SNDBUF/SO_RCVBUF (TcpRingOptions: -1 = by oversubscription, "
          "0 = kernel auto-tuning).");
ABSL_FLAG(std::string, codec, "",
          "Ring wire format: empty (float32) or fp16 (RingOptions::codec).");
ABSL_FLAG(int64_t, budget_bytes, 256 << 20, "Bytes per size: iters = budget / size, clamped.");
ABSL_FLAG(int, min_iters, 5, "Fewest timed iterations per size.");
ABSL_FLAG(int, max_iters, 200, "Most timed iterations per size.");
ABSL_FLAG(int, warmup, 2, "Untimed all-reduces per size.");
ABSL_FLAG(bool, gloo, true, "Also run tests/bench/gloo_allreduce.py.");
ABSL_FLAG(std::string, python, "/usr/bin/python3", "Python with torch for the gloo baseline.");
ABSL_FLAG(std::string, gloo_script, "",
          "Path of gloo_allreduce.py (default: found in the runfiles or the source tree).");
// Internal: set by the parent for each rank process.
ABSL_FLAG(int, rank, -1, "Internal: this process's rank.");
ABSL_FLAG(std::string, peers, "", "Internal: comma-separated host:port of every rank.");

namespace gradmesh {
namespace {

std::vector<int64_t> ParseList(const std::string& s) {
  std::vector<int64_t> out;
  for (absl::string_view p : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int64_t v;
    if (absl::SimpleAtoi(p, &v)) out.push_back(v);
  }
  return out;
}

int Iterations(int64_t bytes) {
  const int64_t it = absl::GetFlag(FLAGS_budget_bytes) / std::max<int64_t>(bytes, 1);
  return static_cast<int>(
      std::clamp<int64_t>(it, absl::GetFlag(FLAGS_min_iters), absl::GetFlag(FLAGS_max_iters)));
}

// `n` distinct TCP ports on 127.0.0.1 that were free a moment ago (all bound at once, so
// they differ).
std::vector<int> FreePorts(int n) {
  std::vector<int> fds, ports;
  for (int i = 0; i < n; ++i) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      ports.push_back(-1);
    } else {
      ports.push_back(ntohs(a.sin_port));
    }
    fds.push_back(fd);
  }
  for (int fd : fds) close(fd);
  return ports;
}

pid_t Spawn(const std::vector<std::string>& argv) {
  const pid_t pid = fork();
  if (pid == 0) {
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execv(args[0], args.data());
    std::perror("execv");
    _exit(127);
  }
  return pid;
}

int WaitAll(const std::vector<pid_t>& pids) {
  int worst = 0;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    worst = std::max(worst, code);
  }
  return worst;
}

std::string FindGlooScript(const char* argv0) {
  if (!absl::GetFlag(FLAGS_gloo_script).empty()) return absl::GetFlag(FLAGS_gloo_script);
  const std::string rel = "tests/bench/gloo_allreduce.py";
  std::vector<std::string> candidates = {rel};
  if (const char* d = std::getenv("RUNFILES_DIR")) {
    candidates.push_back(absl::StrCat(d, "/gradmesh/", rel));
  }
  candidates.push_back(absl::StrCat(argv0, ".runfiles/gradmesh/", rel));
  if (const char* w = std::getenv("BUILD_WORKSPACE_DIRECTORY")) {
    candidates.push_back(absl::StrCat(w, "/", rel));
  }
  for (const auto& c : candidates) {
    if (access(c.c_str(), R_OK) == 0) return c;
  }
  return rel;
}

// Every size over transport `t`; rank 0 prints the JSON lines as `impl`. 0 or an exit code.
int MeasureSizes(RingTransport* t, const RingOptions& ro, const std::string& impl) {
  const int n = t->size();
  const int rank = t->rank();
  std::vector<float> one(1);
  for (int64_t bytes : ParseList(absl::GetFlag(FLAGS_sizes))) {
    std::vector<float> buf(bytes / 4, 1.0f);
    for (int w = 0; w < absl::GetFlag(FLAGS_warmup); ++w) {
      std::fill(buf.begin(), buf.end(), 1.0f);
      absl::Status st = RingAllreduce(t, absl::MakeSpan(buf), ro);
      if (!st.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank, st.ToString().c_str());
        return 1;
      }
      for (float v : buf) {
        if (v != static_cast<float>(n)) {
          std::fprintf(stderr, "rank %d: wrong sum %f\n", rank, v);
          return 1;
        }
      }
    }
    std::fill(buf.begin(), buf.end(), 0.0f);
    const int iters = Iterations(bytes);
    if (!RingAllreduce(t, absl::MakeSpan(one), ro).ok()) return 1;  // Barrier.
    const absl::Time start = absl::Now();
    for (int i = 0; i < iters; ++i) {
      absl::Status st = RingAllreduce(t, absl::MakeSpan(buf), ro);
      if (!st.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", rank, st.ToString().c_str());
        return 1;
      }
    }
    const double mean = absl::ToDoubleSeconds(absl::Now() - start) / iters;
    auto all =
        RingAllgather(t, absl::string_view(reinterpret_cast<const char*>(&mean), sizeof(mean)), ro);
    if (!all.ok()) return 1;
    double slowest = 0;
    for (const std::string& s : *all) {
      double v;
      std::memcpy(&v, s.data(), sizeof(v));
      slowest = std::max(slowest, v);
    }
    if (rank == 0) {
      const double algbw = bytes / slowest / 1e9;
      std::printf(
          "{\"impl\": \"%s\", \"np\": %d, \"bytes\": %lld, \"iters\": %d, "
          "\"time_us\": %.1f, \"algbw_gbps\": %.3f, \"busbw_gbps\": %.3f, "
          "\"segment_bytes\": %lld}\n",
          impl.c_str(), n, static_cast<long long>(bytes), iters, slowest * 1e6, algbw,
          algbw * 2 * (n - 1) / n, static_cast<long long>(ro.segment_bytes));
      std::fflush(stdout);
    }
  }
  return 0;
}

// One rank: serve, connect, measure every size.
int RunRank(int rank, const std::vector<std::string>& peers) {
  CollectiveServiceImpl service;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(peers[rank], grpc::InsecureServerCredentials());
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // A taken port must fail.
  builder.SetMaxReceiveMessageSize(256 << 20);
  builder.SetMaxSendMessageSize(256 << 20);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) {
    std::fprintf(stderr, "rank %d: cannot serve on %s\n", rank, peers[rank].c_str());
    return 1;
  }
  int code = 0;
  {
    GrpcRingOptions o;
    o.job = "bench";
    o.rank = rank;
    o.peers = peers;
    o.local = &service;
    auto transport = NewGrpcRingTransport(o);
    if (!transport.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", rank, transport.status().ToString().c_str());
      return 1;
    }
    RingTransport* grpc_ring = transport->get();
    RingOptions ro;
    ro.segment_bytes = absl::GetFlag(FLAGS_segment_bytes);
    ro.timeout = absl::Seconds(60);
    if (absl::GetFlag(FLAGS_codec) == "fp16") ro.codec = RingCodec::kFp16;
    for (absl::string_view name :
         absl::StrSplit(absl::GetFlag(FLAGS_transports), ',', absl::SkipEmpty())) {
      std::unique_ptr<RingTransport> tcp;
      RingTransport* t = grpc_ring;
      if (name == "tcp") {
        TcpRingOptions to;
        to.timeout = absl::Seconds(60);
        to.socket_buffer_bytes = absl::GetFlag(FLAGS_socket_buffer_bytes);
        auto connected = ConnectTcpRing(grpc_ring, peers, to);
        if (!connected.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", rank, connected.status().ToString().c_str());
          return 1;
        }
        tcp = *std::move(connected);
        t = tcp.get();
      } else if (name != "grpc") {
        std::fprintf(stderr, "unknown transport %s (known: grpc, tcp)\n",
                     std::string(name).c_str());
        return 2;
      }
      if (int rc = MeasureSizes(t, ro, absl::StrCat("gradmesh_", name)); rc != 0) return rc;
    }
  }
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  return code;
}

int RunParent(const char* argv0) {
  const std::string self = "/proc/self/exe";
  char exe[4096];
  const ssize_t len = readlink(self.c_str(), exe, sizeof(exe) - 1);
  if (len <= 0) return 1;
  exe[len] = 0;
  int worst = 0;
  for (int64_t n : ParseList(absl::GetFlag(FLAGS_nps))) {
    std::vector<std::string> peers;
    const std::vector<int> ports = FreePorts(static_cast<int>(n) + 1);
    for (int r = 0; r < n; ++r) peers.push_back(absl::StrCat("127.0.0.1:", ports[r]));
    std::vector<pid_t> pids;
    for (int r = 0; r < n; ++r) {
      pids.push_back(Spawn(
          {exe, absl::StrCat("--rank=", r), absl::StrCat("--peers=", absl::StrJoin(peers, ",")),
           absl::StrCat("--sizes=", absl::GetFlag(FLAGS_sizes)),
           absl::StrCat("--segment_bytes=", absl::GetFlag(FLAGS_segment_bytes)),
           absl::StrCat("--budget_bytes=", absl::GetFlag(FLAGS_budget_bytes)),
           absl::StrCat("--min_iters=", absl::GetFlag(FLAGS_min_iters)),
           absl::StrCat("--max_iters=", absl::GetFlag(FLAGS_max_iters)),
           absl::StrCat("--warmup=", absl::GetFlag(FLAGS_warmup)),
           absl::StrCat("--transports=", absl::GetFlag(FLAGS_transports)),
           absl::StrCat("--socket_buffer_bytes=", absl::GetFlag(FLAGS_socket_buffer_bytes)),
           absl::StrCat("--codec=", absl::GetFlag(FLAGS_codec))}));
    }
    worst = std::max(worst, WaitAll(pids));
    if (absl::GetFlag(FLAGS_gloo)) {
      pid_t p = Spawn({absl::GetFlag(FLAGS_python), FindGlooScript(argv0), absl::StrCat("--np=", n),
                       absl::StrCat("--port=", ports[n]),
                       absl::StrCat("--sizes=", absl::GetFlag(FLAGS_sizes)),
                       absl::StrCat("--budget_bytes=", absl::GetFlag(FLAGS_budget_bytes)),
                       absl::StrCat("--min_iters=", absl::GetFlag(FLAGS_min_iters)),
                       absl::StrCat("--max_iters=", absl::GetFlag(FLAGS_max_iters)),
                       absl::StrCat("--warmup=", absl::GetFlag(FLAGS_warmup))});
      worst = std::max(worst, WaitAll({p}));
    }
  }
  return worst;
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  signal(SIGPIPE, SIG_IGN);
  // As gradmesh_worker does: keep large message buffers in the heap (no mmap per message).
  gradmesh::TuneAllocatorForLargeMessages();
  absl::ParseCommandLine(argc, argv);
  const int rank = absl::GetFlag(FLAGS_rank);
  if (rank >= 0) {
    std::vector<std::string> peers =
        absl::StrSplit(absl::GetFlag(FLAGS_peers), ',', absl::SkipEmpty());
    return gradmesh::RunRank(rank, peers);
  }
  return gradmesh::RunParent(argv[0]);
}
