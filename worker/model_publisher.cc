// Uploads of a worker's model to the coordinator (see model_publisher.h).
#include "worker/model_publisher.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "rpc/auth.h"
#include "rpc/grpc_status.h"
#include "rpc/grpc_util.h"
#include "worker/core/examples.h"
#include "worker/core/train_util.h"

namespace gradmesh {
namespace {

// The header of a snapshot, or INVALID_ARGUMENT when its parts disagree.
absl::Status StateHeader(const std::string& job_id, const ModelSnapshot& m, ModelHeader* h) {
  const size_t n = m.names.size();
  if (m.shapes.size() != n || m.values.size() != n || (!m.dtypes.empty() && m.dtypes.size() != n) ||
      (!m.buffer.empty() && m.buffer.size() != n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model snapshot of job ", job_id, ": ", n, " names, ", m.shapes.size(),
                     " shapes, ", m.values.size(), " value arrays, ", m.dtypes.size(), " dtypes, ",
                     m.buffer.size(), " buffer flags"));
  }
  h->set_job_id(job_id);
  h->set_kind(MODEL_STATE);
  h->set_step(m.step);
  h->set_final(m.final);
  int64_t values = 0;
  for (size_t i = 0; i < n; ++i) {
    ModelTensorInfo* t = h->add_tensors();
    t->set_name(m.names[i]);
    int64_t numel = 1;
    for (int64_t d : m.shapes[i]) {
      t->add_shape(d);
      numel *= d;
    }
    if (numel != static_cast<int64_t>(m.values[i].size())) {
      return absl::InvalidArgumentError(absl::StrCat("model snapshot of job ", job_id, ": tensor ",
                                                     m.names[i], " has ", m.values[i].size(),
                                                     " values for ", numel, " elements"));
    }
    t->set_dtype(m.dtypes.empty() ? FLOAT32 : ToProtoDType(m.dtypes[i]));
    t->set_buffer(!m.buffer.empty() && m.buffer[i]);
    values += numel;
  }
  h->set_total_bytes(values * static_cast<int64_t>(sizeof(float)));
  return absl::OkStatus();
}

}  // namespace

ModelPublisher::ModelPublisher(ModelPublisherOptions options)
    : options_(std::move(options)),
      stub_(NodeService::NewStub(MakeChannel(options_.coordinator, options_.rpc))) {}

namespace {

// Streams `header`, then what `fill` appends to each message's data until it returns false.
absl::Status Upload(NodeService::Stub* stub, const ModelPublisherOptions& o, ModelHeader header,
                    const std::function<bool(std::string*)>& fill) {
  header.set_node(o.node);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + o.deadline));
  AddBearerToken(o.auth_token, &ctx);
  const std::string token = o.node_token != nullptr ? o.node_token->Get() : "";
  if (!token.empty()) ctx.AddMetadata(kNodeIdentityMetadataKey, token);
  PublishModelResponse resp;
  std::unique_ptr<grpc::ClientWriter<ModelChunk>> writer = stub->PublishModel(&ctx, &resp);
  ModelChunk msg;
  *msg.mutable_header() = std::move(header);
  bool open = writer->Write(msg);
  msg.Clear();
  while (open) {
    const bool more = fill(msg.mutable_data());
    if (!msg.data().empty()) open = writer->Write(msg);
    msg.clear_data();
    if (!more) break;
  }
  // A refused header ends the call early (open false): Finish has the coordinator's reason.
  if (open) writer->WritesDone();
  return Annotate(FromGrpcStatus(writer->Finish()),
                  absl::StrCat("PublishModel to coordinator ", o.coordinator));
}

// Upload; with `retry`, again with backoff (1 s doubling to 16 s, for up to 2 minutes) while
// the coordinator answers ABORTED: another publish of the job's model of that kind is in
// flight (one left by a node that lost rank 0 holds it until that call ends). Only the final
// model is worth the wait: a periodic publish runs on the training thread, whose peers would
// time out meanwhile, and the next one comes soon. `restart` rewinds what `fill` sends.
absl::Status UploadRetrying(NodeService::Stub* stub, const ModelPublisherOptions& o,
                            const ModelHeader& header,
                            const std::function<bool(std::string*)>& fill,
                            const std::function<void()>& restart, bool retry) {
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  absl::Duration backoff = absl::Seconds(1);
  while (true) {
    absl::Status st = Upload(stub, o, header, fill);
    if (!retry || st.code() != absl::StatusCode::kAborted || absl::Now() + backoff > give_up) {
      return st;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Seconds(16));
    restart();
  }
}

}  // namespace

absl::Status ModelPublisher::PublishState(const std::string& job_id,
                                          const ModelSnapshot& snapshot) const {
  ModelHeader header;
  RETURN_IF_ERROR(StateHeader(job_id, snapshot, &header));
  size_t tensor = 0, offset = 0;  // Next value to send.
  const auto restart = [&] { tensor = offset = 0; };
  const auto fill = [&](std::string* data) {
    const size_t max_values = std::max<size_t>(options_.chunk_bytes / sizeof(float), 1);
    size_t room = max_values;
    while (room > 0 && tensor < snapshot.values.size()) {
      const std::vector<float>& v = snapshot.values[tensor];
      const size_t take = std::min(room, v.size() - offset);
      data->append(reinterpret_cast<const char*>(v.data() + offset), take * sizeof(float));
      offset += take;
      room -= take;
      if (offset == v.size()) {
        ++tensor;
        offset = 0;
      }
    }
    return tensor < snapshot.values.size();
  };
  return UploadRetrying(stub_.get(), options_, header, fill, restart, /*retry=*/snapshot.final);
}

absl::Status ModelPublisher::PublishModule(const std::string& job_id,
                                           const std::string& path) const {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) {
    return absl::NotFoundError(absl::StrCat("module of job ", job_id, ": cannot open ", path));
  }
  const std::streamoff size = in.tellg();
  if (size < 0) return absl::InternalError(absl::StrCat("cannot size ", path));
  if (size > options_.max_module_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "module ", path, " has ", size, " bytes, more than ", options_.max_module_bytes));
  }
  in.seekg(0);
  ModelHeader header;
  header.set_job_id(job_id);
  header.set_kind(MODEL_MODULE);
  header.set_total_bytes(size);
  int64_t sent = 0;
  bool read_error = false;
  const auto restart = [&] {
    in.clear();
    in.seekg(0);
    sent = 0;
    read_error = false;
  };
  const auto fill = [&](std::string* data) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(options_.chunk_bytes), size - sent);
    data->resize(static_cast<size_t>(n));
    if (n > 0 && !in.read(&(*data)[0], n)) {
      // Short of total_bytes: the coordinator refuses the upload, and we say why.
      read_error = true;
      data->clear();
      return false;
    }
    sent += n;
    return sent < size;
  };
  // Not retried: it is sent before rank 0 starts, whose peers would time out meanwhile.
  absl::Status st = UploadRetrying(stub_.get(), options_, header, fill, restart, /*retry=*/false);
  if (read_error) return absl::InternalError(absl::StrCat("reading ", path, " failed"));
  return st;
}

}  // namespace gradmesh
