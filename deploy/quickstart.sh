#!/usr/bin/env bash
# gradmesh quickstart: set up, build, start 2 parameter-server shards and 2 workers on
# 127.0.0.1, train the MLP on MNIST asynchronously, stop everything, and print exactly one
# line on stdout:
#   RESULT accuracy=<test accuracy> samples_per_s=<all workers> wall_s=<training seconds>
# Progress goes to stderr (a live bar on a terminal, plain lines otherwise).
#
# Environment: EPOCHS (default 3), WORKERS (2), SHARDS (2), MODEL (mlp), DATASET (mnist),
# MODE (async), RUN_DIR (logs; default a new temp dir), GRADMESH_DATA_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

EPOCHS="${EPOCHS:-3}"
WORKERS="${WORKERS:-2}"
SHARDS="${SHARDS:-2}"
MODEL="${MODEL:-mlp}"
DATASET="${DATASET:-mnist}"
MODE="${MODE:-async}"
DATA_DIR="${GRADMESH_DATA_DIR:-/var/lib/gradmesh/data}"
RUN_DIR="${RUN_DIR:-$(mktemp -d /tmp/gradmesh-quickstart.XXXXXX)}"
mkdir -p "$RUN_DIR"

say() { echo "quickstart: $*" >&2; }

say "setting up (deploy/setup.sh)"
GRADMESH_DATA_DIR="$DATA_DIR" bash deploy/setup.sh
say "building"
bazel build //server:gradmesh_server //worker:gradmesh_worker >"$RUN_DIR/build.log" 2>&1 ||
  { tail -30 "$RUN_DIR/build.log" >&2; say "build failed (log: $RUN_DIR/build.log)"; exit 1; }
BIN="$(bazel info bazel-bin 2>/dev/null)"
cp "$BIN/server/gradmesh_server" "$BIN/worker/gradmesh_worker" "$RUN_DIR/"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# One intra-op thread per process: workers and shards share the machine's cores.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

SERVERS=""
for ((s = 0; s < SHARDS; s++)); do
  rm -f "$RUN_DIR/port$s"
  "$RUN_DIR/gradmesh_server" --host=127.0.0.1 --port=0 --port_file="$RUN_DIR/port$s" \
    --node="shard$s" 2>"$RUN_DIR/server$s.log" &
  PIDS+=($!)
done
for ((s = 0; s < SHARDS; s++)); do
  for _ in $(seq 100); do [ -s "$RUN_DIR/port$s" ] && break; sleep 0.1; done
  [ -s "$RUN_DIR/port$s" ] || { say "shard $s did not start (log: $RUN_DIR/server$s.log)"; exit 1; }
  SERVERS="${SERVERS:+$SERVERS,}127.0.0.1:$(cat "$RUN_DIR/port$s")"
done
say "shards at $SERVERS; logs in $RUN_DIR"

JOB="quickstart-$$"
WPIDS=()
for ((r = 0; r < WORKERS; r++)); do
  "$RUN_DIR/gradmesh_worker" --servers="$SERVERS" --rank=$r --num_workers="$WORKERS" \
    --name="$JOB" --model="$MODEL" --dataset="$DATASET" --mode="$MODE" --epochs="$EPOCHS" \
    --optimizer=adam --lr=0.001 --lr_schedule=cosine \
    --data_dir="$DATA_DIR" --log_every=25 --output="$RUN_DIR/model.pt" \
    --node="worker$r" 2>"$RUN_DIR/worker$r.log" &
  WPIDS+=($!)
  PIDS+=($!)
done

# Value of key=... in a log line.
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }

progress() {
  local done_steps=0 total=0 rate=0 loss="" epoch="" line r
  for ((r = 0; r < WORKERS; r++)); do
    line="$(grep 'event=progress' "$RUN_DIR/worker$r.log" 2>/dev/null | tail -1 || true)"
    [ -n "$line" ] || continue
    done_steps=$((done_steps + $(field step "$line")))
    total=$((total + $(field total "$line")))
    rate=$((rate + $(field samples_per_s "$line")))
    [ "$r" = 0 ] && loss="$(field loss "$line")" && epoch="$(field epoch "$line")/$(field epochs "$line")"
  done
  [ "$total" -gt 0 ] || { echo "starting..."; return; }
  local pct=$((100 * done_steps / total)) width=30 eta="?"
  local fill=$((width * done_steps / total))
  if [ "$rate" -gt 0 ]; then
    local batch=64
    eta="$(((total - done_steps) * batch / rate))s"
  fi
  printf '[%-*s] %3d%% epoch %s step %d/%d loss %s %d samples/s ETA %s' "$width" \
    "$(printf '%*s' "$fill" '' | tr ' ' '#')" "$pct" "${epoch:-?}" "$done_steps" "$total" \
    "${loss:-?}" "$rate" "$eta"
}

tty=false
[ -t 2 ] && tty=true
last_plain=0
running=true
while $running; do
  running=false
  for pid in "${WPIDS[@]}"; do kill -0 "$pid" 2>/dev/null && running=true; done
  if $tty; then
    printf '\r%s\033[K' "$(progress)" >&2
  elif [ $((SECONDS - last_plain)) -ge 5 ]; then
    echo "progress: $(progress)" >&2
    last_plain=$SECONDS
  fi
  $running && sleep 1
done
$tty && echo >&2

status=0
for ((r = 0; r < WORKERS; r++)); do
  wait "${WPIDS[$r]}" || { status=$?; say "worker $r failed (log: $RUN_DIR/worker$r.log):"; grep -E 'ERROR' "$RUN_DIR/worker$r.log" | tail -3 >&2; }
done
[ "$status" = 0 ] || exit 1

accuracy="" samples=0 wall=0
for ((r = 0; r < WORKERS; r++)); do
  line="$(grep 'event=done' "$RUN_DIR/worker$r.log" | tail -1)"
  [ "$r" = 0 ] && accuracy="$(field accuracy "$line")"
  samples=$((samples + $(field samples "$line")))
  wall="$(awk -v a="$wall" -v b="$(field wall_s "$line")" 'BEGIN { print (b > a) ? b : a }')"
done
say "model saved to $RUN_DIR/model.pt"
awk -v a="$accuracy" -v s="$samples" -v w="$wall" \
  'BEGIN { printf "RESULT accuracy=%.4f samples_per_s=%.0f wall_s=%.1f\n", a, s / w, w }'
