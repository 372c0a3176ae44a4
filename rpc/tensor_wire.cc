#include "rpc/tensor_wire.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/numeric.h"
#include "proto/gradmesh.pb.h"

namespace gradmesh {
namespace {

using google::protobuf::internal::WireFormatLite;
using google::protobuf::io::CodedInputStream;
using google::protobuf::io::CodedOutputStream;
using google::protobuf::io::StringOutputStream;

// Field numbers and wire types of proto/gradmesh.proto.
constexpr uint32_t kVarint = 0, kLengthDelimited = 2;
constexpr uint32_t Tag(uint32_t field, uint32_t type) { return (field << 3) | type; }
constexpr int kFloat32 = 1;  // DType.FLOAT32

void PutVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>(v | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Appends an int field (skipped when zero, as proto3 does).
void PutIntField(uint32_t field, int64_t v, std::string* out) {
  if (v == 0) return;
  PutVarint(Tag(field, kVarint), out);
  PutVarint(static_cast<uint64_t>(v), out);
}

// Ranges [begin, begin + size) of the bytes in `all` (a buffer's slices, which hold them), in
// ascending order of begin, each as a buffer sharing the slices; an empty range is a valid,
// empty buffer (decoders can read it). One pass over the slices for all ranges.
std::vector<grpc::ByteBuffer> CutSlices(const std::vector<grpc::Slice>& all,
                                        const std::vector<std::pair<size_t, size_t>>& ranges) {
  std::vector<grpc::ByteBuffer> out;
  size_t slice = 0, pos = 0;  // The slice holding the range's start, and that slice's offset.
  for (const auto& [begin, size] : ranges) {
    std::vector<grpc::Slice> part;
    while (slice + 1 < all.size() && pos + all[slice].size() <= begin) pos += all[slice++].size();
    for (size_t i = slice, at = pos; i < all.size() && at < begin + size; at += all[i++].size()) {
      const size_t from = std::max(begin, at), to = std::min(begin + size, at + all[i].size());
      if (from < to) part.push_back(all[i].sub(from - at, to - at));
    }
    if (part.empty()) part.emplace_back();
    out.emplace_back(part.data(), part.size());
  }
  return out;
}

// Bytes [begin, begin + size) of `buffer` (which holds them), sharing its slices.
grpc::ByteBuffer SubBuffer(const grpc::ByteBuffer& buffer, size_t begin, size_t size) {
  std::vector<grpc::Slice> all;
  if (size == 0 || !buffer.Dump(&all).ok()) all.clear();
  return CutSlices(all, {{begin, size}})[0];
}

// Appends to `slices` a length-delimited field `field` holding `body`: one copied slice with
// `head` (small fields already encoded, which come first), the field's tag and length, then
// `body`'s slices, shared (no copy of the body).
void AppendMessageField(std::string head, uint32_t field, const grpc::ByteBuffer& body,
                        std::vector<grpc::Slice>* slices) {
  PutVarint(Tag(field, kLengthDelimited), &head);
  PutVarint(body.Length(), &head);
  slices->emplace_back(head.data(), head.size());
  std::vector<grpc::Slice> rest;
  if (body.Length() > 0 && body.Dump(&rest).ok()) {
    for (grpc::Slice& s : rest) slices->push_back(std::move(s));
  }
}

// Builds a message as gRPC slices: small bytes gathered and copied, large strings moved into
// slices of their own (no copy).
class SliceWriter {
 public:
  void Bytes(absl::string_view b) {
    pending_.append(b.data(), b.size());
    size_ += b.size();
  }
  void Varint(uint64_t v) {
    std::string b;
    PutVarint(v, &b);
    Bytes(b);
  }
  // Takes `s`'s bytes without copying them.
  void Owned(std::string s) {
    if (s.empty()) return;
    Flush();
    auto* held = new std::string(std::move(s));
    size_ += held->size();
    slices_.emplace_back(
        held->data(), held->size(), [](void* p) { delete static_cast<std::string*>(p); }, held);
  }
  void Append(SliceWriter&& w) {
    w.Flush();
    Flush();
    for (grpc::Slice& slice : w.slices_) slices_.push_back(std::move(slice));
    size_ += w.size_;
  }
  size_t size() const { return size_; }
  grpc::ByteBuffer Finish() {
    Flush();
    if (slices_.empty()) slices_.emplace_back();
    return grpc::ByteBuffer(slices_.data(), slices_.size());
  }

 private:
  void Flush() {
    if (pending_.empty()) return;
    slices_.emplace_back(pending_.data(), pending_.size());  // Copies the small bytes.
    pending_.clear();
  }
  std::string pending_;
  std::vector<grpc::Slice> slices_;
  size_t size_ = 0;
};

// A PullResponse's encoding, each chunk's data moved out of `r` into its own slice.
SliceWriter EncodePullBody(PullResponse* r) {
  SliceWriter w;
  for (ChunkData& c : *r->mutable_chunks()) {
    std::string data;
    data.swap(*c.mutable_data());
    const std::string head = c.SerializeAsString();  // Fields 1-5: data is now empty.
    std::string data_head;
    if (!data.empty()) {
      PutVarint(Tag(6, kLengthDelimited), &data_head);
      PutVarint(data.size(), &data_head);
    }
    w.Varint(Tag(1, kLengthDelimited));
    w.Varint(head.size() + data_head.size() + data.size());
    w.Bytes(head);
    w.Bytes(data_head);
    w.Owned(std::move(data));
  }
  if (r->commit_missing()) {
    w.Varint(Tag(2, kVarint));
    w.Varint(1);
  }
  return w;
}

// A PushResponse's encoding, the data of its pulled chunks moved out of `r`.
SliceWriter EncodePushBody(PushResponse* r) {
  SliceWriter w;
  SliceWriter pulled;
  const bool fused = r->has_pulled();
  if (fused) pulled = EncodePullBody(r->mutable_pulled());
  r->clear_pulled();
  w.Bytes(r->SerializeAsString());  // Fields 1-3.
  if (fused) {
    w.Varint(Tag(4, kLengthDelimited));
    w.Varint(pulled.size());
    w.Append(std::move(pulled));
  }
  return w;
}

}  // namespace

grpc::ByteBuffer EncodePullResponse(PullResponse* response) {
  return EncodePullBody(response).Finish();
}

grpc::ByteBuffer EncodePushResponse(PushResponse* response) {
  return EncodePushBody(response).Finish();
}

grpc::ByteBuffer EncodeStreamResponse(StreamResponse* response) {
  StreamResponse head;  // Fields 1-3.
  head.set_call(response->call());
  head.set_code(response->code());
  head.set_message(response->message());
  SliceWriter out;
  out.Bytes(head.SerializeAsString());
  if (response->has_pull() || response->has_push()) {
    const bool pull = response->has_pull();
    SliceWriter body =
        pull ? EncodePullBody(response->mutable_pull()) : EncodePushBody(response->mutable_push());
    out.Varint(Tag(pull ? 5 : 4, kLengthDelimited));
    out.Varint(body.size());
    out.Append(std::move(body));
  }
  return out.Finish();
}

absl::Status UndecodableRequest(const absl::Status& decoded, absl::string_view where,
                                absl::string_view type, int64_t max_chunks) {
  if (decoded.code() == absl::StatusCode::kInvalidArgument) {
    return absl::InvalidArgumentError(absl::StrCat(
        where, ": more than ", max_chunks, " chunks, more than a job has (--max_chunks_per_job)"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": the request is not a ", type, ": ", decoded.message()));
}

grpc::ByteBuffer FrameStreamRequest(uint64_t call, StreamOp op, const grpc::ByteBuffer& body) {
  std::string head;
  if (call != 0) {
    PutVarint(Tag(1, kVarint), &head);
    PutVarint(call, &head);
  }
  std::vector<grpc::Slice> slices;
  AppendMessageField(std::move(head), static_cast<uint32_t>(op), body, &slices);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

void AppendStreamBatchElement(const grpc::ByteBuffer& message, std::vector<grpc::Slice>* slices) {
  AppendMessageField("", kStreamBatchField, message, slices);
}

namespace {

// `message` (an encoded StreamRequest) preceded by a kStreamPadField field sized so that its
// largest slice starts at a multiple of kShmAlignment once the message starts at offset `at`;
// as it is if that slice is small.
grpc::ByteBuffer PadStreamRequest(const grpc::ByteBuffer& message, size_t at) {
  std::vector<grpc::Slice> slices;
  if (message.Length() < kShmAlignFromBytes || !message.Dump(&slices).ok()) return message;
  size_t offset = 0, largest_at = 0, largest = 0;
  for (const grpc::Slice& s : slices) {
    if (s.size() > largest) {
      largest = s.size();
      largest_at = offset;
    }
    offset += s.size();
  }
  if (largest < kShmAlignFromBytes / 2) return message;
  // The field is its one-byte tag, a one-byte length n (< 128) and n bytes: 2 to 65 in all.
  size_t pad = (kShmAlignment - (at + largest_at) % kShmAlignment) % kShmAlignment;
  if (pad < 2) pad += kShmAlignment;
  std::string field(pad, '\0');
  field[0] = static_cast<char>(Tag(kStreamPadField, kLengthDelimited));
  field[1] = static_cast<char>(pad - 2);
  slices.insert(slices.begin(), grpc::Slice(field));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace

grpc::ByteBuffer JoinAlignedStreamRequests(const std::vector<grpc::ByteBuffer>& messages) {
  static_assert(kShmAlignment <= 64 && (kShmAlignment & (kShmAlignment - 1)) == 0, "");
  static_assert(Tag(kStreamPadField, kLengthDelimited) < 0x80, "a one-byte tag");
  if (messages.size() == 1) return PadStreamRequest(messages[0], 0);
  std::vector<grpc::Slice> slices;
  if (std::none_of(messages.begin(), messages.end(),
                   [](const grpc::ByteBuffer& m) { return m.Length() >= kShmAlignFromBytes; })) {
    for (const grpc::ByteBuffer& m : messages) AppendStreamBatchElement(m, &slices);
    return grpc::ByteBuffer(slices.data(), slices.size());
  }
  size_t offset = 0;  // Where the next element's tag goes.
  for (const grpc::ByteBuffer& m : messages) {
    // The element starts after its tag and length, whose size depends on the padding.
    grpc::ByteBuffer element = m;
    for (size_t header = 2; header <= 6; ++header) {
      grpc::ByteBuffer padded = PadStreamRequest(m, offset + header);
      if (1 + CodedOutputStream::VarintSize64(padded.Length()) == header) {
        element = std::move(padded);
        break;
      }
    }
    offset += 1 + CodedOutputStream::VarintSize64(element.Length()) + element.Length();
    AppendStreamBatchElement(element, &slices);
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer TakeStreamMessages(std::deque<grpc::ByteBuffer>* queue, bool batch) {
  // An element's bytes in a batch: its one-byte tag, its length and itself.
  const auto element = [](size_t len) { return 1 + CodedOutputStream::VarintSize64(len) + len; };
  size_t n = 1, bytes = element(queue->front().Length());
  if (batch) {
    while (n < queue->size() && n < kMaxStreamBatch &&
           bytes + element((*queue)[n].Length()) <= kStreamBatchBytes) {
      bytes += element((*queue)[n++].Length());
    }
  }
  if (n == 1) {
    grpc::ByteBuffer one = std::move(queue->front());
    queue->pop_front();
    return one;
  }
  std::vector<grpc::Slice> slices;
  for (size_t i = 0; i < n; ++i) {
    AppendStreamBatchElement(queue->front(), &slices);
    queue->pop_front();
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::Status SplitStreamBatch(const grpc::ByteBuffer& buffer, size_t max_parts,
                              std::vector<grpc::ByteBuffer>* parts, bool* is_batch) {
  parts->clear();
  *is_batch = false;
  std::vector<grpc::Slice> all;
  if (buffer.Length() == 0 || !buffer.Dump(&all).ok()) return absl::OkStatus();
  constexpr uint32_t kBatchTag = Tag(kStreamBatchField, kLengthDelimited);
  static_assert(kBatchTag < 0x80, "a one-byte tag");
  const auto first =
      std::find_if(all.begin(), all.end(), [](const grpc::Slice& s) { return s.size() > 0; });
  if (first == all.end() || first->begin()[0] != kBatchTag) return absl::OkStatus();
  *is_batch = true;
  // The elements' byte ranges, then one pass over the slices to cut them out.
  std::vector<std::pair<size_t, size_t>> ranges;
  {
    grpc::ByteBuffer copy(buffer);  // Shares slices (refcounted); the reader consumes it.
    grpc::ProtoBufferReader reader(&copy);
    CodedInputStream in(&reader);
    in.SetTotalBytesLimit(INT32_MAX);
    for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
      uint32_t len;
      if (tag != kBatchTag) {
        return absl::DataLossError(absl::StrCat("a batch holds field ", tag >> 3, " besides its ",
                                                "elements (field ", kStreamBatchField, ")"));
      }
      if (ranges.size() == max_parts) {
        return absl::DataLossError(absl::StrCat("a batch of more than ", max_parts, " elements"));
      }
      if (!in.ReadVarint32(&len)) return absl::DataLossError("a batch element's length is bad");
      ranges.emplace_back(static_cast<size_t>(in.CurrentPosition()), len);
      if (!in.Skip(static_cast<int>(len))) {
        return absl::DataLossError(
            absl::StrCat("a batch element of ", len, " bytes is longer than the message"));
      }
    }
    if (!in.ConsumedEntireMessage()) return absl::DataLossError("a malformed batch");
  }
  *parts = CutSlices(all, ranges);
  return absl::OkStatus();
}

absl::Status SplitStreamResponse(const grpc::ByteBuffer& buffer, StreamResponseHead* head,
                                 grpc::ByteBuffer* body) {
  *head = StreamResponseHead();
  *body = grpc::ByteBuffer();
  grpc::ByteBuffer copy(buffer);  // Shares slices (refcounted); the reader consumes it.
  grpc::ProtoBufferReader reader(&copy);
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT32_MAX);
  size_t body_begin = 0, body_size = 0;
  while (true) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) break;
    const uint32_t field = tag >> 3;
    uint64_t v;
    if (tag == Tag(1, kVarint) || tag == Tag(2, kVarint)) {
      if (!in.ReadVarint64(&v)) return absl::DataLossError("StreamResponse: bad varint");
      if (field == 1) head->call = v;
      if (field == 2) head->code = static_cast<int32_t>(v);
    } else if (tag == Tag(3, kLengthDelimited)) {
      uint32_t size;
      if (!in.ReadVarint32(&size) || size > (1u << 20) ||
          !in.ReadString(&head->message, static_cast<int>(size))) {
        return absl::DataLossError("StreamResponse: bad message field");
      }
    } else if (tag == Tag(4, kLengthDelimited) || tag == Tag(5, kLengthDelimited)) {
      uint32_t size;
      if (!in.ReadVarint32(&size)) return absl::DataLossError("StreamResponse: bad length");
      body_begin = static_cast<size_t>(in.CurrentPosition());
      body_size = size;
      if (!in.Skip(static_cast<int>(size))) {
        return absl::DataLossError(absl::StrCat("StreamResponse: response of ", size,
                                                " bytes is longer than the message"));
      }
      head->op = static_cast<int32_t>(field);
    } else if (field == kStreamBatchField) {
      // SplitStreamBatch takes a batch apart first: one here is nested, or beside other fields.
      return absl::DataLossError("StreamResponse: a batch inside a batch or beside other fields");
    } else if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) {
      return absl::DataLossError("StreamResponse: malformed field");
    }
  }
  if (!in.ConsumedEntireMessage()) return absl::DataLossError("StreamResponse: malformed");
  *body = SubBuffer(buffer, body_begin, body_size);
  return absl::OkStatus();
}

grpc::ByteBuffer EncodePushRequest(const std::string& job, int32_t worker, int64_t step,
                                   uint64_t request_id, const std::vector<PushChunkRef>& chunks,
                                   bool nonfinite, absl::string_view pull) {
  std::vector<grpc::Slice> slices;
  std::string head;
  if (!job.empty()) {
    PutVarint(Tag(1, kLengthDelimited), &head);
    PutVarint(job.size(), &head);
    head += job;
  }
  PutIntField(2, worker, &head);
  PutIntField(3, step, &head);
  if (request_id != 0) {
    PutVarint(Tag(4, kVarint), &head);
    PutVarint(request_id, &head);
  }
  for (const PushChunkRef& c : chunks) {
    // ChunkData header: fields 1-4, then the data field's tag and length.
    std::string chunk_head;
    PutIntField(1, c.tensor, &chunk_head);
    PutIntField(2, c.chunk, &chunk_head);
    PutIntField(3, c.version, &chunk_head);
    PutIntField(4, kFloat32, &chunk_head);
    if (!c.codec.empty()) {
      PutVarint(Tag(5, kLengthDelimited), &chunk_head);
      PutVarint(c.codec.size(), &chunk_head);
      chunk_head += c.codec;
    }
    const void* payload = c.codec.empty() ? static_cast<const void*>(c.data)
                                          : static_cast<const void*>(c.encoded.data());
    const uint64_t bytes = c.codec.empty() ? static_cast<uint64_t>(c.numel) * sizeof(float)
                                           : static_cast<uint64_t>(c.encoded.size());
    if (bytes > 0) {
      PutVarint(Tag(6, kLengthDelimited), &chunk_head);
      PutVarint(bytes, &chunk_head);
    }
    PutVarint(Tag(5, kLengthDelimited), &head);
    PutVarint(chunk_head.size() + bytes, &head);
    head += chunk_head;
    if (bytes > 0) {
      slices.emplace_back(head.data(), head.size());  // Copies the small header.
      head.clear();
      slices.emplace_back(payload, bytes, grpc::Slice::STATIC_SLICE);
    }
  }
  if (nonfinite) PutIntField(6, 1, &head);
  if (!pull.empty()) {
    PutVarint(Tag(7, kLengthDelimited), &head);
    PutVarint(pull.size(), &head);
    head.append(pull.data(), pull.size());
  }
  if (!head.empty()) slices.emplace_back(head.data(), head.size());
  return grpc::ByteBuffer(slices.data(), slices.size());
}

absl::Status FindMessageField(const grpc::ByteBuffer& buffer, uint32_t field, grpc::ByteBuffer* out,
                              bool* found) {
  *found = false;
  *out = grpc::ByteBuffer();
  grpc::ByteBuffer copy(buffer);  // Shares slices (refcounted); the reader consumes it.
  grpc::ProtoBufferReader reader(&copy);
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT32_MAX);
  size_t begin = 0, size = 0;
  while (true) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) break;
    if (tag == Tag(field, kLengthDelimited)) {
      if (*found) {
        *found = false;
        return absl::DataLossError(absl::StrCat("field ", field, " occurs twice"));
      }
      uint32_t len;
      if (!in.ReadVarint32(&len)) return absl::DataLossError("bad length of a message field");
      begin = static_cast<size_t>(in.CurrentPosition());
      size = len;
      if (!in.Skip(static_cast<int>(len))) {
        return absl::DataLossError(
            absl::StrCat("field ", field, " of ", len, " bytes is longer than the message"));
      }
      *found = true;
    } else if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) {
      return absl::DataLossError("malformed field");
    }
  }
  if (!in.ConsumedEntireMessage()) return absl::DataLossError("malformed message");
  if (*found) *out = SubBuffer(buffer, begin, size);
  return absl::OkStatus();
}

absl::Status DecodePullResponse(const grpc::ByteBuffer& buffer, const PullChunkSink& sink,
                                bool* commit_missing) {
  if (commit_missing != nullptr) *commit_missing = false;
  grpc::ByteBuffer copy(buffer);  // Shares slices (refcounted); the reader consumes it.
  grpc::ProtoBufferReader reader(&copy);
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT32_MAX);
  const size_t total = buffer.Length();
  int index = 0;
  while (true) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) break;  // End of message.
    if (tag == Tag(2, kVarint)) {
      uint64_t v;
      if (!in.ReadVarint64(&v)) return absl::DataLossError("PullResponse: bad commit_missing");
      if (commit_missing != nullptr) *commit_missing = v != 0;
      continue;
    }
    if (tag != Tag(1, kLengthDelimited)) {
      if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) {
        return absl::DataLossError("PullResponse: malformed field");
      }
      continue;
    }
    uint32_t len;
    if (!in.ReadVarint32(&len)) return absl::DataLossError("PullResponse: truncated chunk");
    if (len > total - static_cast<size_t>(in.CurrentPosition())) {
      // Checked here so that the data length, checked against this limit below, can never
      // exceed the message either: the sink is asked only for memory the message fills.
      return absl::DataLossError(absl::StrCat("PullResponse: chunk ", index, " claims ", len,
                                              " bytes, more than the message holds"));
    }
    const auto limit = in.PushLimit(static_cast<int>(len));
    uint64_t tensor = 0, chunk = 0, version = 0, dtype = 0;
    std::string codec;
    bool got_data = false;
    while (true) {
      const uint32_t t = in.ReadTag();
      if (t == 0) break;
      const uint32_t field = t >> 3;
      if (got_data && field >= 1 && field <= 6) {
        // The sink has been called with the header read so far: a later header field (or a
        // second data field, which protobuf would take instead) would make it wrong.
        return absl::DataLossError(
            absl::StrCat("PullResponse: chunk ", index, " has field ", field, " after its data"));
      }
      if ((t & 7) == kVarint && field >= 1 && field <= 4) {
        uint64_t v;
        if (!in.ReadVarint64(&v)) return absl::DataLossError("PullResponse: bad varint");
        (field == 1 ? tensor : field == 2 ? chunk : field == 3 ? version : dtype) = v;
      } else if (t == Tag(5, kLengthDelimited)) {
        uint32_t size;
        if (!in.ReadVarint32(&size) || size > 256 ||
            !in.ReadString(&codec, static_cast<int>(size))) {
          return absl::DataLossError("PullResponse: bad codec field");
        }
      } else if (t == Tag(6, kLengthDelimited)) {
        uint32_t bytes;
        if (!in.ReadVarint32(&bytes)) return absl::DataLossError("PullResponse: bad length");
        if (static_cast<int64_t>(bytes) > in.BytesUntilLimit()) {
          return absl::DataLossError(absl::StrCat("PullResponse: chunk ", index, " claims ", bytes,
                                                  " bytes, more than the message holds"));
        }
        auto dest = sink(static_cast<int32_t>(tensor), static_cast<int32_t>(chunk),
                         static_cast<int64_t>(version), static_cast<int32_t>(dtype), codec, bytes);
        if (!dest.ok()) return dest.status();
        if (!in.ReadRaw(*dest, static_cast<int>(bytes))) {
          return absl::DataLossError(absl::StrCat("PullResponse: chunk ", index, " truncated"));
        }
        got_data = true;
      } else if (!google::protobuf::internal::WireFormatLite::SkipField(&in, t)) {
        return absl::DataLossError("PullResponse: malformed chunk field");
      }
    }
    if (!in.ConsumedEntireMessage() || in.BytesUntilLimit() != 0) {
      return absl::DataLossError(absl::StrCat("PullResponse: chunk ", index, " truncated"));
    }
    in.PopLimit(limit);
    if (!got_data) {
      // Zero-length data (an empty chunk) is legal protobuf: report it with 0 bytes.
      auto dest = sink(static_cast<int32_t>(tensor), static_cast<int32_t>(chunk),
                       static_cast<int64_t>(version), static_cast<int32_t>(dtype), codec, 0);
      if (!dest.ok()) return dest.status();
    }
    ++index;
  }
  if (!in.ConsumedEntireMessage()) return absl::DataLossError("PullResponse: malformed");
  return absl::OkStatus();
}

