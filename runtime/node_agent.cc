#include "runtime/node_agent.h"

#include <errno.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"
#include "rpc/grpc_util.h"

namespace gradmesh {

absl::StatusOr<std::unique_ptr<NodeTokenStore>> NodeTokenStore::Open(const std::string& path) {
  // Never through a symbolic link (one planted in a shared directory would make Save
  // overwrite its target), and only a regular file of this user's, readable by no one else.
  Fd fd(open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (fd.get() < 0) {
    return absl::InternalError(
        absl::StrCat("node token store ", path, ": cannot open: ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
      ((st.st_mode & 077) != 0 && fchmod(fd.get(), 0600) != 0)) {
    return absl::FailedPreconditionError(
        absl::StrCat("node token store ", path,
                     " is not a regular file of this user's, or cannot be made "
                     "private (mode 0600)"));
  }
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node token store ", path,
          " is held by another daemon (two daemons with one --node name and directory?)"));
    }
    return absl::InternalError(
        absl::StrCat("node token store ", path, ": cannot lock: ", std::strerror(err)));
  }
  return std::unique_ptr<NodeTokenStore>(new NodeTokenStore(std::move(fd), path));
}

std::string NodeTokenStore::Load() const {
  char buf[258];
  const ssize_t n = pread(fd_.get(), buf, sizeof(buf), 0);
  if (n <= 0 || n > 256) return "";
  const std::string token(buf, static_cast<size_t>(n));
  const bool ok = std::all_of(token.begin(), token.end(), [](char c) {
    return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
  });
  return ok ? token : "";
}

absl::Status NodeTokenStore::Save(const std::string& token) {
  // In place: the file is what is locked. A torn write leaves no valid token (Load), or one
  // the coordinator refuses: either way a restart then waits as without a store.
  errno = 0;
  if (ftruncate(fd_.get(), 0) != 0 ||
      pwrite(fd_.get(), token.data(), token.size(), 0) != static_cast<ssize_t>(token.size()) ||
      fsync(fd_.get()) != 0) {
    return absl::InternalError(absl::StrCat("node token store ", path_, ": cannot write: ",
                                            errno != 0 ? std::strerror(errno) : "short write"));
  }
  return absl::OkStatus();
}

std::string NodeTokenStorePath(const std::string& dir, const std::string& name) {
  std::string safe = name;
  for (char& c : safe) {
    const bool ok =
        absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' || c == '_';
    if (!ok) c = '_';
  }
  return absl::StrCat(dir, "/node-", safe, ".token");
}

std::shared_ptr<NodeTokenStore> OpenNodeTokenStore(const std::string& flag,
                                                   const std::string& default_dir,
                                                   const std::string& node_name,
                                                   const Logger* logger) {
  if (flag == "none" || (flag.empty() && default_dir.empty())) return nullptr;
  std::string path = flag;
  if (path.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(default_dir, ec);  // Open says what went wrong.
    path = NodeTokenStorePath(default_dir, node_name);
  }
  absl::StatusOr<std::unique_ptr<NodeTokenStore>> store = NodeTokenStore::Open(path);
  // Held: a predecessor that was just killed may still be exiting; give it a few seconds.
  for (int i = 0; i < 30 && absl::IsFailedPrecondition(store.status()) &&
                  absl::StrContains(store.status().message(), "held by another daemon");
       ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    store = NodeTokenStore::Open(path);
  }
  if (!store.ok()) {
    LogWarning(logger, "node_token_store_unavailable",
               {Kv("error", store.status().ToString()),
                Kv("note", "a restart registers again once the old registration is dead")});
    return nullptr;
  }
  return std::move(store).value();
}

NodeAgent::NodeAgent(NodeAgentOptions options, Reconcile reconcile, Reports reports)
    : options_(std::move(options)),
      reconcile_(std::move(reconcile)),
      reports_(std::move(reports)),
      stub_(NodeService::NewStub(MakeChannel(options_.coordinator, options_.rpc))),
      node_token_(options_.node_token != nullptr ? options_.node_token
                                                 : std::make_shared<NodeTokenHolder>()) {}

NodeAgent::~NodeAgent() {
  if (started_ && !stopped_) Stop(/*leaving=*/false);
}

void NodeAgent::AddNodeToken(grpc::ClientContext* context) const {
  const std::string token = node_token_->Get();
  if (!token.empty()) context->AddMetadata(kNodeIdentityMetadataKey, token);
}

