// Published models of the coordinator (see coordinator.h "# Published models").
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/job_name.h"
#include "common/status.h"
#include "coordinator/coordinator.h"

namespace gradmesh {
namespace {

constexpr char kTorchScriptModel[] = "torchscript";

// The header's own consistency (no job, no caller): INVALID_ARGUMENT naming the field or
// tensor; RESOURCE_EXHAUSTED when header and payload exceed `max_bytes`.
absl::Status ValidateModelHeader(const ModelHeader& h, int64_t max_bytes) {
  RETURN_IF_ERROR(CheckName("PublishModel: header.job_id", h.job_id()));
  if (h.kind() != MODEL_STATE && h.kind() != MODEL_MODULE) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PublishModel of job ", h.job_id(), ": header.kind must be MODEL_STATE or MODEL_MODULE"));
  }
  if (h.node().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("PublishModel of job ", h.job_id(), ": header.node is empty"));
  }
  const int64_t header_bytes = static_cast<int64_t>(h.ByteSizeLong());
  if (h.total_bytes() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PublishModel of job ", h.job_id(), ": header.total_bytes is negative"));
  }
  if (header_bytes > Coordinator::kMaxModelHeaderBytes || h.total_bytes() > max_bytes ||
      header_bytes + h.total_bytes() > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "PublishModel of job ", h.job_id(), ": ", header_bytes + h.total_bytes(), " bytes (header ",
        header_bytes, ", payload ", h.total_bytes(), ") exceed the coordinator's limit of ",
        max_bytes, " bytes (--max_model_bytes; headers at most ", Coordinator::kMaxModelHeaderBytes,
        ")"));
  }
  if (h.kind() == MODEL_MODULE) {
    if (h.tensors_size() > 0 || h.total_bytes() == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("PublishModel of job ", h.job_id(),
                       ": a MODEL_MODULE has no tensors and a non-empty payload (got ",
                       h.tensors_size(), " tensors, ", h.total_bytes(), " bytes)"));
    }
    return absl::OkStatus();
  }
  if (h.tensors_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("PublishModel of job ", h.job_id(), ": a MODEL_STATE needs tensors"));
  }
  std::set<std::string> names;
  const int64_t max_values = max_bytes / 4;
  int64_t values = 0;
  for (int i = 0; i < h.tensors_size(); ++i) {
    const ModelTensorInfo& t = h.tensors(i);
    const std::string where = absl::StrCat("PublishModel of job ", h.job_id(), ": tensor ", i,
                                           " \"", t.name().substr(0, 80), "\"");
    if (t.name().empty() || t.name().size() > Coordinator::kMaxModelTensorNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the name must have 1..",
                                                     Coordinator::kMaxModelTensorNameBytes,
                                                     " bytes, got ", t.name().size()));
    }
    if (!names.insert(t.name()).second) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": the name is repeated"));
    }
    if (!DType_IsValid(t.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": unknown dtype ", t.dtype()));
    }
    int64_t numel = 1;
    for (int64_t d : t.shape()) {
      if (d < 0) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": negative dimension in shape [",
                                                       absl::StrJoin(t.shape(), ","), "]"));
      }
      // Bounded at every step, so the products cannot overflow.
      numel = d == 0 ? 0 : (numel > max_values / d ? max_values + 1 : numel * d);
    }
    values += numel;
    if (values > max_values) {
      return absl::ResourceExhaustedError(
          absl::StrCat(where, ": the tensors' values exceed the coordinator's limit of ", max_bytes,
                       " bytes (--max_model_bytes)"));
    }
  }
  if (h.total_bytes() != values * 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PublishModel of job ", h.job_id(), ": header.total_bytes is ", h.total_bytes(),
        ", but the tensors' shapes hold ", values, " float32 values (", values * 4, " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> Coordinator::CheckPublisherLocked(const ModelHeader& header,
                                                          const NodeCredentials& credentials) {
  auto job = jobs_.find(header.job_id());
  if (job == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("PublishModel: job ", header.job_id(), " not found"));
  }
  auto node = nodes_.find(header.node());
  RETURN_IF_ERROR(CheckIdentityLocked(header.node(), node == nodes_.end() ? nullptr : &node->second,
                                      credentials, "PublishModel"));
  const JobStatus& st = job->second.record.status();
  const int r = PublisherRank(job->second);
  const std::string publisher = r < st.workers_size() ? st.workers(r).node() : "";
  if (publisher != header.node()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "PublishModel of job ", header.job_id(), " by node \"", header.node(),
        "\" refused: only the node running rank ", r, " publishes the model (rank ", r, " is on ",
        publisher.empty() ? std::string("no node") : absl::StrCat("node \"", publisher, "\""),
        ")"));
  }
  if (header.kind() == MODEL_MODULE && st.spec().model().name() != kTorchScriptModel) {
    return absl::InvalidArgumentError(absl::StrCat("PublishModel of job ", header.job_id(),
                                                   ": its model is \"", st.spec().model().name(),
                                                   "\", not a TorchScript module"));
  }
  return job->second.record.sequence();
}

