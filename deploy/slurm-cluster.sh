#!/usr/bin/env bash
# A real 4-node Slurm test cluster on this one machine: its own munged, one
# slurmctld and four slurmd (n1..n4, `slurmd -N nX`), all with their config,
# key, sockets, state, logs and pid files inside one state directory.
#
# Usage: deploy/slurm-cluster.sh start|stop|status|restart [DIR]
#        DIR defaults to /tmp/scape-slurm.  After `start`, point the Slurm
#        client commands at the cluster with the printed line:
#            export SLURM_CONF=DIR/slurm.conf
# Env:   SCAPE_SLURM_PORT_BASE   first port to try (default 17817); the
#                                controller and the four slurmd get 5
#                                consecutive free ports from there on
#        SCAPE_SLURM_TIMEOUT     seconds to wait for 4 idle nodes (default 60)
#        SCAPE_SLURM_CRED_EXPIRE credential lifetime, also the delay before a
#                                requeued job may start again (default 15 s)
#
# Installs nothing.  Needs the Debian packages munge, slurmctld, slurmd and
# slurm-client (deploy/setup.sh installs them) and root (SlurmUser=root).
set -euo pipefail

prog=${0##*/}
cmd=${1:-}
DIR=${2:-/tmp/scape-slurm}
NODES=(n1 n2 n3 n4)
TIMEOUT=${SCAPE_SLURM_TIMEOUT:-60}

say() { echo "$prog: $*"; }
die() { echo "$prog: error: $*" >&2; exit 1; }

usage() {
  sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

case "$cmd" in
  start|stop|status|restart) ;;
  -h|--help|help) usage 0 ;;
  *) usage 2 ;;
esac

# The state directory must be absolute: it ends up in slurm.conf.
case "$DIR" in
  /*) ;;
  *) DIR="$(pwd)/$DIR" ;;
esac
DIR=${DIR%/}
CONF=$DIR/slurm.conf
MUNGE_DIR=$DIR/munge
MUNGE_SOCK=$MUNGE_DIR/munge.socket.2
MUNGE_KEY=$MUNGE_DIR/munge.key
MUNGE_PID=$MUNGE_DIR/munged.pid
CTLD_PID=$DIR/run/slurmctld.pid
LOG_DIR=$DIR/log

export SLURM_CONF=$CONF
# a Unix socket path holds at most 107 bytes
[ ${#MUNGE_SOCK} -le 100 ] || die "state directory path too long for the munge socket: $MUNGE_SOCK"

# ---------------------------------------------------------------- prerequisites
check_tools() {
  # tool -> the Debian package that ships it
  local -A pkg_of=(
    [munged]=munge [mungekey]=munge [munge]=munge [unmunge]=munge
    [slurmctld]=slurmctld [slurmd]=slurmd [slurmstepd]=slurmd
    [sinfo]=slurm-client [sbatch]=slurm-client [srun]=slurm-client
    [squeue]=slurm-client [scancel]=slurm-client [scontrol]=slurm-client
  )
  local t missing_tools=() missing_pkgs=()
  for t in munged mungekey munge unmunge slurmctld slurmd slurmstepd \
           sinfo sbatch srun squeue scancel scontrol; do
    if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$t" >/dev/null 2>&1; then
      missing_tools+=("$t")
      [[ " ${missing_pkgs[*]} " == *" ${pkg_of[$t]} "* ]] || missing_pkgs+=("${pkg_of[$t]}")
    fi
  done
  if [ ${#missing_tools[@]} -ne 0 ]; then
    echo "$prog: error: missing ${missing_tools[*]}" >&2
    echo "$prog: install the Debian package(s): ${missing_pkgs[*]}" >&2
    echo "$prog:   apt-get install --no-install-recommends ${missing_pkgs[*]}   (or run deploy/setup.sh)" >&2
    exit 3
  fi
  [ "$(id -u)" -eq 0 ] || die "must run as root (the test cluster uses SlurmUser=root)"
}
PATH="$PATH:/usr/sbin:/sbin"

# ---------------------------------------------------------------- processes
pid_of() {  # pid file -> pid, if that process is alive
  local f=$1 p
  [ -s "$f" ] || return 1
  p=$(tr -dc '0-9' <"$f")
  [ -n "$p" ] && kill -0 "$p" 2>/dev/null || return 1
  echo "$p"
}
slurmd_pidfile() { echo "$DIR/run/slurmd-$1.pid"; }

running_count() {  # how many of our 6 daemons are alive
  local n=0 node
  pid_of "$MUNGE_PID" >/dev/null && n=$((n + 1))
  pid_of "$CTLD_PID" >/dev/null && n=$((n + 1))
  for node in "${NODES[@]}"; do
    pid_of "$(slurmd_pidfile "$node")" >/dev/null && n=$((n + 1))
  done
  echo "$n"
}

# slurmstepd processes of this cluster: they log into our slurmd log files.
# (/proc only: procps may not be installed)
our_stepds() {
  local d fd
  for d in /proc/[0-9]*; do
    [ "$(cat "$d/comm" 2>/dev/null)" = slurmstepd ] || continue
    for fd in "$d"/fd/*; do
      if [[ "$(readlink "$fd" 2>/dev/null)" == "$LOG_DIR/"* ]]; then
        echo "${d#/proc/}"
        break
      fi
    done
  done
}

descendants() {  # pids... -> those pids and all their descendants
  local d
  for d in /proc/[0-9]*; do
    # stat: "pid (comm) state ppid ..."; comm may hold spaces, so cut at the last ')'
    sed -n 's/^\([0-9]*\) .*) [A-Za-z] \([0-9]*\) .*/\1 \2/p' "$d/stat" 2>/dev/null
  done | awk -v roots="$*" '
    { parent[$1] = $2; pids[NR] = $1 }
    END {
      n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1
      do { added = 0
        for (i in pids) { p = pids[i]; if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; added = 1 } }
      } while (added)
      for (p in keep) print p
    }'
}

