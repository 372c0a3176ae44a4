#!/usr/bin/env bash
# DiLoCo against async ps on a slow link (#14 target): the MNIST MLP (tests/bench/modes.sh,
# 2 workers, 2 shards, EPOCHS epochs, Adam 1e-3 cosine as the inner / async optimizer) with
# every worker's channels to the shards paced to LINK_MBIT (default 100) Mbit/s by the
# transport itself (--link_mbit: a token bucket on each worker's outgoing and incoming
# tensor bytes; not tc shaping, which needs network namespaces this machine's CI lacks).
# One JSON line per run (modes.sh's, with "label"), then one summary line per DiLoCo run:
#   {"bench":"diloco","inner_steps":H,"bytes_ratio":async/diloco bytes per sample,
#    "speedup":diloco/async samples_per_s,"accuracy_delta":diloco - async,
#    "perplexity_ratio":diloco/async test perplexity (sequence models; else null)}
#
#   bash tests/bench/diloco.sh                # H in 10 50 200
#   H_LIST="50" EPOCHS=1 LINK_MBIT=100 bash tests/bench/diloco.sh
#   WORKLOAD=transformer STEPS=1200 WORKLOAD_DIR=~/.cache/gradmesh/workloads-small \
#     bash tests/bench/diloco.sh
#     the text model (modes.sh's WORKLOAD): here the KJV transformer's --small preset
#     (examples/kjv_transformer/make.py --small --max_test 4096 --out $WORKLOAD_DIR/transformer,
#     made beforehand; 0.21M parameters), STEPS steps per worker.
set -euo pipefail
cd "$(dirname "$0")/../.."
H_LIST="${H_LIST:-10 50 200}"
LINK_MBIT="${LINK_MBIT:-100}"
export EPOCHS="${EPOCHS:-1}" MODES=ps
out="$(mktemp /tmp/gradmesh-diloco.XXXXXX)"
LABEL=async PS_FLAGS="--link_mbit=$LINK_MBIT" bash tests/bench/modes.sh | tee -a "$out"
for h in $H_LIST; do
  LABEL="diloco_h$h" PS_FLAGS="--mode=diloco --inner_steps=$h --link_mbit=$LINK_MBIT" \
    bash tests/bench/modes.sh | tee -a "$out"
done
/usr/bin/python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = next(r for r in rows if r["label"] == "async")
for r in rows:
    if not r["label"].startswith("diloco_h"):
        continue
    print(json.dumps({
        "bench": "diloco", "inner_steps": int(r["label"][8:]),
        "bytes_ratio": round(base["bytes_per_sample"] / max(r["bytes_per_sample"], 1e-9), 1),
        "speedup": round(r["samples_per_s"] / base["samples_per_s"], 2),
        "accuracy_delta": round(r["accuracy"] - base["accuracy"], 4),
        "perplexity_ratio": (round(r["perplexity"] / base["perplexity"], 4)
                             if r.get("perplexity") and base.get("perplexity") else None)}))
PY
