#!/usr/bin/env bash
# gradmesh quickstart: set up, build, start a coordinator, 2 parameter-server shards and 2
# worker daemons on 127.0.0.1 (service mode), submit the MNIST MLP job with the `gradmesh`
# CLI, watch it to the end, stop everything, and print exactly one line on stdout:
#   RESULT accuracy=<test accuracy> samples_per_s=<all workers> wall_s=<training seconds>
# Progress goes to stderr (`gradmesh watch`: a live bar on a terminal, plain lines otherwise).
#
# Environment: EPOCHS (default 3), WORKERS (2), SHARDS (2), MODEL (mlp, lenet, or a shipped
# TorchScript workload: resnet = a ResNet-style CNN with BatchNorm on Fashion-MNIST as a
# `tensors` dataset, transformer = a character-level decoder-only transformer on the King
# James Bible; made once by examples/*/make.py into WORKLOAD_DIR, default
# ~/.cache/gradmesh/workloads; the RESULT line then has perplexity= for the transformer),
# STEPS (instead of EPOCHS; transformer default 300), BATCH (64; transformer 32), DATASET (mnist),
# MODE (async; also ssp:<s>, sync, gossip, allreduce), RUN_DIR (logs; default a new temp dir),
# GRADMESH_DATA_DIR, TLS (1: mutual TLS everywhere: deploy/tls/make_certs.sh makes a CA and
# certificates in $RUN_DIR/tls; every daemon gets --tls_cert_file/--tls_key_file/--tls_ca_file
# --tls_client_auth, the CLI its client certificate; allreduce rings then use transport grpc).
set -euo pipefail
cd "$(dirname "$0")/.."

EPOCHS="${EPOCHS:-3}"
WORKERS="${WORKERS:-2}"
SHARDS="${SHARDS:-2}"
MODEL="${MODEL:-mlp}"
DATASET="${DATASET:-mnist}"
MODE="${MODE:-async}"
TLS="${TLS:-0}"
DATA_DIR="${GRADMESH_DATA_DIR:-/var/lib/gradmesh/data}"
RUN_DIR="${RUN_DIR:-$(mktemp -d /tmp/gradmesh-quickstart.XXXXXX)}"
WORKLOAD_DIR="${WORKLOAD_DIR:-$HOME/.cache/gradmesh/workloads}"
BATCH="${BATCH:-}"
STEPS="${STEPS:-}"
mkdir -p "$RUN_DIR"

say() { echo "quickstart: $*" >&2; }

say "setting up (deploy/setup.sh)"
GRADMESH_DATA_DIR="$DATA_DIR" bash deploy/setup.sh

# The shipped TorchScript workloads: model + tensors dataset, made once (Debian's torch).
MODEL_SPEC="{name: $MODEL}"
DATASET_SPEC="{name: $DATASET}"
case "$MODEL" in
  resnet | transformer)
    wl="$WORKLOAD_DIR/$MODEL"
    if [ ! -s "$wl/model.pt" ]; then
      say "making the $MODEL workload in $wl (examples/)"
      rm -rf "$wl"
      if [ "$MODEL" = resnet ]; then
        /usr/bin/python3 examples/fashion_resnet/make.py --data "$DATA_DIR/fashion-mnist" \
          --out "$wl.tmp" >&2
      else
        /usr/bin/python3 examples/kjv_transformer/make.py --out "$wl.tmp" >&2
      fi
      mv "$wl.tmp" "$wl"
    fi
    MODEL_SPEC="{name: torchscript, path: $wl/model.pt}"
    DATASET_SPEC="{name: tensors, path: $wl/data}"
    if [ "$MODEL" = transformer ]; then
      BATCH="${BATCH:-32}"
      STEPS="${STEPS:-300}"
    fi
    ;;
esac
BATCH="${BATCH:-64}"
if [ -n "$STEPS" ]; then LENGTH="steps: $STEPS"; else LENGTH="epochs: $EPOCHS"; fi
say "building"
bazel build //coordinator:gradmesh_coordinator //server:gradmesh_server \
  //worker:gradmesh_worker //cli:gradmesh >"$RUN_DIR/build.log" 2>&1 ||
  { tail -30 "$RUN_DIR/build.log" >&2; say "build failed (log: $RUN_DIR/build.log)"; exit 1; }
BIN="$(bazel info bazel-bin 2>/dev/null)"
cp "$BIN/coordinator/gradmesh_coordinator" "$BIN/server/gradmesh_server" \
  "$BIN/worker/gradmesh_worker" "$BIN/cli/gradmesh" "$RUN_DIR/"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# One intra-op thread per process: workers and shards share the machine's cores.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

wait_port() {  # wait_port FILE WHAT
  for _ in $(seq 300); do [ -s "$1" ] && return 0; sleep 0.1; done
  say "$2 did not start (logs in $RUN_DIR)"; exit 1
}

# TLS=1: one CA; the daemons present node.pem (server and client), the CLI client.pem.
DAEMON_TLS=()
CLI_TLS=()
if [ "$TLS" = 1 ]; then
  bash deploy/tls/make_certs.sh "$RUN_DIR/tls" >&2
  DAEMON_TLS=(--tls_cert_file="$RUN_DIR/tls/node.pem" --tls_key_file="$RUN_DIR/tls/node.key"
    --tls_ca_file="$RUN_DIR/tls/ca.pem" --tls_client_auth)
  CLI_TLS=(--tls_cert_file="$RUN_DIR/tls/client.pem" --tls_key_file="$RUN_DIR/tls/client.key"
    --tls_ca_file="$RUN_DIR/tls/ca.pem")
  say "mutual TLS on (certificates in $RUN_DIR/tls)"