idle_nodes() {  # number of nodes sinfo reports idle (0 if it cannot tell)
  sinfo -h -o '%T %D' 2>/dev/null | awk '$1 == "idle" { n += $2 } END { print n + 0 }'
}

# ---------------------------------------------------------------- ports
listening_ports() {  # every TCP port something listens on (decimal), v4 and v6
  local f
  for f in /proc/net/tcp /proc/net/tcp6; do
    [ -r "$f" ] && awk 'NR > 1 && $4 == "0A" { split($2, a, ":"); print a[2] }' "$f"
  done | sort -u | while read -r hex; do echo $((16#$hex)); done
}

pick_ports() {  # prints the first of 5 consecutive free ports
  local base=${SCAPE_SLURM_PORT_BASE:-17817} used p ok i
  used=" $(listening_ports | tr '\n' ' ') "
  for ((p = base; p < base + 2000; p += 5)); do
    ok=1
    for ((i = 0; i < 5; i++)); do
      [[ "$used" == *" $((p + i)) "* ]] && { ok=0; break; }
    done
    [ $ok -eq 1 ] && { echo "$p"; return 0; }
  done
  die "no 5 consecutive free TCP ports in $base..$((base + 2000))"
}

# ---------------------------------------------------------------- config
write_conf() {
  local host=$1 port=$2 comm=""
  # Bind slurmd/srun to this host's address only when the host name resolves
  # to loopback (it does on this kind of test machine); slurmctld in Slurm
  # 22.05 always binds every address.
  if getent ahostsv4 "$host" 2>/dev/null | awk '{print $1; exit}' | grep -q '^127\.'; then
    comm="CommunicationParameters=NoInAddrAny"
  fi
  cat >"$CONF.tmp" <<EOF
# Written by deploy/slurm-cluster.sh -- a 4-node test cluster on one host.
ClusterName=scape
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
$comm

AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start
# again (Slurm's default: 120 s); short, for tests of --requeue
AuthInfo=socket=$MUNGE_SOCK,cred_expire=${SCAPE_SLURM_CRED_EXPIRE:-15}

StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info

# no cgroups anywhere
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
SwitchType=switch/none
MpiDefault=none

SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
MaxJobCount=10000
MinJobAge=300
SchedulerParameters=batch_sched_delay=0
KillWait=5
Waittime=0
InactiveLimit=0
MessageTimeout=10
SlurmdTimeout=120
SlurmctldTimeout=120
UnkillableStepTimeout=60
TreeWidth=8

NodeName=n[1-4] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$((port + 1))-$((port + 4))] CPUs=2 RealMemory=2048 State=UNKNOWN
PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  mv "$CONF.tmp" "$CONF"
}

# ---------------------------------------------------------------- start
show_logs() {
  local f
  for f in "$MUNGE_DIR/munged.log" "$LOG_DIR"/slurmctld.log "$LOG_DIR"/slurmd-*.log; do
    [ -f "$f" ] || continue
    echo "----- tail $f" >&2
    tail -n 25 "$f" >&2
  done
}

start_munge() {
  if pid_of "$MUNGE_PID" >/dev/null; then return 0; fi
  mkdir -p "$MUNGE_DIR"
  chmod 0700 "$MUNGE_DIR"
  if [ ! -s "$MUNGE_KEY" ]; then
    rm -f "$MUNGE_KEY"
    mungekey --create --keyfile="$MUNGE_KEY" 2>/dev/null ||
      dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
  fi
  chmod 0400 "$MUNGE_KEY"
  rm -f "$MUNGE_SOCK" "$MUNGE_SOCK.lock"
  # --force: /tmp (a parent of DIR) is world-writable (sticky); munged would
  # otherwise refuse such a socket directory path.
  munged --force --socket="$MUNGE_SOCK" --key-file="$MUNGE_KEY" \
    --pid-file="$MUNGE_PID" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" --num-threads=4 ||
    { show_logs; die "munged failed to start"; }
  local i
  for ((i = 0; i < 50; i++)); do
    [ -S "$MUNGE_SOCK" ] && break
    sleep 0.1
  done
  munge -n --socket="$MUNGE_SOCK" | unmunge --socket="$MUNGE_SOCK" >/dev/null ||
    { show_logs; die "munge round trip on $MUNGE_SOCK failed"; }
}

do_start() {
  check_tools
  local n
  n=$(running_count)
  if [ "$n" -eq 6 ] && [ -f "$CONF" ] && [ "$(idle_nodes)" -ge 4 ]; then
    say "cluster already running in $DIR (4 nodes idle)"
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  if [ "$n" -gt 0 ]; then
    if [ "$n" -eq 6 ] && [ -f "$CONF" ]; then
      say "cluster already running in $DIR; waiting for its nodes"
      wait_idle
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    say "partial cluster in $DIR ($n of 6 daemons up); stopping it first"
    do_stop
  fi

  local host port node t0
  t0=$(date +%s)
  host=$(hostname -s)
  [ -n "$host" ] || die "cannot determine the short host name"
  mkdir -p "$DIR" "$DIR/state" "$DIR/run" "$LOG_DIR"
  chmod 0755 "$DIR"
  for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node"; done
  port=$(pick_ports)
  write_conf "$host" "$port"
  say "state in $DIR, slurmctld on port $port, slurmd n1-n4 on ports $((port + 1))-$((port + 4))"

  start_munge
  say "munged up (socket $MUNGE_SOCK)"

  # -c: start from a clean state (no jobs from an earlier run of this DIR)
  slurmctld -c -f "$CONF" || { show_logs; die "slurmctld failed to start"; }
  for node in "${NODES[@]}"; do
    slurmd -N "$node" -f "$CONF" || { show_logs; die "slurmd -N $node failed to start"; }
  done
  wait_idle
  say "cluster up in $(($(date +%s) - t0)) s: 4 nodes idle"
  echo "export SLURM_CONF=$CONF"
}

wait_idle() {
  local deadline=$(($(date +%s) + TIMEOUT)) last="" now state idle
  while :; do
    idle=$(idle_nodes)
    [ "$idle" -ge 4 ] && return 0
    now=$(date +%s)
    state=$(sinfo -h -o '%T %D' 2>/dev/null | tr '\n' ' ' || true)
    if [ "$state" != "$last" ]; then
      say "waiting for 4 idle nodes: ${state:-controller not answering yet}"
      last=$state
    fi
    if [ "$now" -ge "$deadline" ]; then
      echo "$prog: error: nodes not idle after ${TIMEOUT} s (sinfo: ${state:-no answer})" >&2
      sinfo -R 2>/dev/null >&2 || true
      show_logs
      do_stop >&2
      exit 1
    fi
    # a daemon that died will not come back: fail fast
    if [ "$(running_count)" -lt 6 ]; then
      sleep 1
      if [ "$(running_count)" -lt 6 ]; then
        echo "$prog: error: a daemon exited during start-up" >&2
        show_logs
        do_stop >&2
        exit 1
      fi
    fi
    sleep 0.5
  done
}

# ---------------------------------------------------------------- stop
wait_gone() {  # pids... ; waits up to 15 s, then SIGKILL
  local p i alive
  for ((i = 0; i < 150; i++)); do
    alive=()
    for p in "$@"; do kill -0 "$p" 2>/dev/null && alive+=("$p"); done
    [ ${#alive[@]} -eq 0 ] && return 0
    sleep 0.1
  done
  say "still alive after 15 s, sending SIGKILL: ${alive[*]}"
  kill -KILL "${alive[@]}" 2>/dev/null || true
  sleep 0.2
}

do_stop() {
  local p node pids=() ctld jobs i
  ctld=$(pid_of "$CTLD_PID" || true)
  if [ "$(running_count)" -eq 0 ] && [ -z "$(our_stepds)" ]; then
    say "cluster in $DIR is not running"
    return 0
  fi

  # 1. cancel every job and let the slurmd clean up their steps
  if [ -n "$ctld" ] && [ -f "$CONF" ]; then
    jobs=$(squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      say "cancelling job(s): $jobs"
      # shellcheck disable=SC2086
      scancel $jobs 2>/dev/null || true
      for ((i = 0; i < 100; i++)); do
        [ -z "$(squeue -h -o '%A' 2>/dev/null)" ] && break
        sleep 0.1
      done
    fi
  fi

  # 2. no jobs left: stop every daemon at once (each takes ~2 s to shut down)
  for node in "${NODES[@]}"; do
    p=$(pid_of "$(slurmd_pidfile "$node")" || true)
    [ -n "$p" ] && pids+=("$p")
  done
  [ -n "$ctld" ] && pids+=("$ctld")
  p=$(pid_of "$MUNGE_PID" || true)
  [ -n "$p" ] && pids+=("$p")
  if [ ${#pids[@]} -ne 0 ]; then
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait_gone "${pids[@]}"
  fi
  # 3. any slurmstepd of ours that outlived its slurmd, with its job's processes
  mapfile -t pids < <(our_stepds)
  if [ ${#pids[@]} -ne 0 ]; then
    say "killing leftover slurmstepd and their tasks: ${pids[*]}"
    mapfile -t pids < <(descendants "${pids[@]}")
    kill -STOP "${pids[@]}" 2>/dev/null || true
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait_gone "${pids[@]}"
  fi
  rm -f "$CTLD_PID" "$DIR"/run/slurmd-*.pid "$MUNGE_PID"
  say "cluster in $DIR stopped"
}

# ---------------------------------------------------------------- status
show_one() {  # name, pid or ""
  if [ -n "$2" ]; then printf '%-10s running (pid %s)\n' "$1" "$2"; else printf '%-10s stopped\n' "$1"; fi
}

do_status() {
  local node p rc=0
  p=$(pid_of "$MUNGE_PID" || true);  show_one munged "$p"
  [ -n "$p" ] || rc=1
  p=$(pid_of "$CTLD_PID" || true);   show_one slurmctld "$p"
  [ -n "$p" ] || rc=1
  for node in "${NODES[@]}"; do
    p=$(pid_of "$(slurmd_pidfile "$node")" || true)
    show_one "slurmd $node" "$p"
    [ -n "$p" ] || rc=1
  done
  if pid_of "$CTLD_PID" >/dev/null && [ -f "$CONF" ]; then
    echo "export SLURM_CONF=$CONF"
    sinfo 2>/dev/null || true
    squeue 2>/dev/null || true
  fi
  return $rc
}

case "$cmd" in
  start) do_start ;;
  stop) do_stop ;;
  restart) do_stop; do_start ;;
  status) do_status ;;
esac