namespace {

// DenseData is filled and scanned in blocks of this size (a multiple of 4: blocks hold whole
// floats), each scanned while it is still in cache.
constexpr int64_t kDenseBlockBytes = int64_t{64} << 10;

// The first NaN/Inf among the `n` floats at `at` (in `copy`'s private bytes), from its scan.
int64_t FirstNonFiniteIn(const ScannedCopy& copy, const float* at, int64_t n) {
  if (!copy.complete) return FirstNonFinite(at, n);
  const uint64_t from = static_cast<uint64_t>(reinterpret_cast<const char*>(at) - copy.base);
  const auto it = std::lower_bound(copy.nonfinite.begin(), copy.nonfinite.end(), from);
  if (it == copy.nonfinite.end() || *it >= from + static_cast<uint64_t>(n) * 4) return -1;
  return static_cast<int64_t>((*it - from) / 4);
}

// Reads a data field's `bytes` bytes (known to be within the message) into `d`; with
// `in_place`, whole floats lying float-aligned in one piece of that private copy are referenced
// where they lie instead of copied.
bool ReadDense(CodedInputStream* in, int64_t bytes, DenseData* d, const ScannedCopy* in_place) {
  d->present = true;
  d->bytes = bytes;
  d->first_nonfinite = -1;
  d->view = nullptr;
  const void* at = nullptr;
  int size = 0;
  if (in_place != nullptr && bytes > 0 && bytes % 4 == 0 &&
      in->GetDirectBufferPointer(&at, &size) && size >= bytes &&
      reinterpret_cast<uintptr_t>(at) % alignof(float) == 0 &&
      static_cast<const char*>(at) >= in_place->base &&
      static_cast<const char*>(at) + bytes <= in_place->base + in_place->bytes &&
      (static_cast<const char*>(at) - in_place->base) % 4 == 0) {  // On the scan's words.
    d->values.reset();
    d->view = static_cast<const float*>(at);
    d->first_nonfinite = FirstNonFiniteIn(*in_place, d->view, bytes / 4);
    return in->Skip(static_cast<int>(bytes));
  }
  const int64_t floats = (bytes + 3) / 4;
  d->values.reset(floats > 0 ? new float[floats] : nullptr);
  if (floats > 0) d->values[floats - 1] = 0.0f;  // The padding after a partial last float.
  char* dst = reinterpret_cast<char*>(d->values.get());
  for (int64_t off = 0; off < bytes; off += kDenseBlockBytes) {
    const int64_t n = std::min(kDenseBlockBytes, bytes - off);
    if (!in->ReadRaw(dst + off, static_cast<int>(n))) return false;
    if (d->first_nonfinite < 0) {
      const int64_t bad = FirstNonFinite(d->values.get() + off / 4, n / 4);
      if (bad >= 0) d->first_nonfinite = off / 4 + bad;
    }
  }
  return true;
}

// Reads a length prefix that must fit in what is left of the current limit.
bool ReadLength(CodedInputStream* in, uint32_t* len) {
  return in->ReadVarint32(len) && static_cast<int64_t>(*len) <= in->BytesUntilLimit();
}

// Reads a length-delimited field's length and runs `body` on its contents (the stream limited
// to them). False if the length does not fit, `body` fails, or it leaves bytes unread.
template <typename Body>
bool InField(CodedInputStream* in, Body body) {
  uint32_t len;
  if (!ReadLength(in, &len)) return false;
  const auto limit = in->PushLimit(static_cast<int>(len));
  if (!body() || in->BytesUntilLimit() != 0) return false;
  in->PopLimit(limit);
  return true;
}

// One ChunkData (the stream limited to it), written to `out` without its raw data, which goes
// to `d`. Only raw chunks come here: a push with an encoded chunk is parsed by protobuf
// (ScanPush), and a codec found here anyway refuses the message.
bool StripChunk(CodedInputStream* in, std::string* out, DenseData* d, const ScannedCopy* in_place) {
  std::string codec;
  DenseData data;
  {
    StringOutputStream stream(out);
    CodedOutputStream os(&stream);
    while (true) {
      const uint32_t tag = in->ReadTag();
      if (tag == 0) break;
      uint32_t len;
      if (tag == Tag(6, kLengthDelimited)) {  // data: protobuf keeps the last one.
        if (!ReadLength(in, &len) || !ReadDense(in, len, &data, in_place)) return false;
      } else if (tag == Tag(5, kLengthDelimited)) {  // codec: kept, and remembered.
        if (!ReadLength(in, &len) || !in->ReadString(&codec, static_cast<int>(len))) return false;
        WireFormatLite::WriteString(5, codec, &os);
      } else if (!WireFormatLite::SkipField(in, tag, &os)) {
        return false;
      }
    }
    if (!in->ConsumedEntireMessage() || !codec.empty() || os.HadError()) return false;
  }
  if (data.present) *d = std::move(data);
  return true;
}

// The PushRequest fields up to the current limit, written to `out` with each chunk stripped by
// StripChunk; appends one DenseData per chunk to `dense`.
bool StripPush(CodedInputStream* in, std::string* out, DenseChunks* dense,
               const ScannedCopy* in_place) {
  StringOutputStream stream(out);
  CodedOutputStream os(&stream);
  while (true) {
    const uint32_t tag = in->ReadTag();
    if (tag == 0) break;
    if (tag != Tag(5, kLengthDelimited)) {  // Not a chunk: copied as it is.
      if (!WireFormatLite::SkipField(in, tag, &os)) return false;
      continue;
    }
    std::string chunk;
    DenseData d;
    if (!InField(in, [&] { return StripChunk(in, &chunk, &d, in_place); })) return false;
    WireFormatLite::WriteBytes(5, chunk, &os);
    dense->push_back(std::move(d));
  }
  return in->ConsumedEntireMessage() && !os.HadError();
}

// Walks a PushRequest's fields up to the current limit, reading only codec strings and
// skipping the rest, data included: adds its chunks to *chunks and sets *codec if a chunk
// names a codec (its last codec field, as protobuf keeps). Stops, false, on malformed input
// (the decoding that follows refuses it) or once *chunks passes max_chunks.
bool ScanPush(CodedInputStream* in, int64_t max_chunks, int64_t* chunks, bool* codec) {
  while (true) {
    const uint32_t tag = in->ReadTag();
    if (tag == 0) return true;
    if (tag != Tag(5, kLengthDelimited)) {
      if (!WireFormatLite::SkipField(in, tag)) return false;
      continue;
    }
    if (++*chunks > max_chunks) return false;
    std::string name;
    const bool read = InField(in, [&] {
      while (true) {
        const uint32_t t = in->ReadTag();
        if (t == 0) return in->ConsumedEntireMessage();
        uint32_t n;
        if (t == Tag(5, kLengthDelimited)) {
          if (!ReadLength(in, &n) || !in->ReadString(&name, static_cast<int>(n))) return false;
        } else if (!WireFormatLite::SkipField(in, t)) {
          return false;
        }
      }
    });
    if (!read) return false;
    if (!name.empty()) *codec = true;
  }
}

// Decodes `buffer` with `strip` (which writes the message without its raw chunk data) and
// parses the result into `message` with protobuf. A message in which `scan` (a ScanPush over
// the message's pushes) finds an encoded chunk is parsed whole by protobuf instead (`dense`
// stays empty): its payloads would otherwise be copied once per level of nesting, for no scan
// saved. A message with more than `max_chunks` chunks is refused before anything is allocated
// for them.
template <typename Message, typename Scan, typename Strip>
absl::Status DecodeStripped(const grpc::ByteBuffer& buffer, const char* what, Message* message,
                            DenseChunks* dense, int64_t max_chunks, Scan scan, Strip strip) {
  message->Clear();
  dense->clear();
  const size_t total = buffer.Length();
  if (total >= static_cast<size_t>(INT32_MAX)) {
    return absl::DataLossError(absl::StrCat(what, ": ", total, " bytes is too long"));
  }
  const auto malformed = [&] {
    message->Clear();
    dense->clear();
    return absl::DataLossError(absl::StrCat(what, ": malformed"));
  };
  bool encoded;
  {
    grpc::ByteBuffer copy(buffer);  // Shares slices (refcounted); the reader consumes it.
    grpc::ProtoBufferReader reader(&copy);
    if (!reader.status().ok()) return malformed();
    CodedInputStream in(&reader);
    in.SetTotalBytesLimit(INT32_MAX);
    in.PushLimit(static_cast<int>(total));
    int64_t chunks = 0;
    encoded = false;
    // A malformed message goes on to the parse chosen by what was seen so far, which refuses it.
    scan(&in, max_chunks, &chunks, &encoded);
    if (chunks > max_chunks) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": more than ", max_chunks, " chunks"));
    }
  }
  grpc::ByteBuffer copy(buffer);
  grpc::ProtoBufferReader reader(&copy);
  if (!reader.status().ok()) return malformed();
  if (encoded) {
    if (!message->ParseFromZeroCopyStream(&reader)) return malformed();
    return absl::OkStatus();
  }
  CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT32_MAX);
  in.PushLimit(static_cast<int>(total));
  std::string stripped;
  if (!strip(&in, &stripped) || in.BytesUntilLimit() != 0 || !message->ParseFromString(stripped)) {
    return malformed();
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DecodePushRequest(const grpc::ByteBuffer& buffer, PushRequest* request,
                               DenseChunks* dense, int64_t max_chunks) {
  return DecodeStripped(buffer, "PushRequest", request, dense, max_chunks, ScanPush,
                        [dense](CodedInputStream* in, std::string* out) {
                          return StripPush(in, out, dense, nullptr);
                        });
}

absl::Status DecodeStreamRequest(const grpc::ByteBuffer& buffer, StreamRequest* request,
                                 DenseChunks* dense, int64_t max_chunks,
                                 const ScannedCopy* in_place) {
  // Every push field counts: protobuf merges repeated ones, chunks and all.
  const auto scan = [](CodedInputStream* in, int64_t max, int64_t* chunks, bool* codec) {
    while (true) {
      const uint32_t tag = in->ReadTag();
      if (tag == 0) return true;
      if (tag != Tag(static_cast<uint32_t>(StreamOp::kPush), kLengthDelimited)) {
        if (!WireFormatLite::SkipField(in, tag)) return false;
        continue;
      }
      if (!InField(in, [&] { return ScanPush(in, max, chunks, codec); })) return false;
    }
  };
  return DecodeStripped(
      buffer, "StreamRequest", request, dense, max_chunks, scan,
      [dense, in_place](CodedInputStream* in, std::string* out) {
        StringOutputStream stream(out);
        CodedOutputStream os(&stream);
        while (true) {
          const uint32_t tag = in->ReadTag();
          if (tag == 0) break;
          if (tag == Tag(static_cast<uint32_t>(StreamOp::kPush), kLengthDelimited)) {
            // A second push merges into the first (protobuf): its chunks follow.
            std::string push;
            if (!InField(in, [&] { return StripPush(in, &push, dense, in_place); })) {
              return false;
            }
            WireFormatLite::WriteBytes(static_cast<int>(StreamOp::kPush), push, &os);
            continue;
          }
          // A pull replaces the oneof's push, chunks and all (a field 3 of another wire type
          // is an unknown field to protobuf, and replaces nothing).
          if (tag == Tag(static_cast<uint32_t>(StreamOp::kPull), kLengthDelimited)) dense->clear();
          if (!WireFormatLite::SkipField(in, tag, &os)) return false;
        }
        return in->ConsumedEntireMessage() && !os.HadError();
      });
}

void CopyAndScan(const char* from, char* to, size_t bytes, ScannedCopy* out) {
  out->base = to;
  out->bytes = bytes;
  out->nonfinite.clear();
  out->complete = true;
  const float* words = reinterpret_cast<const float*>(to);
  for (size_t off = 0; off < bytes; off += static_cast<size_t>(kDenseBlockBytes)) {
    const size_t n = std::min(static_cast<size_t>(kDenseBlockBytes), bytes - off);
    std::memcpy(to + off, from + off, n);
    // The block's whole words, scanned while they are in cache.
    const int64_t first = static_cast<int64_t>(off / 4), end = first + static_cast<int64_t>(n / 4);
    for (int64_t w = first; w < end && out->complete;) {
      const int64_t bad = FirstNonFinite(words + w, end - w);
      if (bad < 0) break;
      if (out->nonfinite.size() == ScannedCopy::kMaxListed) {
        out->complete = false;  // The decoder scans each payload itself.
        break;
      }
      out->nonfinite.push_back(static_cast<uint32_t>((w + bad) * 4));
      w += bad + 1;
    }
  }
}

bool CopyBufferTo(const grpc::ByteBuffer& buffer, char* out, size_t capacity) {
  std::vector<grpc::Slice> slices;
  if (buffer.Length() > capacity || !buffer.Dump(&slices).ok()) return false;
  for (const grpc::Slice& s : slices) {
    std::memcpy(out, s.begin(), s.size());
    out += s.size();
  }
  return true;
}

}  // namespace gradmesh
