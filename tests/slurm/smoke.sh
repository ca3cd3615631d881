#!/usr/bin/env bash
# Smoke test of the local 4-node Slurm cluster (deploy/slurm-cluster.sh):
# starts it in a private state directory, runs an srun and an `sbatch --wait`
# job across n1-n4, checks ranks / task count / node list and, when the
# cluster runs on test hosts, that each node's tasks run inside its own host
# (its network namespace, its 10.231.0.x address on eth0), and always stops
# the cluster again.  Without test hosts the cluster falls back to loopback
# and the host check is skipped with the reason.  Exit 0 on success.
# Usage: bash tests/slurm/smoke.sh     (root; Debian packages munge slurmctld
#                                       slurmd slurm-client, see deploy/setup.sh)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cluster=$root/deploy/slurm-cluster.sh
t0=$(date +%s)

fail() { echo "smoke: FAIL: $*" >&2; exit 1; }

# Long commands run in the background and are waited for, so that a signal
# (a CI timeout) runs the cleanup at once instead of after the command ends.
child=""
run_bg() {  # command... ; runs it, returns its status
  "$@" &
  child=$!
  local rc=0
  wait "$child" || rc=$?
  child=""
  return $rc
}

DIR=$(mktemp -d /tmp/scape-slurm-smoke.XXXXXX)
cleanup() {
  local rc=$? f
  trap - EXIT INT TERM
  set +e
  if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null; wait "$child" 2>/dev/null; fi
  if [ $rc -ne 0 ] && [ -d "$DIR/log" ]; then
    for f in "$DIR"/log/*.log; do
      echo "----- tail $f" >&2
      tail -n 15 "$f" >&2
    done
  fi
  bash "$cluster" stop "$DIR" || rc=1
  rm -rf "$DIR"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

run_bg bash "$cluster" start "$DIR"
export SLURM_CONF=$DIR/slurm.conf
cenv() { sed -n "s/^$1=//p" "$DIR/cluster.env" | tr -d '"'; }
net=$(cenv SCAPE_SLURM_NET)
iface=$(cenv SCAPE_SLURM_IFACE)
read -r -a addrs <<<"$(cenv SCAPE_SLURM_NODE_ADDRS)"
[ ${#addrs[@]} -eq 4 ] || fail "cluster.env lists ${#addrs[@]} node addresses"
[ "$net" != hosts ] || export PATH=$DIR/client:$PATH
echo "smoke: cluster up after $(($(date +%s) - t0)) s, network $net"

# ---- 1. interactive srun across the four nodes; each task says where it runs
# shellcheck disable=SC2016  # expanded by the task's shell
run_bg timeout 60 srun -N4 -n4 --time=1 bash -c \
  'echo "$SLURMD_NODENAME $(ip -o -4 addr show dev '"$iface"' | awk "{print \$4; exit}") $(ip netns identify) $(hostname)"' \
  >"$DIR/srun.out" || { cat "$DIR/srun.out" >&2; fail "srun -N4 -n4 failed"; }
out=$(cat "$DIR/srun.out")
sed 's/^/smoke: srun: /' "$DIR/srun.out"
nodes=$(echo "$out" | awk '{print $1}' | sort | tr '\n' ' ')
[ "$nodes" = "n1 n2 n3 n4 " ] || fail "srun ran on '$nodes', expected 'n1 n2 n3 n4 '"
if [ "$net" = hosts ]; then
  hname=$(cenv SCAPE_SLURM_HOSTS_NAME)
  for i in 0 1 2 3; do
    want="n$((i + 1)) ${addrs[i]}/24 $hname-h$i"
    echo "$out" | grep -q "^$want " || fail "n$((i + 1)) did not run on its host ($want)"
  done
  echo "smoke: every node's task ran on its own test host (${addrs[*]} on $iface)"
else
  echo "smoke: SKIP the test-host check: the cluster runs on loopback ($(cenv SCAPE_SLURM_NET_WHY))"
fi

# ---- 2. batch job (sbatch --wait) with one step of one task per node
job=$DIR/job.sh
cat >"$job" <<'EOF'
#!/bin/bash
srun --ntasks-per-node=1 bash -c 'echo $SLURM_PROCID $SLURM_NTASKS $SLURM_JOB_NODELIST'
EOF
outf=$DIR/job.out
run_bg timeout 90 sbatch -N4 --time=1 --wait -o "$outf" -e "$outf" "$job" ||
  { cat "$outf" >&2 2>/dev/null || true; fail "sbatch -N4 --wait job failed"; }
[ -s "$outf" ] || fail "batch job wrote no output ($outf)"
sed 's/^/smoke: sbatch: /' "$outf"

ranks=$(awk '{print $1}' "$outf" | sort -n | tr '\n' ' ')
[ "$ranks" = "0 1 2 3 " ] || fail "ranks '$ranks', expected '0 1 2 3 '"
ntasks=$(awk '{print $2}' "$outf" | sort -u | tr '\n' ' ')
[ "$ntasks" = "4 " ] || fail "SLURM_NTASKS '$ntasks', expected 4"
nodelist=$(awk '{print $3}' "$outf" | sort -u)
[ "$(echo "$nodelist" | wc -l)" -eq 1 ] || fail "tasks disagree on the node list: $nodelist"
expanded=$(scontrol show hostnames "$nodelist" | sort | tr '\n' ' ')
[ "$expanded" = "n1 n2 n3 n4 " ] || fail "node list '$nodelist' expands to '$expanded', expected n1..n4"

echo "smoke: PASS in $(($(date +%s) - t0)) s (before stop)"
