#!/usr/bin/env bash
# A real 4-node Slurm test cluster on this one machine: its own munged, one
# slurmctld and four slurmd (n1..n4, `slurmd -N nX`), all with their config,
# key, sockets, state, logs and pid files inside one state directory.
#
# Usage: deploy/slurm-cluster.sh start [DIR] [--hosts|--loopback]
#        deploy/slurm-cluster.sh stop|status|restart [DIR]
#        DIR defaults to /tmp/scape-slurm.  After `start`, point the Slurm
#        client commands at the cluster with the printed lines:
#            export SLURM_CONF=DIR/slurm.conf
#            export PATH=DIR/client:$PATH     (on test hosts only)
#
# Network: with --hosts (the default where root can make network
# namespaces) each slurmd runs inside its own test host of deploy/hosts.sh:
# n1..n4 are the namespaces NAME-h0..h3 at 10.231.0.1..4, and slurmctld runs
# on a fifth one, NAME-h4 at 10.231.0.5, all on one private bridge (NAME is
# scsl- and 8 hex digits of DIR's md5, one group per DIR); so the
# jobs' steps, and the daemons they start, talk over real (veth) interfaces
# with a rate.  Nothing is added to the machine's own namespace: the Slurm
# client commands reach the controller through the wrappers in DIR/client,
# which run them in NAME-h4 (inside a job they run as they are, already on a
# host).  munged stays outside: its socket is a file.  DIR/cluster.env says
# which network the cluster got (SCAPE_SLURM_NET=hosts|loopback, the hosts'
# name, the nodes' addresses and interface).  With --loopback, or where
# namespaces cannot be made (it says why), all daemons share 127.0.0.1 on
# ports of their own.
#
# Env:   SCAPE_SLURM_HOSTS       auto (default), 1 (test hosts or fail), 0 (loopback)
#        SCAPE_SLURM_RATE        the hosts' link rate, tc units (default 1gbit; none)
#        SCAPE_SLURM_PORT_BASE   first port to try (default 17817); the
#                                controller and the four slurmd get 5
#                                consecutive free ports from there on
#        SCAPE_SLURM_TIMEOUT     seconds to wait for 4 idle nodes (default 60)
#        SCAPE_SLURM_CRED_EXPIRE credential lifetime, also the delay before a
#                                requeued job may start again (default 15 s)
#
# Installs nothing.  Needs the Debian packages munge, slurmctld, slurmd and
# slurm-client (deploy/setup.sh installs them), root (SlurmUser=root), and
# for the test hosts iproute2.
set -euo pipefail

prog=${0##*/}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cmd=${1:-}
net_opt=${SCAPE_SLURM_HOSTS:-auto}
pos=()
shift || true
for a in "$@"; do
  case "$a" in
    --hosts) net_opt=1 ;;
    --loopback) net_opt=0 ;;
    *) pos+=("$a") ;;
  esac
done
DIR=${pos[0]:-/tmp/scape-slurm}
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
ENV_FILE=$DIR/cluster.env
CLIENT_DIR=$DIR/client
HOSTS_SH=$here/hosts.sh
RATE=${SCAPE_SLURM_RATE:-1gbit}
CLIENTS=(sinfo sbatch srun squeue scancel scontrol)
# the network of a cluster that was started (loopback when none is recorded)
NET=loopback HOSTS_NAME="" CTL_NS="" NET_WHY=""

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

# ---------------------------------------------------------------- network
# Test hosts of this state directory: one name per DIR, so two clusters
# (two DIRs) get two groups of namespaces.
hosts_name() { echo "scsl-$(printf '%s' "$DIR" | md5sum | cut -c1-8)"; }

load_env() {  # the network recorded by `start`, if any
  NET=loopback HOSTS_NAME="" CTL_NS=""
  [ -f "$ENV_FILE" ] || return 0
  NET=$(sed -n 's/^SCAPE_SLURM_NET=//p' "$ENV_FILE")
  HOSTS_NAME=$(sed -n 's/^SCAPE_SLURM_HOSTS_NAME=//p' "$ENV_FILE")
  CTL_NS=$(sed -n 's/^SCAPE_SLURM_CTL_NS=//p' "$ENV_FILE")
  if [ "$NET" = hosts ] && [ -z "$HOSTS_NAME" ]; then NET=loopback; fi
  return 0
}

