// Ring all-reduce and all-gather over a RingTransport (see ring.h).
#include "worker/allreduce/ring.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "compression/float16.h"

namespace gradmesh {

absl::Status RingAbortedError(absl::string_view where) {
  return absl::AbortedError(
      absl::StrCat(where, ": aborted: this rank's run is being restarted (a new generation)"));
}
namespace {

int Mod(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

// Adds a run of n whole floats at any byte alignment into dst (memcpy of 4 bytes is an
// unaligned load; the loop vectorises).
__attribute__((optimize("tree-vectorize"))) void AddFloats(const char* __restrict src,
                                                           float* __restrict dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float s;
    std::memcpy(&s, src + 4 * i, 4);
    dst[i] += s;
  }
}

// Adds the message's floats into dst[0, size/4). Pieces may split a float: its bytes are
// assembled on the way.
void AddInto(const RingMessage& msg, float* dst) {
  char carry[4];
  size_t carried = 0;
  for (absl::Span<const char> piece : msg.pieces) {
    const char* p = piece.data();
    size_t left = piece.size();
    if (carried > 0) {
      const size_t take = std::min(left, 4 - carried);
      std::memcpy(carry + carried, p, take);
      carried += take;
      p += take;
      left -= take;
      if (carried < 4) continue;
      AddFloats(carry, dst++, 1);
      carried = 0;
    }
    const size_t whole = left / 4;
    AddFloats(p, dst, whole);
    dst += whole;
    carried = left - 4 * whole;
    std::memcpy(carry, p + 4 * whole, carried);
  }
  // The message size was checked to be a multiple of 4 before: nothing is left over.
}

void CopyInto(const RingMessage& msg, char* dst) {
  for (absl::Span<const char> piece : msg.pieces) {
    std::memcpy(dst, piece.data(), piece.size());
    dst += piece.size();
  }
}

// The fp16 wire format: every message carries float16 values (half the bytes), sums are
// accumulated in float32. The completed chunk's owner rounds its own copy to fp16 as well, so
// every rank ends with the same bits.
absl::Status RingAllreduceFp16(RingTransport* transport, absl::Span<float> data,
                               const RingOptions& options, int64_t* bytes_sent,
                               const FinalRangeFn* on_final) {
  const int n = transport->size();
  const int r = transport->rank();
  const int64_t length = static_cast<int64_t>(data.size());
  const int64_t seg = std::max<int64_t>(1, options.segment_bytes / sizeof(uint16_t));
  const int last_step = 2 * (n - 1) - 1;
  int64_t sent = 0;
  std::vector<uint16_t> half;  // One segment, encoded or received.
  std::vector<float> wide;     // One segment, decoded.

  // Encodes data[b, e) and sends it (copied).
  auto send_encoded = [&](int64_t b, int64_t e, int step) -> absl::Status {
    half.resize(e - b);
    const int64_t bad = FloatToHalf(data.data() + b, e - b, half.data());
    if (bad >= 0) {
      return absl::InvalidArgumentError(absl::StrCat("fp16 ring all-reduce: element ", b + bad,
                                                     " is ", data[b + bad],
                                                     " (the fp16 codec needs finite gradients)"));
    }
    const size_t bytes = half.size() * sizeof(uint16_t);
    RETURN_IF_ERROR(Annotate(
        transport->Send(absl::Span<const char>(reinterpret_cast<const char*>(half.data()), bytes)),
        absl::StrCat("fp16 ring all-reduce step ", step)));
    sent += static_cast<int64_t>(bytes);
    return absl::OkStatus();
  };

  {
    const ChunkRange range = RingChunkRange(length, n, r);
    for (int64_t b = range.begin; b < range.end; b += seg) {
      RETURN_IF_ERROR(send_encoded(b, std::min(range.end, b + seg), 0));
    }
  }
  for (int step = 0; step <= last_step; ++step) {
    const bool reduce = step < n - 1;
    const ChunkRange range = RingChunkRange(length, n, Mod(r - step - 1, n));
    for (int64_t b = range.begin; b < range.end; b += seg) {
      const int64_t e = std::min(range.end, b + seg);
      const size_t want = static_cast<size_t>(e - b) * sizeof(uint16_t);
      absl::StatusOr<RingMessage> msg = transport->Recv(absl::Now() + options.timeout);
      if (!msg.ok()) {
        return Annotate(msg.status(),
                        absl::StrCat("fp16 ring all-reduce step ", step, " of ", last_step + 1));
      }
      if (msg->size() != want) {
        return absl::InternalError(absl::StrCat(
            "fp16 ring all-reduce step ", step, ": ", transport->PeerName(Mod(r - 1, n)), " sent ",
            msg->size(), " bytes where ", want,
            " were expected (do all ranks reduce buffers of the same length and codec?)"));
      }
      half.resize(e - b);
      CopyInto(*msg, reinterpret_cast<char*>(half.data()));
      msg->owner.reset();
      float* dst = data.data() + b;
      if (reduce) {
        wide.resize(e - b);
        if (HalfToFloat(half.data(), e - b, wide.data()) >= 0) {
          return absl::InternalError(absl::StrCat("fp16 ring all-reduce step ", step, ": ",
                                                  transport->PeerName(Mod(r - 1, n)),
                                                  " sent a non-finite value"));
        }
        for (int64_t i = 0; i < e - b; ++i) dst[i] += wide[i];
        if (step == n - 2) {
          // The sum of this chunk is complete here: round it as the others will see it.
          RETURN_IF_ERROR(send_encoded(b, e, step + 1));
          HalfToFloat(half.data(), e - b, dst);
        } else {
          RETURN_IF_ERROR(send_encoded(b, e, step + 1));
        }
      } else {
        if (HalfToFloat(half.data(), e - b, dst) >= 0) {
          return absl::InternalError(absl::StrCat("fp16 ring all-reduce step ", step, ": ",
                                                  transport->PeerName(Mod(r - 1, n)),
                                                  " sent a non-finite value"));
        }
        if (step < last_step) {
          RETURN_IF_ERROR(Annotate(transport->Send(absl::Span<const char>(
                                       reinterpret_cast<const char*>(half.data()), want)),
                                   absl::StrCat("fp16 ring all-reduce step ", step + 1)));
          sent += static_cast<int64_t>(want);
        }
      }
      if (on_final != nullptr && step >= n - 2) (*on_final)(b, e);
    }
  }
  if (bytes_sent != nullptr) *bytes_sent += sent;
  return Annotate(transport->Flush(absl::Now() + options.timeout), "fp16 ring all-reduce flush");
}

}  // namespace

absl::StatusOr<size_t> RingTransport::RecvInto(absl::Span<char> dst, absl::Time deadline) {
  ASSIGN_OR_RETURN(RingMessage msg, Recv(deadline));
  const size_t size = msg.size();
  if (size == dst.size()) CopyInto(msg, dst.data());
  return size;
}

size_t RingMessage::size() const {
  size_t n = 0;
  for (const auto& p : pieces) n += p.size();
  return n;
}

ChunkRange RingChunkRange(int64_t length, int n, int c) {
  return {length * c / n, length * (c + 1) / n};
}

absl::Status RingAllreduce(RingTransport* transport, absl::Span<float> data,
                           const RingOptions& options, int64_t* bytes_sent,
                           const FinalRangeFn* on_final) {
  const int n = transport->size();
  const int r = transport->rank();
  if (n <= 1) {
    if (on_final != nullptr && !data.empty()) (*on_final)(0, static_cast<int64_t>(data.size()));
    return absl::OkStatus();
  }
  const int64_t length = static_cast<int64_t>(data.size());
  const int64_t seg = std::max<int64_t>(1, options.segment_bytes / sizeof(float));
  const int last_step = 2 * (n - 1) - 1;
  int64_t sent = 0;

  auto send_chunk = [&](int c, int step) -> absl::Status {
    const ChunkRange range = RingChunkRange(length, n, c);
    for (int64_t b = range.begin; b < range.end; b += seg) {
      const int64_t e = std::min(range.end, b + seg);
      absl::Span<const char> bytes(reinterpret_cast<const char*>(data.data() + b),
                                   (e - b) * sizeof(float));
      RETURN_IF_ERROR(
          Annotate(transport->SendNoCopy(bytes), absl::StrCat("ring all-reduce step ", step)));
      sent += static_cast<int64_t>(bytes.size());
    }
    return absl::OkStatus();
  };

  if (options.codec == RingCodec::kFp16) {
    return RingAllreduceFp16(transport, data, options, bytes_sent, on_final);
  }

  RETURN_IF_ERROR(send_chunk(r, 0));
  for (int step = 0; step <= last_step; ++step) {
    const bool reduce = step < n - 1;
    const ChunkRange range = RingChunkRange(length, n, Mod(r - step - 1, n));
    for (int64_t b = range.begin; b < range.end; b += seg) {
      const int64_t e = std::min(range.end, b + seg);
      const size_t want = static_cast<size_t>(e - b) * sizeof(float);
      float* dst = data.data() + b;
      const absl::Time deadline = absl::Now() + options.timeout;
      size_t got = 0;
      if (reduce) {
        absl::StatusOr<RingMessage> msg = transport->Recv(deadline);
        if (!msg.ok()) {
          return Annotate(msg.status(),
                          absl::StrCat("ring all-reduce step ", step, " of ", last_step + 1));
        }
        got = msg->size();
        if (got == want) AddInto(*msg, dst);
        // msg (and its receive buffers) goes back to the transport here.
      } else {
        // All-gather: the final sum is copied in place, so let the transport put it there.
        absl::StatusOr<size_t> size =
            transport->RecvInto(absl::Span<char>(reinterpret_cast<char*>(dst), want), deadline);
        if (!size.ok()) {
          return Annotate(size.status(),
                          absl::StrCat("ring all-reduce step ", step, " of ", last_step + 1));
        }
        got = *size;
      }
      if (got != want) {
        return absl::InternalError(
            absl::StrCat("ring all-reduce step ", step, ": ", transport->PeerName(Mod(r - 1, n)),
                         " sent ", got, " bytes where ", want,
                         " were expected (do all ranks reduce buffers of the same length?)"));
      }
      if (step < last_step) {
        // Chunk c is sent at step + 1. It is overwritten again (all-gather) only after its
        // sum has come round the ring, i.e. after the next rank has received these bytes.
        RETURN_IF_ERROR(Annotate(
            transport->SendNoCopy(absl::Span<const char>(reinterpret_cast<const char*>(dst), want)),
            absl::StrCat("ring all-reduce step ", step + 1)));
        sent += static_cast<int64_t>(want);
      }
      // The last reduce-scatter step completes this rank's own chunk; every all-gather
      // message is a final chunk of another rank.
      if (on_final != nullptr && step >= n - 2) (*on_final)(b, e);
    }
  }
  if (bytes_sent != nullptr) *bytes_sent += sent;
  return Annotate(transport->Flush(absl::Now() + options.timeout), "ring all-reduce flush");
}

absl::StatusOr<std::vector<std::string>> RingAllgather(RingTransport* transport,
                                                       absl::string_view mine,
                                                       const RingOptions& options) {
  const int n = transport->size();
  const int r = transport->rank();
  std::vector<std::string> all(n);
  all[r] = std::string(mine);
  // Step s: send block (r - s) mod n (own at s = 0, then the one just received).
  for (int step = 0; step < n - 1; ++step) {
    const std::string& out = all[Mod(r - step, n)];
    RETURN_IF_ERROR(Annotate(transport->Send(absl::Span<const char>(out.data(), out.size())),
                             absl::StrCat("ring all-gather step ", step)));
    absl::StatusOr<RingMessage> msg = transport->Recv(absl::Now() + options.timeout);
    if (!msg.ok()) {
      return Annotate(msg.status(), absl::StrCat("ring all-gather step ", step));
    }
    std::string& in = all[Mod(r - step - 1, n)];
    in.resize(msg->size());
    CopyInto(*msg, in.data());
  }
  // A transport without background threads moves bytes only while it is called: hand the
  // last block to the next rank before returning.
  RETURN_IF_ERROR(
      Annotate(transport->Flush(absl::Now() + options.timeout), "ring all-gather flush"));
  return all;
}

}  // namespace gradmesh
