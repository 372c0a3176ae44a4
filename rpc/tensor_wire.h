// Copy-avoiding encoding of the tensor-carrying messages of proto/gradmesh.proto.
//
// Protobuf would copy a gradient twice on the way out (into the message's `bytes` field, then
// into gRPC's buffer) and a pulled chunk twice on the way in (into a std::string, then into
// the model). These functions produce and consume exactly the same wire bytes as the
// generated code (checked against it in tensor_wire_test.cc) while:
//   * EncodePushRequest: referencing the caller's float arrays from the grpc::ByteBuffer
//     (static slices, no copy). The arrays must stay alive and unchanged until the RPC that
//     sends the buffer has completed.
//   * DecodePullResponse: copying each chunk's data straight from gRPC's slices into memory
//     chosen by the caller.
//   * DecodePushRequest / DecodeStreamRequest (the shard's side): copying each raw gradient
//     once, from gRPC's slices into aligned memory, scanning it for NaN/Inf as it lands, where
//     protobuf would copy it into a std::string and the shard then scan it in a pass of its own.
// The bytes of a "changes" chunk (compression/changes.h) are not framing and are not here.
//
// ParameterService.Stream messages wrap those encodings: FrameStreamRequest puts a small
// header before an encoded PushRequest or PullRequest (sharing its slices), and
// SplitStreamResponse finds the encoded PushResponse or PullResponse inside a StreamResponse
// (sharing gRPC's slices), so a streamed gradient or pulled chunk is copied no more than a
// unary one.
//
// Thread safety: pure functions.
#ifndef GRADMESH_RPC_TENSOR_WIRE_H_
#define GRADMESH_RPC_TENSOR_WIRE_H_

#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dense_data.h"
#include "compression/changes.h"