# Daemons and commands enter a host by its network namespace only (nsenter):
# `ip netns exec` would also remount /sys for it, without /sys/fs/cgroup,
# which slurmd needs.
on_host() {  # namespace, command...
  local ns=$1
  shift
  nsenter --net="/run/netns/$ns" "$@"
}

ctl() {  # a Slurm client command, run where it reaches the controller
  if [ "$NET" = hosts ]; then on_host "$CTL_NS" "$@"; else "$@"; fi
}

hosts_why_not() {  # prints why test hosts cannot be made here; nothing if they can
  local probe="scsl-probe-$$" err
  if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
    echo "no iproute2 (ip, tc)"; return 0
  fi
  command -v nsenter >/dev/null 2>&1 || { echo "no nsenter (util-linux)"; return 0; }
  [ -f "$HOSTS_SH" ] || { echo "no $HOSTS_SH"; return 0; }
  if ! err=$(ip netns add "$probe" 2>&1); then
    echo "no network namespaces here: $err"; return 0
  fi
  if ! err=$(on_host "$probe" true 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    echo "cannot enter a network namespace: $err"; return 0
  fi
  ip netns del "$probe" || { echo "cannot remove network namespace $probe"; return 0; }
}

choose_net() {  # sets NET from --hosts/--loopback/SCAPE_SLURM_HOSTS, saying why
  local why
  case "$net_opt" in
    0|no|off|loopback)
      NET=loopback NET_WHY="asked for (SCAPE_SLURM_HOSTS=0 or --loopback)"
      say "network: loopback, $NET_WHY"
      return 0 ;;
    1|yes|on|hosts|auto) ;;
    *) die "SCAPE_SLURM_HOSTS=$net_opt: use auto, 1 or 0" ;;
  esac
  why=$(hosts_why_not)
  if [ -z "$why" ]; then NET=hosts NET_WHY=""; return 0; fi
  [ "$net_opt" = auto ] || die "test hosts asked for, but $why"
  NET=loopback NET_WHY=${why//[\"\$\`\\]/}
  say "network: loopback, not test hosts: $why"
}

write_env() {
  local addrs="127.0.0.1 127.0.0.1 127.0.0.1 127.0.0.1" iface=lo nodens="" rate=none
  if [ "$NET" = hosts ]; then
    addrs="10.231.0.1 10.231.0.2 10.231.0.3 10.231.0.4" iface=eth0 rate=$RATE
    nodens="$HOSTS_NAME-h0 $HOSTS_NAME-h1 $HOSTS_NAME-h2 $HOSTS_NAME-h3"
  fi
  {
    echo "# Written by deploy/slurm-cluster.sh: the network of this cluster."
    echo "SCAPE_SLURM_NET=$NET"
    echo "SCAPE_SLURM_NET_WHY=\"$NET_WHY\""
    echo "SCAPE_SLURM_HOSTS_NAME=$HOSTS_NAME"
    echo "SCAPE_SLURM_CTL_NS=$CTL_NS"
    echo "SCAPE_SLURM_RATE=$rate"
    echo "SCAPE_SLURM_NODE_NS=\"$nodens\""
    echo "SCAPE_SLURM_NODE_ADDRS=\"$addrs\""
    echo "SCAPE_SLURM_IFACE=$iface"
  } >"$ENV_FILE.tmp"
  mv "$ENV_FILE.tmp" "$ENV_FILE"
}

make_hosts() {  # 5 test hosts: n1..n4 on h0..h3, the controller on h4
  HOSTS_NAME=$(hosts_name)
  CTL_NS=$HOSTS_NAME-h4
  write_env  # first, so that a failed start still finds them to remove
  bash "$HOSTS_SH" up 5 --rate "$RATE" --name "$HOSTS_NAME" >/dev/null ||
    die "deploy/hosts.sh up 5 --name $HOSTS_NAME failed"
  say "network: test hosts $HOSTS_NAME-h0..h3 (n1..n4) at 10.231.0.1..4," \
      "slurmctld on $CTL_NS at 10.231.0.5, links $RATE"
}

