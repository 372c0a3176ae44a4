// Fuzz target: checkpoint files (common/checkpoint.h and the gossip and allreduce wrappers
// with their legacy parsers), which a worker reads back after a restart from a directory
// others may write to.
//
// Input: byte 0 holds flags, the rest is the file. Flag bit 0 rewrites the header CRC and the
// file CRC of a gmckpt/1 layout to the right values first (so mutations reach the parser past
// the checksums); bits 1-2 pick the reader: the generic full read and header read (which
// must agree), the gossip reader, the allreduce reader. Checked: every refusal is DATA_LOSS,
// FAILED_PRECONDITION or INVALID_ARGUMENT; an accepted file's arrays have the sizes its
// header declares; a file the full read accepts is accepted by the header read alike.
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <variant>

#include "absl/strings/str_cat.h"
#include "common/checkpoint.h"
#include "tests/fuzz/fuzz_util.h"
#include "worker/allreduce/checkpoint.h"
#include "worker/gossip/checkpoint.h"

namespace gradmesh {
namespace {

uint32_t Le32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[at + i]);
  return v;
}

void PutLe32(uint32_t v, std::string* s, size_t at) {
  for (int i = 0; i < 4; ++i) (*s)[at + i] = static_cast<char>(v >> (8 * i));
}

uint32_t Crc(const std::string& s, size_t n) {
  return static_cast<uint32_t>(crc32_z(0, reinterpret_cast<const Bytef*>(s.data()), n));
}

// Sets the header CRC (at 16 + H - 4) and the file CRC (the last 4 bytes) of a gmckpt/1
// layout, where they fit; for the legacy layouts (GMGOSCK1, GMARCKP1), the CRC of everything
// before the last 4 bytes.
void FixChecksums(std::string* file) {
  if (file->size() >= 12 &&
      (file->compare(0, 8, "GMGOSCK1") == 0 || file->compare(0, 8, "GMARCKP1") == 0)) {
    PutLe32(Crc(*file, file->size() - 4), file, file->size() - 4);
    return;
  }
  if (file->size() < 20) return;
  const uint64_t h = Le32(*file, 12);
  if (h >= 4 && 16 + h <= file->size()) PutLe32(Crc(*file, 16 + h - 4), file, 16 + h - 4);
  if (file->size() >= 16 + h + 4) PutLe32(Crc(*file, file->size() - 4), file, file->size() - 4);
}

void CheckRefusal(const absl::Status& st, const char* reader) {
  FUZZ_CHECK(st.code() == absl::StatusCode::kDataLoss ||
                 st.code() == absl::StatusCode::kFailedPrecondition ||
                 st.code() == absl::StatusCode::kInvalidArgument,
             absl::StrCat(reader, ": ", st.ToString()));
}

size_t Elements(const ckpt::ArrayData& data) {
  return std::visit([](const auto& v) { return v.size(); }, data);
}

void FuzzGeneric(const std::string& path) {
  ckpt::ReadOptions options;
  options.fallback_to_prev = false;
  const absl::StatusOr<ckpt::Checkpoint> full = ckpt::ReadCheckpointFile(path, options);
  const absl::StatusOr<ckpt::CheckpointHeader> head = ckpt::ReadCheckpointHeader(path, options);
  if (!full.ok()) CheckRefusal(full.status(), "ReadCheckpointFile");
  if (!head.ok()) CheckRefusal(head.status(), "ReadCheckpointHeader");
  FUZZ_CHECK(full.ok() == head.ok(), absl::StrCat("full read: ", full.status().ToString(),
                                                  "; header read: ", head.status().ToString()));
  if (!full.ok()) return;
  FUZZ_CHECK(full->header.kind == head->kind && full->header.metadata == head->metadata &&
                 full->header.arrays.size() == head->arrays.size(),
             "header read differs from the full read");
  FUZZ_CHECK(full->data.size() == full->header.arrays.size(), "arrays vs data");
  for (size_t i = 0; i < full->data.size(); ++i) {
    FUZZ_CHECK(static_cast<int64_t>(Elements(full->data[i])) == full->header.arrays[i].count,
               absl::StrCat("array ", i, " has ", Elements(full->data[i]), " elements, header ",
                            full->header.arrays[i].count));
  }
}

const std::string& ScratchFile() {
  static const std::string* path = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/ckpt_fuzz.XXXXXX");
    FUZZ_CHECK(mkdtemp(dir.data()) != nullptr, "mkdtemp");
    return new std::string(dir + "/rank-0.ckpt");
  }();
  return *path;
}

}  // namespace
}  // namespace gradmesh

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gradmesh;
  FuzzInput in(data, size);
  const uint8_t flags = in.Byte();
  std::string file(in.Rest());
  if (flags & 1) FixChecksums(&file);
  const std::string& path = ScratchFile();
  FILE* f = std::fopen(path.c_str(), "wb");
  FUZZ_CHECK(f != nullptr, path);
  FUZZ_CHECK(std::fwrite(file.data(), 1, file.size(), f) == file.size(), "write");
  std::fclose(f);
  switch ((flags >> 1) & 3) {
    case 0:
    case 1:
      FuzzGeneric(path);
      break;
    case 2: {
      const absl::StatusOr<GossipCheckpoint> g = ReadGossipCheckpoint(path);
      if (!g.ok()) {
        CheckRefusal(g.status(), "ReadGossipCheckpoint");
      } else {
        FUZZ_CHECK(g->num_slots >= 0 &&
                       g->slots.size() == static_cast<size_t>(g->num_slots) * g->values.size(),
                   "gossip slots vs values");
      }
      break;
    }
    default: {
      const absl::StatusOr<RankCheckpoint> r = ReadCheckpoint(path);
      if (!r.ok()) CheckRefusal(r.status(), "allreduce ReadCheckpoint");
    }
  }
  return 0;
}
