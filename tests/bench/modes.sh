#!/usr/bin/env bash
# Mode comparison on MNIST (MLP 784-256-256-10, batch 64 per worker, Adam lr 1e-3 with a
# cosine schedule, EPOCHS epochs, WORKERS workers, one intra-op thread per process): gradmesh
# `ps` (async, 2 shards), `gossip` and `allreduce`, then PyTorch DDP over gloo on the same
# settings (tests/bench/ddp_baseline.py with Debian's "$PYTHON"). One JSON line each:
#   {"bench":"modes","mode":"allreduce","workers":2,"samples_per_s":...,"accuracy":...,"wall_s":...}
# samples_per_s = every worker's samples / the slowest worker's training wall time. The ps run
# also prints each shard's CPU seconds: {"bench":"modes_shard_cpu","label":...,"shard":0,...}.
#
#   bash tests/bench/modes.sh            # EPOCHS=3 WORKERS=2 by default
#   MODES="allreduce ddp_gloo" ALLREDUCE_FLAGS="--job=/tmp/ar.yaml" bash tests/bench/modes.sh
#     MODES: which of ps gossip allreduce ddp_gloo to run (default all); <MODE>_FLAGS (upper
#     case, e.g. ALLREDUCE_FLAGS): extra worker flags for that mode.
#   LABEL names the run in the JSON lines; bytes_per_sample = all workers' bytes pushed +
#   pulled (on the wire) / all their samples.
#   MODES="ps torch_rpcps" EPOCHS=1 SHARDS=1 PS_FLAGS="--optimizer=sgd --lr=0.05
#     --momentum=0.9 --lr_schedule=constant" bash tests/bench/modes.sh
#     torch_rpcps: the peer parameter server (../shared/peers/torch_baseline.py --mode rpcps
#     --ps-sync 0: torch.distributed.rpc, one PS process applying each gradient as it arrives
#     and answering with the weights, WORKERS trainers, 1 thread each) on the same MLP, data,
#     batch and 1 epoch (the peer's only length: EPOCHS must be 1), with its optimizer (SGD lr 0.05, momentum 0.9): PS_FLAGS above gives
#     gradmesh's ps the same. SHARDS (2) is the number of gradmesh shards; PEERS the peers'
#     directory.
#   DURABLE=1 MODES=ps PS_FLAGS="--durability=every_update" bash tests/bench/modes.sh
#     the shards keep their state on disk (each its own --data_dir under the run's directory).
#   SERVER_FLAGS="--http2_window_kb=8192" PS_FLAGS="--http2_window_kb=8192" MODES=ps ...
#     extra flags of every shard (SERVER_FLAGS) and of the ps workers (PS_FLAGS).
#   GRADMESH_BIN=/path bash tests/bench/modes.sh
#     runs prebuilt binaries (<path>/server/gradmesh_server, <path>/worker/gradmesh_worker),
#     e.g. another commit's, for a before/after comparison in one session.
#
#   WORKLOAD=lenet bash tests/bench/modes.sh
#     the built-in LeNet-5 (two conv layers, three fc layers) on MNIST, as the MLP is trained;
#     no DDP peer (tests/bench/ddp_baseline.py trains the MLP). With PS_FLAGS="--overlap=2
#     --placement=ordered" its forward waits layer by layer for the previous step's answers.
#   WORKLOAD=resnet bash tests/bench/modes.sh       # or WORKLOAD=transformer
#     the shipped TorchScript workloads (examples/: ResNet-style CNN with BatchNorm on
#     Fashion-MNIST, character-level transformer on KJV; made once into WORKLOAD_DIR, default
#     ~/.cache/gradmesh/workloads) for STEPS steps (resnet 300, transformer 40) at BATCH (64 /
#     32) with Adam (LR 0.002 / 0.001), and instead of DDP the plain single-process PyTorch
#     reference with one thread (tests/bench/torch_reference.py: mode "torch_1thread") on the
#     same model file, data, batch, optimizer and steps. The JSON lines then also carry
#     test_loss and perplexity (sequence models).
#
#   On a GPU machine (tests/gpu/run_on_gpu.sh): WORKER_FLAGS="--device=cuda" puts every
#   gradmesh worker's forward/backward on the GPU (shards stay on the CPU), mode "torch_gpu"
#   runs the same single-process reference on the GPU (--device cuda), and PYTHON names a
#   python3 with torch (default Debian's "$PYTHON").
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-/usr/bin/python3}"
EPOCHS="${EPOCHS:-3}"
WORKERS="${WORKERS:-2}"
WORKLOAD="${WORKLOAD:-mlp}"
if [ "$WORKLOAD" = mlp ]; then
  MODES="${MODES:-ps gossip allreduce ddp_gloo}"