write_clients() {  # DIR/client/<cmd>: run in the controller's host from outside
  local c real
  rm -rf "$CLIENT_DIR"
  [ "$NET" = hosts ] || return 0
  mkdir -p "$CLIENT_DIR"
  for c in "${CLIENTS[@]}"; do
    real=$(command -v "$c") || die "no $c"
    {
      echo "#!/bin/sh"
      echo "# Written by deploy/slurm-cluster.sh: $c of the test cluster in $DIR, run on"
      echo "# its controller's host $CTL_NS; inside a job (already on a host) as it is."
      echo "if [ -z \"\$(ip netns identify 2>/dev/null)\" ]; then"
      echo "  exec nsenter --net=/run/netns/$CTL_NS $real \"\$@\""
      echo "fi"
      echo "exec $real \"\$@\""
    } >"$CLIENT_DIR/$c"
    chmod 0755 "$CLIENT_DIR/$c"
  done
}

remove_hosts() {  # kills what is left on the hosts, then removes them
  [ "$NET" = hosts ] || return 0
  local i ns pids=() p
  for i in 0 1 2 3 4; do
    ns=$HOSTS_NAME-h$i
    ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$ns" || continue
    for p in $(ip netns pids "$ns" 2>/dev/null); do pids+=("$p"); done
  done
  if [ ${#pids[@]} -ne 0 ]; then
    say "killing what is left on the test hosts: ${pids[*]}"
    kill -KILL "${pids[@]}" 2>/dev/null || true
    wait_gone "${pids[@]}"
  fi
  bash "$HOSTS_SH" down --name "$HOSTS_NAME" >/dev/null ||
    { say "could not remove the test hosts $HOSTS_NAME"; return 1; }
  say "removed test hosts $HOSTS_NAME"
}

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
  ctl sinfo -h -o '%T %D' 2>/dev/null | awk '$1 == "idle" { n += $2 } END { print n + 0 }'
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
  local host=$1 port=$2 comm="" ctld_addr=127.0.0.1 nodes i
  # Bind slurmd/srun to this host's address only when the host name resolves
  # to loopback (it does on this kind of test machine); slurmctld in Slurm
  # 22.05 always binds every address.  On test hosts each daemon has a
  # namespace of its own: binding every address there binds only its own.
  if [ "$NET" = loopback ] &&
     getent ahostsv4 "$host" 2>/dev/null | awk '{print $1; exit}' | grep -q '^127\.'; then
    comm="CommunicationParameters=NoInAddrAny"
  fi
  if [ "$NET" = hosts ]; then
    ctld_addr=10.231.0.5
    nodes=""
    for i in 1 2 3 4; do
      nodes+="NodeName=n$i NodeHostname=$host NodeAddr=10.231.0.$i Port=$((port + i))"
      nodes+=" CPUs=2 RealMemory=2048 State=UNKNOWN"$'\n'
    done
  else
    nodes="NodeName=n[1-4] NodeHostname=$host NodeAddr=127.0.0.1"
    nodes+=" Port=[$((port + 1))-$((port + 4))] CPUs=2 RealMemory=2048 State=UNKNOWN"
  fi
  cat >"$CONF.tmp" <<EOF
# Written by deploy/slurm-cluster.sh -- a 4-node test cluster on one host.
ClusterName=scape
SlurmctldHost=$host($ctld_addr)
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
# a requeued job may start once cred_expire is past, but only a scheduling
# pass starts it (by default every 60 s, backfill every 30 s): often, here
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
KillWait=5
Waittime=0
InactiveLimit=0
MessageTimeout=10
SlurmdTimeout=120
SlurmctldTimeout=120
UnkillableStepTimeout=60
TreeWidth=8

$nodes
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

print_exports() {
  echo "export SLURM_CONF=$CONF"
  if [ "$NET" = hosts ]; then echo "export PATH=$CLIENT_DIR:\$PATH"; fi
}

start_failed() {  # EXIT trap of a start that did not finish: undo it
  local rc=$?
  trap - EXIT
  if [ $rc -ne 0 ]; then
    say "start failed; removing what it made" >&2
    do_stop >&2 || true
  fi
  exit $rc
}

do_start() {
  check_tools
  local n
  n=$(running_count)
  if [ "$n" -eq 6 ] && [ -f "$CONF" ] && [ "$(idle_nodes)" -ge 4 ]; then
    say "cluster already running in $DIR (4 nodes idle, network $NET)"
    print_exports
    return 0
  fi
  if [ "$n" -gt 0 ]; then
    if [ "$n" -eq 6 ] && [ -f "$CONF" ]; then
      say "cluster already running in $DIR; waiting for its nodes"
      wait_idle
      print_exports
      return 0
    fi
    say "partial cluster in $DIR ($n of 6 daemons up); stopping it first"
    do_stop
  fi
  # leftovers of a start that was killed: namespaces without daemons
  [ "$NET" = hosts ] && { remove_hosts || die "cannot remove the old test hosts"; }
  trap start_failed EXIT

  local host port node t0
  t0=$(date +%s)
  host=$(hostname -s)
  [ -n "$host" ] || die "cannot determine the short host name"
  mkdir -p "$DIR" "$DIR/state" "$DIR/run" "$LOG_DIR"
  chmod 0755 "$DIR"
  for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node"; done
  choose_net
  local i on=()  # on[i]: the command prefix that runs a daemon on node i's host
  if [ "$NET" = hosts ]; then
    make_hosts
    # the namespaces are fresh: every port is free there
    port=${SCAPE_SLURM_PORT_BASE:-17817}
    for i in 0 1 2 3; do on[i]="nsenter --net=/run/netns/$HOSTS_NAME-h$i"; done
    on[4]="nsenter --net=/run/netns/$CTL_NS"
  else
    HOSTS_NAME="" CTL_NS=""
    write_env
    port=$(pick_ports)
    for i in 0 1 2 3 4; do on[i]=""; done
  fi
  write_clients
  write_conf "$host" "$port"
  say "state in $DIR, slurmctld on port $port, slurmd n1-n4 on ports $((port + 1))-$((port + 4))"

  start_munge
  say "munged up (socket $MUNGE_SOCK)"

  # -c: start from a clean state (no jobs from an earlier run of this DIR)
  # shellcheck disable=SC2086  # on[i] is a command prefix or nothing
  ${on[4]} slurmctld -c -f "$CONF" || { show_logs; die "slurmctld failed to start"; }
  for i in 0 1 2 3; do
    node=${NODES[i]}
    # shellcheck disable=SC2086
    ${on[i]} slurmd -N "$node" -f "$CONF" || { show_logs; die "slurmd -N $node failed to start"; }
  done
  wait_idle
  trap - EXIT
  say "cluster up in $(($(date +%s) - t0)) s: 4 nodes idle, network $NET"
  print_exports
}

wait_idle() {
  local deadline=$(($(date +%s) + TIMEOUT)) last="" now state idle
  while :; do
    idle=$(idle_nodes)
    [ "$idle" -ge 4 ] && return 0
    now=$(date +%s)
    state=$(ctl sinfo -h -o '%T %D' 2>/dev/null | tr '\n' ' ' || true)
    if [ "$state" != "$last" ]; then
      say "waiting for 4 idle nodes: ${state:-controller not answering yet}"
      last=$state
    fi
    if [ "$now" -ge "$deadline" ]; then
      echo "$prog: error: nodes not idle after ${TIMEOUT} s (sinfo: ${state:-no answer})" >&2
      ctl sinfo -R 2>/dev/null >&2 || true
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
    remove_hosts || return 1
    rm -rf "$ENV_FILE" "$CLIENT_DIR"
    return 0
  fi

  # 1. cancel every job and let the slurmd clean up their steps
  if [ -n "$ctld" ] && [ -f "$CONF" ]; then
    jobs=$(ctl squeue -h -o '%A' 2>/dev/null | tr '\n' ' ' || true)
    if [ -n "${jobs// /}" ]; then
      say "cancelling job(s): $jobs"
      # shellcheck disable=SC2086
      ctl scancel $jobs 2>/dev/null || true
      for ((i = 0; i < 100; i++)); do
        [ -z "$(ctl squeue -h -o '%A' 2>/dev/null)" ] && break
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
  remove_hosts || return 1
  rm -rf "$ENV_FILE" "$CLIENT_DIR"
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
  if [ "$NET" = hosts ]; then
    echo "network: test hosts $HOSTS_NAME-h0..h3 (n1..n4), controller on $CTL_NS"
    bash "$HOSTS_SH" status --name "$HOSTS_NAME" || rc=1
  else
    echo "network: loopback"
  fi
  if pid_of "$CTLD_PID" >/dev/null && [ -f "$CONF" ]; then
    print_exports
    ctl sinfo 2>/dev/null || true
    ctl squeue 2>/dev/null || true
  fi
  return $rc
}

load_env
case "$cmd" in
  start) do_start ;;
  stop) do_stop ;;
  restart) do_stop; load_env; do_start ;;
  status) do_status ;;
esac
