// Gossip checkpoint files (see checkpoint.h).
#include "worker/gossip/checkpoint.h"

#include <zlib.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace gradmesh {
namespace {

constexpr char kMagic[8] = {'G', 'M', 'G', 'O', 'S', 'C', 'K', '1'};

template <typename T>
void Put(std::string* out, const T& v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// Reads sizeof(T) bytes at *pos; false if too short.
template <typename T>
bool Get(const std::string& in, size_t* pos, T* v) {
  if (in.size() - *pos < sizeof(T)) return false;
  std::memcpy(v, in.data() + *pos, sizeof(T));
  *pos += sizeof(T);
  return true;
}

}  // namespace

std::string GossipCheckpointPath(const std::string& dir, const std::string& job, int32_t rank) {
  return absl::StrCat(dir, "/", job, "/rank-", rank, ".ckpt");
}

absl::Status WriteGossipCheckpoint(const std::string& path, const GossipCheckpoint& c) {
  std::string data;
  data.append(kMagic, sizeof(kMagic));
  Put(&data, c.rank);
  Put(&data, c.num_workers);
  Put(&data, static_cast<int64_t>(c.values.size()));
  Put(&data, c.num_slots);
  Put(&data, c.step);
  Put(&data, c.weight);
  data.append(reinterpret_cast<const char*>(c.values.data()), c.values.size() * sizeof(float));
  data.append(reinterpret_cast<const char*>(c.slots.data()), c.slots.size() * sizeof(float));
  const uint32_t crc = static_cast<uint32_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size())));
  Put(&data, crc);

  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat("checkpoint ", path, ": cannot create its directory: ", ec.message()));
  }
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(absl::StrCat("checkpoint ", tmp, ": ", std::strerror(errno)));
  }
  const bool ok = std::fwrite(data.data(), 1, data.size(), f) == data.size() &&
                  std::fflush(f) == 0;
  const bool closed = std::fclose(f) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("checkpoint ", tmp, ": write failed"));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::InternalError(
        absl::StrCat("checkpoint ", path, ": rename failed: ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

absl::StatusOr<GossipCheckpoint> ReadGossipCheckpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("checkpoint ", path, " does not exist"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string data = ss.str();
  auto bad = [&path](const std::string& what) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, ": ", what));
  };
  if (data.size() < sizeof(kMagic) + sizeof(uint32_t) ||
      std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) {
    return bad("not a gossip checkpoint (bad magic or too short)");
  }
  uint32_t stored_crc = 0;
  std::memcpy(&stored_crc, data.data() + data.size() - sizeof(uint32_t), sizeof(uint32_t));
  const uint32_t crc = static_cast<uint32_t>(crc32(
      0L, reinterpret_cast<const Bytef*>(data.data()), static_cast<uInt>(data.size() - 4)));
  if (crc != stored_crc) return bad("CRC mismatch (corrupt file)");
  const std::string body = data.substr(0, data.size() - sizeof(uint32_t));
  size_t pos = sizeof(kMagic);
  GossipCheckpoint c;
  int64_t numel = 0;
  if (!Get(body, &pos, &c.rank) || !Get(body, &pos, &c.num_workers) || !Get(body, &pos, &numel) ||
      !Get(body, &pos, &c.num_slots) || !Get(body, &pos, &c.step) ||
      !Get(body, &pos, &c.weight)) {
    return bad("truncated header");
  }
  if (numel < 0 || c.num_slots < 0 || c.step < 0 || !(c.weight > 0)) {
    return bad("invalid header values");
  }
  const size_t floats = static_cast<size_t>(numel) * (1 + static_cast<size_t>(c.num_slots));
  if (body.size() - pos != floats * sizeof(float)) {
    return bad(absl::StrCat(body.size() - pos, " bytes of values and slots, expected ",
                            floats * sizeof(float)));
  }
  c.values.resize(numel);
  std::memcpy(c.values.data(), body.data() + pos, numel * sizeof(float));
  pos += numel * sizeof(float);
  c.slots.resize(static_cast<size_t>(numel) * c.num_slots);
  std::memcpy(c.slots.data(), body.data() + pos, c.slots.size() * sizeof(float));
  return c;
}

}  // namespace gradmesh
