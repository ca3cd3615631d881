#!/usr/bin/env bash
# The generic sbatch template on the local 4-node Slurm cluster: one scaped
# per node (4 daemons, host backend over loopback), TRAINERS trainers per node
# (trainer_c through libscape), SCAPE at rho 0.1.  The job's output must show
# every trainer of every node finishing with the same parameters and a loss
# that fell.  No port is configured: rank 0's rendezvous port follows the job
# id and every data plane takes a free port.
# Usage: tests/slurm/template.sh BUILD_DIR [TRAINERS [requeue|pair]]   (root)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "$1" && pwd)
trainers=${2:-2}
cluster=$root/deploy/slurm-cluster.sh
DIR=$(mktemp -d /tmp/scape-slurm-tpl.XXXXXX)
fail() { echo "template: FAIL: $*" >&2; exit 1; }
cleanup() {
  local rc=$?
  trap - EXIT
  set +e
  [ "$rc" -ne 0 ] && [ -f "$DIR/job.out" ] && tail -n 40 "$DIR/job.out" >&2
  [ "$rc" -ne 0 ] && [ -f "$DIR/requeue.out" ] && tail -n 60 "$DIR/requeue.out" >&2
  for f in "$DIR"/pair-*.out; do [ "$rc" -ne 0 ] && [ -f "$f" ] && tail -n 30 "$f" >&2; done
  bash "$cluster" stop "$DIR" >/dev/null
  rm -rf "$DIR"
  exit "$rc"
}
trap cleanup EXIT

bash "$cluster" start "$DIR" >/dev/null
export SLURM_CONF=$DIR/slurm.conf
# scaped and scapectl from the build tree, where scape-node.sh looks for them
mkdir -p "$DIR/bin"
ln -s "$build/daemon/scaped" "$build/client/scapectl" "$DIR/bin/"
steps=150
export SCAPE_HOME=$root SCAPE_BIN=$DIR/bin SCAPE_RUN_BASE=$DIR READY_TIMEOUT=60
export SCAPE_COORD_HOST=127.0.0.1 SCAPE_LISTEN_IFACE=lo TRAINERS_PER_NODE=$trainers
unset SCAPE_RDV_PORT SCAPE_DATA_PORT
# The cluster's own munged (not at munge's default socket): the daemons
# authenticate their rendezvous with it and run CURVE between them, as on
# Vista (where auth auto finds munged at its default socket).
export SCAPE_AUTH=munge SCAPE_MUNGE_SOCKET=$DIR/munge/munge.socket.2
export SCAPE_ARGS="--rho 0.1 --warmup 5 --comm-timeout-ms 60000"
export TRAINER_CMD="$build/tests/integration/trainer_c --n 4000 --steps $steps"
export SCAPE_CHECKPOINT_DIR=$DIR/ckpt-plain
timeout 300 sbatch --wait --nodes=4 --output="$DIR/job.out" --export=ALL \
  "$root/slurm/generic.sbatch" >/dev/null || fail "the job failed"

want=$((4 * trainers))
done_lines=$(grep -c "steps 1..$steps done" "$DIR/job.out" || true)
[ "$done_lines" -eq "$want" ] || fail "$done_lines of $want trainers finished"
hashes=$(grep -o "params [0-9a-f]*" "$DIR/job.out" | sort -u | wc -l)
[ "$hashes" -eq 1 ] || fail "the trainers' parameters differ ($hashes distinct)"
falling=$(grep -o "loss [0-9.]* -> [0-9.]*" "$DIR/job.out" |
          awk '{ if ($4 < $2) n++ } END { print n + 0 }')
[ "$falling" -eq "$want" ] || fail "the loss fell for $falling of $want trainers"
grep -q "scape: every daemon is up" "$DIR/job.out" || fail "the template did not report its daemons"
[ "$(grep -c "auth munge" "$DIR/job.out" || true)" -eq 4 ] ||
  fail "not every daemon says auth munge"
[ "$(grep -c "CURVE: authenticated and encrypted" "$DIR/job.out" || true)" -eq 4 ] ||
  fail "not every daemon runs CURVE"
echo "template: 4 nodes x $trainers trainers, identical parameters, loss falling: ok"