elif [ "$WORKLOAD" = lenet ]; then
  MODES="${MODES:-ps gossip allreduce}"
else
  MODES="${MODES:-ps gossip allreduce torch_1thread}"
fi
want() { [[ " $MODES " == *" $1 "* ]]; }
if want torch_rpcps && [ "$EPOCHS" != 1 ]; then
  echo "modes.sh: torch_rpcps trains 1 epoch; run it with EPOCHS=1 (got $EPOCHS)" >&2
  exit 2
fi
DATA_DIR="${GRADMESH_DATA_DIR:-/var/lib/gradmesh/data}"
RUN_DIR="$(mktemp -d /tmp/gradmesh-modes.XXXXXX)"
if [ -n "${GRADMESH_BIN:-}" ]; then
  BIN="$GRADMESH_BIN"  # Prebuilt binaries (server/gradmesh_server, worker/gradmesh_worker).
else
  bazel build -c opt //server:gradmesh_server //worker:gradmesh_worker >"$RUN_DIR/build.log" 2>&1 ||
    { tail -20 "$RUN_DIR/build.log" >&2; exit 1; }
  BIN="$(bazel info -c opt bazel-bin 2>/dev/null)"
fi
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

# What the workers train: the MLP on MNIST, or a shipped TorchScript workload.
case "$WORKLOAD" in
  mlp | lenet)
    TRAIN=(--model="$WORKLOAD" --dataset=mnist --epochs="$EPOCHS" --batch_size=64 --optimizer=adam
      --lr=0.001 --lr_schedule=cosine --log_every=100)
    BATCH=64
    ;;
  resnet | transformer)
    WORKLOAD_DIR="${WORKLOAD_DIR:-$HOME/.cache/gradmesh/workloads}"
    WL="$WORKLOAD_DIR/$WORKLOAD"
    if [ ! -s "$WL/model.pt" ]; then
      rm -rf "$WL.tmp"
      if [ "$WORKLOAD" = resnet ]; then
        "$PYTHON" examples/fashion_resnet/make.py --data "$DATA_DIR/fashion-mnist" \
          --out "$WL.tmp" >&2
      else
        "$PYTHON" examples/kjv_transformer/make.py --out "$WL.tmp" >&2
      fi
      mv "$WL.tmp" "$WL"
    fi
    if [ "$WORKLOAD" = resnet ]; then
      STEPS="${STEPS:-300}" BATCH="${BATCH:-64}" LR="${LR:-0.002}"
    else
      STEPS="${STEPS:-40}" BATCH="${BATCH:-32}" LR="${LR:-0.001}"
    fi
    TRAIN=(--model=torchscript --model_path="$WL/model.pt" --dataset=tensors
      --dataset_path="$WL/data" --steps="$STEPS" --batch_size="$BATCH" --optimizer=adam
      --lr="$LR" --log_every=10)
    ;;
  *) echo "WORKLOAD must be mlp, lenet, resnet or transformer" >&2; exit 2 ;;
esac
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# N distinct free ports as 127.0.0.1:P,... (all bound at once: one at a time, the kernel may
# hand out the same port twice, and two ranks would then share an address).
free_peers() {
  "$PYTHON" -c 'import socket, sys
ss = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1", 0))
print(",".join("127.0.0.1:%d" % s.getsockname()[1] for s in ss))' "$1"
}
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2" | tr -d '"'; }

