// Gossip checkpoint files (see checkpoint.h).
#include "worker/gossip/checkpoint.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace gradmesh {
namespace {

// A push-sum weight a checkpoint may bring back: finite and > 0. (Not bounded like a gossip
// message's, replica.cc: a replica sums what it absorbs, and restarts can bring weight back
// twice, so its own weight may legitimately exceed what one message may carry.) An infinite
// or NaN one would make the replica's values inf/NaN and spread them.
bool WeightFits(double weight) { return std::isfinite(weight) && weight > 0; }

constexpr char kKind[] = "gossip";
constexpr char kLegacyMagic[] = "GMGOSCK1";
constexpr char kLegacyAllreduceMagic[] = "GMARCKP1";

// Reads sizeof(T) bytes at *pos; false if too short.
template <typename T>
bool Get(const std::string& in, size_t end, size_t* pos, T* v) {
  if (end - *pos < sizeof(T)) return false;
  std::memcpy(v, in.data() + *pos, sizeof(T));
  *pos += sizeof(T);
  return true;
}

// The pre-common/checkpoint gossip layout (see checkpoint.h), as a kind "gossip" checkpoint.
absl::StatusOr<ckpt::Checkpoint> ParseLegacy(const std::string& path, const std::string& data) {
  auto bad = [&path](const std::string& what) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, " (legacy gossip format GMGOSCK1): ", what));
  };
  if (data.size() < 8 + sizeof(uint32_t)) return bad("truncated (bad magic or too short)");
  uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, data.data() + data.size() - sizeof(uint32_t), sizeof(uint32_t));
  ckpt::Crc32 crc;
  crc.Update(data.data(), data.size() - sizeof(uint32_t));
  if (crc.value() != stored_crc) return bad("CRC mismatch (corrupt file)");
  const size_t end = data.size() - sizeof(uint32_t);
  size_t pos = 8;
  int32_t rank, num_workers, num_slots;
  int64_t numel, step;
  double weight;
  if (!Get(data, end, &pos, &rank) || !Get(data, end, &pos, &num_workers) ||
      !Get(data, end, &pos, &numel) || !Get(data, end, &pos, &num_slots) ||
      !Get(data, end, &pos, &step) || !Get(data, end, &pos, &weight)) {
    return bad("truncated header");
  }
  if (numel < 0 || num_slots < 0 || step < 0 || !WeightFits(weight)) {
    return bad("invalid header values");
  }
  // Sizes are checked by division first: numel * (1 + num_slots) * 4 can wrap around for a
  // hostile header (numel = 2^62 would pass a multiplied check and then fail to allocate).
  const size_t have = (end - pos) / sizeof(float);
  const uint64_t per_value = 1 + static_cast<uint64_t>(num_slots);
  if ((end - pos) % sizeof(float) != 0 || static_cast<uint64_t>(numel) > have / per_value ||
      static_cast<uint64_t>(numel) * per_value != have) {
    return bad(absl::StrCat(end - pos, " bytes of values and slots, expected ", numel, " x ",
                            per_value, " floats"));
  }
  ckpt::Checkpoint c;
  c.header.kind = kKind;
  c.header.metadata.SetInt("rank", rank);
  c.header.metadata.SetInt("num_workers", num_workers);
  c.header.metadata.SetInt("num_slots", num_slots);
  c.header.metadata.SetInt("step", step);
  c.header.metadata.SetDouble("weight", weight);
  std::vector<float> values(numel), slots(static_cast<size_t>(numel) * num_slots);
  if (!values.empty()) {
    std::memcpy(values.data(), data.data() + pos, values.size() * sizeof(float));
  }
  pos += values.size() * sizeof(float);
  if (!slots.empty()) std::memcpy(slots.data(), data.data() + pos, slots.size() * sizeof(float));
  c.Add("values", std::move(values));
  c.Add("slots", std::move(slots));
  return c;
}

std::vector<ckpt::LegacyFormat> LegacyFormats() {
  return {
      ckpt::LegacyFormat{kLegacyMagic, "legacy gossip checkpoint (GMGOSCK1)", ParseLegacy},
      ckpt::LegacyFormat{kLegacyAllreduceMagic, "legacy allreduce checkpoint (GMARCKP1)", {}},
  };
}

// Reads an int64 metadata value that must fit in int32.
absl::StatusOr<int32_t> GetInt32(const ckpt::Metadata& m, const char* key) {
  absl::StatusOr<int64_t> v = m.GetInt(key);
  if (!v.ok()) return v.status();
  if (*v < std::numeric_limits<int32_t>::min() || *v > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat("metadata '", key, "' = ", *v, " is out of range"));
  }
  return static_cast<int32_t>(*v);
}

