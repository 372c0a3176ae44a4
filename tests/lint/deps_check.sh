#!/usr/bin/env bash
# Dependency rules that bazel itself does not enforce, checked with `bazel query`:
#   1. The core targets link no gRPC: the shard, the coordinator, the training loop and the
#      modes' base (their gRPC adapters are separate targets).
#   2. No cycles between packages (a package's targets may depend on another package's only if
#      that one's never depend back, directly or through others).
# Prints what it found; exits 1 on a violation. Run from the repository root (tests/run.sh).
set -uo pipefail
cd "$(dirname "$0")/../.."
CORE=(//server:shard //coordinator:coordinator //worker:training_loop //worker/core:training_mode
      //worker/ps:ps_mode)
rc=0
for t in "${CORE[@]}"; do
  path=$(bazel query --noshow_progress "somepath($t, @sys//:grpc)" 2>/dev/null)
  if [ -n "$path" ]; then
    echo "deps_check: FAILED: $t depends on gRPC through:"; echo "$path" | sed 's/^/  /'
    rc=1
  else
    echo "deps_check: $t links no gRPC"
  fi
done
edges=$(bazel query --noshow_progress 'deps(//..., 1) intersect //...' --output=graph 2>/dev/null) ||
  { echo "deps_check: FAILED: bazel query"; exit 1; }
if ! /usr/bin/python3 - "$edges" <<'PY'
import re, sys
graph = {}
for a, b in re.findall(r'"(//[^"]*)"\s*->\s*"(//[^"]*)"', sys.argv[1]):
    for x, y in [(a, b)]:
        pa, pb = x.split(":")[0], y.split(":")[0]
        if pa != pb:
            graph.setdefault(pa, set()).add(pb)
# Tarjan's strongly connected components: a component of more than one package is a cycle.
index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
def visit(v):
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in graph.get(v, ()):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v: break
        if len(comp) > 1: out.append(sorted(comp))
sys.setrecursionlimit(10000)
for v in list(graph):
    if v not in index: visit(v)
for c in out: print("deps_check: FAILED: package cycle among " + " ".join(c))
print("deps_check: %d packages, %d package cycles" % (len(graph), len(out)))
sys.exit(1 if out else 0)
PY
then rc=1; fi
exit $rc
