#!/usr/bin/env bash
# The GPU check, in one command on a GPU machine (the device tool's machine: a CUDA LibTorch in
# its python3's torch package, no Bazel), from the repository root, with the bundle of
# tests/gpu/make_bundle.py at .gpu/bundle.tar.xz:
#
#   bash tests/gpu/run_on_gpu.sh OUT_DIR
#
# 1. builds the worker and the loop's tests against that LibTorch (tests/gpu/build_on_gpu.sh);
# 2. runs //worker:training_loop_test there: its Device tests run on the GPU (the model view,
#    buffers, gradient hooks, and that SGD through the view ends in the CPU's model);
# 3. makes the KJV transformer workload with that python3 (examples/kjv_transformer/make.py);
# 4. runs tests/bench/modes.sh on it: gradmesh workers on the GPU (--device=cuda; ps with two
#    shards on the CPU; allreduce and gossip) against plain PyTorch on the same GPU
#    (torch_reference.py --device cuda), same model file, data, batch, optimizer and steps.
# Every result is a JSON line in OUT_DIR/results.jsonl (also on stdout); the build, test and
# make logs and every benchmark process's log are in OUT_DIR/logs.tar.gz.
set -uo pipefail
OUT_DIR="$(mkdir -p "$1" && cd "$1" && pwd)"
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
STEPS="${STEPS:-300}"
# A dry run on a machine without a GPU (checks this script and the bundle):
#   TORCH=/usr CUDA_LIBS="" DEVICE=cpu REF=torch_1thread PYTHON=/usr/bin/python3 STEPS=20 \
#     bash tests/gpu/run_on_gpu.sh /tmp/gpu-dry
DEVICE="${DEVICE:-cuda}"
REF="${REF:-torch_gpu}"
W=/tmp/gradmesh-gpu
L="$W/logs"
rm -rf "$W" && mkdir -p "$W" "$L"
trap 'tar -C "$W" -czf "$OUT_DIR/logs.tar.gz" logs' EXIT
say() { echo "run_on_gpu: $*" >&2; }
result() { echo "$1" | tee -a "$OUT_DIR/results.jsonl"; }

tar -C "$W" -xJf .gpu/bundle.tar.xz || { say "no bundle"; exit 1; }
B="$W/bundle"
TORCH="${TORCH:-$("$PYTHON" -c 'import torch, os; print(os.path.dirname(torch.__file__))')}"
"$PYTHON" - <<'EOF' | tee -a "$OUT_DIR/results.jsonl"
import json, torch
print(json.dumps({"bench": "gpu_env", "torch": torch.__version__, "cuda": torch.version.cuda,
                  "cxx11_abi": torch._C._GLIBCXX_USE_CXX11_ABI,
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}))
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2 || true
g++ --version | head -1 >&2

# 1. Build (C++17 first; a LibTorch that needs C++20 gets it).
t0=$(date +%s)
if ! TORCH="$TORCH" bash tests/gpu/build_on_gpu.sh "$B" "$W/build" 2>"$L/build.log"; then
  say "C++17 build failed; trying C++20"
  CXX_STD=c++20 TORCH="$TORCH" bash tests/gpu/build_on_gpu.sh "$B" "$W/build" \
    2>>"$L/build.log" || { tail -40 "$L/build.log" >&2; exit 1; }
fi
result "{\"bench\":\"gpu_build\",\"seconds\":$(($(date +%s) - t0))}"
export GRADMESH_DATA_DIR="$B/data" OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

# 1b. A probe: a TorchScript model with buffers through the loop. If the process dies (a symbol
# both the bundle's libraries and LibTorch export, bound to the wrong copy), relink with
# LibTorch first and probe again. A backtrace shim (LD_PRELOAD) prints where it died.
cat >"$W/bt.c" <<'EOF'
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
static void on_signal(int s) {
  void* b[64];
  int n = backtrace(b, 64);
  backtrace_symbols_fd(b, n, 2);
  _exit(128 + s);
}
__attribute__((constructor)) static void init(void) {
  signal(SIGABRT, on_signal);
  signal(SIGSEGV, on_signal);
}
EOF
gcc -shared -fPIC -o "$W/bt.so" "$W/bt.c"
probe() {  # label
  LD_PRELOAD="$W/bt.so" GRADMESH_DATA_DIR="$B/data" timeout 120 \
    "$W/build/worker/training_loop_test" --gtest_filter='*BuffersAreMirrored*' \
    >"$L/probe-$1.log" 2>&1
  local rc=$?
  result "{\"bench\":\"gpu_probe\",\"link\":\"$1\",\"rc\":$rc}"
  [ "$rc" = 0 ] || { grep -v '^\[' "$L/probe-$1.log" | head -40 >&2; }
  return "$rc"
}
# Symbols exported by both LibTorch and the bundle's libraries.
for f in "$TORCH"/lib/libtorch_cpu.so "$TORCH"/lib/libc10.so; do nm -D --defined-only "$f"; done 2>/dev/null |
  awk '{print $3}' | LC_ALL=C sort -u >"$W/torch.syms"
