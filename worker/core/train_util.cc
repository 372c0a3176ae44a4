#include "worker/core/train_util.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"

namespace gradmesh {

absl::StatusOr<ComputeDevice> ParseComputeDevice(const std::string& name) {
  if (name == "auto") return ComputeDevice::kAuto;
  if (name == "cpu") return ComputeDevice::kCpu;
  if (name == "cuda") return ComputeDevice::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device \"", name, "\" (known: auto, cpu, cuda)"));
}

const char* ComputeDeviceName(ComputeDevice device) {
  switch (device) {
    case ComputeDevice::kAuto:
      return "auto";
    case ComputeDevice::kCpu:
      return "cpu";
    case ComputeDevice::kCuda:
      return "cuda";
  }
  return "auto";
}

absl::StatusOr<DeviceCodecUse> ParseDeviceCodecUse(const std::string& name) {
  if (name == "auto") return DeviceCodecUse::kAuto;
  if (name == "off") return DeviceCodecUse::kOff;
  if (name == "on") return DeviceCodecUse::kOn;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown device codec use \"", name, "\" (known: auto, off, on)"));
}

const char* DeviceCodecUseName(DeviceCodecUse use) {
  switch (use) {
    case DeviceCodecUse::kAuto:
      return "auto";
    case DeviceCodecUse::kOff:
      return "off";
    case DeviceCodecUse::kOn:
      return "on";
  }
  return "auto";
}

absl::StatusOr<JobData> LoadJobData(const JobSpec& spec, const std::string& data_dir) {
  const std::string path = spec.dataset().path().empty()
                               ? absl::StrCat(data_dir, "/", spec.dataset().name())
                               : spec.dataset().path();
  return LoadDataset(spec.dataset().name(), path);
}

BatchLoader::Options LoaderOptions(const JobSpec& spec, int32_t rank) {
  BatchLoader::Options lo;
  lo.rank = rank;
  lo.world_size = spec.num_workers();
  lo.batch_size = spec.batch_size();
  lo.epochs = spec.epochs();
  lo.max_steps = spec.steps();
  lo.seed = spec.seed();
  return lo;
}

DType ToProtoDType(ElemType type) {
  switch (type) {
    case ElemType::kFloat32:
      return FLOAT32;
    case ElemType::kFloat64:
      return FLOAT64;
    case ElemType::kFloat16:
      return FLOAT16;
    case ElemType::kBFloat16:
      return BFLOAT16;
    case ElemType::kInt64:
      return INT64;
    case ElemType::kInt32:
      return INT32;
    case ElemType::kInt16:
      return INT16;
    case ElemType::kInt8:
      return INT8;
    case ElemType::kUInt8:
      return UINT8;
    case ElemType::kBool:
      return BOOL;
  }
  return FLOAT32;
}

OptimizerSpec WithDecayUpdates(const OptimizerSpec& spec, int64_t updates) {
  OptimizerSpec out = spec;
  if (!out.lr_schedule().empty() && out.lr_schedule() != "constant" && out.decay_updates() == 0) {
    out.set_decay_updates(std::max<int64_t>(updates, 1));
  }
  return out;
}

double SecondsSince(absl::Time since) { return absl::ToDoubleSeconds(absl::Now() - since); }

std::optional<Batch> NextBatch(BatchLoader* loader, absl::Duration step_delay, double* data_s) {
  if (step_delay > absl::ZeroDuration()) absl::SleepFor(step_delay);
  const absl::Time start = absl::Now();
  std::optional<Batch> batch = loader->Next();
  if (batch.has_value()) *data_s += SecondsSince(start);
  return batch;
}

}  // namespace gradmesh
