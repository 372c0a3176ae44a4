// ShmOpChannel: the worker's side of one shared-memory channel to a shard on the same machine
// (ParameterService.OpenShm; the region and its protocol: rpc/shm_region.h). It carries the
// same framed operations as the shard's Stream (rpc/op_stream.h), one request at a time: Call
// copies one operation into the region (CallBatch several, as one Stream batch) and wakes the
// shard's thread, and a thread of this object waits for the answer and completes each call
// with the status and encoded PushResponse or PullResponse the Stream would have given. Those
// responses are not copied: they refer to the region, and the channel takes no further request
// (the operations go over the Stream) until the caller has released every one of them.
//
// This object's thread opens the channel when it is made (a gRPC round trip and an open of
// the shard's memfd, at most `open_timeout`), and again when a Call finds it broken; a channel
// lives as long as its OpenShm call. Call never blocks on the shard: it returns false, and the
// caller sends the operation over the Stream instead, whenever the channel cannot take it: not open
// (yet), an operation already in flight on it, the message larger than its area. A refusal another
// try would meet again (another machine, user or PID namespace; an old shard; --shm_channels=0; the
// token; the area) turns the channel off for good, logged once (event=shm_unavailable); after any
// other failure (the shard down, its channels all open) opening is tried again at most once a
// second. When the channel breaks (the shard restarted, Abort) the operation in flight fails
// UNAVAILABLE, like a broken Stream's, and is retried by the caller; the next Call reopens it.
// An answer larger than the area (a "changes" pull can be) also fails UNAVAILABLE, and the
// channel is reopened with areas twice as large.
//
// Thread safety: all methods may be called concurrently; completions run on this object's
// thread and must not block.
#ifndef GRADMESH_RPC_SHM_OP_CHANNEL_H_
#define GRADMESH_RPC_SHM_OP_CHANNEL_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/status.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/logging.h"
#include "common/spin_wait.h"
#include "proto/gradmesh.grpc.pb.h"
#include "rpc/tensor_wire.h"

namespace gradmesh {

class ShmOpChannel {
 public:
  using Done = std::function<void(grpc::Status)>;

  struct Options {
    size_t area_bytes = 0;  // Asked of the shard for each area: the largest message either way.
    std::string job;        // Whose token `metadata` carries.
    std::vector<std::pair<std::string, std::string>> metadata;  // Sent with OpenShm.
    std::string shard;               // Named in logs and errors ("shard 1 (host:port)").
    const Logger* logger = nullptr;  // Not owned; may be null.
    absl::Duration open_timeout = absl::Seconds(5);
    // Waiting for an answer, the channel's thread first spins (yielding the CPU) for up to
    // this long while recent answers came within half of it (common/spin_wait.h).
    absl::Duration spin = absl::Microseconds(100);
  };

  // `stub` is not owned and must outlive this object.
  ShmOpChannel(ParameterService::Stub* stub, Options options);
  // Fails an operation in flight UNAVAILABLE, closes the channel and joins the thread.
  ~ShmOpChannel();
  ShmOpChannel(const ShmOpChannel&) = delete;
  ShmOpChannel& operator=(const ShmOpChannel&) = delete;

  // Sends `body` (an encoded PushRequest or PullRequest, as `op` says) through the channel and,
  // when the answer arrives, fills `*response` and runs `*done` (moved from) with its status.
  // False if the channel cannot take it now (see above): nothing was sent, `*done` is untouched.
  bool Call(StreamOp op, const grpc::ByteBuffer& body, grpc::ByteBuffer* response, Done* done);

  // One operation of CallBatch: as Call's arguments. `body` must stay alive until CallBatch
  // returns; `response` until `done` ran.
  struct Item {
    StreamOp op = StreamOp::kPull;
    const grpc::ByteBuffer* body = nullptr;
    grpc::ByteBuffer* response = nullptr;
    Done done;
  };
  // Sends `items` (1 to kMaxStreamBatch) as one request, the shard starting them in order
  // without waiting for each other (a Stream batch), and completes each as Call does, in order,
  // once the shard has answered all. All or nothing: false if the channel cannot take them
  // all now (as Call; or more than kMaxStreamBatch; or a shard from before batches), and then
  // nothing was sent and every `done` is untouched. A batch the shard refuses whole fails each
  // of them with its status. The answers come only once every operation of the batch has
  // completed: an operation that waits (a sync push at its barrier, an ssp pull) holds the
  // others' answers until it is released, so a caller must not batch an operation with one
  // whose release depends on those answers. The shard starts no operation of a batch once the
  // answers of those before it pass the response area (RESOURCE_EXHAUSTED).
  bool CallBatch(std::vector<Item>* items);
  // The largest request the open channel takes (0 while none is open), for a caller that
  // packs batches to fit.
  size_t area_bytes() const;
  // Breaks the open channel if an operation is in flight on it (it fails UNAVAILABLE); the
  // next Call reopens it. Does nothing to an idle channel.
  void Abort();

  // Channels opened so far; whether the channel is off for good.
  int64_t opened() const;
  bool disabled() const;

 private:
  class Control;
  struct Conn;
  struct Outstanding {  // One call of a request.
    uint64_t call = 0;
    grpc::ByteBuffer* response = nullptr;
    Done done;
  };
  struct Pending {
    std::shared_ptr<Conn> conn;
    uint32_t seq = 0;
    bool batch = false;  // Sent as a batch (more than one call).
    std::vector<Outstanding> calls;
  };

  // Opens a channel with areas of `area_bytes` (blocking; no lock held).
  absl::StatusOr<std::shared_ptr<Conn>> Open(size_t area_bytes);
  // On the thread: replaces a broken channel by a new one, as Call asked (want_open_).
  void Reopen();
  void DisableLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();     // The thread: opens channels and waits for each answer, completing its call.
  void Answer();  // Waits for the answer of in_flight_ and completes its calls.
  // Fills the responses of `p`'s calls and their statuses from the answer (answered), or says
  // why there is none; breaks the channel on a bad answer.
  std::vector<grpc::Status> Complete(Pending* p, bool answered);
  // Reads the answer `whole` to `p` into its calls' responses and `*statuses`; DataLoss (and
  // nothing filled) if it does not answer them.
  static absl::Status ReadAnswers(const grpc::ByteBuffer& whole, Pending* p,
                                  std::vector<grpc::Status>* statuses);

  ParameterService::Stub* const stub_;
  const Options options_;
  mutable absl::Mutex mu_;
  std::shared_ptr<Conn> conn_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<Conn> opening_ ABSL_GUARDED_BY(mu_);  // While the thread opens one.
  std::optional<Pending> in_flight_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool disabled_ ABSL_GUARDED_BY(mu_) = false;
  bool want_open_ ABSL_GUARDED_BY(mu_) = false;  // A Call found no usable channel.
  absl::Time next_open_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  size_t area_bytes_ ABSL_GUARDED_BY(mu_);  // Asked at the next open (grows on overflow).
  uint64_t next_call_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t opened_ ABSL_GUARDED_BY(mu_) = 0;
  AdaptiveSpin spin_;
  std::thread thread_;
};

}  // namespace gradmesh

#endif  // GRADMESH_RPC_SHM_OP_CHANNEL_H_
