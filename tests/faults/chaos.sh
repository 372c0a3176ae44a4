#!/usr/bin/env bash
# A fault schedule against a real cluster on 127.0.0.1: a coordinator, 2 shard daemons (RocksDB
# in a data dir) and 2 worker daemons train the MNIST MLP through the CLI while this kills
# (SIGKILL) a random shard, a random worker daemon, either (TARGET=shard|worker|both) or the
# coordinator (TARGET=coordinator, on the same port and data dir), every
# KILL_EVERY_S seconds, and once it has exited starts it again under the same name on the same
# port (with its data dir, so with the node token it kept), until the
# job ends. It prints the number of kills and the job's last line (SUCCEEDED with its accuracy,
# or why it failed); the daemons' logs stay in $CHAOS_DIR/NAME. Randomised, so a tool, not a
# test (README, "Fault schedules").
#
#   bazel build //coordinator:gradmesh_coordinator //server:gradmesh_server \
#       //worker:gradmesh_worker //cli:gradmesh
#   STEPS=4000 TARGET=shard tests/faults/chaos.sh NAME MODE "EXTRA SPEC LINES" KILL_EVERY_S
#   e.g. tests/faults/chaos.sh clipped sync $'clip_grad_norm: 1.0\ndurability: {mode: every_update}' 5
#
#   WORKER_FLAGS="--ps_transport=shm" adds flags to every worker daemon.
#
# usage: chaos.sh NAME MODE EXTRA_SPEC KILL_EVERY_S
name=$1; mode=$2; extra=$3; every=${4:-6}
B=${GRADMESH_BIN:-$(cd "$(dirname "$0")/../.." && pwd)/bazel-bin}
export OPENBLAS_NUM_THREADS=1
d=${CHAOS_DIR:-/tmp/gradmesh-chaos}/$name; rm -rf $d; mkdir -p $d
head -c 24 /dev/urandom | base64 | tr -d '/+=' > $d/token
CPORT=$((7300 + RANDOM % 200))
start_coord() { rm -f $d/coord.port; $B/coordinator/gradmesh_coordinator --host=127.0.0.1 --port=$CPORT --port_file=$d/coord.port --data_dir=$d/coord --auth_token_file=$d/token 2>>$d/coord.log & cp=$!; while [ ! -s $d/coord.port ]; do sleep 0.1; done; }
start_coord
C=127.0.0.1:$CPORT
start_shard() { $B/server/gradmesh_server --host=127.0.0.1 --port=$2 --node=shard$1 --data_dir=$d/shard$1 --coordinator=$C --auth_token_file=$d/token 2>>$d/shard$1.log & echo $! > $d/shard$1.pid; }
P0=$((7600 + RANDOM % 300)); P1=$((P0+1))
start_shard 0 $P0; start_shard 1 $P1
start_worker() { $B/worker/gradmesh_worker --host=127.0.0.1 --peer_port=0 --node=worker$1 --coordinator=$C --auth_token_file=$d/token --data_dir=${GRADMESH_DATA:-/var/lib/gradmesh/data} --checkpoint_dir=$d/ckpt$1 ${WORKER_FLAGS:-} 2>>$d/worker$1.log & echo $! > $d/worker$1.pid; }
for r in 0 1 ${EXTRA_WORKERS:-}; do start_worker $r; done
cat > $d/job.yaml <<Y
name: $name
model: {name: mlp}
dataset: {name: mnist}
optimizer: {name: adam, lr: 0.001}
batch_size: 64
steps: ${STEPS:-1500}
mode: $mode
num_workers: 2
num_shards: 2
seed: 1
log_every: 100
$extra
Y
export GRADMESH_COORDINATOR=$C GRADMESH_AUTH_TOKEN_FILE=$d/token
for i in $(seq 40); do $B/cli/gradmesh submit $d/job.yaml > $d/submit.log 2>&1 && break; sleep 0.5; done
cat $d/submit.log | head -3
( timeout 600 $B/cli/gradmesh watch $name > $d/watch.log 2>&1; echo "watch_rc=$?" >> $d/watch.log ) &
wp=$!
k=0
while kill -0 $wp 2>/dev/null; do
  sleep $every
  kill -0 $wp 2>/dev/null || break
  s=$((RANDOM % 2)); port=$([ $s = 0 ] && echo $P0 || echo $P1)
  if [ "${TARGET:-shard}" = coordinator ]; then
    kill -9 $cp 2>/dev/null; wait $cp 2>/dev/null; k=$((k+1)); sleep 0.$((RANDOM % 9)); start_coord
  elif [ "${TARGET:-shard}" = worker ] || { [ "${TARGET:-shard}" = both ] && [ $((RANDOM % 2)) = 1 ]; }; then
    v=$(cat $d/worker$s.pid); kill -9 $v 2>/dev/null; wait $v 2>/dev/null; k=$((k+1)); sleep 0.$((RANDOM % 9)); start_worker $s
  else
    v=$(cat $d/shard$s.pid); kill -9 $v 2>/dev/null; wait $v 2>/dev/null; k=$((k+1)); sleep 0.$((RANDOM % 9)); start_shard $s $port
  fi
done
wait $wp
echo "kills=$k"; tail -2 $d/watch.log
kill $(cat $d/shard0.pid) $(cat $d/shard1.pid) $(cat $d/worker*.pid) $cp 2>/dev/null
wait 2>/dev/null
grep -h "event=failed\|ERROR" $d/worker*.log | head -3 | cut -c1-300
