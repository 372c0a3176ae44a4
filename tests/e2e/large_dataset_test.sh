#!/usr/bin/env bash
# A `tensors` dataset larger than the memory a worker may use trains within that bound: three
# train files of ~200 MiB each (x float32 [N, 4096]; 600 MiB in all) and a test file, written
# by plain torch.save; a standalone shard and worker (async) train a TorchScript linear model
# on them for one epoch; the worker's peak resident set (VmHWM, polled from /proc) must stay
# under LIMIT_MB (320), i.e. the files are read sample by sample, never loaded whole.
set -euo pipefail
fail() { for f in "$tmp"/*.log; do echo "--- $f"; tail -n 8 "$f"; done; echo "FAIL: $*"; exit 1; }
tmp="$(mktemp -d)"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
PY=/usr/bin/python3
LIMIT_MB="${LIMIT_MB:-320}"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

"$PY" - "$tmp" >"$tmp/make.log" 2>&1 <<'PYEOF' || fail "making the dataset"
import os, sys, torch
out = sys.argv[1]
os.makedirs(out + "/data")
g = torch.Generator().manual_seed(0)
w = torch.randn(4096, 10, generator=g)
def part(n):
    x = torch.randn(n, 4096, generator=g)
    return x, (x @ w).argmax(1)
for i in range(3):
    x, y = part(12800)
    torch.save({"x": x, "y": y}, f"{out}/data/train-{i:05d}.pt")
x, y = part(2000)
torch.save({"x": x, "y": y}, f"{out}/data/test-00000.pt")
torch.jit.script(torch.nn.Linear(4096, 10)).save(out + "/model.pt")
PYEOF
bytes="$(cat "$tmp"/data/train-*.pt | wc -c)"
[ "$bytes" -gt $((LIMIT_MB * 1024 * 1024)) ] || fail "the dataset ($bytes bytes) is not larger than the limit"

server/gradmesh_server --host=127.0.0.1 --port=0 --port_file="$tmp/port" --node=s0 \
  2>"$tmp/server.log" &
PIDS+=($!)
for _ in $(seq 100); do [ -s "$tmp/port" ] && break; sleep 0.1; done
[ -s "$tmp/port" ] || fail "shard did not start"
worker/gradmesh_worker --servers="127.0.0.1:$(cat "$tmp/port")" --node=w0 --name=big \
  --model=torchscript --model_path="$tmp/model.pt" --dataset=tensors \
  --dataset_path="$tmp/data" --epochs=1 --batch_size=64 --optimizer=sgd --lr=0.05 \
  --log_every=100 2>"$tmp/worker.log" &
W=$!
PIDS+=($W)
peak=0
while kill -0 "$W" 2>/dev/null; do
  v="$(awk '/VmHWM/ {print $2}' "/proc/$W/status" 2>/dev/null || true)"
  [ -n "$v" ] && peak="$v"
  sleep 0.1
done
wait "$W" || fail "the worker failed"
line="$(grep 'event=done' "$tmp/worker.log" | tail -n 1)"
[ -n "$line" ] || fail "no done line"
steps="$(sed -n 's/.* steps=\([0-9]*\).*/\1/p' <<<"$line")"
[ "$steps" = 600 ] || fail "expected 600 steps (38400 samples / 64), got $steps"
acc="$(sed -n 's/.* accuracy=\([0-9.]*\).*/\1/p' <<<"$line")"
echo "dataset: $((bytes / 1048576)) MiB in 3 files; worker peak RSS: $((peak / 1024)) MiB; accuracy $acc"
[ $((peak / 1024)) -lt "$LIMIT_MB" ] || fail "worker peak RSS $((peak / 1024)) MiB >= $LIMIT_MB MiB"
"$PY" -c "import sys; sys.exit(0 if float('$acc') > 0.3 else 1)" ||
  fail "accuracy $acc: the linear model did not learn the linear labels"
echo PASS
