// Options of the gRPC layer as plain data, free of gRPC headers: message limits, reconnection
// backoff and transport security (TLS). Parsed once in main (flags) and passed down to every
// channel and server the process makes (rpc/grpc_util.h applies them; rpc/tls.h builds the
// credentials). Kept apart from grpc_util.h so gRPC-free code (TrainerOptions) can carry them.
//
// Thread safety: plain values.
#ifndef GRADMESH_RPC_RPC_OPTIONS_H_
#define GRADMESH_RPC_RPC_OPTIONS_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace gradmesh {

// Transport security of a process's channels and servers (flags --tls_cert_file,
// --tls_key_file, --tls_ca_file, --tls_client_auth, --allow_insecure; see rpc/tls.h
// MakeTlsOptions, which validates them once).
//
// TLS is on when cert_file or ca_file is set (enabled()). A server then presents cert_file
// (key key_file), and with client_auth requires every client to present a certificate that
// chains to ca_file. A client verifies the server's certificate against ca_file (the system
// roots when empty) including its host name (a SAN naming the host or IP the client dials),
// and presents cert_file when set (mutual TLS). The files are re-read every
// refresh_interval_s, so replacing them (atomically: write new files, rename into place)
// takes effect for new connections without a restart.
struct TlsOptions {
  std::string cert_file;  // PEM certificate chain this process presents. Default: none.
  std::string key_file;   // PEM private key of cert_file. Required with cert_file.
  std::string ca_file;    // PEM CA bundle peers are verified against. Default: none.
  // Servers require and verify client certificates (needs ca_file and cert_file). Default off.
  bool client_auth = false;
  // Allows sending tokens over plaintext to a non-loopback address (rpc/tls.h
  // CheckTokenTransport). Default false.
  bool allow_insecure = false;
  // Seconds between re-reads of the certificate files. Default 10.
  int refresh_interval_s = 10;

  bool enabled() const { return !cert_file.empty() || !ca_file.empty(); }
};

struct RpcOptions {
  // Largest message sent or received, bytes. Default 256 MiB.
  int64_t max_message_bytes = 256ll << 20;
  // Reconnection to a peer that went away: first retry after this long, doubling up to
  // max. gRPC's defaults (1 s, 120 s) are too slow for a shard that restarts in a second.
  int64_t min_reconnect_backoff_ms = 100;
  int64_t max_reconnect_backoff_ms = 5000;
  // How long one connection attempt may take (TCP, TLS and HTTP/2 handshakes: several round
  // trips) before it counts as failed. gRPC takes its minimum from the same channel argument
  // as the reconnect backoff's (GRPC_ARG_MIN_RECONNECT_BACKOFF_MS), so it is set on its own:
  // at 100 ms no connection over a link of 50 ms round trip or more completed its first
  // attempts. gRPC's default, 20 s. A refused connection (a peer that is down) fails at once
  // whatever this is; a call's own deadline still bounds the call.
  int64_t connect_timeout_ms = 20000;
  // HTTP/2 keepalive: a connection that has seen nothing for keepalive_time_ms is pinged, and
  // one whose ping is not answered within keepalive_timeout_ms is closed, failing its calls
  // UNAVAILABLE so that they are retried over a new connection. Without it a connection that
  // died silently (a NAT or load balancer dropping it, a peer machine gone, a link that stops
  // forwarding) was kept: every retry went out on it and waited out its deadline, and a
  // daemon never rejoined its coordinator. Clients ping (also with no call open: a node
  // agent's channel between heartbeats), servers answer any ping rate and ping idle clients
  // too, so dead clients' streams are closed. 0 = off. Defaults 10 s and 10 s.
  int64_t keepalive_time_ms = 10000;
  int64_t keepalive_timeout_ms = 10000;
  // Servers: calls open at once on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); a
  // client with more waits for one to end (gRPC queues them). gRPC's default is unbounded: a
  // probe's unauthenticated client opening streams it never completed grew a shard by ~11 KB
  // per stream (80 connections x 4,000 streams: 2.2 GB, kept after they closed). No
  // gradmesh client needs more than a few per connection. Default 256; 0 = gRPC's default.
  // gRPC 1.51 holds to it only clients that acknowledge the server's SETTINGS (every gRPC
  // client does); a raw client that never does is not held to it, and nothing in 1.51 bounds
  // connections or their streams' memory (its ResourceQuota, measured, bounds message
  // buffers only): mutual TLS (no HTTP/2 frame is read before the handshake) or a connection
  // limit in the network is the defence (README, Security).
  int64_t max_concurrent_streams = 256;
  // HTTP/2 flow control of every connection made with these options (its receiving side:
  // how much a peer may send before this process has read it). 0 (the default): gRPC's own,
  // which probes the connection's bandwidth-delay product with pings and sizes its windows and
  // frames from the estimate. N > 0: no probing; each stream may have N bytes unread (its
  // initial window) and frames may be up to min(N, 16 MiB - 1) bytes. Measured on loopback
  // (README, HTTP/2 flow control): with one shard a fixed 8 MiB window moves 4 MiB pushes
  // 1.5-2.2x and pulls 1.1-1.8x faster, while 256 KiB-1 MiB messages over the Stream (a
  // typical worker's step) are 5-30% slower (without probing, gRPC 1.51 keeps the
  // connection's own window near 64 KiB, and each such message stalls on it once). Over a
  // real link N must cover its bandwidth-delay product, or the link is not filled. Valid: 0
  // or [64 KiB, 1 GiB] (Http2WindowBytesFromKb).
  int64_t http2_window_bytes = 0;
  // Models a slower link for a client's tensor traffic (each direction paced separately, as a
  // full-duplex NIC), in bits per second; 0 = as fast as the transport goes. For measuring
  // compression on a slow network with loopback daemons (see worker --link_mbit).
  double link_bits_per_s = 0;
  // Transport security of every channel and server made with these options. Default: none
  // (plaintext).
  TlsOptions tls;
};

// --http2_window_kb (the daemons' flag) as RpcOptions.http2_window_bytes: 0 stays 0 (gRPC's
// probed windows); a fixed window must be 64 KiB to 1 GiB. InvalidArgument otherwise.
inline absl::StatusOr<int64_t> Http2WindowBytesFromKb(int64_t kb) {
  if (kb != 0 && (kb < 64 || kb > (int64_t{1} << 20))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--http2_window_kb must be 0 (gRPC's own) or 64 to 1048576, got ", kb));
  }
  return kb << 10;
}

}  // namespace gradmesh

#endif  // GRADMESH_RPC_RPC_OPTIONS_H_
