// Writes the generated part of the seed corpora of tests/fuzz/corpus/ (the rest are text
// files written by hand): valid inputs made by the real encoders, each with the fuzz target's
// leading selector bytes. Run once when a format changes:
//   bazel run //tests/fuzz:make_seeds -- $PWD/tests/fuzz/corpus
#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/checkpoint.h"
#include "compression/changes.h"
#include "compression/compressor.h"
#include "proto/gossip.pb.h"
#include "proto/gradmesh.pb.h"
#include "worker/allreduce/checkpoint.h"
#include "worker/gossip/checkpoint.h"

namespace gradmesh {
namespace {

std::string root;

// Writes corpus/<target>/<name>, with ':' and '+' in the name as '_' (Bazel labels).
void Write(const std::string& target, std::string name, const std::string& bytes) {
  for (char& c : name) {
    if (c == ':' || c == '+') c = '_';
  }
  const std::string path = root + "/" + target + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  std::printf("%s (%zu bytes)\n", path.c_str(), bytes.size());
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<float> Ramp(size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.01f * static_cast<float>(i * i % 97) - 0.3f;
  return v;
}

void PayloadSeeds() {
  const char* const specs[] = {
      "identity",    "fp16",   "bf16",   "topk:0.1", "topk:0.5+fp16", "topk_approx:0.05+bf16",
      "randomk:0.3", "qsgd:1", "qsgd:4", "qsgd:8"};
  const CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  for (size_t s = 0; s < 10; ++s) {
    for (size_t n : {5u, 40u}) {
      std::string payload;
      if (!registry.Create(specs[s]).value()->Encode(Ramp(n), 7, &payload).ok()) std::abort();
      Write("payload_fuzz", std::string(specs[s]) + "_" + std::to_string(n),
            std::string(1, static_cast<char>(s)) + static_cast<char>(n) + '\0' + payload);
    }
  }
  std::vector<float> now = Ramp(40), held(40, 0.0f);
  now[3] = 9;
  std::string changes;
  if (!EncodeChanges(now, absl::MakeSpan(held), 1 << 20, &changes)) std::abort();
  Write("payload_fuzz", "changes_40", std::string("\x0a\x28\x00", 3) + changes);
}

void WireSeeds() {
  PullResponse r;
  for (int i = 0; i < 2; ++i) {
    ChunkData* c = r.add_chunks();
    c->set_tensor(i);
    c->set_chunk(1);
    c->set_version(5 + i);
    c->set_dtype(FLOAT32);
    if (i == 1) c->set_codec("fp16");
    c->set_data(std::string(8, static_cast<char>(i + 1)));
  }
  Write("tensor_wire_fuzz", "two_chunks", std::string(1, '\x25') + r.SerializeAsString());

  // A push with a raw chunk (a NaN in it), an encoded one, an odd-length one and a pull; as a
  // PushRequest and inside a StreamRequest, cut into slices at bytes 7 and 7 + 19.
  PushRequest p;
  p.set_job("j");
  p.set_worker(1);
  p.set_step(4);
  p.set_request_id(99);
  std::vector<float> raw = Ramp(12);
  raw[5] = std::nanf("");
  ChunkData* c = p.add_chunks();
  c->set_tensor(0);
  c->set_data(std::string(reinterpret_cast<const char*>(raw.data()), raw.size() * sizeof(float)));
  c = p.add_chunks();
  c->set_tensor(1);
  c->set_codec("fp16");
  c->set_data(std::string(6, '\x3c'));
  c = p.add_chunks();
  c->set_tensor(2);
  c->set_data(std::string(5, '\x01'));
  p.mutable_pull()->set_job("j");
  Write("push_request_fuzz", "push", std::string("\x0e\x13", 2) + p.SerializeAsString());
  StreamRequest s;
  s.set_call(3);
  *s.mutable_push() = p;
  Write("push_request_fuzz", "stream_push", std::string("\x0f\x13", 2) + s.SerializeAsString());
  s.mutable_pull()->set_job("j");
  Write("push_request_fuzz", "stream_pull", std::string("\x01\x00", 2) + s.SerializeAsString());
}

void CheckpointSeeds(const std::string& tmp) {
  ckpt::Metadata meta;
  meta.SetInt("step", 12);
  meta.SetDouble("weight", 0.5);
  meta.SetString("note", "x");
  const std::vector<float> f = Ramp(6);
  const std::vector<int64_t> i64 = {1, -2, 3};
  const std::vector<ckpt::ArrayRef> arrays = {ckpt::ArrayRef::Of<float>("values", f),
                                              ckpt::ArrayRef::Of<int64_t>("ids", i64)};
  const std::string generic = tmp + "/generic.ckpt";
  if (!ckpt::WriteCheckpointFile(generic, "fuzz", meta, arrays).ok()) std::abort();
  Write("checkpoint_fuzz", "generic", std::string(1, '\x00') + ReadAll(generic));
  GossipCheckpoint g;
  g.rank = 1;
  g.num_workers = 2;
  g.step = 3;
  g.weight = 0.75;
  g.values = Ramp(4);
  g.num_slots = 1;
  g.slots = Ramp(4);
  const std::string gossip = tmp + "/gossip.ckpt";
  if (!WriteGossipCheckpoint(gossip, g).ok()) std::abort();
  Write("checkpoint_fuzz", "gossip", std::string(1, '\x04') + ReadAll(gossip));
  const std::string allreduce = tmp + "/allreduce.ckpt";
  const std::vector<float> p = Ramp(5), slot = Ramp(5);
  if (!WriteCheckpoint(allreduce, 9, {absl::MakeConstSpan(p), absl::MakeConstSpan(slot)}).ok()) {
    std::abort();
  }
  Write("checkpoint_fuzz", "allreduce", std::string(1, '\x06') + ReadAll(allreduce));
}

void GossipSeeds() {
  const char* const codecs[] = {"", "fp16", "bf16"};
  const GossipKind kinds[] = {GOSSIP_PUSH_SUM, GOSSIP_AVERAGE, GOSSIP_FINAL};
  const CompressorRegistry registry = CompressorRegistry::WithBuiltins();
  for (int c = 0; c < 3; ++c) {
    GossipExchangeRequest r;
    r.set_job("fz");
    r.set_from_rank(1);
    r.set_to_rank(0);
    r.set_kind(kinds[c]);
    r.set_round(2);
    r.set_step(10);
    r.set_weight(0.5);
    r.set_exchange_id((uint64_t{7} << 32) | 1);
    r.mutable_values()->set_codec(codecs[c]);
    r.mutable_values()->set_numel(8);
    const std::vector<float> v = Ramp(8);
    std::string payload(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
    if (c > 0 && !registry.Create(codecs[c]).value()->Encode(v, 0, &payload).ok()) std::abort();
    r.mutable_values()->set_data(payload);
    Write("gossip_wire_fuzz", std::string("kind") + std::to_string(c),
          std::string(1, '\0') + r.SerializeAsString());
  }
}

}  // namespace
}  // namespace gradmesh

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_seeds CORPUS_DIR\n");
    return 2;
  }
  gradmesh::root = argv[1];
  char tmp[] = "/tmp/make_seeds.XXXXXX";
  if (mkdtemp(tmp) == nullptr) return 1;
  gradmesh::PayloadSeeds();
  gradmesh::WireSeeds();
  gradmesh::CheckpointSeeds(tmp);
  gradmesh::GossipSeeds();
  return 0;
}
