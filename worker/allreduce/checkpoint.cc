// Per-rank checkpoint files (see checkpoint.h).
#include "worker/allreduce/checkpoint.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gradmesh {
namespace {

constexpr char kMagic[8] = {'G', 'M', 'A', 'R', 'C', 'K', 'P', '1'};

absl::Status Errno(const std::string& what, const std::string& path) {
  return absl::InternalError(absl::StrCat("checkpoint: ", what, " ", path, ": ",
                                          std::strerror(errno)));
}

absl::Status MakeDirs(const std::string& dir) {
  std::string at;
  for (size_t i = 0; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') {
      at = dir.substr(0, i);
      if (!at.empty() && mkdir(at.c_str(), 0755) != 0 && errno != EEXIST) {
        return Errno("cannot create directory", at);
      }
    }
  }
  return absl::OkStatus();
}

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

}  // namespace

std::string CheckpointPath(const std::string& dir, const std::string& job, int rank) {
  return absl::StrCat(dir, "/", job, "/rank-", rank, ".ckpt");
}

absl::Status WriteCheckpoint(const std::string& path, int64_t step,
                             const std::vector<absl::Span<const float>>& arrays) {
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos) {
    if (absl::Status st = MakeDirs(path.substr(0, slash)); !st.ok()) return st;
  }
  std::string head(kMagic, sizeof(kMagic));
  Put<uint64_t>(&head, static_cast<uint64_t>(step));
  Put<uint32_t>(&head, static_cast<uint32_t>(arrays.size()));
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return Errno("cannot create", tmp);
  uLong crc = crc32(0L, Z_NULL, 0);
  auto write_all = [&](const char* p, size_t n) {
    if (n == 0) return true;  // (crc32 with a null buffer would restart the sum.)
    crc = crc32(crc, reinterpret_cast<const Bytef*>(p), static_cast<uInt>(n));
    while (n > 0) {
      const ssize_t w = write(fd, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        return false;
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  };
  bool ok = write_all(head.data(), head.size());
  for (const auto& a : arrays) {
    if (!ok) break;
    const uint64_t len = a.size();
    ok = write_all(reinterpret_cast<const char*>(&len), sizeof(len)) &&
         write_all(reinterpret_cast<const char*>(a.data()), a.size() * sizeof(float));
  }
  const uint32_t sum = static_cast<uint32_t>(crc);
  ok = ok && write(fd, &sum, sizeof(sum)) == sizeof(sum) && fsync(fd) == 0;
  const int saved = errno;
  close(fd);
  if (!ok) {
    errno = saved;
    unlink(tmp.c_str());
    return Errno("cannot write", tmp);
  }
  // Keep the previous checkpoint as .prev, then move the new one in.
  if (rename(path.c_str(), (path + ".prev").c_str()) != 0 && errno != ENOENT) {
    return Errno("cannot rename", path);
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) return Errno("cannot rename", tmp);
  return absl::OkStatus();
}

absl::StatusOr<RankCheckpoint> ReadCheckpoint(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no checkpoint at ", path));
    return Errno("cannot open", path);
  }
  std::string data;
  char buf[1 << 16];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) data.append(buf, n);
  std::fclose(f);
  auto corrupt = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat("checkpoint ", path, " is unusable: ", why));
  };
  if (data.size() < sizeof(kMagic) + 8 + 4 + 4) return corrupt("truncated");
  if (std::memcmp(data.data(), kMagic, sizeof(kMagic)) != 0) return corrupt("bad magic");
  uint32_t sum;
  std::memcpy(&sum, data.data() + data.size() - 4, 4);
  const uLong crc = crc32(crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(data.data()),
                          static_cast<uInt>(data.size() - 4));
  if (static_cast<uint32_t>(crc) != sum) return corrupt("checksum mismatch");
  size_t at = sizeof(kMagic);
  auto get = [&](void* out, size_t len) {
    if (at + len > data.size() - 4) return false;
    std::memcpy(out, data.data() + at, len);
    at += len;
    return true;
  };
  RankCheckpoint ck;
  uint64_t step;
  uint32_t count;
  if (!get(&step, 8) || !get(&count, 4)) return corrupt("truncated header");
  ck.step = static_cast<int64_t>(step);
  for (uint32_t i = 0; i < count; ++i) {
    uint64_t len;
    if (!get(&len, 8) || len > (data.size() - at) / sizeof(float)) {
      return corrupt(absl::StrCat("array ", i, " truncated"));
    }
    std::vector<float> a(len);
    if (!get(a.data(), len * sizeof(float))) return corrupt(absl::StrCat("array ", i));
    ck.arrays.push_back(std::move(a));
  }
  if (at != data.size() - 4) return corrupt("trailing bytes");
  return ck;
}

std::vector<RankCheckpoint> ReadAvailableCheckpoints(const std::string& path) {
  std::vector<RankCheckpoint> out;
  for (const std::string& p : {path, path + ".prev"}) {
    absl::StatusOr<RankCheckpoint> ck = ReadCheckpoint(p);
    if (ck.ok()) out.push_back(std::move(ck).value());
  }
  return out;
}

absl::StatusOr<int64_t> ResumeStep(const std::vector<std::vector<int64_t>>& steps_per_rank) {
  bool any = false;
  std::set<int64_t> common;
  for (size_t r = 0; r < steps_per_rank.size(); ++r) {
    const std::set<int64_t> mine(steps_per_rank[r].begin(), steps_per_rank[r].end());
    any = any || !mine.empty();
    if (r == 0) {
      common = mine;
    } else {
      std::set<int64_t> both;
      std::set_intersection(common.begin(), common.end(), mine.begin(), mine.end(),
                            std::inserter(both, both.begin()));
      common = std::move(both);
    }
  }
  if (!any) return 0;
  if (common.empty()) {
    std::vector<std::string> parts;
    for (size_t r = 0; r < steps_per_rank.size(); ++r) {
      parts.push_back(absl::StrCat("rank ", r, ": [",
                                   absl::StrJoin(steps_per_rank[r], ","), "]"));
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "allreduce checkpoints: the ranks have no checkpoint step in common (",
        absl::StrJoin(parts, "; "),
        "); remove the checkpoint directory to start over"));
  }
  return *common.rbegin();
}

}  // namespace gradmesh