# run_workers MODE EXTRA_FLAGS...: starts WORKERS workers, waits, prints the JSON line.
run_workers() {
  local mode="$1"; shift
  local wpids=() r peers=""
  if [ "$mode" != ps ]; then
    peers="$(free_peers "$WORKERS")"
  fi
  for ((r = 0; r < WORKERS; r++)); do
    "$BIN/worker/gradmesh_worker" --rank=$r --num_workers="$WORKERS" --name="bench-$mode" \
      "${TRAIN[@]}" --data_dir="$DATA_DIR" ${peers:+--peers=$peers} ${WORKER_FLAGS:-} "$@" \
      --node="w$r" \
      2>"$RUN_DIR/$mode-w$r.log" &
    wpids+=($!)
  done
  for p in "${wpids[@]}"; do wait "$p" || { tail -n 5 "$RUN_DIR/$mode-w"*.log >&2; return 1; }; done
  local samples=0 wall=0 acc="" tl="" ppl="" line s w bytes=0 prog="" cms="" xms="" hid="" early="" pms="" kms="" th=""
  for ((r = 0; r < WORKERS; r++)); do
    line="$(grep 'event=done' "$RUN_DIR/$mode-w$r.log" | tail -1)"
    s="$(field samples "$line")"; w="$(field wall_s "$line")"
    samples=$((samples + s))
    bytes=$((bytes + $(field bytes_pushed "$line") + $(field bytes_pulled "$line")))
    wall="$("$PYTHON" -c "print(max($wall, $w))")"
    if [ "$r" = 0 ]; then
      acc="$(field accuracy "$line")" tl="$(field test_loss "$line")"
      ppl="$(field perplexity "$line")"
      # The step timeline of rank 0's last progress line: comm_ms (what a step waited for its
      # exchange) and, with pipeline 1 or overlap 1, exchange_ms (the whole exchange, in the
      # background or from backward on) and hidden (the fraction of it that overlapped
      # compute); with overlap 1, early_shards (the share of shard parts sent during backward).
      prog="$(grep 'event=progress' "$RUN_DIR/$mode-w$r.log" | tail -1 || true)"
      cms="$(field comm_ms "$prog")"; xms="$(field exchange_ms "$prog")"
      hid="$(field hidden "$prog")"; early="$(field early_shards "$prog")"
      # compute_ms (forward + backward, with a GPU's copies), codec_ms (encoding and decoding,
      # on the host or the device) and to_host_bytes_per_step (gradient bytes a GPU copied to
      # the host: dense gradients, or with --device_codec only the payloads).
      pms="$(field compute_ms "$prog")"; kms="$(field codec_ms "$prog")"
      th="$(field to_host_bytes_per_step "$prog")"
    fi
  done
  "$PYTHON" -c "import json; print(json.dumps({'bench':'modes','workload':'$WORKLOAD','mode':'$mode','workers':$WORKERS,'label':'${LABEL:-$mode}','samples_per_s':round($samples/$wall,1),'bytes_per_sample':round($bytes/max($samples,1),1),'accuracy':$acc,'test_loss':$tl,'perplexity':$ppl,'wall_s':$wall,'compute_ms':${pms:-None},'comm_ms':${cms:-None},'codec_ms':${kms:-None},'to_host_bytes_per_step':${th:-None},'exchange_ms':${xms:-None},'hidden':${hid:-None},'early_shards':${early:-None},'steps_or_epochs':'${STEPS:-$EPOCHS}','batch':$BATCH}))"
}

# ps (async by default; PS_FLAGS="--mode=diloco --inner_steps=50" for DiLoCo) through 2 shards.
if want ps; then
SERVERS=""
SHARD_PIDS=()
for s in $(seq 0 $((${SHARDS:-2} - 1))); do
  # DURABLE=1: each shard keeps its state under the run's directory (--data_dir), for
  # PS_FLAGS="--durability=every_update" or periodic.
  "$BIN/server/gradmesh_server" --host=127.0.0.1 --port=0 --port_file="$RUN_DIR/port$s" \
    --node="shard$s" ${DURABLE:+--data_dir="$RUN_DIR/shard$s"} ${SERVER_FLAGS:-} \
    2>"$RUN_DIR/server$s.log" &
  PIDS+=($!)
  SHARD_PIDS+=($!)