fi

# The API token every control-plane call carries.
head -c 24 /dev/urandom | base64 | tr -d '/+=' >"$RUN_DIR/token"
export GRADMESH_AUTH_TOKEN_FILE="$RUN_DIR/token"

"$RUN_DIR/gradmesh_coordinator" --host=127.0.0.1 --port=0 --port_file="$RUN_DIR/coord.port" \
  --data_dir="$RUN_DIR/coordinator" --auth_token_file="$RUN_DIR/token" "${DAEMON_TLS[@]}" \
  2>"$RUN_DIR/coordinator.log" &
PIDS+=($!)
wait_port "$RUN_DIR/coord.port" coordinator
export GRADMESH_COORDINATOR="127.0.0.1:$(cat "$RUN_DIR/coord.port")"
say "coordinator at $GRADMESH_COORDINATOR; logs in $RUN_DIR"

for ((s = 0; s < SHARDS; s++)); do
  "$RUN_DIR/gradmesh_server" --host=127.0.0.1 --port=0 --port_file="$RUN_DIR/shard$s.port" \
    --node="shard$s" --data_dir="$RUN_DIR/shard$s" --coordinator="$GRADMESH_COORDINATOR" \
    --auth_token_file="$RUN_DIR/token" "${DAEMON_TLS[@]}" 2>"$RUN_DIR/shard$s.log" &
  PIDS+=($!)
done
for ((r = 0; r < WORKERS; r++)); do
  "$RUN_DIR/gradmesh_worker" --host=127.0.0.1 --peer_port=0 --port_file="$RUN_DIR/worker$r.port" \
    --node="worker$r" --coordinator="$GRADMESH_COORDINATOR" --auth_token_file="$RUN_DIR/token" \
    --data_dir="$DATA_DIR" --checkpoint_dir="$RUN_DIR/checkpoints" "${DAEMON_TLS[@]}" \
    2>"$RUN_DIR/worker$r.log" &
  PIDS+=($!)
done
for ((s = 0; s < SHARDS; s++)); do wait_port "$RUN_DIR/shard$s.port" "shard $s"; done
for ((r = 0; r < WORKERS; r++)); do wait_port "$RUN_DIR/worker$r.port" "worker $r"; done

JOB="quickstart-$$"
cat >"$RUN_DIR/job.yaml" <<SPEC
name: $JOB
model: $MODEL_SPEC
dataset: $DATASET_SPEC
optimizer: {name: adam, lr: 0.001, lr_schedule: cosine}
batch_size: $BATCH
$LENGTH
mode: $MODE
num_workers: $WORKERS
num_shards: $SHARDS
log_every: 25
output: $RUN_DIR/model.pt
SPEC
# Under TLS the all-reduce ring stays on TLS-protected gRPC streams (the TCP links would not).
[ "$TLS" = 1 ] && [ "$MODE" = allreduce ] && echo "allreduce: {transport: grpc}" >>"$RUN_DIR/job.yaml"

# The daemons register within a heartbeat or two; submit once the coordinator can place it.
for attempt in $(seq 40); do
  if "$RUN_DIR/gradmesh" "${CLI_TLS[@]}" submit "$RUN_DIR/job.yaml" >"$RUN_DIR/submit.out" 2>&1; then
    break
  fi
  [ "$attempt" = 40 ] && { cat "$RUN_DIR/submit.out" >&2; exit 1; }
  sleep 0.5
done
say "submitted $JOB: $(head -1 "$RUN_DIR/submit.out")"
"$RUN_DIR/gradmesh" "${CLI_TLS[@]}" watch "$JOB" >&2 || { say "job $JOB did not succeed"; exit 1; }

# Figures from the workers' task_end lines: accuracy from rank 0, all samples over the
# slowest rank's training time.
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2" | tr -d '"'; }
accuracy="" perplexity="" samples=0 wall=0
while IFS= read -r line; do
  samples=$((samples + $(field samples "$line")))
  wall="$(awk -v a="$wall" -v b="$(field wall_s "$line")" 'BEGIN { print (b > a) ? b : a }')"
  if [ "$(field rank "$line")" = 0 ]; then
    accuracy="$(field accuracy "$line")"
    perplexity="$(field perplexity "$line")"
  fi
done < <(grep -h "event=task_end" "$RUN_DIR"/worker*.log | grep "job=$JOB ")
say "model saved to $RUN_DIR/model.pt"
if [ "$MODEL" = transformer ]; then
  awk -v p="$perplexity" -v a="$accuracy" -v s="$samples" -v w="$wall" 'BEGIN {
    printf "RESULT perplexity=%.3f token_accuracy=%.4f samples_per_s=%.0f wall_s=%.1f\n", p, a, s / w, w }'
else
  awk -v a="$accuracy" -v s="$samples" -v w="$wall" \
    'BEGIN { printf "RESULT accuracy=%.4f samples_per_s=%.0f wall_s=%.1f\n", a, s / w, w }'
fi
