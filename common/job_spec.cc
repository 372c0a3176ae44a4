#include "common/job_spec.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/util/json_util.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_read.h"
#include "common/job_name.h"
#include "common/mode.h"
#include "common/optimizer.h"
#include "common/status.h"

namespace gradmesh {
namespace {

namespace pb = google::protobuf;

std::string JsonQuote(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += absl::StrCat("\\u00", absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
        } else {
          out.push_back(c);
        }
    }
  }
  return out + "\"";
}

std::string Where(const std::string& path) {
  return path.empty() ? "job spec" : absl::StrCat("job spec at \"", path, "\"");
}

absl::Status ScalarToJson(const YAML::Node& node, const pb::FieldDescriptor* field,
                          const std::string& path, std::string* out);

// Converts a YAML map to JSON for `desc`, rejecting keys that are not fields of it.
absl::Status MessageToJson(const YAML::Node& node, const pb::Descriptor* desc,
                           const std::string& path, std::string* out) {
  if (!node.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(path), ": expected a mapping for ", desc->name()));
  }
  std::vector<std::string> parts;
  std::set<const pb::FieldDescriptor*> seen;
  for (const auto& kv : node) {
    const std::string key = kv.first.as<std::string>();
    const pb::FieldDescriptor* field = desc->FindFieldByName(key);
    if (field == nullptr) field = desc->FindFieldByCamelcaseName(key);
    if (field == nullptr) {
      std::vector<std::string> known;
      for (int i = 0; i < desc->field_count(); ++i) known.push_back(desc->field(i)->name());
      return absl::InvalidArgumentError(absl::StrCat("unknown field \"", key, "\" in ", Where(path),
                                                     " (known fields: ", absl::StrJoin(known, ", "),
                                                     ")"));
    }
    // A key given twice (or in both spellings) would silently keep the last: a typo's
    // second block, or an override the user did not mean.
    if (!seen.insert(field).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("field \"", field->name(), "\" appears twice in ", Where(path)));
    }
    const std::string child = path.empty() ? key : absl::StrCat(path, ".", key);
    std::string value;
    if (field->is_repeated()) {
      if (!kv.second.IsSequence()) {
        return absl::InvalidArgumentError(absl::StrCat(Where(child), ": expected a list"));
      }
      std::vector<std::string> items;
      int i = 0;
      for (const auto& item : kv.second) {
        std::string v;
        const std::string item_path = absl::StrCat(child, "[", i++, "]");
        if (field->type() == pb::FieldDescriptor::TYPE_MESSAGE) {
          RETURN_IF_ERROR(MessageToJson(item, field->message_type(), item_path, &v));
        } else {
          RETURN_IF_ERROR(ScalarToJson(item, field, item_path, &v));
        }
        items.push_back(std::move(v));
      }
      value = absl::StrCat("[", absl::StrJoin(items, ","), "]");
    } else if (field->type() == pb::FieldDescriptor::TYPE_MESSAGE) {
      RETURN_IF_ERROR(MessageToJson(kv.second, field->message_type(), child, &value));
    } else {
      RETURN_IF_ERROR(ScalarToJson(kv.second, field, child, &value));
    }
    parts.push_back(absl::StrCat(JsonQuote(field->name()), ":", value));
  }
  *out = absl::StrCat("{", absl::StrJoin(parts, ","), "}");
  return absl::OkStatus();
}

absl::Status ScalarToJson(const YAML::Node& node, const pb::FieldDescriptor* field,
                          const std::string& path, std::string* out) {
  if (!node.IsScalar()) {
    return absl::InvalidArgumentError(
        absl::StrCat(Where(path), ": expected a single value for ", field->name()));
  }
  const std::string text = node.Scalar();
  switch (field->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_STRING:
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      *out = JsonQuote(text);
      return absl::OkStatus();
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      if (text != "true" && text != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat(Where(path), ": expected true or false, got \"", text, "\""));
      }
      *out = text;
      return absl::OkStatus();
    default:
      // Numbers: passed through quoted so protobuf's JSON parser checks range and syntax
      // (it accepts numbers as strings for every numeric type).
      *out = JsonQuote(text);
      return absl::OkStatus();
  }
}

// "job spec: <field>: <value> <what>", INVALID_ARGUMENT.
absl::Status Bad(absl::string_view field, absl::string_view value, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("job spec: ", field, ": ", value, " ", what));
}