done
for s in "${!SHARD_PIDS[@]}"; do
  for _ in $(seq 100); do [ -s "$RUN_DIR/port$s" ] && break; sleep 0.1; done
  SERVERS="${SERVERS:+$SERVERS,}127.0.0.1:$(cat "$RUN_DIR/port$s")"
done
run_workers ps --mode=async --servers="$SERVERS" ${PS_FLAGS:-}
# Each shard's CPU time over the run (user + system): how evenly the job's chunks split.
for s in "${!SHARD_PIDS[@]}"; do
  read -r -a st <"/proc/${SHARD_PIDS[$s]}/stat"
  echo "{\"bench\":\"modes_shard_cpu\",\"label\":\"${LABEL:-ps}\",\"shard\":$s,\"cpu_s\":$(((st[13] + st[14]) * 1000 / $(getconf CLK_TCK)))e-3}"
done
cleanup; PIDS=()
fi
want gossip && run_workers gossip --mode=gossip ${GOSSIP_FLAGS:-}
want allreduce && run_workers allreduce --mode=allreduce ${ALLREDUCE_FLAGS:-}
# The PyTorch peers load the same OpenBLAS: give them the kernels the gradmesh workers chose
# (worker/blas_core.h: a worker re-executes itself with OPENBLAS_CORETYPE when OpenBLAS fell
# back to pre-AVX2 kernels; its `event=blas` line names the core), so that the comparison is
# of the frameworks, not of their BLAS kernels.
if [ -z "${OPENBLAS_CORETYPE:-}" ]; then
  core="$( (grep -h 'event=blas' "$RUN_DIR"/*.log 2>/dev/null || true) | head -n 1 |
    sed -n 's/.* core=\([^ ]*\).*/\1/p')"
  if [ -n "$core" ]; then export OPENBLAS_CORETYPE="$core"; fi
fi
for ref in torch_1thread torch_gpu; do
  want "$ref" || continue
  device=cpu; [ "$ref" = torch_gpu ] && device=cuda
  "$PYTHON" tests/bench/torch_reference.py --model "$WL/model.pt" --data "$WL/data" \
    --batch "$BATCH" --steps "$STEPS" --optimizer adam --lr "$LR" --threads 1 --device "$device" \
    2>"$RUN_DIR/$ref.log" | sed -n 's/^RESULT //p' | "$PYTHON" -c "
import json, sys
r = json.loads(sys.stdin.read())
print(json.dumps({'bench': 'modes', 'workload': '$WORKLOAD', 'mode': '$ref', 'workers': 1,
                  'samples_per_s': r['samples_per_s'], 'accuracy': r.get('accuracy'),
                  'test_loss': r.get('test_loss'), 'perplexity': r.get('perplexity'),
                  'steps_or_epochs': '$STEPS', 'batch': $BATCH}))"
done
if want torch_rpcps; then
  "$PYTHON" "${PEERS:-../shared/peers}/torch_baseline.py" --mode rpcps --ps-sync 0 \
    --world "$WORKERS" --threads 1 --batch 64 --data "$DATA_DIR/mnist" \
    2>"$RUN_DIR/torch_rpcps.log" | sed -n 's/^RESULT //p' | "$PYTHON" -c "
import json, sys
r = json.loads(sys.stdin.read())
print(json.dumps({'bench': 'modes', 'workload': 'mlp', 'mode': 'torch_rpcps', 'workers': $WORKERS,
                  'samples_per_s': round(r['samples_per_s_train'], 1), 'accuracy': r['acc'],
                  'ps_updates': r.get('ps_updates'), 'steps_or_epochs': '1', 'batch': 64}))"
fi
want ddp_gloo && "$PYTHON" tests/bench/ddp_baseline.py --workers "$WORKERS" --epochs "$EPOCHS" \
  --data_dir "$DATA_DIR/mnist"
echo "logs: $RUN_DIR" >&2
