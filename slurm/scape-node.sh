#!/usr/bin/env bash
# scape-node.sh - the per-node half of the sbatch templates, run by srun on
# every node of the job:
#   scape-node.sh daemon        exec this node's scaped (job shape from Slurm)
#   scape-node.sh wait SECONDS  until this node's scaped answers (rendezvous done)
#   scape-node.sh run CMD...    exec CMD as one trainer, with the launch
#                               environment below
#   scape-node.sh checkpoint S  checkpoint after the next step; wait up to S seconds
#   scape-node.sh state         print this node's name and its scaped's state
#                               (broken: it lost another daemon part-way through
#                               a step; gone: no scaped answers)
#   scape-node.sh stop          print what this node's scaped sent on its data
#                               plane, then ask it to shut down
# Settings come from the environment:
#   SCAPE_BIN         directory of scaped and scapectl     (default: found on PATH)
#   SCAPE_RUN_BASE    where per-node runtime dirs go        (default: /tmp)
#   SCAPE_COORD_HOST  host of rank 0's rendezvous           (default: the address Slurm
#                     has for the job's first node, its NodeAddr, which is its
#                     name unless slurm.conf says otherwise)
#   SCAPE_RDV_PORT    its port            (default: 20000 + SLURM_JOB_ID % 10000)
#   SCAPE_LISTEN_HOST this node's address for the data plane (default: first of hostname -I)
#   SCAPE_LISTEN_IFACE or the interface whose IPv4 address to use, e.g. ib0
#   SCAPE_DATA_PORT   data-plane port, plus the rank  (default: any free port,
#                     which the rendezvous publishes)
#   SCAPE_ARGS        further scaped flags (--rho 0.01 --trainers 2 ...)
#   SCAPE_CHECKPOINT_DIR, SCAPE_RESUME  read by scaped itself (checkpoint_dir, resume)
#
# The launch environment of `run` (a task of an srun step with one task per
# trainer), the same as scape-run gives its trainers:
#   RANK=SLURM_PROCID  WORLD_SIZE=the step's tasks  LOCAL_RANK=SLURM_LOCALID
#   LOCAL_WORLD_SIZE=the step's tasks on this node  NODE_RANK=SLURM_NODEID
#   SCAPE_INDEX=SLURM_LOCALID (the trainer's slot)  SCAPE_RUNTIME_DIR, SCAPE_ENDPOINT
# and no MASTER_ADDR or MASTER_PORT: with them, frameworks start
# torch.distributed and all-reduce the gradients besides scaped.
set -euo pipefail
case "${1:-}" in
-h|--help)  # the comment above
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    exit 0 ;;
--version)  # the scaped it runs says the version
    s=$(if [ -n "${SCAPE_BIN:-}" ]; then echo "$SCAPE_BIN/scaped"; else command -v scaped || true; fi)
    if [ -n "$s" ] && v=$("$s" --version 2>/dev/null | head -n 1); then
        echo "scape-node.sh (${v:-scaped, version unknown})"
    else
        echo "scape-node.sh (no scaped found: set SCAPE_BIN or PATH)"
    fi
    exit 0 ;;
esac
: "${SLURM_JOB_ID:?run me inside a Slurm job step}"
node=${SLURMD_NODENAME:-$(hostname -s)}
export SCAPE_RUNTIME_DIR="${SCAPE_RUN_BASE:-/tmp}/scape-job${SLURM_JOB_ID}-${node}"
bin() { if [ -n "${SCAPE_BIN:-}" ]; then echo "$SCAPE_BIN/$1"; else command -v "$1"; fi; }

node_addr() {  # a node's address as Slurm knows it (NodeAddr), or its name
    local a
    a=$(scontrol show node "$1" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2) || a=""
    echo "${a:-$1}"
}

status_json() { "$(bin scapectl)" --timeout-ms 5000 status --json 2>/dev/null; }

