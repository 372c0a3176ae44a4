#!/bin/bash
# Alternating rounds of gradmesh's push_pull benchmark (both client transports) and the
# ps-lite peer (../shared/peers/pslite_bench.sh), in one session, so that ratios compare
# figures measured at the same moment. Prints the JSON lines of every run, each prefixed by
# "round N <impl> ".
#
#   bazel build -c opt //tests/bench:push_pull
#   bash tests/bench/push_pull_rounds.sh [push_pull flags]   # ROUNDS=3 SECONDS_PER=2
#
# env: ROUNDS (3), SECONDS_PER (push_pull --seconds, 2), SHARDS (1,2), LONE (1: also a
# --inflight=1 4 KiB run per round, the lone-operation latency), KEYS (40: also a --keys=40
# run per round, 1 shard, stream: each operation one step of a 40-tensor model, the payload of
# one ps-lite round; empty: none), DEPTH (40: also a --inflight=1 --depth=40 run per round,
# ps-lite's own workload: one client, 40 single-tensor operations issued, then awaited; empty:
# none), DEPTH_TRANSPORTS (stream,shm: the depth run's transports; shm goes through
# --shm_lanes shared-memory channels per shard), PINS ("0 1": ps-lite runs once per value, as
# its PIN: unpinned, then pinned).
set -u -o pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BIN=$ROOT/bazel-bin/tests/bench/push_pull
PEERS=${PEERS:-$ROOT/../shared/peers}
ROUNDS=${ROUNDS:-3}
SECONDS_PER=${SECONDS_PER:-2}
SHARDS=${SHARDS:-1,2}
LONE=${LONE:-1}
KEYS=${KEYS-40}
DEPTH=${DEPTH-40}
DEPTH_TRANSPORTS=${DEPTH_TRANSPORTS:-stream,shm}
PINS=${PINS:-0 1}
[ -x "$BIN" ] || { echo "build it first: bazel build -c opt //tests/bench:push_pull" >&2; exit 1; }
for r in $(seq 1 "$ROUNDS"); do
  echo "round $r uptime $(uptime)"
  # Which transport runs first alternates between rounds.
  if [ $((r % 2)) = 1 ]; then ORDER=stream,unary; else ORDER=unary,stream; fi
  "$BIN" --seconds="$SECONDS_PER" --shards="$SHARDS" --transports=$ORDER "$@" |
    sed "s/^/round $r gradmesh /"
  if [ "$LONE" = 1 ]; then
    "$BIN" --seconds="$SECONDS_PER" --shards=1 --sizes=4096 --ops=push,pull --inflight=1 \
      --transports=$ORDER "$@" | sed "s/^/round $r gradmesh-lone /"
  fi
  if [ -n "$KEYS" ]; then
    "$BIN" --seconds="$SECONDS_PER" --shards=1 --keys="$KEYS" --transports=stream "$@" |
      sed "s/^/round $r gradmesh-keys /"
  fi
  if [ -n "$DEPTH" ]; then
    "$BIN" --seconds="$SECONDS_PER" --shards="$SHARDS" --inflight=1 --depth="$DEPTH" \
      --transports="$DEPTH_TRANSPORTS" "$@" | sed "s/^/round $r gradmesh-depth /"
  fi
  for pin in $PINS; do
    PIN=$pin bash "$PEERS/pslite_bench.sh" 2>/dev/null | sed "s/^/round $r ps-lite-pin$pin /"
  done
done