namespace gradmesh {

class PullResponse;  // proto/gradmesh.proto
class PushRequest;
class PushResponse;
class StreamRequest;
class StreamResponse;

// One chunk of a push: dense float32 values at `data` (numel elements), or, when `codec` is
// not empty, the encoded payload `encoded` (referenced too: it must outlive the RPC).
struct PushChunkRef {
  int32_t tensor = 0;
  int32_t chunk = 0;
  int64_t version = 0;
  const float* data = nullptr;
  int64_t numel = 0;
  std::string codec;
  absl::string_view encoded;
};

// Encodes PushRequest{job, worker, step, request_id, chunks (dtype FLOAT32, codec ""),
// nonfinite, pull}; `pull` is an encoded PullRequest (copied; empty: none).
grpc::ByteBuffer EncodePushRequest(const std::string& job, int32_t worker, int64_t step,
                                   uint64_t request_id, const std::vector<PushChunkRef>& chunks,
                                   bool nonfinite = false, absl::string_view pull = {});

// The encoded bytes of length-delimited field `field` of the message in `buffer`, sharing
// `buffer`'s slices: e.g. PushResponse.pulled (4), for DecodePullResponse. *found says whether
// the field was present (else `out` is empty). DataLoss on malformed input, and when the field
// occurs more than once (protobuf would merge the occurrences; no encoder here writes two).
absl::Status FindMessageField(const grpc::ByteBuffer& buffer, uint32_t field, grpc::ByteBuffer* out,
                              bool* found);

// Called for each chunk of a PullResponse once its header is known (tensor, chunk, version,
// dtype, codec and the data size in bytes). Returns where to copy the data (exactly `bytes`
// bytes), or an error to abort decoding.
using PullChunkSink =
    std::function<absl::StatusOr<char*>(int32_t tensor, int32_t chunk, int64_t version,
                                        int32_t dtype, absl::string_view codec, int64_t bytes)>;

// Decodes a PullResponse. Chunks must serialise (tensor, chunk, version, dtype, codec) before
// data, as protobuf's encoder does (fields in number order); otherwise, or on any malformed
// input, returns DataLoss naming the problem.
// `commit_missing` (may be null) receives PullResponse.commit_missing.
absl::Status DecodePullResponse(const grpc::ByteBuffer& buffer, const PullChunkSink& sink,
                                bool* commit_missing = nullptr);

// Decodes a PushRequest as protobuf would, except for each chunk's raw data (codec ""): that is
// not copied into `request` (its ChunkData.data stays empty) but once, straight from gRPC's
// slices, into (*dense)[i] (aligned floats, one per chunk of `request`), each 64 KiB block
// scanned for NaN/Inf while it is in cache. A shard then validates and applies those values
// without another copy or pass of its own (server/push_decoding.h). A message with an encoded
// chunk (a codec) is parsed whole by protobuf, every payload in its `data`, and `dense` left
// empty. Whatever protobuf's parser accepts decodes to the same message (once the data is put
// back); what it refuses is DataLoss, except a few encodings that CodedInputStream reads and
// protobuf does not (overlong tag or length varints; the result is still a valid message).
// Checked against protobuf by tensor_wire_test and //tests/fuzz:push_request_fuzz.
// A push of more than `max_chunks` chunks is INVALID_ARGUMENT before anything is allocated for
// them (an empty chunk is 2 bytes on the wire and about a hundred decoded: a shard passes its
// --max_chunks_per_job, which no job's push can exceed).
inline constexpr int64_t kNoChunkLimit = INT64_MAX;
absl::Status DecodePushRequest(const grpc::ByteBuffer& buffer, PushRequest* request,
                               DenseChunks* dense, int64_t max_chunks = kNoChunkLimit);
// A request copied out of memory that another process may write (a shared-memory channel's
// request area) into private memory, and scanned on the way, each 64 KiB block while it is in
// cache, for the 4-byte words that as floats are NaN or Inf.
struct ScannedCopy {
  static constexpr size_t kMaxListed = 64;
  const char* base = nullptr;  // The private copy.
  size_t bytes = 0;
  // Offsets from `base` (multiples of 4, ascending) of the words that are not finite floats;
  // all of them when `complete`, else only the first kMaxListed.
  std::vector<uint32_t> nonfinite;
  bool complete = true;
};
// Copies `bytes` bytes from `from` to `to` (float-aligned; bytes < 4 GiB) and fills `*out`.
// The scan's words start at `to`.
void CopyAndScan(const char* from, char* to, size_t bytes, ScannedCopy* out);

// The same for a StreamRequest: its push's chunks as DecodePushRequest decodes them (none for
// a pull). `in_place` (a shared-memory channel's private copy of the request, `buffer` lying
// in it, both unchanged and alive for as long as `dense`): raw data lying float-aligned there
// is referenced (DenseData.view) rather than copied, its NaN/Inf found in the copy's scan.
absl::Status DecodeStreamRequest(const grpc::ByteBuffer& buffer, StreamRequest* request,
                                 DenseChunks* dense, int64_t max_chunks = kNoChunkLimit,
                                 const ScannedCopy* in_place = nullptr);

// The INVALID_ARGUMENT a shard answers for a request that `decoded` (the failed status of one
// of the decoders above) refused, at `where` ("Stream: message 3"): more than `max_chunks`
// chunks (the decoders' InvalidArgument), or not a `type` ("PushRequest") at all.
absl::Status UndecodableRequest(const absl::Status& decoded, absl::string_view where,
                                absl::string_view type, int64_t max_chunks);

// Which operation a StreamRequest carries: its oneof field number.
enum class StreamOp : int32_t { kPush = 2, kPull = 3 };

// Encodes StreamRequest{call, push or pull = the message encoded in `body`}, referencing
// `body`'s slices (static ones included: the memory they point to must stay as required for
// `body` itself).
grpc::ByteBuffer FrameStreamRequest(uint64_t call, StreamOp op, const grpc::ByteBuffer& body);

// Encode `response` exactly as protobuf would, but move the data of its pulled chunks
// (PullResponse.chunks, PushResponse.pulled, StreamResponse.pull or .push) into the buffer's
// slices instead of copying them: `response` keeps everything else and loses those strings.
grpc::ByteBuffer EncodePullResponse(PullResponse* response);
grpc::ByteBuffer EncodePushResponse(PushResponse* response);
grpc::ByteBuffer EncodeStreamResponse(StreamResponse* response);

// The fields of a StreamResponse other than its push or pull response.
struct StreamResponseHead {
  uint64_t call = 0;
  int32_t code = 0;  // grpc::StatusCode.
  std::string message;
  int32_t op = 0;  // 4 (push), 5 (pull) or 0 (neither was present).
};

// Decodes a StreamResponse: the head, and in `body` the encoded PushResponse or PullResponse
// (empty when neither is present), sharing `buffer`'s slices. DataLoss on malformed input, and
// on a batch field (SplitStreamBatch takes batches apart first).
absl::Status SplitStreamResponse(const grpc::ByteBuffer& buffer, StreamResponseHead* head,
                                 grpc::ByteBuffer* body);

// Batches on ParameterService.Stream: several operations in one message, each an element of
// StreamRequest.batch (or StreamResponse.batch), field kStreamBatchField, encoded as a complete
// StreamRequest (StreamResponse). A batch message carries nothing but those elements.
// A side sends batches only to a peer that announced, in its metadata, that it reads them
// (kStreamBatchMetadata = "1": the client when it opens the call, the shard in its initial
// metadata); a peer from before batches never sees one.
inline constexpr uint32_t kStreamBatchField = 15;
inline constexpr char kStreamBatchMetadata[] = "x-gradmesh-stream-batch";
// A batch holds at most this many elements and, with their tags and lengths, at most
// kStreamBatchBytes (a message larger than that goes alone).
inline constexpr size_t kMaxStreamBatch = 256;
inline constexpr size_t kStreamBatchBytes = size_t{1} << 20;

// The next message to write from `queue` (not empty): its front alone, or, when `batch` and
// more than one message waits, as many from the front as fit kStreamBatchBytes and
// kMaxStreamBatch (at least one) as one batch. A peer whose RpcOptions.max_message_bytes is
// under kStreamBatchBytes must not be sent batches (the defaults are 256 MiB).
grpc::ByteBuffer TakeStreamMessages(std::deque<grpc::ByteBuffer>* queue, bool batch);

// Appends `message` (an encoded StreamRequest or StreamResponse) to a batch being built in
// `slices` as one more element, sharing its slices (the header is copied).
void AppendStreamBatchElement(const grpc::ByteBuffer& message, std::vector<grpc::Slice>* slices);

// Shared-memory channels (rpc/shm_op_channel.h): `messages` (encoded StreamRequests, at least
// one) as one request, a batch if more than one, each preceded by a kStreamPadField field
// (StreamRequest.pad, which the shard ignores) sized so that its largest
// slice (a push's largest chunk of data) starts at a multiple of kShmAlignment from the
// request's start, when it is kShmAlignFromBytes / 2 or more. The shard, which reads its private
// copy of the request in place (DecodeStreamRequest's in_place), then finds that data
// float-aligned and does not copy it again. (Smaller messages go as they are: a copy of a few
// KiB costs less than finding their slices.)
inline constexpr uint32_t kStreamPadField = 14;
inline constexpr size_t kShmAlignment = 64;
inline constexpr size_t kShmAlignFromBytes = size_t{32} << 10;
grpc::ByteBuffer JoinAlignedStreamRequests(const std::vector<grpc::ByteBuffer>& messages);

// Whether `buffer` is a batch (its first field is kStreamBatchField; false for an empty
// message). If so, `parts` receives its elements in order, sharing `buffer`'s slices, and a
// batch holding any other field, or more than `max_parts` elements, is DataLoss.
absl::Status SplitStreamBatch(const grpc::ByteBuffer& buffer, size_t max_parts,
                              std::vector<grpc::ByteBuffer>* parts, bool* is_batch);

// Copies the bytes of `buffer` to `out` (shared-memory channels, rpc/shm_region.h). False
// (nothing copied) if they are more than `capacity` or the buffer cannot be read.
bool CopyBufferTo(const grpc::ByteBuffer& buffer, char* out, size_t capacity);

// "changes" pull payloads: the codec lives in compression/changes.h (EncodeChanges on spans,
// DecodeChanges), which this header includes so that its users keep compiling. Transitional:
// new code includes compression/changes.h directly. This overload keeps the older
// pointer-and-count form of EncodeChanges.
inline bool EncodeChanges(const float* now, float* held, int64_t n, int64_t max_bytes,
                          std::string* out) {
  return EncodeChanges(absl::MakeConstSpan(now, static_cast<size_t>(n)),
                       absl::MakeSpan(held, static_cast<size_t>(n)), max_bytes, out);
}

}  // namespace gradmesh

#endif  // GRADMESH_RPC_TENSOR_WIRE_H_