daemon() {
    : "${SLURM_PROCID:?}" "${SLURM_NTASKS:?}"
    local nodes first coord host listen
    nodes=${SLURM_STEP_NODELIST:-$SLURM_JOB_NODELIST}
    first=$(scontrol show hostnames "$nodes" | head -n 1)
    # as scaped's own Slurm default: two jobs that share a first node do not
    # want the same port
    coord="tcp://${SCAPE_COORD_HOST:-$(node_addr "$first")}:${SCAPE_RDV_PORT:-$((20000 + SLURM_JOB_ID % 10000))}"
    if [ -n "${SCAPE_LISTEN_IFACE:-}" ]; then
        host=$(ip -o -4 addr show dev "$SCAPE_LISTEN_IFACE" | awk '{ split($4, a, "/"); print a[1]; exit }')
        [ -n "$host" ] || { echo "scape-node: no IPv4 address on $SCAPE_LISTEN_IFACE" >&2; exit 1; }
    else
        host=${SCAPE_LISTEN_HOST:-$(hostname -I | awk '{print $1}')}
    fi
    if [ -n "${SCAPE_DATA_PORT:-}" ]; then
        listen="tcp://${host}:$((SCAPE_DATA_PORT + SLURM_PROCID))"
    else
        listen="tcp://${host}:*"
    fi
    # shellcheck disable=SC2086  # SCAPE_ARGS is a list of flags
    exec "$(bin scaped)" --world "$SLURM_NTASKS" --rank "$SLURM_PROCID" --job "$SLURM_JOB_ID" \
         --coordinator "$coord" --listen "$listen" ${SCAPE_ARGS:-}
}

tasks_on_node() {  # Slurm's tasks-per-node list ("2(x3),1"), a node id: its count
    local item i=0 n r
    local -a items
    IFS=, read -r -a items <<<"$1"
    for item in "${items[@]}"; do
        if [[ $item =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
            n=${BASH_REMATCH[1]} r=${BASH_REMATCH[2]}
        else
            n=$item r=1
        fi
        if [ "$2" -lt $((i + r)) ]; then echo "$n"; return 0; fi
        i=$((i + r))
    done
    return 1
}

launch_env() {
    : "${SLURM_PROCID:?}" "${SLURM_LOCALID:?}" "${SLURM_NODEID:?}"
    local ntasks=${SLURM_STEP_NUM_TASKS:-${SLURM_NTASKS:?}} here
    here=$(tasks_on_node "${SLURM_STEP_TASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-}}" "$SLURM_NODEID") ||
        here=${SLURM_NTASKS_PER_NODE:?Slurm set neither SLURM_STEP_TASKS_PER_NODE nor SLURM_NTASKS_PER_NODE}
    export RANK=$SLURM_PROCID WORLD_SIZE=$ntasks LOCAL_RANK=$SLURM_LOCALID \
           LOCAL_WORLD_SIZE=$here NODE_RANK=$SLURM_NODEID SCAPE_INDEX=$SLURM_LOCALID \
           SCAPE_ENDPOINT="ipc://$SCAPE_RUNTIME_DIR/control"
    unset MASTER_ADDR MASTER_PORT
}

wait_ready() {
    local deadline=$((SECONDS + ${1:-120}))
    until "$(bin scapectl)" --timeout-ms 2000 status >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "scape-node: scaped on $node did not answer within ${1:-120} s" \
                 "(runtime dir $SCAPE_RUNTIME_DIR)" >&2
            exit 1
        fi
        sleep 1
    done
}

case "${1:-}" in
daemon) daemon ;;
wait) wait_ready "${2:-120}" ;;
run) shift; launch_env; exec "$@" ;;
checkpoint) "$(bin scapectl)" --timeout-ms 5000 checkpoint --wait \
               --wait-ms "$((${2:-240} * 1000))" ;;
state) st=$(status_json | grep -o '"state":"[a-z_]*"' | head -n 1 | cut -d'"' -f4) || st=""
       echo "$node ${st:-gone}" ;;
stop) # a lone daemon has no data plane: nothing to print
      if st=$(status_json); then
          ep=$(echo "$st" | grep -o '"data_endpoint":"[^"]*"' | cut -d'"' -f4) || ep=""
          tx=$(echo "$st" | grep -o '"data_sent_bytes":[0-9]*' | cut -d: -f2) || tx=""
          rx=$(echo "$st" | grep -o '"data_recv_bytes":[0-9]*' | cut -d: -f2) || rx=""
          [ -z "$tx" ] || echo "scape-node: $node: data plane ${ep:-?} sent $tx B, received $rx B"
      fi
      "$(bin scapectl)" --timeout-ms 5000 shutdown >/dev/null || true ;;
*) echo "usage: scape-node.sh daemon | wait SECONDS | run CMD... | checkpoint SECONDS | state | stop" >&2
   exit 64 ;;
esac
