#!/usr/bin/env bash
# The generic sbatch template on the local 4-node Slurm cluster: one scaped
# per node (4 daemons, host backend over loopback), TRAINERS trainers per node
# (trainer_c through libscape), SCAPE at rho 0.1.  The job's output must show
# every trainer of every node finishing with the same parameters and a loss
# that fell.  Usage: tests/slurm/template.sh BUILD_DIR [TRAINERS]   (root)
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
export SCAPE_COORD_HOST=127.0.0.1 SCAPE_LISTEN_HOST=127.0.0.1 TRAINERS_PER_NODE=$trainers
export SCAPE_RDV_PORT=$((30000 + RANDOM % 2000)) SCAPE_DATA_PORT=$((32000 + RANDOM % 2000))
export SCAPE_ARGS="--rho 0.1 --warmup 5 --comm-timeout-ms 60000"
export TRAINER_CMD="$build/tests/integration/trainer_c --n 4000 --steps $steps"
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
echo "template: 4 nodes x $trainers trainers, identical parameters, loss falling: ok"