absl::Status Coordinator::CheckModelHeader(const ModelHeader& header,
                                           const NodeCredentials& credentials) {
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(CheckPublisherLocked(header, credentials).status());
  }
  return ValidateModelHeader(header, options_.max_model_bytes);
}

absl::Status Coordinator::BeginPublish(const ModelHeader& header) {
  absl::MutexLock lock(&mu_);
  if (!publishing_.emplace(header.job_id(), static_cast<int>(header.kind())).second) {
    return absl::AbortedError(absl::StrCat("PublishModel of job ", header.job_id(),
                                           ": another publish of its ",
                                           ModelKind_Name(header.kind()), " is in progress"));
  }
  return absl::OkStatus();
}

void Coordinator::EndPublish(const ModelHeader& header) {
  absl::MutexLock lock(&mu_);
  publishing_.erase({header.job_id(), static_cast<int>(header.kind())});
}

absl::Status Coordinator::PublishModel(ModelHeader header, absl::string_view payload,
                                       const NodeCredentials& credentials) {
  int64_t sequence = 0;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(sequence, CheckPublisherLocked(header, credentials));
    header.set_published_ms(Now());
  }
  // As CheckModelHeader: the tensors after the caller, outside the lock.
  RETURN_IF_ERROR(ValidateModelHeader(header, options_.max_model_bytes));
  if (static_cast<int64_t>(payload.size()) != header.total_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("PublishModel of job ", header.job_id(), ": got ", payload.size(),
                     " payload bytes, header.total_bytes says ", header.total_bytes()));
  }
  // Outside mu_: a large model must not hold up heartbeats.
  RETURN_IF_ERROR(store_->PutModel(header, payload));
  absl::MutexLock lock(&mu_);
  auto job = jobs_.find(header.job_id());
  if (job == jobs_.end() || job->second.record.sequence() != sequence) {
    // Compacted meanwhile (perhaps submitted again): the model belongs to no job.
    RETURN_IF_ERROR(store_->DeleteModels(header.job_id()));
    return absl::NotFoundError(absl::StrCat("PublishModel: job ", header.job_id(),
                                            " was removed while its model was written"));
  }
  if (header.kind() == MODEL_STATE && header.final() && !job->second.final_published) {
    // Kept in the record: a resumed job's new record starts without it, while the store still
    // holds the last run's final model until this run publishes.
    job->second.final_published = true;
    job->second.record.set_final_published(true);
    ChangedLocked(&job->second, /*persist_now=*/true);
  }
  // "publisher": the logger's own fields already hold the coordinator's "node".
  if (header.kind() == MODEL_STATE) {
    LogInfo(options_.logger, "model_published",
            {Kv("job", header.job_id()), Kv("kind", "state"), Kv("publisher", header.node()),
             Kv("step", header.step()), Kv("final", header.final() ? "true" : "false"),
             Kv("tensors", header.tensors_size()), Kv("bytes", header.total_bytes())});
  } else {
    LogInfo(options_.logger, "model_published",
            {Kv("job", header.job_id()), Kv("kind", "module"), Kv("publisher", header.node()),
             Kv("bytes", header.total_bytes())});
  }
  return absl::OkStatus();
}

absl::Status Coordinator::GetModel(const std::string& job_id, ModelKind kind,
                                   const std::function<bool(const ModelHeader&)>& on_header,
                                   const std::function<bool(absl::string_view)>& on_data) {
  if (kind != MODEL_STATE && kind != MODEL_MODULE) {
    return absl::InvalidArgumentError("GetModel: kind must be MODEL_STATE or MODEL_MODULE");
  }
  std::string mode;
  {
    absl::ReaderMutexLock lock(&mu_);
    auto job = jobs_.find(job_id);
    if (job == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("job ", job_id, " not found"));
    }
    const JobSpec& spec = job->second.record.status().spec();
    mode = spec.mode();
    if (kind == MODEL_MODULE && spec.model().name() != kTorchScriptModel) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, "'s model is \"", spec.model().name(), "\", not a TorchScript module"));
    }
  }
  absl::Status s = store_->ReadModel(job_id, kind, on_header, on_data);
  if (absl::IsNotFound(s)) {
    return absl::FailedPreconditionError(
        kind == MODEL_STATE
            ? absl::StrCat("job ", job_id, " (", mode,
                           ") has not published a model yet; rank 0 publishes at checkpoints, "
                           "every 60 s and at the end")
            : absl::StrCat("job ", job_id, " (", mode,
                           ") has not published its TorchScript module yet; rank 0 uploads it "
                           "when it starts"));
  }
  return s;
}

}  // namespace gradmesh
