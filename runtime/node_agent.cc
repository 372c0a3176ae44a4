#include "runtime/node_agent.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>

#include "common/status.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"
#include "rpc/grpc_util.h"

namespace gradmesh {

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
  if (!resp.node_token().empty()) node_token_->Set(resp.node_token());
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
