#include "tests/e2e/e2e_harness.h"

#include <arpa/inet.h>
#include <errno.h>
#include <grpcpp/client_context.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "common/status_testing.h"
#include "proto/gradmesh.grpc.pb.h"
#include "rpc/grpc_status.h"

namespace gradmesh {
namespace e2e {

using testutil::LastLines;
using testutil::LinesWith;
using testutil::LogField;
using testutil::MakeTestDir;
using testutil::ReadFile;
using testutil::RunfilePath;
using testutil::WaitForPortFile;
using testutil::WriteFile;

const std::vector<std::pair<std::string, std::string>>& ChildEnv() {
  static const auto* env = new std::vector<std::pair<std::string, std::string>>{
      {"OPENBLAS_NUM_THREADS", "1"}, {"OMP_NUM_THREADS", "1"}};
  return *env;
}

std::string DataDir() {
  const char* d = std::getenv("GRADMESH_DATA_DIR");
  return d != nullptr && *d != '\0' ? d : "/var/lib/gradmesh/data";
}

namespace {
bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}
}  // namespace

bool HaveMnist() {
  for (const char* base : {"train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                           "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"}) {
    const std::string p = absl::StrCat(DataDir(), "/mnist/", base);
    if (!Exists(p) && !Exists(p + ".gz")) return false;
  }
  return true;
}

int64_t ToInt(const std::optional<std::string>& s) {
  int64_t v = -1;
  if (!s.has_value() || !absl::SimpleAtoi(*s, &v)) return -1;
  return v;
}

double ToDouble(const std::optional<std::string>& s) {
  double v = -1;
  if (!s.has_value() || !absl::SimpleAtod(*s, &v)) return -1;
  return v;
}

absl::StatusOr<JobInfoResponse> GetJobInfo(const std::string& address, const std::string& job) {
  std::unique_ptr<ParameterService::Stub> stub =
      ParameterService::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  JobInfoRequest request;
  request.set_job(job);
  JobInfoResponse response;
  const grpc::Status st = stub->GetJobInfo(&ctx, request, &response);
  if (!st.ok()) return FromGrpcStatus(st);
  return response;
}

absl::StatusOr<int> PickFreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    const int err = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("bind/getsockname: ", std::strerror(err)));
  }
  close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

int64_t LastProgressStep(absl::string_view log) {
  const std::vector<std::string> lines = LinesWith(log, "event=progress");
  if (lines.empty()) return -1;
  return ToInt(LogField(lines.back(), "step"));
}

std::string DoneLine(absl::string_view log) {
  const std::vector<std::string> done = LinesWith(log, "event=done");
  return done.size() == 1 ? done[0] : "";
}

void E2eHarness::SetUp() {
  ASSERT_OK_AND_ASSIGN(server_bin_, RunfilePath("server/gradmesh_server"));
  ASSERT_OK_AND_ASSIGN(worker_bin_, RunfilePath("worker/gradmesh_worker"));
  // Parameterized tests are named "Name/param": one directory level.
  ASSERT_OK_AND_ASSIGN(
      dir_, MakeTestDir(absl::StrReplaceAll(
                ::testing::UnitTest::GetInstance()->current_test_info()->name(), {{"/", "-"}})));
}

void E2eHarness::TearDown() {
  if (HasFailure()) {
    for (const std::string& log : logs_) {
      std::cerr << "---- " << log << " (last 40 lines) ----\n"
                << LastLines(ReadFile(log), 40) << "\n";
    }
  }
  // Subprocess destructors SIGKILL and reap whatever is still running.
}

std::string E2eHarness::NewLog(const std::string& name) {
  logs_.push_back(absl::StrCat(dir_, "/", name, ".log"));
  return logs_.back();
}

absl::StatusOr<std::unique_ptr<Subprocess>> E2eHarness::StartServer(const std::string& name,
                                                                    int port,
                                                                    const std::string& data_dir,
                                                                    std::string* address) {
  // A fresh port file per start, so a restart never reads the previous incarnation's.
  const std::string port_file = absl::StrCat(dir_, "/", name, ".port", port_files_++);
  std::vector<std::string> args = {server_bin_, "--host=127.0.0.1", absl::StrCat("--port=", port),
                                   "--port_file=" + port_file, "--node=" + name};
  if (!data_dir.empty()) args.push_back("--data_dir=" + data_dir);
  auto p = Subprocess::Start(args, ChildEnv(), NewLog(name));
  if (!p.ok()) return p.status();
  auto bound = WaitForPortFile(port_file, absl::Seconds(60), p->get());
  if (!bound.ok()) return bound.status();
  if (port != 0 && *bound != port) {
    return absl::InternalError(absl::StrCat(name, " bound port ", *bound, ", asked for ", port));
  }
  *address = absl::StrCat("127.0.0.1:", *bound);
  return p;
}

void E2eHarness::StartServers(int n) {
  for (int s = 0; s < n; ++s) {
    std::string address;
    ASSERT_OK_AND_ASSIGN(auto p, StartServer(absl::StrCat("server", s), 0, "", &address));
    servers_.push_back(std::move(p));
    addresses_.push_back(address);
  }
}

void E2eHarness::StopServers() {
  for (auto& s : servers_) ASSERT_OK(s->Signal(SIGTERM));
  for (size_t s = 0; s < servers_.size(); ++s) {
    ASSERT_OK_AND_ASSIGN(int code, servers_[s]->Wait(absl::Seconds(30)));
    EXPECT_EQ(code, 0) << "shard " << s;
    const std::string log = ReadFile(servers_[s]->log_path());
    EXPECT_EQ(LinesWith(log, "event=stopped").size(), 1u) << "shard " << s;
  }
}

std::unique_ptr<Subprocess> E2eHarness::StartWorker(const std::string& name,
                                                    std::vector<std::string> args) {
  args.insert(args.begin(), worker_bin_);
  args.push_back("--node=" + name);
  auto p = Subprocess::Start(args, ChildEnv(), NewLog(name));
  EXPECT_OK(p);
  return p.ok() ? std::move(p).value() : nullptr;
}

std::vector<int> E2eHarness::WaitAll(const std::vector<Subprocess*>& procs,
                                     absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<int> codes(procs.size(), -1000);
  while (true) {
    int running = 0;
    bool failed = false;
    for (size_t i = 0; i < procs.size(); ++i) {
      if (procs[i] == nullptr) {
        failed = true;
      } else if (procs[i]->Running()) {
        ++running;
      } else {
        codes[i] = procs[i]->Wait(absl::ZeroDuration()).value_or(-1000);
        failed = failed || codes[i] != 0;
      }
    }
    if (running == 0 || failed || absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return codes;
}

bool E2eHarness::WaitForLog(Subprocess* proc, const std::function<bool(const std::string&)>& pred,
                            absl::Duration timeout) {
  return testutil::WaitForLog(proc, pred, timeout);
}

std::string E2eHarness::ServersFlag() const {
  return "--servers=" + absl::StrJoin(addresses_, ",");
}

std::string E2eHarness::WriteYaml(const std::string& name, const std::string& yaml) {
  const std::string path = absl::StrCat(dir_, "/", name, ".yaml");
  EXPECT_OK(WriteFile(path, yaml));
  return path;
}

}  // namespace e2e
}  // namespace gradmesh