void NodeAgent::Start() {
  if (options_.token_store != nullptr && node_token_->Get().empty()) {
    const std::string stored = options_.token_store->Load();
    if (!stored.empty()) {
      node_token_->Set(stored);
      LogInfo(options_.logger, "node_token_restored", {Kv("store", options_.token_store->path())});
    }
  }
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
}

void NodeAgent::Stop(bool leaving) {
  if (!started_ || stopped_) return;
  stopped_ = true;
  stop_.Notify();
  thread_.join();
  absl::Status st = Heartbeat(leaving);
  LogInfo(options_.logger, "agent_stopped",
          {Kv("coordinator", options_.coordinator), Kv("leaving", leaving ? "true" : "false"),
           Kv("last_heartbeat", st.ok() ? "ok" : st.ToString())});
}

absl::Status NodeAgent::Register() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_deadline));
  AddBearerToken(options_.auth_token, &ctx);
  AddNodeToken(&ctx);
  RegisterRequest req;
  *req.mutable_node() = options_.node;
  RegisterResponse resp;
  grpc::Status st = stub_->Register(&ctx, req, &resp);
  if (!st.ok()) {
    return Annotate(FromGrpcStatus(st), "register with coordinator " + options_.coordinator);
  }
  if (resp.heartbeat_interval_ms() > 0) {
    interval_ = absl::Milliseconds(resp.heartbeat_interval_ms());
  }
  // A new token replaces ours; none means the one we presented stays valid.
  if (!resp.node_token().empty()) {
    node_token_->Set(resp.node_token());
    if (options_.token_store != nullptr) {
      // Without it the next restart waits for this registration to be declared dead, as
      // without a store: worth a warning, not a failure.
      if (absl::Status saved = options_.token_store->Save(resp.node_token()); !saved.ok()) {
        LogWarning(options_.logger, "node_token_not_saved", {Kv("error", saved.ToString())});
      }
    }
  }
  LogInfo(options_.logger, "registered",
          {Kv("coordinator", options_.coordinator), Kv("address", options_.node.address()),
           Kv("heartbeat_ms", absl::ToInt64Milliseconds(interval_))});
  return absl::OkStatus();
}

absl::Status NodeAgent::Heartbeat(bool leaving) {
  HeartbeatRequest req;
  req.set_node(options_.node.name());
  req.set_leaving(leaving);
  for (TaskReport& r : reports_()) *req.add_tasks() = std::move(r);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_deadline));
  AddBearerToken(options_.auth_token, &ctx);
  AddNodeToken(&ctx);
  HeartbeatResponse resp;
  grpc::Status st = stub_->Heartbeat(&ctx, req, &resp);
  if (!st.ok()) {
    return Annotate(FromGrpcStatus(st), "heartbeat to coordinator " + options_.coordinator);
  }
  if (resp.register_again()) return absl::NotFoundError("coordinator asks to register again");
  if (!leaving) {
    reconcile_(std::vector<Task>(resp.tasks().begin(), resp.tasks().end()));
  }
  return absl::OkStatus();
}

void NodeAgent::Loop() {
  bool registered = false;
  absl::Duration backoff = interval_;
  int failures = 0;
  while (!stop_.HasBeenNotified()) {
    absl::Status st = registered ? Heartbeat(false) : Register();
    if (st.ok() && !registered) {
      registered = true;
      st = Heartbeat(false);
    }
    if (st.ok()) {
      if (failures > 0) {
        LogInfo(options_.logger, "coordinator_reachable",
                {Kv("coordinator", options_.coordinator), Kv("after_failures", failures)});
      }
      failures = 0;
      backoff = interval_;
    } else {
      // PERMISSION_DENIED: the coordinator no longer takes our node token (e.g. we were
      // declared dead and the name registered again); registering again sorts it out.
      if (absl::IsNotFound(st) || absl::IsUnauthenticated(st) || absl::IsPermissionDenied(st)) {
        registered = false;
      }
      if (failures == 0 || failures % 20 == 0) {
        LogWarning(options_.logger, "coordinator_unreachable",
                   {Kv("coordinator", options_.coordinator), Kv("error", st.ToString()),
                    Kv("failures", failures + 1)});
      }
      ++failures;
      backoff = std::min(backoff * 2, interval_ * 4);
    }
    stop_.WaitForNotificationWithTimeout(st.ok() ? interval_ : backoff);
  }
}

}  // namespace gradmesh