# Two jobs at the same time, as two jobs sharing nodes would be (every node
# of this cluster is this one machine, so they share every address): each
# finds its own daemons, and both end with the same parameters.
if [ "${3:-}" = pair ]; then
  pair_cmd="$TRAINER_CMD --sleep-ms 20"
  ids=()
  for j in a b; do
    id=$(TRAINER_CMD=$pair_cmd SCAPE_CHECKPOINT_DIR=$DIR/ckpt-pair-$j sbatch --parsable \
         --nodes=2 --output="$DIR/pair-$j.out" --export=ALL "$root/slurm/generic.sbatch") ||
      fail "sbatch refused job $j"
    ids+=("$id")
  done
  both=0 deadline=$((SECONDS + 300))
  while :; do
    states=$(for id in "${ids[@]}"; do
               scontrol show job "$id" | grep -o "JobState=[A-Z_]*" | cut -d= -f2; done | tr '\n' ' ')
    [ "$states" = "RUNNING RUNNING " ] && both=1
    case "$states" in *PENDING*|*RUNNING*|*CONFIGURING*|*COMPLETING*) ;; *) break ;; esac
    [ "$SECONDS" -lt "$deadline" ] || fail "the pair of jobs did not finish (states $states)"
    sleep 0.2
  done
  [ "$states" = "COMPLETED COMPLETED " ] || fail "the pair of jobs ended $states"
  [ "$both" = 1 ] || fail "the two jobs never ran at the same time"
  pair=$(cat "$DIR"/pair-a.out "$DIR"/pair-b.out | grep -o "params [0-9a-f]*" | sort -u)
  [ "$(grep -c "steps 1..$steps done" "$DIR"/pair-a.out "$DIR"/pair-b.out | cut -d: -f2 |
       tr '\n' ' ')" = "$((2 * trainers)) $((2 * trainers)) " ] ||
    fail "not every trainer of the pair finished"
  [ "$(echo "$pair" | wc -l)" -eq 1 ] || fail "the two jobs' parameters differ: $pair"
  echo "template: two 2-node jobs at once on shared addresses, each met its own daemons," \
       "the same parameters: ok"
fi
[ "${3:-}" = requeue ] || exit 0

# The same job, slowed down, gets SIGUSR1 part-way (as --signal=B:USR1@300
# would send it), checkpoints, is requeued, resumes, and must end with the
# uninterrupted job's parameters, bit for bit.
plain=$(grep -o "params [0-9a-f]*" "$DIR/job.out" | sort -u)
export SCAPE_CHECKPOINT_DIR=$DIR/ckpt-requeue
export TRAINER_CMD="$TRAINER_CMD --sleep-ms 40"
job=$(sbatch --parsable --nodes=4 --output="$DIR/requeue.out" --open-mode=append \
      --export=ALL "$root/slurm/generic.sbatch") || fail "sbatch refused the job"
deadline=$((SECONDS + 120))
until grep -q "scape: every daemon is up" "$DIR/requeue.out" 2>/dev/null; do
  [ "$SECONDS" -lt "$deadline" ] || fail "the job did not start its daemons"
  sleep 0.5
done
sleep 2
scancel --signal=USR1 --batch "$job" || fail "scancel --signal=USR1 failed"
deadline=$((SECONDS + 300))
while :; do
  state=$(scontrol show job "$job" | grep -o "JobState=[A-Z_]*" | cut -d= -f2)
  restarts=$(scontrol show job "$job" | grep -o "Restarts=[0-9]*" | cut -d= -f2)
  case "$state" in
  COMPLETED) break ;;
  FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) fail "the requeued job ended $state" ;;
  esac
  [ "$SECONDS" -lt "$deadline" ] || fail "the requeued job did not finish (state $state)"
  sleep 1
done
[ "${restarts:-0}" -ge 1 ] || fail "the job was not requeued (Restarts=${restarts:-0})"
grep -q "checkpoint written; requeueing" "$DIR/requeue.out" || fail "no checkpoint before the requeue"
grep -q "resumes from" "$DIR/requeue.out" || fail "the second run did not resume"
first=$(grep -o "steps [0-9]*..$steps done" "$DIR/requeue.out" | sort -u)
[ "$(echo "$first" | wc -l)" -eq 1 ] || fail "trainers resumed at different steps: $first"
case "$first" in "steps 1..$steps done") fail "the trainers started over at step 1" ;; esac
resumed=$(grep -o "params [0-9a-f]*" "$DIR/requeue.out" | sort -u)
[ "$(echo "$resumed" | wc -l)" -eq 1 ] || fail "the resumed trainers differ"
[ "$resumed" = "$plain" ] || fail "resumed $resumed, uninterrupted $plain"
echo "template: SIGUSR1 -> checkpoint -> requeue -> resume ($first), parameters equal to the uninterrupted job: ok"

# A corrupted checkpoint: one flipped byte in rank 2's file.  The job that
# would resume from it fails at start-up with the reason, and the files on
# disk stay as they were.
latest=$SCAPE_CHECKPOINT_DIR/$(cat "$SCAPE_CHECKPOINT_DIR/LATEST")
victim=$latest/rank-00002.ckpt
size=$(stat -c %s "$victim")
printf '\x5a' | dd of="$victim" bs=1 seek=$((size / 2)) conv=notrunc 2>/dev/null
before=$(cd "$SCAPE_CHECKPOINT_DIR" && find . -type f -exec sha256sum {} + | sort)
if timeout 300 sbatch --wait --nodes=4 --output="$DIR/corrupt.out" --export=ALL \
     "$root/slurm/generic.sbatch" >/dev/null 2>&1; then
  fail "a job resumed from a corrupted checkpoint"
fi
grep -q "rank-00002.ckpt: section '[a-z_]*' checksum mismatch" "$DIR/corrupt.out" ||
  { tail -n 30 "$DIR/corrupt.out" >&2; fail "the refusal does not give its reason"; }
after=$(cd "$SCAPE_CHECKPOINT_DIR" && find . -type f -exec sha256sum {} + | sort)
[ "$before" = "$after" ] || fail "the refused resume changed the checkpoint directory"
echo "template: a corrupted checkpoint is refused with its reason, the files untouched: ok"
