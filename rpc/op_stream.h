// OpStream: the client side of one ParameterService.Stream per shard. Many callers share it:
// each Call frames its already-encoded PushRequest or PullRequest (rpc/tensor_wire.h, no copy
// of the tensor bytes) with a fresh call id, queues it on the long-lived call and is completed
// when the response with that id arrives (in any order), with the status the unary call would
// have returned and the encoded PushResponse or PullResponse.
//
// The call is opened on first use and reopened by the next Call after it breaks. When it
// breaks (server restart, network, Abort), every operation in flight fails UNAVAILABLE and
// the caller retries it (with the same request id: the shard applies a push once). An
// operation's request buffer (and the memory its static slices point to) is no longer used
// once its completion has run.
//
// Operations queued while a write is in progress go together in the next message, as one
// batch (StreamRequest.batch, rpc/tensor_wire.h) once the shard has announced that it reads
// batches; a caller issuing a burst can hold its operations back to go in one message (`more`).
// Responses may come batched too: this side announces that it reads them.
//
// Thread safety: all methods may be called concurrently; completions run on gRPC's threads
// and must not block.
#ifndef GRADMESH_RPC_OP_STREAM_H_
#define GRADMESH_RPC_OP_STREAM_H_

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/byte_buffer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "rpc/tensor_wire.h"

namespace gradmesh {

class OpStream {
 public:
  using Done = std::function<void(grpc::Status)>;

  // `stub` is not owned and must outlive this object. `metadata` is sent when a call opens.
  OpStream(grpc::GenericStub* stub, std::string method,
           std::vector<std::pair<std::string, std::string>> metadata);
  // Cancels the open call (and any earlier one gRPC is not done with yet), waits for their
  // OnDone and destroys them on this thread: each call's ClientContext holds a reference to
  // the channel, and the last grpc::Channel must not be released on a gRPC callback thread.
  ~OpStream();
  OpStream(const OpStream&) = delete;
  OpStream& operator=(const OpStream&) = delete;

  // Sends `body` (an encoded PushRequest or PullRequest, as `op` says) and, when its answer
  // arrives, fills `*response` (encoded PushResponse or PullResponse; empty on error) and runs
  // `done` with its status. `body`'s memory must stay valid until then.
  //
  // `more`: the caller is about to issue further operations on this stream: this one waits
  // to go with them in one message (a batch; several if the burst passes a batch's bounds).
  // The last operation of such a burst must be issued with `more` false, or the waiting ones
  // are not sent. Ignored until the shard has announced that it reads batches.
  void Call(StreamOp op, const grpc::ByteBuffer& body, grpc::ByteBuffer* response, Done done,
            bool more = false);

  // Breaks the open call (e.g. an operation is past its deadline): its operations fail
  // UNAVAILABLE; the next Call opens a new one.
  void Abort();

  // Calls opened so far (1 after first use; each reopen adds 1).
  int64_t opened() const;
  // On the open call: messages written (a batch counts once), and whether the shard announced
  // that it reads batches (until then every operation goes alone).
  int64_t writes() const;
  bool batching() const;

 private:
  class Conn;

  grpc::GenericStub* const stub_;
  const std::string method_;
  const std::vector<std::pair<std::string, std::string>> metadata_;
  mutable absl::Mutex mu_;
  std::shared_ptr<Conn> conn_ ABSL_GUARDED_BY(mu_);  // The open call (may have broken).
  // Calls replaced by a newer one, kept until gRPC is done with them (see ~OpStream).
  std::vector<std::shared_ptr<Conn>> retired_ ABSL_GUARDED_BY(mu_);
  uint64_t next_call_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t opened_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradmesh

#endif  // GRADMESH_RPC_OP_STREAM_H_