// The buffers are a tail of the values, and the slots cover the parameters (the rest).
bool SizesFit(const GossipCheckpoint& c) {
  if (c.num_slots < 0 || c.buffer_values < 0 ||
      static_cast<uint64_t>(c.buffer_values) > c.values.size()) {
    return false;
  }
  const size_t param_values = c.values.size() - static_cast<size_t>(c.buffer_values);
  if (c.num_slots == 0) return c.slots.empty();
  // By division: a hostile num_slots times the values could wrap around.
  const size_t per_slot = c.slots.size() / static_cast<size_t>(c.num_slots);
  return c.slots.size() % static_cast<size_t>(c.num_slots) == 0 && per_slot == param_values;
}

absl::StatusOr<GossipCheckpoint> FromCheckpoint(ckpt::Checkpoint c) {
  const std::string& path = c.header.source.path;
  auto bad = [&path](const absl::Status& why) {
    return absl::DataLossError(
        absl::StrCat("checkpoint ", path, ": not a valid gossip checkpoint: ", why.message()));
  };
  const ckpt::Metadata& m = c.header.metadata;
  GossipCheckpoint g;
  absl::StatusOr<int32_t> rank = GetInt32(m, "rank"), num_workers = GetInt32(m, "num_workers"),
                          num_slots = GetInt32(m, "num_slots");
  absl::StatusOr<int64_t> step = m.GetInt("step");
  absl::StatusOr<double> weight = m.GetDouble("weight");
  for (const absl::Status& s :
       {rank.status(), num_workers.status(), num_slots.status(), step.status(), weight.status()}) {
    if (!s.ok()) return bad(s);
  }
  g.rank = *rank;
  g.num_workers = *num_workers;
  g.num_slots = *num_slots;
  g.step = *step;
  g.weight = *weight;
  absl::StatusOr<std::vector<float>> values = c.Take<float>("values");
  if (!values.ok()) return bad(values.status());
  absl::StatusOr<std::vector<float>> slots = c.Take<float>("slots");
  if (!slots.ok()) return bad(slots.status());
  g.values = std::move(values).value();
  g.slots = std::move(slots).value();
  // Absent in files written before buffers were part of the model: no buffers.
  if (m.Has("buffer_values")) {
    absl::StatusOr<int64_t> buffer_values = m.GetInt("buffer_values");
    if (!buffer_values.ok()) return bad(buffer_values.status());
    g.buffer_values = *buffer_values;
  }
  if (g.num_slots < 0 || g.step < 0 || !WeightFits(g.weight) || !SizesFit(g)) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": invalid header values (step ",
                                            g.step, ", weight ", g.weight, ", ", g.values.size(),
                                            " values of which ", g.buffer_values, " of buffers, ",
                                            g.num_slots, " slots of ", g.slots.size(), " floats)"));
  }
  return g;
}

}  // namespace

absl::Status WriteGossipCheckpoint(const std::string& path, const GossipCheckpoint& c) {
  if (!SizesFit(c)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint ", path, ": ", c.slots.size(), " slot values for ", c.num_slots, " slots of ",
        c.values.size(), " values of which ", c.buffer_values, " are buffers (without slots)"));
  }
  ckpt::Metadata m;
  m.SetInt("rank", c.rank);
  m.SetInt("num_workers", c.num_workers);
  m.SetInt("num_slots", c.num_slots);
  m.SetInt("buffer_values", c.buffer_values);
  m.SetInt("step", c.step);
  m.SetDouble("weight", c.weight);
  const ckpt::ArrayRef arrays[] = {ckpt::ArrayRef::Of<float>("values", c.values),
                                   ckpt::ArrayRef::Of<float>("slots", c.slots)};
  ckpt::WriteOptions o;
  o.legacy = LegacyFormats();
  return ckpt::WriteCheckpointFile(path, kKind, m, arrays, o);
}

absl::StatusOr<GossipCheckpoint> ReadGossipCheckpoint(const std::string& path) {
  return ReadGossipCheckpoint(path, nullptr);
}

absl::StatusOr<GossipCheckpoint> ReadGossipCheckpoint(const std::string& path,
                                                      ckpt::CheckpointSource* source) {
  ckpt::ReadOptions o;
  o.kind = kKind;
  o.legacy = LegacyFormats();
  absl::StatusOr<ckpt::Checkpoint> c = ckpt::ReadCheckpointFile(path, o);
  if (!c.ok()) return c.status();
  if (source != nullptr) *source = c->header.source;
  return FromCheckpoint(std::move(c).value());
}

}  // namespace gradmesh