for f in "$B"/lib/*.so*; do nm -D --defined-only "$f" 2>/dev/null | awk -v f="${f##*/}" '{print $3, f}'; done |
  LC_ALL=C sort -u >"$W/bundle.syms"
LC_ALL=C join "$W/torch.syms" "$W/bundle.syms" >"$L/shared-symbols.txt" || true
result "{\"bench\":\"gpu_shared_symbols\",\"count\":$(wc -l <"$L/shared-symbols.txt"),\"libs\":\"$(awk '{print $2}' "$L/shared-symbols.txt" | sort | uniq -c | sort -rn | head -8 | awk '{printf "%s:%s ", $2, $1}')\"}"
if ! probe bundle_first; then
  LINK_ONLY=1 LINK_ORDER=torch_first TORCH="$TORCH" bash tests/gpu/build_on_gpu.sh "$B" "$W/build" \
    2>>"$L/build.log"
  probe torch_first || exit 1
fi

[ "${SKIP_TESTS:-0}" = 1 ] || {
# 2. The loop's tests, CPU and GPU instances.
"$W/build/worker/training_loop_test" >"$L/training_loop_test.log" 2>&1
rc=$?
passed=$(grep -c '^\[       OK \]' "$L/training_loop_test.log")
failed=$(grep -c '^\[  FAILED  \]' "$L/training_loop_test.log")
result "{\"bench\":\"gpu_training_loop_test\",\"rc\":$rc,\"ok\":$passed,\"failed_lines\":$failed}"
grep -E '^\[ +(OK|FAILED) +\]' "$L/training_loop_test.log" >&2

# 2b. The NCCL communicator's one-GPU tests and bench (built here with --config=cuda into
# .gpu/nccl/ when present: they need libcudart and libnccl, taken from the python's nvidia
# packages; the two-process tests skip on one GPU, as NCCL refuses two ranks on one device).
if [ -x .gpu/nccl/nccl_communicator_test ]; then
  site="$(dirname "$TORCH")"
  nv="$(find "$site" -name 'libnccl.so.2' -o -name 'libcudart.so.1*' 2>/dev/null |
    xargs -r -n1 dirname | sort -u | paste -sd:)"
  LD_LIBRARY_PATH="$B/lib:$nv" timeout 90 .gpu/nccl/nccl_communicator_test >"$L/nccl_test.log" 2>&1
  rc=$?
  result "{\"bench\":\"gpu_nccl_test\",\"rc\":$rc,\"ok\":$(grep -c '^\[       OK \]' "$L/nccl_test.log"),\"skipped\":$(grep -c '^\[  SKIPPED \]' "$L/nccl_test.log")}"
  LD_LIBRARY_PATH="$B/lib:$nv" timeout 60 .gpu/nccl/nccl_bench --gpus=1 --max_bytes=67108864 \
    2>>"$L/nccl_test.log" | tee -a "$OUT_DIR/results.jsonl"
fi

}

# 3. The transformer workload, made with this machine's torch.
WLD="$W/workloads"
mkdir -p "$WLD"
"$PYTHON" examples/kjv_transformer/make.py --text "$B/data/kjv.txt" --out "$WLD/transformer" \
  >"$L/make.log" 2>&1 || { tail -20 "$L/make.log" >&2; exit 1; }

# 4. Modes on the GPU against PyTorch on the same GPU.
mkdir -p "$W/bin/worker" "$W/bin/server"
cp "$W/build/worker/gradmesh_worker" "$W/bin/worker/"
cp "$W/build/server/gradmesh_server" "$W/bin/server/"
bench() {  # label, then env assignments for modes.sh
  local label="$1"; shift
  timeout 200 env GRADMESH_BIN="$W/bin" WORKLOAD=transformer WORKLOAD_DIR="$WLD" PYTHON="$PYTHON" \
    STEPS="$STEPS" WORKER_FLAGS="--device=$DEVICE" "$@" \
    bash tests/bench/modes.sh 2>"$L/modes-$label.log" |
    sed "s/^{/{\"run\":\"$label\",\"gpu\":true,/" | tee -a "$OUT_DIR/results.jsonl"
  local dir
  dir="$(sed -n 's/^logs: //p' "$L/modes-$label.log")"
  [ -d "$dir" ] && cp -r "$dir" "$L/run-$label"
}
if [ -n "${BENCHES:-}" ]; then
  # Other runs: a file of lines "LABEL VAR=value ..." (modes.sh settings; no spaces in values
  # other than inside MODES/PS_FLAGS, which take "..." quotes).
  while read -r line; do
    [ -z "$line" ] && continue
    eval "bench $line"
  done <"$BENCHES"
else
  bench w1 WORKERS=1 MODES="$REF ps allreduce"
  bench w2 WORKERS=2 MODES="ps gossip allreduce"
  bench w1-topk WORKERS=1 MODES="ps" PS_FLAGS="--push_codec=topk:0.01+fp16 --pull_codec=fp16"
  bench w1-ref WORKERS=1 MODES="$REF"
fi
say "done"