std::string Num(double v) { return absl::StrFormat("%g", v); }

// A float32 hyper-parameter: finite as a float32 and in [lo, hi] (hi_open: [lo, hi)).
absl::Status CheckFloat(absl::string_view field, double v, double lo, double hi,
                        bool hi_open = false) {
  if (!std::isfinite(v) || std::fabs(v) > FLT_MAX) {
    return Bad(field, Num(v), "is not a finite float32");
  }
  if (v < lo || v > hi || (hi_open && v == hi)) {
    return Bad(field, Num(v),
               absl::StrCat("is out of range [", Num(lo), ", ", Num(hi), hi_open ? ")" : "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckInt(absl::string_view field, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    return Bad(field, absl::StrCat(v), absl::StrCat("is out of range [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckLength(absl::string_view field, const std::string& v) {
  if (v.size() > kMaxSpecStringBytes) {
    return Bad(field, absl::StrCat(v.size(), " bytes"),
               absl::StrCat("is too long (at most ", kMaxSpecStringBytes, ")"));
  }
  return absl::OkStatus();
}

// Fields the sender knew and this binary does not (a spec that came as protobuf bytes).
absl::Status CheckNoUnknownFields(const pb::Message& m, const std::string& path) {
  const pb::Reflection* r = m.GetReflection();
  const pb::UnknownFieldSet& unknown = r->GetUnknownFields(m);
  if (!unknown.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: unknown field number ", unknown.field(0).number(), " in ",
                     path.empty() ? "the spec" : path,
                     " (sent by a newer client? this coordinator does not "
                     "know it)"));
  }
  std::vector<const pb::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const pb::FieldDescriptor* f : fields) {
    if (f->cpp_type() != pb::FieldDescriptor::CPPTYPE_MESSAGE || f->is_repeated()) continue;
    const std::string child = path.empty() ? f->name() : absl::StrCat(path, ".", f->name());
    RETURN_IF_ERROR(CheckNoUnknownFields(r->GetMessage(m, f), child));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptimizerSpec(const OptimizerSpec& o) {
  const std::vector<std::string> known = OptimizerRegistry::WithBuiltins().names();
  if (!o.name().empty() && std::find(known.begin(), known.end(), o.name()) == known.end()) {
    return Bad("optimizer.name", absl::StrCat("\"", o.name(), "\""),
               absl::StrCat("is not one of ", absl::StrJoin(known, ", ")));
  }
  // lr: > 0 and still > 0 as the shards' float32.
  if (!std::isfinite(o.lr()) || std::fabs(o.lr()) > FLT_MAX) {
    return Bad("optimizer.lr", Num(o.lr()), "is not a finite float32");
  }
  if (!(o.lr() > 0) || !(static_cast<float>(o.lr()) > 0)) {
    return Bad("optimizer.lr", Num(o.lr()), "must be > 0 (and > 0 as a float32)");
  }
  RETURN_IF_ERROR(CheckFloat("optimizer.momentum", o.momentum(), 0, 1, true));
  RETURN_IF_ERROR(CheckFloat("optimizer.dampening", o.dampening(), 0, 1, true));
  RETURN_IF_ERROR(CheckFloat("optimizer.weight_decay", o.weight_decay(), 0, 1e9));
  RETURN_IF_ERROR(CheckFloat("optimizer.beta1", o.beta1(), 0, 1, true));
  RETURN_IF_ERROR(CheckFloat("optimizer.beta2", o.beta2(), 0, 1, true));
  RETURN_IF_ERROR(CheckFloat("optimizer.eps", o.eps(), 0, 1));
  RETURN_IF_ERROR(CheckFloat("optimizer.min_lr_fraction", o.min_lr_fraction(), 0, 1));
  RETURN_IF_ERROR(CheckInt("optimizer.decay_updates", o.decay_updates(), 0, kMaxSpecSteps));
  RETURN_IF_ERROR(CheckInt("optimizer.warmup_updates", o.warmup_updates(), 0, kMaxSpecSteps));
  RETURN_IF_ERROR(CheckFloat("optimizer.warmup_start_fraction", o.warmup_start_fraction(), 0, 1));
  const std::string& sched = o.lr_schedule();
  if (!sched.empty() && sched != "constant" && sched != "cosine") {
    return Bad("optimizer.lr_schedule", absl::StrCat("\"", sched, "\""),
               "is not one of constant, cosine");
  }
  if (o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0)) {
    return Bad("optimizer.nesterov", "true", "needs momentum > 0 and dampening 0");
  }
  return absl::OkStatus();
}

// precision and loss_scale (after ApplyJobSpecDefaults: fp16 has mode dynamic).
absl::Status ValidatePrecision(const JobSpec& spec) {
  const std::string& precision = spec.precision();
  if (!precision.empty() && precision != "fp32" && precision != "bf16" && precision != "fp16") {
    return Bad("precision", absl::StrCat("\"", precision, "\""), "is not one of fp32, bf16, fp16");
  }
  const LossScaleSpec& ls = spec.loss_scale();
  if (!ls.mode().empty() && ls.mode() != "none" && ls.mode() != "dynamic") {
    return Bad("loss_scale.mode", absl::StrCat("\"", ls.mode(), "\""),
               "is not one of dynamic, none");
  }
  if (ls.mode() != "dynamic") return absl::OkStatus();
  RETURN_IF_ERROR(CheckFloat("loss_scale.init_scale", ls.init_scale(), 0, FLT_MAX));
  if (!(ls.init_scale() > 0))
    return Bad("loss_scale.init_scale", Num(ls.init_scale()), "must be > 0");
  RETURN_IF_ERROR(CheckFloat("loss_scale.growth_factor", ls.growth_factor(), 1, 1e6));
  if (!(ls.growth_factor() > 1)) {
    return Bad("loss_scale.growth_factor", Num(ls.growth_factor()), "must be > 1");
  }
  RETURN_IF_ERROR(CheckFloat("loss_scale.backoff_factor", ls.backoff_factor(), 0, 1, true));
  if (!(ls.backoff_factor() > 0)) {
    return Bad("loss_scale.backoff_factor", Num(ls.backoff_factor()), "must be > 0");
  }
  return CheckInt("loss_scale.growth_interval", ls.growth_interval(), 1, kMaxSpecSteps);
}

// overlap and placement (ps modes).
absl::Status ValidateOverlap(const JobSpec& spec) {
  const std::string& placement = spec.placement();
  if (!placement.empty() && placement != "greedy" && placement != "ordered") {
    return Bad("placement", absl::StrCat("\"", placement, "\""), "is not one of greedy, ordered");
  }
  const Mode mode = SpecMode(spec);
  if (!placement.empty() && !IsPsMode(mode)) {
    return Bad(
        "placement", absl::StrCat("\"", placement, "\""),
        absl::StrCat("applies to the ps modes (async, ssp, sync, diloco), not ", spec.mode()));
  }
  RETURN_IF_ERROR(CheckInt("overlap", spec.overlap(), 0, 2));
  if (spec.overlap() == 0) return absl::OkStatus();
  const std::string value = absl::StrCat(spec.overlap());
  if (mode != Mode::kAsync && mode != Mode::kSsp && mode != Mode::kSync) {
    return Bad("overlap", value,
               absl::StrCat("is not supported in mode ", spec.mode(),
                            ": only async, ssp and sync push each step's gradient as it is "
                            "produced (allreduce always overlaps its buckets with backward)"));
  }
  // The push leaves during backward, before the loop could clip or unscale the gradient.
  const char* conflict = spec.pipeline() > 0                     ? "pipeline"
                         : spec.clip_grad_norm() > 0             ? "clip_grad_norm"
                         : spec.clip_grad_value() > 0            ? "clip_grad_value"
                         : spec.loss_scale().mode() == "dynamic" ? "loss_scale (dynamic)"
                                                                 : nullptr;
  if (conflict != nullptr) {
    return Bad("overlap", value,
               absl::StrCat("cannot be combined with ", conflict,
                            ": a shard's part of the push leaves as soon as backward produced "
                            "it, before the whole gradient exists to be clipped or unscaled"));
  }
  return absl::OkStatus();
}

// The training guardrails (precision, accumulation, clipping, lr scaling).
absl::Status ValidateTrainingFeatures(const JobSpec& spec) {
  RETURN_IF_ERROR(ValidateOverlap(spec));
  RETURN_IF_ERROR(ValidatePrecision(spec));
  RETURN_IF_ERROR(CheckInt("accumulation_steps", spec.accumulation_steps(), 0, 1 << 16));
  RETURN_IF_ERROR(CheckFloat("clip_grad_norm", spec.clip_grad_norm(), 0, 1e30));
  RETURN_IF_ERROR(CheckFloat("clip_grad_value", spec.clip_grad_value(), 0, 1e30));
  RETURN_IF_ERROR(CheckInt("pipeline", spec.pipeline(), 0, 1));
  if (spec.pipeline() > 0 && SpecMode(spec) != Mode::kAsync && SpecMode(spec) != Mode::kSsp) {
    return Bad("pipeline", absl::StrCat(spec.pipeline()),
               absl::StrCat("is not supported in mode ", spec.mode(),
                            ": only async and ssp may compute a step before the previous "
                            "step's exchange is done"));
  }
  const DilocoSpec& d = spec.diloco();
  RETURN_IF_ERROR(CheckInt("diloco.inner_steps", d.inner_steps(), 0, kMaxSpecSteps));
  if (!d.outer_optimizer().empty() && d.outer_optimizer() != "nesterov" &&
      d.outer_optimizer() != "sgd") {
    return Bad("diloco.outer_optimizer", absl::StrCat("\"", d.outer_optimizer(), "\""),
               "is not one of nesterov, sgd");
  }
  RETURN_IF_ERROR(CheckFloat("diloco.outer_lr", d.outer_lr(), 0, 1e6));
  RETURN_IF_ERROR(CheckFloat("diloco.outer_momentum", d.outer_momentum(), 0, 1, true));
  if (SpecMode(spec) == Mode::kDiloco) {
    if (!spec.lr_scaling().rule().empty() && spec.lr_scaling().rule() != "none") {
      return Bad("lr_scaling.rule", absl::StrCat("\"", spec.lr_scaling().rule(), "\""),
                 "is not supported in mode diloco: the inner steps are each worker's own batch, "
                 "and the outer step averages pseudo-gradients (set diloco.outer_lr instead)");
    }
    if (d.outer_optimizer() == "nesterov" && !(d.outer_momentum() > 0)) {
      return Bad("diloco.outer_momentum", Num(d.outer_momentum()),
                 "must be > 0 with outer_optimizer nesterov");
    }
  }
  const LrScalingSpec& lr = spec.lr_scaling();
  const std::string& rule = lr.rule();
  if (!rule.empty() && rule != "none" && rule != "linear" && rule != "sqrt") {
    return Bad("lr_scaling.rule", absl::StrCat("\"", rule, "\""),
               "is not one of none, linear, sqrt");
  }
  if (!rule.empty() && rule != "none" && lr.base_batch_size() <= 0) {
    return Bad("lr_scaling.base_batch_size", absl::StrCat(lr.base_batch_size()),
               absl::StrCat("must be > 0 with rule ", rule));
  }
  RETURN_IF_ERROR(CheckInt("lr_scaling.base_batch_size", lr.base_batch_size(), 0, 1 << 30));
  RETURN_IF_ERROR(CheckInt("lr_scaling.warmup_steps", lr.warmup_steps(), 0, kMaxSpecSteps));
  // The scaled lr must still be a usable float32.
  const double scaled = spec.optimizer().lr() * LrScalingFactor(spec, spec.num_workers());
  if (!std::isfinite(scaled) || scaled > FLT_MAX || !(static_cast<float>(scaled) > 0)) {
    return Bad("lr_scaling", Num(scaled), "makes optimizer.lr out of float32 range");
  }
  return absl::OkStatus();
}

// Counts, sizes, times and strings the checks in ValidateJobSpec do not bound.
absl::Status ValidateLimits(const JobSpec& spec) {
  RETURN_IF_ERROR(CheckInt("num_workers", spec.num_workers(), 1, kMaxSpecWorkers));
  RETURN_IF_ERROR(CheckInt("num_shards", spec.num_shards(), 1, kMaxSpecShards));
  RETURN_IF_ERROR(CheckInt("batch_size", spec.batch_size(), 1, kMaxSpecBatchSize));
  RETURN_IF_ERROR(CheckInt("steps", spec.steps(), 0, kMaxSpecSteps));
  RETURN_IF_ERROR(CheckInt("epochs", spec.epochs(), 0, kMaxSpecEpochs));
  RETURN_IF_ERROR(CheckInt("chunk_bytes", spec.chunk_bytes(), 0, kMaxSpecChunkBytes));
  RETURN_IF_ERROR(
      CheckInt("allreduce.bucket_bytes", spec.allreduce().bucket_bytes(), 0, kMaxSpecChunkBytes));
  RETURN_IF_ERROR(
      CheckInt("checkpoint.every_steps", spec.checkpoint().every_steps(), 0, kMaxSpecSteps));
  // Derived from checkpoint.every_steps x num_workers when unset.
  RETURN_IF_ERROR(CheckInt("durability.snapshot_every_updates",
                           spec.durability().snapshot_every_updates(), 0,
                           kMaxSpecSteps * kMaxSpecWorkers));
  RETURN_IF_ERROR(
      CheckInt("compression.warmup_steps", spec.compression().warmup_steps(), 0, kMaxSpecSteps));
  RETURN_IF_ERROR(CheckInt("gossip.every_steps", spec.gossip().every_steps(), 0, kMaxSpecSteps));
  RETURN_IF_ERROR(CheckFloat("barrier_timeout_s", spec.barrier_timeout_s(), 0, kMaxSpecSeconds));
  RETURN_IF_ERROR(CheckFloat("durability.snapshot_every_seconds",
                             spec.durability().snapshot_every_seconds(), 0, kMaxSpecSeconds));
  RETURN_IF_ERROR(CheckFloat("gossip.timeout_s", spec.gossip().timeout_s(), 0, kMaxSpecSeconds));
  RETURN_IF_ERROR(
      CheckFloat("gossip.start_wait_s", spec.gossip().start_wait_s(), 0, kMaxSpecSeconds));
  RETURN_IF_ERROR(
      CheckFloat("allreduce.timeout_s", spec.allreduce().timeout_s(), 0, kMaxSpecSeconds));
  RETURN_IF_ERROR(CheckFloat("compression.momentum", spec.compression().momentum(), 0, 1, true));
  for (const auto& [field, value] : std::vector<std::pair<const char*, const std::string*>>{
           {"name", &spec.name()},
           {"model.name", &spec.model().name()},
           {"model.path", &spec.model().path()},
           {"dataset.name", &spec.dataset().name()},
           {"dataset.path", &spec.dataset().path()},
           {"loss", &spec.loss()},
           {"output", &spec.output()},
           {"mode", &spec.mode()},
           {"checkpoint.dir", &spec.checkpoint().dir()},
           {"compression.push", &spec.compression().push()}}) {
    RETURN_IF_ERROR(CheckLength(field, *value));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<JobSpec> ParseJobSpec(const std::string& text) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec is not valid YAML/JSON: ", e.what()));
  }
  if (!root.IsDefined() || root.IsNull()) {
    return absl::InvalidArgumentError("job spec is empty");
  }
  std::string json;
  try {
    RETURN_IF_ERROR(MessageToJson(root, JobSpec::descriptor(), "", &json));
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("job spec: ", e.what()));
  }
  JobSpec spec;
  pb::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = pb::util::JsonStringToMessage(json, &spec, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec has a value of the wrong type: ", status.message().as_string()));
  }
  return spec;
}

absl::StatusOr<JobSpec> LoadJobSpecFile(const std::string& path) {
  // A job spec is a few KB; 16 MiB is far more than any needs.
  ASSIGN_OR_RETURN(const std::string text, ReadFileUpTo(path, 16 << 20, "job spec file"));
  auto spec = ParseJobSpec(text);
  if (!spec.ok()) return Annotate(spec.status(), path);
  return spec;
}

void ApplyJobSpecDefaults(int num_servers, JobSpec* spec) {
  if (spec->name().empty()) spec->set_name("job");
  if (spec->model().name().empty()) spec->mutable_model()->set_name("mlp");
  if (spec->dataset().name().empty()) spec->mutable_dataset()->set_name("mnist");
  OptimizerSpec* opt = spec->mutable_optimizer();
  if (opt->name().empty()) opt->set_name("adam");
  if (opt->lr() == 0) opt->set_lr(opt->name() == "sgd" ? 0.01 : 1e-3);
  if (spec->batch_size() == 0) spec->set_batch_size(64);
  if (spec->epochs() == 0 && spec->steps() == 0) spec->set_epochs(1);
  if (spec->mode().empty()) spec->set_mode("async");
  if (spec->num_workers() == 0) spec->set_num_workers(1);
  if (spec->num_shards() == 0) spec->set_num_shards(num_servers > 0 ? num_servers : 1);
  if (spec->seed() == 0) spec->set_seed(1);
  if (spec->log_every() == 0) spec->set_log_every(50);
  if (spec->barrier_timeout_s() == 0) {
    // diloco: a round's barrier waits for workers that may drift apart over inner_steps steps.
    const int32_t inner = spec->mode() == "diloco" && spec->diloco().inner_steps() > 0
                              ? spec->diloco().inner_steps()
                              : (spec->mode() == "diloco" ? 50 : 1);
    // At most the limit on timeouts (kMaxSpecSeconds), so that a long round's default is never
    // what refuses the spec.
    spec->set_barrier_timeout_s(std::min(static_cast<int32_t>(kMaxSpecSeconds),
                                         std::max(120, 10 * std::min(inner, 1 << 20))));
  }
  if (spec->mode() == "ps") spec->set_mode("async");
  // diloco averages pseudo-gradients: a smaller group changes no lr.
  if (spec->sync_lr_scaling().empty()) {
    spec->set_sync_lr_scaling(spec->mode() == "diloco" ? "none" : "linear");
  }
  if (spec->precision().empty()) spec->set_precision("fp32");
  LossScaleSpec* ls = spec->mutable_loss_scale();
  if (ls->mode().empty()) ls->set_mode(spec->precision() == "fp16" ? "dynamic" : "none");
  if (ls->mode() == "dynamic") {
    if (ls->init_scale() == 0) ls->set_init_scale(65536);
    if (ls->growth_factor() == 0) ls->set_growth_factor(2);
    if (ls->backoff_factor() == 0) ls->set_backoff_factor(0.5);
    if (ls->growth_interval() == 0) ls->set_growth_interval(2000);
  }
  if (spec->mode() == "diloco") {
    DilocoSpec* d = spec->mutable_diloco();
    if (d->inner_steps() == 0) d->set_inner_steps(50);
    if (d->outer_optimizer().empty()) d->set_outer_optimizer("nesterov");
    if (d->outer_lr() == 0) d->set_outer_lr(0.7);
    if (d->outer_momentum() == 0 && d->outer_optimizer() == "nesterov") d->set_outer_momentum(0.9);
  }
  if (spec->accumulation_steps() == 0) spec->set_accumulation_steps(1);
  if (spec->lr_scaling().rule().empty()) spec->mutable_lr_scaling()->set_rule("none");
  if (spec->mode() == "gossip") {
    GossipSpec* g = spec->mutable_gossip();
    if (g->topology().empty()) g->set_topology("exponential");
    if (g->every_steps() == 0) g->set_every_steps(1);
    if (g->timeout_s() == 0) g->set_timeout_s(2);
    if (g->start_wait_s() == 0) g->set_start_wait_s(60);
  }
  if (spec->mode() == "allreduce") {
    AllreduceSpec* a = spec->mutable_allreduce();
    if (a->bucket_bytes() == 0) a->set_bucket_bytes(1 << 20);
    if (a->backend().empty()) a->set_backend("auto");
    if (a->timeout_s() == 0) a->set_timeout_s(30);
    if (a->transport().empty()) a->set_transport("tcp");
  }
  DurabilitySpec* d = spec->mutable_durability();
  // In the ps modes a checkpoint is a durable snapshot of the shards: every_steps steps of
  // every worker are every_steps updates in sync mode and about every_steps * num_workers
  // pushes otherwise.
  const Mode mode = SpecMode(*spec);
  if (spec->checkpoint().every_steps() > 0 && IsPsMode(mode)) {
    if (d->mode().empty() || d->mode() == "none") {
      d->set_mode("periodic");
      // Checkpoints at exactly those steps, not also every 30 s.
      if (!d->has_snapshot_every_seconds()) d->set_snapshot_every_seconds(0);
    }
    if (d->snapshot_every_updates() == 0) {
      // Clamped so the product cannot overflow; ValidateJobSpec refuses the inputs anyway.
      const int64_t every = std::min(spec->checkpoint().every_steps(), kMaxSpecSteps + 1);
      const int64_t workers = std::clamp<int64_t>(spec->num_workers(), 1, kMaxSpecWorkers + 1);
      // diloco: one update per round of inner_steps steps.
      const int64_t inner = std::max(1, spec->diloco().inner_steps());
      d->set_snapshot_every_updates(mode == Mode::kDiloco
                                        ? (every + inner - 1) / inner
                                        : every * (mode == Mode::kSync ? 1 : workers));
    }
  }
  if (d->mode().empty()) d->set_mode("none");
  if (d->snapshot_every_updates() == 0) d->set_snapshot_every_updates(1000);
  if (!d->has_snapshot_every_seconds() && d->mode() != "none") d->set_snapshot_every_seconds(30);
}

absl::Status ValidateJobSpec(const JobSpec& spec) {
  if (!spec.name().empty()) RETURN_IF_ERROR(CheckName("job spec: name", spec.name()));
  RETURN_IF_ERROR(CheckNoUnknownFields(spec, ""));
  // Names only: the models and datasets themselves live in worker/ (LibTorch), which the
  // coordinator must not link, so these lists mirror ModelRegistry and the dataset loader.
  const std::string& model = spec.model().name();
  if (!model.empty() && model != "lenet" && model != "mlp" && model != "torchscript") {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: unknown model \"", model, "\" (known: lenet, mlp, torchscript)"));
  }
  if (model == "torchscript" && spec.model().path().empty()) {
    return absl::InvalidArgumentError(
        "job spec: model \"torchscript\" needs model.path (a module saved with torch.jit.save)");
  }
  const std::string& dataset = spec.dataset().name();
  if (!dataset.empty() && dataset != "mnist" && dataset != "fashion-mnist" &&
      dataset != "tensors") {
    return absl::InvalidArgumentError(absl::StrCat("job spec: unknown dataset \"", dataset,
                                                   "\" (known: fashion-mnist, mnist, tensors)"));
  }
  const std::string& loss = spec.loss();
  if (!loss.empty() && loss != "cross_entropy" && loss != "mse" && loss != "module") {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: unknown loss \"", loss, "\" (known: cross_entropy, module, mse)"));
  }
  if (loss == "module" && model != "torchscript") {
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: loss \"module\" needs a TorchScript model with a loss(x, y) method; model \"",
        model.empty() ? "mlp" : model, "\" has none"));
  }
  if (spec.batch_size() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: batch_size must be > 0, got ", spec.batch_size()));
  }
  if (spec.epochs() < 0 || spec.steps() < 0) {
    return absl::InvalidArgumentError("job spec: epochs and steps must be >= 0");
  }
  if (spec.num_workers() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: num_workers must be > 0, got ", spec.num_workers()));
  }
  if (spec.num_shards() <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: num_shards must be > 0, got ", spec.num_shards()));
  }
  if (spec.chunk_bytes() < 0 || spec.chunk_bytes() % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: chunk_bytes must be 0 (auto) or a positive multiple of 4, got ",
                     spec.chunk_bytes()));
  }
  if (!(spec.optimizer().lr() > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: optimizer.lr must be > 0, got ", spec.optimizer().lr()));
  }
  if (spec.log_every() < 0) {
    return absl::InvalidArgumentError("job spec: log_every must be >= 0");
  }
  const std::string& dm = spec.durability().mode();
  if (dm != "none" && dm != "periodic" && dm != "every_update" && !dm.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: durability.mode \"", dm, "\" is not one of none, periodic, every_update"));
  }
  if (spec.durability().snapshot_every_updates() < 0 ||
      spec.durability().snapshot_every_seconds() < 0) {
    return absl::InvalidArgumentError("job spec: snapshot intervals must be >= 0");
  }
  if (spec.barrier_timeout_s() < 0) {
    return absl::InvalidArgumentError("job spec: barrier_timeout_s must be >= 0");
  }
  const CompressionSpec& c = spec.compression();
  if (!c.pull().empty() && c.pull() != "fp16" && c.pull() != "bf16" && c.pull() != "changes") {
    return absl::InvalidArgumentError(absl::StrCat("job spec: compression.pull \"", c.pull(),
                                                   "\" is not one of \"\", fp16, bf16, changes"));
  }
  if (c.warmup_steps() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: compression.warmup_steps must be >= 0, got ", c.warmup_steps()));
  }
  if (!(c.momentum() >= 0 && c.momentum() < 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: compression.momentum must be in [0, 1), got ", c.momentum()));
  }
  if (!spec.mode().empty()) {
    if (absl::Status st = ParseMode(spec.mode()).status(); !st.ok()) return st;
  }
  const GossipSpec& g = spec.gossip();
  if (!g.topology().empty() && g.topology() != "random" && g.topology() != "exponential") {
    return absl::InvalidArgumentError(absl::StrCat("job spec: gossip.topology \"", g.topology(),
                                                   "\" is not one of random, exponential"));
  }
  if (g.every_steps() < 0 || g.timeout_s() < 0) {
    return absl::InvalidArgumentError("job spec: gossip.every_steps and timeout_s must be >= 0");
  }
  if (!g.codec().empty() && g.codec() != "fp16" && g.codec() != "bf16") {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: gossip.codec \"", g.codec(), "\" is not one of \"\", fp16, bf16"));
  }
  const AllreduceSpec& a = spec.allreduce();
  if (a.bucket_bytes() < 0 || a.bucket_bytes() % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: allreduce.bucket_bytes must be a multiple of 4 and >= 0, got ",
                     a.bucket_bytes()));
  }
  if (!a.backend().empty() && a.backend() != "ring" && a.backend() != "nccl" &&
      a.backend() != "hierarchical" && a.backend() != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: allreduce.backend \"", a.backend(),
                     "\" is not one of auto, hierarchical, nccl, ring"));
  }
  if (!a.transport().empty() && a.transport() != "grpc" && a.transport() != "tcp") {
    return absl::InvalidArgumentError(absl::StrCat("job spec: allreduce.transport \"",
                                                   a.transport(), "\" is not one of grpc, tcp"));
  }
  if (a.timeout_s() < 0) {
    return absl::InvalidArgumentError("job spec: allreduce.timeout_s must be >= 0");
  }
  if (spec.checkpoint().every_steps() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job spec: checkpoint.every_steps must be >= 0, got ", spec.checkpoint().every_steps()));
  }
  const std::string& scaling = spec.sync_lr_scaling();
  if (!scaling.empty() && scaling != "linear" && scaling != "none") {
    return absl::InvalidArgumentError(
        absl::StrCat("job spec: sync_lr_scaling \"", scaling, "\" is not one of linear, none"));
  }
  RETURN_IF_ERROR(ValidateOptimizerSpec(spec.optimizer()));
  RETURN_IF_ERROR(ValidateTrainingFeatures(spec));
  return ValidateLimits(spec);
}

