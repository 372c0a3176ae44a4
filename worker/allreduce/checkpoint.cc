// Per-rank checkpoint files (see checkpoint.h).
#include "worker/allreduce/checkpoint.h"

#include <algorithm>
#include <cstring>
#include <iterator>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "common/status.h"

namespace gradmesh {
namespace {

constexpr char kKind[] = "allreduce";
constexpr char kLegacyMagic[8] = {'G', 'M', 'A', 'R', 'C', 'K', 'P', '1'};

std::string ArrayName(size_t i) { return absl::StrCat("a", i); }

// The pre-common/checkpoint allreduce layout (see checkpoint.h), as a kind "allreduce"
// checkpoint.
absl::StatusOr<ckpt::Checkpoint> ParseLegacy(const std::string& path, const std::string& data) {
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", path, " (legacy allreduce format GMARCKP1) is unusable: ", why));
  };
  if (data.size() < sizeof(kLegacyMagic) + 8 + 4 + 4) return corrupt("truncated");
  if (std::memcmp(data.data(), kLegacyMagic, sizeof(kLegacyMagic)) != 0) {
    return corrupt("bad magic");
  }
  uint32_t sum;
  std::memcpy(&sum, data.data() + data.size() - 4, 4);
  ckpt::Crc32 crc;
  crc.Update(data.data(), data.size() - 4);
  if (crc.value() != sum) return corrupt("checksum mismatch");
  size_t at = sizeof(kLegacyMagic);
  auto get = [&](void* out, size_t len) {
    if (len > data.size() - 4 - at) return false;
    if (len > 0) std::memcpy(out, data.data() + at, len);  // a 0-length array has no buffer
    at += len;
    return true;
  };
  uint64_t step;
  uint32_t count;
  if (!get(&step, 8) || !get(&count, 4)) return corrupt("truncated header");
  ckpt::Checkpoint c;
  c.header.kind = kKind;
  c.header.metadata.SetInt("step", static_cast<int64_t>(step));
  for (uint32_t i = 0; i < count; ++i) {
    uint64_t len;
    if (!get(&len, 8) || len > (data.size() - 4 - at) / sizeof(float)) {
      return corrupt(absl::StrCat("array ", i, " truncated"));
    }
    std::vector<float> a(len);
    if (!get(a.data(), len * sizeof(float))) return corrupt(absl::StrCat("array ", i));
    c.Add(ArrayName(i), std::move(a));
  }
  if (at != data.size() - 4) return corrupt("trailing bytes");
  return c;
}

std::vector<ckpt::LegacyFormat> LegacyFormats() {
  return {
      ckpt::LegacyFormat{std::string(kLegacyMagic, sizeof(kLegacyMagic)),
                         "legacy allreduce checkpoint (GMARCKP1)", ParseLegacy},
      ckpt::LegacyFormat{"GMGOSCK1", "legacy gossip checkpoint (GMGOSCK1)", {}},
  };
}

ckpt::ReadOptions ReadOptionsForOneFile() {
  ckpt::ReadOptions o;
  o.kind = kKind;
  o.fallback_to_prev = false;  // The caller reads <path> and <path>.prev itself.
  o.legacy = LegacyFormats();
  return o;
}

// Step and array checks shared by full and header reads.
absl::StatusOr<int64_t> CheckHeader(const ckpt::CheckpointHeader& h) {
  const std::string& path = h.source.path;
  absl::StatusOr<int64_t> step = h.metadata.GetInt("step");
  if (!step.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", step.status().message()));
  }
  for (const ckpt::ArrayInfo& a : h.arrays) {
    if (a.dtype != ckpt::DType::kFloat32) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", path, ": array '", a.name,
                                                        "' is ", ckpt::DTypeName(a.dtype),
                                                        "; allreduce checkpoints hold float32"));
    }
  }
  return *step;
}

}  // namespace

absl::Status WriteCheckpoint(const std::string& path, int64_t step,
                             const std::vector<absl::Span<const float>>& arrays) {
  ckpt::Metadata m;
  m.SetInt("step", step);
  std::vector<ckpt::ArrayRef> refs;
  refs.reserve(arrays.size());
  for (size_t i = 0; i < arrays.size(); ++i) {
    refs.push_back(ckpt::ArrayRef::Of<float>(ArrayName(i), arrays[i]));
  }
  ckpt::WriteOptions o;
  o.legacy = LegacyFormats();
  return ckpt::WriteCheckpointFile(path, kKind, m, refs, o);
}

absl::StatusOr<RankCheckpoint> ReadCheckpoint(const std::string& path) {
  absl::StatusOr<ckpt::Checkpoint> c = ckpt::ReadCheckpointFile(path, ReadOptionsForOneFile());
  if (!c.ok()) return c.status();
  absl::StatusOr<int64_t> step = CheckHeader(c->header);
  if (!step.ok()) return step.status();
  RankCheckpoint ck;
  ck.step = *step;
  ck.arrays.reserve(c->data.size());
  for (ckpt::ArrayData& d : c->data) ck.arrays.push_back(std::move(std::get<0>(d)));
  return ck;
}

std::vector<RankCheckpoint> ReadAvailableCheckpoints(const std::string& path) {
  std::vector<RankCheckpoint> out;
  for (const std::string& p : {path, ckpt::PrevPath(path)}) {
    absl::StatusOr<RankCheckpoint> ck = ReadCheckpoint(p);
    if (ck.ok()) out.push_back(std::move(ck).value());
  }
  return out;
}

std::vector<RankCheckpointInfo> ListAvailableCheckpoints(const std::string& path) {
  std::vector<RankCheckpointInfo> out;
  const ckpt::ReadOptions o = ReadOptionsForOneFile();  // verify_payload is on.
  for (const std::string& p : {path, ckpt::PrevPath(path)}) {
    absl::StatusOr<ckpt::CheckpointHeader> h = ckpt::ReadCheckpointHeader(p, o);
    if (!h.ok()) continue;
    absl::StatusOr<int64_t> step = CheckHeader(*h);
    if (!step.ok()) continue;
    RankCheckpointInfo info;
    info.path = p;
    info.step = *step;
    for (const ckpt::ArrayInfo& a : h->arrays) info.array_sizes.push_back(a.count);
    out.push_back(std::move(info));
  }
  return out;
}

ResumePlan PlanResume(const std::vector<std::vector<int64_t>>& steps_per_rank) {
  std::set<int64_t> common;
  ResumePlan newest;
  for (size_t r = 0; r < steps_per_rank.size(); ++r) {
    const std::set<int64_t> mine(steps_per_rank[r].begin(), steps_per_rank[r].end());
    if (!mine.empty() && *mine.rbegin() > newest.step) {
      newest.step = *mine.rbegin();
      newest.source = static_cast<int>(r);
    }
    if (r == 0) {
      common = mine;
    } else {
      std::set<int64_t> both;
      std::set_intersection(common.begin(), common.end(), mine.begin(), mine.end(),
                            std::inserter(both, both.begin()));
      common = std::move(both);
    }
  }
  if (!common.empty()) return ResumePlan{*common.rbegin(), -1};
  return newest;  // {0, -1} when no rank has any.
}

}  // namespace gradmesh
