#!/usr/bin/env bash
# The generic sbatch template on the local 4-node Slurm cluster: one scaped
# per node (4 daemons, host backend), TRAINERS trainers per node (trainer_c
# through libscape), SCAPE at rho 0.1.  The job's output must show every
# trainer of every node finishing with the same parameters and a loss that
# fell.  No port is configured: rank 0's rendezvous port follows the job id
# and every data plane takes a free port.
#
# Where the cluster runs on test hosts (deploy/slurm-cluster.sh, network
# namespaces at 10.231.0.1..4), each daemon's data plane must be on its
# node's address and each node's interface must have carried at least what
# its daemon counted on its data plane; with `requeue`, a link cut for less
# than the timeout must leave a job bitwise undisturbed, and a link cut for
# longer must get the other daemons to name the lost one within the timeout,
# the job requeued and resumed from its last checkpoint, bitwise equal to the
# uninterrupted job.  On loopback (no namespaces here) those checks are
# skipped with the reason.
# Usage: tests/slurm/template.sh BUILD_DIR [TRAINERS [requeue|pair]]   (root)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "$1" && pwd)
trainers=${2:-2}
cluster=$root/deploy/slurm-cluster.sh
DIR=$(mktemp -d /tmp/scape-slurm-tpl.XXXXXX)
failed=""    # the failure, said again after the logs (CI shows the end of the output)
fail() { failed="template: FAIL: $*"; echo "$failed" >&2; exit 1; }
cut_host=""  # a test host whose link is down now, restored by the cleanup
stray=""     # a scaped started by the test, stopped by the cleanup
cleanup() {
  local rc=$?
  trap - EXIT
  set +e
  [ -n "$cut_host" ] && bash "$root/deploy/hosts.sh" restore "$cut_host" --name "$hname" >/dev/null
  [ -n "$stray" ] && kill "$stray" 2>/dev/null
  [ "$rc" -ne 0 ] && [ -f "$DIR/job.out" ] && tail -n 40 "$DIR/job.out" >&2
  [ "$rc" -ne 0 ] && [ -f "$DIR/requeue.out" ] && tail -n 60 "$DIR/requeue.out" >&2
  for f in "$DIR"/pair-*.out "$DIR"/cut-*.out "$DIR"/vista.out "$DIR"/srun.out "$DIR"/torch-*.out \
           "$DIR"/killed.out; do
    [ "$rc" -ne 0 ] && [ -f "$f" ] && { echo "----- $f" >&2; tail -n 40 "$f" >&2; }
  done
  if [ "$rc" -ne 0 ]; then  # what Slurm itself said, for failures it had a hand in
    for f in "$DIR"/log/slurmctld.log "$DIR"/log/slurmd-*.log; do
      [ -f "$f" ] && { echo "----- tail $f" >&2; tail -n 30 "$f" >&2; }
    done
    # a node that stopped answering (seen once: n2 DOWN after a requeue):
    # what Slurm says of each node, whether its slurmd still lives, its link
    echo "----- nodes, slurmd processes, links" >&2
    timeout 10 scontrol show nodes 2>&1 | grep -E "NodeName=|State=|Reason=" >&2
    ps -eo pid,stat,etime,args | grep "[s]lurmd -N" >&2
    for i in 0 1 2 3; do
      [ -n "${hname:-}" ] || break
      ip -br -n "$hname-h$i" link show 2>&1 | sed "s/^/$hname-h$i: /" >&2
    done
  fi
  bash "$cluster" stop "$DIR" >/dev/null
  rm -rf "$DIR"
  [ -n "$failed" ] && echo "$failed (the logs above)" >&2
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

bash "$cluster" start "$DIR" >/dev/null || fail "the cluster did not start"
export SLURM_CONF=$DIR/slurm.conf
cenv() { sed -n "s/^$1=//p" "$DIR/cluster.env" | tr -d '"'; }
net=$(cenv SCAPE_SLURM_NET)
hname=$(cenv SCAPE_SLURM_HOSTS_NAME)
read -r -a addrs <<<"$(cenv SCAPE_SLURM_NODE_ADDRS)"
[ ${#addrs[@]} -eq 4 ] || fail "cluster.env lists ${#addrs[@]} node addresses"
if [ "$net" = hosts ]; then
  export PATH=$DIR/client:$PATH  # the client commands, run on the controller's host
  echo "template: cluster on test hosts $hname-h0..h3 (${addrs[*]}), links $(cenv SCAPE_SLURM_RATE)"
else
  echo "template: cluster on loopback ($(cenv SCAPE_SLURM_NET_WHY))"
fi
counters() {  # node index i: sets tx and rx to the bytes through its eth0 so far
  local d=/sys/class/net/eth0/statistics v
  v=$(ip netns exec "$hname-h$1" cat "$d/tx_bytes" "$d/rx_bytes" | tr '\n' ' ') ||
    fail "cannot read the counters of $hname-h$1"
  read -r tx rx <<<"$v"
  [[ "$tx" =~ ^[0-9]+$ && "$rx" =~ ^[0-9]+$ ]] || fail "unreadable counters of $hname-h$1: $v"
}
# scaped and scapectl from the build tree, where scape-node.sh looks for them
mkdir -p "$DIR/bin"
ln -s "$build/daemon/scaped" "$build/client/scapectl" "$DIR/bin/"
steps=150
export SCAPE_HOME=$root SCAPE_BIN=$DIR/bin SCAPE_RUN_BASE=$DIR READY_TIMEOUT=60
# The coordinator: the first node's address as Slurm has it (scape-node.sh's
# default); the data plane: the node's address on its interface.
SCAPE_LISTEN_IFACE=$(cenv SCAPE_SLURM_IFACE)
export SCAPE_LISTEN_IFACE TRAINERS_PER_NODE=$trainers
unset SCAPE_RDV_PORT SCAPE_DATA_PORT SCAPE_COORD_HOST SCAPE_LISTEN_HOST
# The cluster's own munged (not at munge's default socket): the daemons
# authenticate their rendezvous with it and run CURVE between them, as on
# Vista (where auth auto finds munged at its default socket).
export SCAPE_AUTH=munge SCAPE_MUNGE_SOCKET=$DIR/munge/munge.socket.2
export SCAPE_ARGS="--rho 0.1 --warmup 5 --comm-timeout-ms 60000"
export TRAINER_CMD="$build/tests/integration/trainer_c --n 4000 --steps $steps"
export SCAPE_CHECKPOINT_DIR=$DIR/ckpt-plain
if [ "$net" = hosts ]; then for i in 0 1 2 3; do counters "$i"; cnt0[i]="$tx $rx"; done; fi
timeout 300 sbatch --wait --nodes=4 --output="$DIR/job.out" --export=ALL \
  "$root/slurm/generic.sbatch" >/dev/null || fail "the job failed"
if [ "$net" = hosts ]; then for i in 0 1 2 3; do counters "$i"; cnt1[i]="$tx $rx"; done; fi

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

# On test hosts: every daemon's data plane on its own node's address, and
# each node's eth0 carried at least what its daemon counted on the data
# plane (the interface also carries Slurm's own messages and the headers).
if [ "$net" = hosts ]; then
  for i in 0 1 2 3; do
    line=$(grep "scape-node: n$((i + 1)): data plane" "$DIR/job.out") ||
      fail "n$((i + 1)) did not report its data plane"
    [[ "$line" =~ data\ plane\ tcp://([0-9.]+):[0-9]+\ sent\ ([0-9]+)\ B,\ received\ ([0-9]+)\ B ]] ||
      fail "unreadable data-plane line: $line"
    ep=${BASH_REMATCH[1]} sent=${BASH_REMATCH[2]} recvd=${BASH_REMATCH[3]}
    [ "$ep" = "${addrs[i]}" ] || fail "n$((i + 1))'s data plane is on $ep, not ${addrs[i]}"
    read -r tx0 rx0 <<<"${cnt0[i]}"
    read -r tx1 rx1 <<<"${cnt1[i]}"
    tx=$((tx1 - tx0)) rx=$((rx1 - rx0))
    echo "template: n$((i + 1)) ${addrs[i]}: eth0 sent $tx B, received $rx B;" \
         "its daemon's data plane sent $sent B, received $recvd B"
    if [ "$sent" -eq 0 ] || [ "$recvd" -eq 0 ]; then fail "n$((i + 1))'s daemon moved no data"; fi
    if [ "$tx" -lt "$sent" ] || [ "$rx" -lt "$recvd" ]; then
      fail "n$((i + 1))'s eth0 carried less than its daemon's data plane"
    fi
  done
  echo "template: the daemons talked over the hosts' interfaces (10.231.0.x): ok"
fi

# Two jobs at the same time, as two jobs sharing nodes would be (on loopback
# every node of this cluster is this one machine, so they share every
# address; on test hosts they share the nodes Slurm gives both): each finds
# its own daemons, and both end with the same parameters.
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
  where=$(for id in "${ids[@]}"; do
            scontrol show job "$id" | grep -o " NodeList=[^ ]*" | cut -d= -f2; done | tr '\n' ' ')
  echo "template: two 2-node jobs at once (on nodes ${where% }), each met its own daemons," \
       "the same parameters: ok"
fi
# vista.sbatch on this cluster: its Vista defaults where they can be checked
# here.  There is no Lmod here: a `module` command on PATH stands in for it
# and notes when it runs; a job on Vista itself has not been run.  The
# checkpoints must land in $SCRATCH, the trainers must run the python3 of
# SCAPE_PYTHON_ENV (activated after the module load), and without ib0 the
# data plane is on the first address of `hostname -I` (the node's).
if [ "${3:-}" = pair ]; then
  /usr/bin/python3 -m venv --without-pip --system-site-packages "$DIR/venv" ||
    fail "cannot make a virtual environment"
  # shellcheck disable=SC2016  # expanded by the trainer's shell
  printf '#!/bin/bash\necho "vista trainer: python3=$(command -v python3)"\nexec %s\n' \
    "$build/tests/integration/trainer_c --n 4000 --steps 60" >"$DIR/vista-trainer.sh"
  chmod +x "$DIR/vista-trainer.sh"
  mkdir -p "$DIR/scratch" "$DIR/lmod"
  printf '#!/bin/sh\necho "vista: module $*"\n' >"$DIR/lmod/module"
  chmod +x "$DIR/lmod/module"
  (unset SCAPE_LISTEN_IFACE SCAPE_CHECKPOINT_DIR
   PATH=$DIR/lmod:$PATH SCRATCH=$DIR/scratch SCAPE_PYTHON_ENV=$DIR/venv TRAINER_CMD=$DIR/vista-trainer.sh \
   SCAPE_ARGS="--rho 0.1 --warmup 5 --checkpoint-every 30" \
   timeout 300 sbatch --wait --nodes=2 --partition=debug --output="$DIR/vista.out" \
     --export=ALL "$root/slurm/vista.sbatch" >/dev/null) || fail "the vista.sbatch job failed"
  out=$DIR/vista.out
  grep -q "^vista: module load gcc cuda python3" "$out" || fail "vista.sbatch loaded no modules"
  [ "$(grep -n -m 1 "^vista: module load" "$out" | cut -d: -f1)" -lt \
    "$(grep -n -m 1 "scape: trainers use $DIR/venv/bin/python3" "$out" | cut -d: -f1)" ] ||
    fail "SCAPE_PYTHON_ENV was not activated after the module load"
  [ "$(grep -c "^vista trainer: python3=$DIR/venv/bin/python3$" "$out" || true)" -eq 2 ] ||
    fail "the trainers did not run the venv's python3"
  grep -q "scape: data plane on the first address of hostname -I" "$out" ||
    fail "vista.sbatch chose a data-plane interface where there is no ib0"
  [ "$(grep -c "steps 1..60 done" "$out" || true)" -eq 2 ] || fail "the vista.sbatch trainers did not finish"
  ls -d "$DIR"/scratch/scape-ckpt-*/step-60 >/dev/null 2>&1 ||
    fail "no checkpoint in \$SCRATCH/scape-ckpt-<job id> ($(ls "$DIR/scratch"))"
  echo "template: vista.sbatch (module stand-in, no ib0): modules, then SCAPE_PYTHON_ENV," \
       "checkpoints in \$SCRATCH, data plane on the node's address: ok"
fi
[ "${3:-}" = requeue ] || exit 0

# The same job, slowed down, gets SIGUSR1 part-way (as --signal=B:USR1@300
# would send it), checkpoints, is requeued, resumes, and must end with the
# uninterrupted job's parameters, bit for bit.  In between, the requeued run
# finds node n3 unsettled: an earlier scaped (a real one) still holds n3's
# runtime dir, so n3's daemon refuses to start; that run must be requeued
# again, and the next one (the stray gone) resumes from the same checkpoint.
plain=$(grep -o "params [0-9a-f]*" "$DIR/job.out" | sort -u)
export SCAPE_CHECKPOINT_DIR=$DIR/ckpt-requeue
export TRAINER_CMD="$TRAINER_CMD --sleep-ms 40"
grep_wait() {  # pattern, seconds: until the job's output has it
  local deadline=$((SECONDS + $2))
  until grep -q "$1" "$DIR/requeue.out" 2>/dev/null; do
    [ "$SECONDS" -lt "$deadline" ] || fail "no '$1' in the job's output within $2 s"
    sleep 0.2
  done
}
job=$(sbatch --parsable --nodes=4 --output="$DIR/requeue.out" --open-mode=append \
      --export=ALL "$root/slurm/generic.sbatch") || fail "sbatch refused the job"
grep_wait "scape: every daemon is up" 120
sleep 2
scancel --signal=USR1 --batch "$job" || fail "scancel --signal=USR1 failed"
grep_wait "checkpoint written; requeueing" 60
# the stray takes n3's runtime dir as soon as the first run's daemon leaves it
# (the requeued run waits cred_expire, 15 s, before it starts)
stray_dir=$DIR/scape-job$job-n3 deadline=$((SECONDS + 30))
while :; do
  env -u SCAPE_CHECKPOINT_DIR -u SCAPE_RESUME "$build/daemon/scaped" --runtime_dir "$stray_dir" \
    --world 1 --trainers 1 --log_level warn >>"$DIR/stray.log" 2>&1 &
  stray=$!
  # it holds the dir once its pid is in scaped.pid and its control socket
  # (bound last) is there; a stray still starting after 0.5 s may yet fail
  # on the first run's lock, so alive alone is not enough
  for _ in $(seq 50); do
    kill -0 "$stray" 2>/dev/null || break
    [ "$(head -n 1 "$stray_dir/scaped.pid" 2>/dev/null)" = "$stray" ] &&
      [ -S "$stray_dir/control" ] && break 2
    sleep 0.1
  done
  kill "$stray" 2>/dev/null || true
  wait "$stray" 2>/dev/null || true
  stray=""
  [ "$SECONDS" -lt "$deadline" ] || fail "the first run's daemon on n3 kept its runtime dir for 30 s" \
    "($(tail -n 3 "$DIR/stray.log" | tr '\n' ' '))"
done
grep_wait "run 1 of job $job could not start its daemons" 120
# srun forwards the daemon's stderr on its own; give it a few seconds
named="another scaped (pid $stray) is serving '$stray_dir'"
for _ in $(seq 50); do grep -qF "$named" "$DIR/requeue.out" && break; sleep 0.2; done
grep -qF "$named" "$DIR/requeue.out" ||
  fail "n3's daemon did not name the stray scaped (pid $stray) that held its runtime dir;" \
    "the job said: $(grep -E "error|refused|another scaped|could not" "$DIR/requeue.out" |
                     tail -n 6 | tr '\n' '|')"
kill "$stray" 2>/dev/null
wait "$stray" 2>/dev/null || true
stray=""
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
[ "${restarts:-0}" -ge 2 ] || fail "the job was not requeued twice (Restarts=${restarts:-0})"
grep -q "run 2 of job $job resumes from" "$DIR/requeue.out" || fail "the third run did not resume"
first=$(grep -o "steps [0-9]*..$steps done" "$DIR/requeue.out" | sort -u)
[ "$(echo "$first" | wc -l)" -eq 1 ] || fail "trainers resumed at different steps: $first"
case "$first" in "steps 1..$steps done") fail "the trainers started over at step 1" ;; esac
resumed=$(grep -o "params [0-9a-f]*" "$DIR/requeue.out" | sort -u)
[ "$(echo "$resumed" | wc -l)" -eq 1 ] || fail "the resumed trainers differ"
[ "$resumed" = "$plain" ] || fail "resumed $resumed, uninterrupted $plain"
echo "template: SIGUSR1 -> checkpoint -> requeue -> n3 unsettled (a stray scaped), requeued again ->" \
     "resume ($first), parameters equal to the uninterrupted job: ok"

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

# ---- A PyTorch trainer through the template (2 nodes x 2 trainers):
# client/examples/torch_train.py with its own state_dict checkpoints
# (--save-every), in a virtual environment the template activates
# (SCAPE_PYTHON_ENV).  Every trainer must get its launch environment from
# Slurm's variables (RANK = SLURM_PROCID, NODE_RANK = its node's place in
# the job, WORLD_SIZE 4, no MASTER_ADDR) and a first batch of its own; one
# trainer saves; and a time-limit requeue (SIGUSR1 after the trainers' first
# saves) must end bitwise where the uninterrupted job does.
# The wrapper gives each trainer its own --out, and rank 0 the --save path
# itself; every other rank gets a symlink to it: it reads rank 0's file as
# with one shared path, but a save of its own (a .tmp renamed over the link)
# would leave a regular file or a .tmp behind.
t_case=$SECONDS
tsteps=200
bash "$root/client/examples/fortunes-corpus.sh" "$DIR/fortunes.txt" >/dev/null ||
  fail "no corpus for torch_train.py (the Debian package fortunes)"
head -c 300000 "$DIR/fortunes.txt" >"$DIR/corpus.txt"
/usr/bin/python3 -m venv --without-pip --system-site-packages "$DIR/venv" ||
  fail "cannot make a virtual environment"
cat >"$DIR/torch-trainer.sh" <<EOF
#!/bin/bash
# torch-trainer.sh RUN: one trainer of the test's run RUN
set -eu
d=$DIR/\$1
mkdir -p "\$d/view-rank\$RANK"
save=\$d/save.pt
if [ "\$RANK" != 0 ]; then
  ln -sfn "\$save" "\$d/view-rank\$RANK/save.pt"
  save=\$d/view-rank\$RANK/save.pt
fi
echo "launch env \$SLURMD_NODENAME RANK=\$RANK WORLD_SIZE=\$WORLD_SIZE LOCAL_RANK=\$LOCAL_RANK" \\
     "LOCAL_WORLD_SIZE=\$LOCAL_WORLD_SIZE NODE_RANK=\$NODE_RANK SCAPE_INDEX=\$SCAPE_INDEX" \\
     "MASTER_ADDR=\${MASTER_ADDR-unset} python3=\$(command -v python3)"
exec python3 $root/client/examples/torch_train.py --corpus $DIR/corpus.txt --steps $tsteps \\
  --d 32 --layers 1 --heads 2 --ctx 32 --batch 4 --eval-every 100000 --eval-windows 4 \\
  --save-every 20 --save "\$save" --out "\$d/params-rank\$RANK.bin"
EOF
chmod +x "$DIR/torch-trainer.sh"
torch_job() {  # run, then sbatch's options
  local run=$1
  shift
  TRAINER_CMD="$DIR/torch-trainer.sh $run" TRAINERS_PER_NODE=2 SCAPE_PYTHON_ENV=$DIR/venv \
    SCAPE_CHECKPOINT_DIR=$DIR/ckpt-$run SCAPE_ARGS="--rho 0.1 --warmup 5 --comm-timeout-ms 60000" \
    SCAPE_BUILD_DIR=$build timeout 300 sbatch --nodes=2 --output="$DIR/$run.out" --export=ALL "$@" \
    "$root/slurm/generic.sbatch"
}
params_of() {  # run: the one sha256 of its trainers' final parameters
  local h
  [ "$(find "$DIR/$1" -name 'params-rank*.bin' | wc -l)" -eq 4 ] ||
    fail "$1: not 4 trainers wrote parameters"
  h=$(sha256sum "$DIR/$1"/params-rank*.bin | awk '{print $1}' | sort -u)
  [ "$(echo "$h" | wc -l)" -eq 1 ] || fail "$1: the trainers' parameters differ"
  echo "$h"
}
one_saver() {  # run: rank 0's save.pt is there, no other rank saved
  if [ ! -f "$DIR/$1/save.pt" ] || [ -L "$DIR/$1/save.pt" ]; then fail "$1: rank 0 saved no save.pt"; fi
  for r in 1 2 3; do
    [ -L "$DIR/$1/view-rank$r/save.pt" ] || fail "$1: rank $r saved a checkpoint of its own"
  done
  if ls "$DIR/$1"/*.tmp "$DIR/$1"/view-rank*/*.tmp >/dev/null 2>&1; then fail "$1: a .tmp is left"; fi
}
check_env() {  # job output: the 4 trainers' launch environments are right
  # each node's trainers: NODE_RANK = its place in the job's node list, RANK =
  # NODE_RANK * 2 + LOCAL_RANK (Slurm's block distribution), SCAPE_INDEX = LOCAL_RANK
  local tnodes node slot want="" got
  read -r -a tnodes <<<"$(grep -o "^launch env n[0-9]" "$1" | awk '{print $3}' | sort -u | tr '\n' ' ')"
  [ ${#tnodes[@]} -eq 2 ] || fail "$1: the trainers ran on ${tnodes[*]}, not 2 nodes"
  for node in 0 1; do
    for slot in 0 1; do
      want+="${tnodes[node]} RANK=$((node * 2 + slot)) WORLD_SIZE=4 LOCAL_RANK=$slot"
      want+=" LOCAL_WORLD_SIZE=2 NODE_RANK=$node SCAPE_INDEX=$slot MASTER_ADDR=unset;"
    done
  done
  got=$(grep "^launch env " "$1" | sed 's/^launch env //; s/ python3=.*//' | sort -t= -k2n |
        tr '\n' ';')
  [ "$got" = "$want" ] || fail "$1: launch environments: $got; expected $want"
}

# scape-run under srun, one per node (srun --ntasks-per-node=1), 2 trainers
# each, MASTER_ADDR set as a user might have it: the daemons take the job's
# shape from Slurm, the trainers their launch environment from scape-run.
# The node names do not resolve here (they do on a cluster): the coordinator
# is given as the first node's address.
cat >"$DIR/srun-scape-run.sh" <<EOF
#!/bin/bash
set -eu
first=\$(scontrol show hostnames "\$SLURM_JOB_NODELIST" | head -n 1)
addr=\$(scontrol show node "\$first" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
# one trainer: says where it runs and what it got
trainer='echo "launch env \$SLURMD_NODENAME RANK=\$RANK WORLD_SIZE=\$WORLD_SIZE LOCAL_RANK=\$LOCAL_RANK LOCAL_WORLD_SIZE=\$LOCAL_WORLD_SIZE NODE_RANK=\$NODE_RANK SCAPE_INDEX=\$SCAPE_INDEX MASTER_ADDR=\${MASTER_ADDR-unset}"'
PYTHONPATH=$root/client/python SCAPE_BUILD_DIR=$build MASTER_ADDR=10.9.9.9 exec /usr/bin/python3 -m scape.run \\
  --nproc-per-node 2 --set coordinator=tcp://\$addr:\$((20000 + SLURM_JOB_ID % 10000)) \\
  -- bash -c "\$trainer"
EOF
printf '#!/bin/bash\nsrun --ntasks-per-node=1 bash %s\n' "$DIR/srun-scape-run.sh" >"$DIR/srun-job.sh"
timeout 120 sbatch --wait --nodes=2 --output="$DIR/srun.out" --export=ALL "$DIR/srun-job.sh" \
  >/dev/null || fail "the job of two scape-runs under srun failed"
check_env "$DIR/srun.out"
for r in 0 1; do
  grep -q "rendezvous: rank $r of 2" "$DIR/srun.out" || fail "no daemon says rank $r of 2"
done
echo "template: scape-run under srun on 2 nodes x 2 trainers: the daemons took Slurm's shape," \
     "the trainers RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, no MASTER_ADDR: ok"

torch_job torch-plain --wait >/dev/null || fail "the torch job failed"
out=$DIR/torch-plain.out
grep -q "scape: trainers use $DIR/venv/bin/python3" "$out" || fail "SCAPE_PYTHON_ENV was not activated"
[ "$(grep -c "^launch env .* python3=$DIR/venv/bin/python3$" "$out" || true)" -eq 4 ] ||
  fail "not 4 trainers ran the venv's python3"
[ "$(grep -c "torch_train: steps 1..$tsteps done" "$out" || true)" -eq 4 ] ||
  fail "not every torch trainer finished"
check_env "$out"
firsts=$(grep -o "first batch sha256 [0-9a-f]* rank [0-9]*" "$out" | sort -k6n)
[ "$(echo "$firsts" | awk '{print $6}' | tr '\n' ' ')" = "0 1 2 3 " ] ||
  fail "first batches of ranks: $(echo "$firsts" | awk '{print $6}' | tr '\n' ' ')"
[ "$(echo "$firsts" | awk '{print $4}' | sort -u | wc -l)" -eq 4 ] ||
  fail "two trainers had the same first batch: $firsts"
one_saver torch-plain
tplain=$(params_of torch-plain)
echo "template: torch_train.py, 2 nodes x 2 trainers in SCAPE_PYTHON_ENV: RANK, WORLD_SIZE," \
     "LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK from Slurm, 4 distinct first batches," \
     "one saver, equal parameters: ok ($((SECONDS - t_case)) s)"

# The time limit: SIGUSR1 once the trainers saved at step 20 (and after);
# the requeued job's daemons resume from the newer checkpoint the signal
# made, and the trainers go on from there, with rank 0's older save on disk.
t_case=$SECONDS
job=$(torch_job torch-requeue --parsable --open-mode=append) || fail "sbatch refused the torch job"
deadline=$((SECONDS + 120))
until [ -f "$DIR/torch-requeue/save.pt" ] && grep -q "scape: every daemon is up" "$DIR/torch-requeue.out"; do
  [ "$SECONDS" -lt "$deadline" ] || fail "the torch job saved nothing within 120 s"
  sleep 0.2
done
scancel --signal=USR1 --batch "$job" || fail "scancel --signal=USR1 failed"
deadline=$((SECONDS + 240))
while :; do
  state=$(scontrol show job "$job" | grep -o "JobState=[A-Z_]*" | cut -d= -f2)
  case "$state" in
  COMPLETED) break ;;
  FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) fail "the requeued torch job ended $state" ;;
  esac
  [ "$SECONDS" -lt "$deadline" ] || fail "the requeued torch job did not finish (state $state)"
  sleep 1
done
out=$DIR/torch-requeue.out
grep -q "checkpoint written; requeueing" "$out" || fail "the torch job was not requeued"
grep -q "run 1 of job $job resumes from" "$out" || fail "the requeued torch job did not resume"
from=$(grep -o "torch_train: steps [0-9]*..$tsteps done" "$out" | sort -u)
if [ "$(echo "$from" | wc -l)" -ne 1 ] || [ "$(grep -c "$from" "$out")" -ne 4 ]; then
  fail "the torch trainers did not all resume at one step: $from"
fi
case "$from" in "torch_train: steps 1..$tsteps done") fail "the torch trainers started over" ;; esac
one_saver torch-requeue
[ "$(params_of torch-requeue)" = "$tplain" ] || fail "the resumed torch job ended elsewhere"
echo "template: torch_train.py: SIGUSR1 -> checkpoint -> requeue -> resume (${from#torch_train: })," \
     "parameters equal to the uninterrupted job: ok ($((SECONDS - t_case)) s)"

# ---- A daemon killed (SIGKILL, as the OOM killer or a crash would end it)
# in the middle of a job with periodic checkpoints: its trainers fail within
# their bound, the daemons' step ends (the srun of the daemons ends them all),
# and the template requeues the job as for a lost daemon; it resumes from the
# last checkpoint and ends with the uninterrupted job's parameters, bit for bit.
t_case=$SECONDS
export SCAPE_CHECKPOINT_DIR=$DIR/ckpt-killed
job=$(SCAPE_ARGS="$SCAPE_ARGS --checkpoint-every 20" sbatch --parsable --nodes=4 \
      --output="$DIR/killed.out" --export=ALL "$root/slurm/generic.sbatch") ||
  fail "sbatch refused the killed-daemon job"
deadline=$((SECONDS + 120))
until [ -f "$SCAPE_CHECKPOINT_DIR/LATEST" ] && [ "$(cat "$SCAPE_CHECKPOINT_DIR/LATEST")" != step-20 ]; do
  [ "$SECONDS" -lt "$deadline" ] || fail "the killed-daemon job made no second checkpoint in 120 s"
  sleep 0.2
done
ckpt=$(cat "$SCAPE_CHECKPOINT_DIR/LATEST")
pid=$(cat "$DIR/scape-job$job-n3/scaped.pid") || fail "no pid file of n3's daemon"
kill -KILL "$pid" || fail "cannot kill n3's daemon (pid $pid)"
t_kill=$SECONDS
deadline=$((SECONDS + 300))
while :; do
  state=$(scontrol show job "$job" | grep -o "JobState=[A-Z_]*" | cut -d= -f2)
  case "$state" in
  COMPLETED) break ;;
  FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) fail "the killed-daemon job ended $state" ;;
  esac
  [ "$SECONDS" -lt "$deadline" ] || fail "the killed-daemon job did not finish (state $state)"
  sleep 0.5
done
# (the reason is the daemons' step that ended, or, when the trainers' step
# ended first, n3's daemon that the others' state calls gone)
grep -q "; requeueing job $job to resume from its last checkpoint" "$DIR/killed.out" ||
  fail "the template did not requeue on the killed daemon"
grep -q "resumes from $SCAPE_CHECKPOINT_DIR/step-" "$DIR/killed.out" ||
  fail "the requeued job did not resume from a checkpoint"
resumed_at=$(grep -o "resumes from $SCAPE_CHECKPOINT_DIR/step-[0-9]*" "$DIR/killed.out" | tail -n 1)
from=$((${resumed_at##*step-} + 1))
[ "$from" -gt "${ckpt#step-}" ] || fail "resumed at step $from, before $ckpt"
[ "$(grep -c "steps $from..$steps done" "$DIR/killed.out" || true)" -eq $((4 * trainers)) ] ||
  fail "not every trainer resumed at step $from and finished"
killed=$(grep -o "params [0-9a-f]*" "$DIR/killed.out" | sort -u)
[ "$killed" = "$plain" ] || fail "after the killed daemon: $killed, uninterrupted $plain"
echo "template: n3's daemon killed after $ckpt -> requeue -> resume (steps $from..$steps)," \
     "parameters equal to the uninterrupted job: ok ($((SECONDS - t_case)) s, of which" \
     "$((SECONDS - t_kill)) s after the kill)"

# ---- A link cut in the middle of a job (test hosts only).  Node n3's link
# (its host's port on the switch) goes down and comes back: the node, its
# slurmd and its daemon stay up, as when a cable or a switch port fails and
# is fixed.
if [ "$net" != hosts ]; then
  echo "template: SKIP the cut-link cases: the cluster runs on loopback" \
       "($(cenv SCAPE_SLURM_NET_WHY)), where no link can be cut"
  exit 0
fi
victim=2  # host h2 = node n3
job_field() { scontrol show job "$1" | grep -o " $2=[^ ]*" | head -n 1 | cut -d= -f2 || true; }
daemon_step() {  # job, node: the last step its daemon finished (empty if it does not answer)
  "$build/client/scapectl" --runtime-dir "$DIR/scape-job$1-$2" --timeout-ms 2000 status --json \
    2>/dev/null | grep -o '"step":[0-9]*' | head -n 1 | cut -d: -f2 || true
}
wait_step() {  # job, step, seconds: until n1's daemon is past that step
  local deadline=$((SECONDS + $3)) st
  while :; do
    st=$(daemon_step "$1" n1)
    [ -n "$st" ] && [ "$st" -ge "$2" ] && return 0
    [ "$SECONDS" -lt "$deadline" ] || fail "job $1 did not reach step $2 within $3 s (at ${st:-?})"
    case "$(job_field "$1" JobState)" in
      PENDING|CONFIGURING|RUNNING) ;;
      *) fail "job $1 ended before step $2" ;;
    esac
    sleep 0.2
  done
}
wait_end() {  # job, seconds: until the job is over; prints its state
  local deadline=$((SECONDS + $2)) st
  while :; do
    st=$(job_field "$1" JobState)
    case "$st" in
      COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) break ;;
    esac
    [ "$SECONDS" -lt "$deadline" ] || fail "job $1 did not end within $2 s (state $st)"
    sleep 0.5
  done
  echo "$st"
}
link() {  # cut|restore
  bash "$root/deploy/hosts.sh" "$1" "$victim" --name "$hname" >/dev/null ||
    fail "deploy/hosts.sh $1 $victim failed"
  if [ "$1" = cut ]; then cut_host=$victim; else cut_host=""; fi
}

# A cut of 2 s, far below the jobs' comm_timeout_ms (60 s), in the middle
# of the job: nothing reaches n3 while it lasts (the cut is real; every step
# needs n3's daemon), then the job goes on and ends as the uninterrupted job
# did, bit for bit, without a requeue.
t_case=$SECONDS
export SCAPE_CHECKPOINT_DIR=$DIR/ckpt-cut-short
job=$(sbatch --parsable --nodes=4 --output="$DIR/cut-short.out" --export=ALL \
      "$root/slurm/generic.sbatch") || fail "sbatch refused the short-cut job"
wait_step "$job" 30 120
at_cut=$(daemon_step "$job" n1)
if [ -z "$at_cut" ] || [ "$at_cut" -ge $((steps - 20)) ]; then
  fail "the job was not in its middle (step ${at_cut:-?})"
fi
link cut
counters "$victim"; rx0=$rx
sleep 2
counters "$victim"; rx1=$rx
link restore
[ "$rx1" = "$rx0" ] || fail "n3 received $((rx1 - rx0)) B while its link was cut"
[ "$(job_field "$job" JobState)" = RUNNING ] || fail "the short-cut job did not run on"
state=$(wait_end "$job" 300)
[ "$state" = COMPLETED ] || fail "the short-cut job ended $state"
[ "$(job_field "$job" Restarts)" = 0 ] || fail "the short-cut job was requeued"
[ "$(grep -c "steps 1..$steps done" "$DIR/cut-short.out" || true)" -eq $((4 * trainers)) ] ||
  fail "not every trainer of the short-cut job finished"
short=$(grep -o "params [0-9a-f]*" "$DIR/cut-short.out" | sort -u)
[ "$short" = "$plain" ] || fail "after a short cut: $short, uninterrupted $plain"
echo "template: n3's link cut for 2 s after step $at_cut (0 B reached it) and restored:" \
     "the job ran on, parameters equal to the uninterrupted job: ok ($((SECONDS - t_case)) s)"

# A cut longer than comm_timeout_ms (10 s here): the other daemons name n3's
# rank within the timeout (their trainers' errors say so); then the link comes
# back (the node returns), the template requeues the job on the lost daemon,
# and the job resumes from its last periodic checkpoint and ends with the
# uninterrupted job's parameters, bit for bit.
tmo=10 t_case=$SECONDS
export SCAPE_CHECKPOINT_DIR=$DIR/ckpt-cut-lost
job=$(SCAPE_ARGS="--rho 0.1 --warmup 5 --comm-timeout-ms $((tmo * 1000)) --checkpoint-every 20" \
      sbatch --parsable --nodes=4 --output="$DIR/cut-lost.out" --export=ALL \
      "$root/slurm/generic.sbatch") || fail "sbatch refused the lost-link job"
wait_step "$job" 50 120
at_cut=$(daemon_step "$job" n1)
[ -f "$SCAPE_CHECKPOINT_DIR/LATEST" ] || fail "no periodic checkpoint by step 50"
rank=$(sed -n "s/.*rendezvous: rank \([0-9]*\) of 4 via .*data plane on tcp:\/\/${addrs[victim]//./\\.}:.*/\1/p" \
       "$DIR/cut-lost.out" | head -n 1)
[ -n "$rank" ] || fail "no daemon says it is on ${addrs[victim]}"
named_re="^trainer_c [0-9]*: step [0-9]*: .*rank ${rank}[^0-9]"
link cut
t_cut=$(date +%s.%N)
deadline=$((SECONDS + tmo + 30))
until grep -q "$named_re" "$DIR/cut-lost.out"; do
  [ "$SECONDS" -lt "$deadline" ] || fail "no trainer named rank $rank within $((tmo + 30)) s of the cut"
  sleep 0.1
done
named=$(awk -v a="$t_cut" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
ckpt=$(cat "$SCAPE_CHECKPOINT_DIR/LATEST")
link restore
echo "template: n3's link cut after step $at_cut; rank $rank named after $named s" \
     "(comm_timeout_ms $((tmo * 1000))): $(grep -m 1 "$named_re" "$DIR/cut-lost.out")"
awk -v s="$named" -v t="$tmo" 'BEGIN { exit !(s <= t + 5) }' ||
  fail "rank $rank was named only after $named s, the timeout is $tmo s"
state=$(wait_end "$job" 300)
[ "$state" = COMPLETED ] || fail "the lost-link job ended $state"
[ "$(job_field "$job" Restarts)" -ge 1 ] || fail "the lost-link job was not requeued"
grep -q "a daemon lost another part-way through a step, or died (.*broken.*); requeueing" "$DIR/cut-lost.out" ||
  fail "the template did not requeue on the lost daemon"
grep -q "resumes from $SCAPE_CHECKPOINT_DIR/$ckpt\$" "$DIR/cut-lost.out" ||
  fail "the requeued job did not resume from $ckpt, the last checkpoint before the cut"
from=$((${ckpt#step-} + 1))
[ "$(grep -c "steps $from..$steps done" "$DIR/cut-lost.out" || true)" -eq $((4 * trainers)) ] ||
  fail "not every trainer resumed at step $from and finished"
lost=$(grep -o "params [0-9a-f]*" "$DIR/cut-lost.out" | sort -u)
[ "$lost" = "$plain" ] || fail "after the lost link: $lost, uninterrupted $plain"
again=$(grep -m 1 "could not start its daemons" "$DIR/cut-lost.out" || true)
echo "template: lost link -> requeue -> resume from $ckpt (steps $from..$steps)," \
     "parameters equal to the uninterrupted job: ok ($((SECONDS - t_case)) s," \
     "$(job_field "$job" Restarts) requeue(s)${again:+; $again})"