double LrScalingFactor(const JobSpec& spec, int64_t workers) {
  const LrScalingSpec& lr = spec.lr_scaling();
  if (lr.rule().empty() || lr.rule() == "none" || lr.base_batch_size() <= 0) return 1.0;
  const double global = static_cast<double>(spec.batch_size()) *
                        std::max(1, spec.accumulation_steps()) *
                        static_cast<double>(std::max<int64_t>(1, workers));
  const double k = global / lr.base_batch_size();
  return lr.rule() == "sqrt" ? std::sqrt(k) : k;
}

OptimizerSpec ScaledOptimizer(const JobSpec& spec, int64_t workers) {
  OptimizerSpec o = spec.optimizer();
  const double k = LrScalingFactor(spec, workers);
  if (k == 1.0 && spec.lr_scaling().warmup_steps() == 0) return o;
  o.set_lr(o.lr() * k);
  if (spec.lr_scaling().warmup_steps() > 0) {
    // In updates of the schedule: async/ssp shards count every worker's pushes.
    const Mode mode = SpecMode(spec);
    const int64_t per_step =
        mode == Mode::kAsync || mode == Mode::kSsp ? std::max<int64_t>(1, workers) : 1;
    o.set_warmup_updates(std::max(
        o.warmup_updates(), std::min(spec.lr_scaling().warmup_steps(), kMaxSpecSteps) * per_step));
    o.set_warmup_start_fraction(std::min(1.0, 1.0 / k));
  }
  return o;
}

Mode SpecMode(const JobSpec& spec) {
  absl::StatusOr<Mode> m = ParseMode(spec.mode().empty() ? "async" : spec.mode());
  return m.ok() ? *m : Mode::kAsync;
}

bool IsPsMode(const std::string& mode) {
  absl::StatusOr<Mode> m = ParseMode(mode);
  return m.ok() && IsPsMode(*m);
}

std::string JobSpecToJson(const JobSpec& spec) {
  std::string out;
  pb::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  (void)pb::util::MessageToJsonString(spec, &out, options);
  return out;
}

}  // namespace gradmesh
