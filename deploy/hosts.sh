#!/usr/bin/env bash
# hosts.sh - test hosts on this machine: Linux network namespaces with their
# own addresses, joined by a switch, each link with a rate.
#
#   deploy/hosts.sh up N [--rate RATE] [--name NAME]   make hosts NAME-h0 .. NAME-h<N-1>
#   deploy/hosts.sh down [--name NAME]                 remove them (and the switch)
#   deploy/hosts.sh cut I [--name NAME]                take host I's link down
#   deploy/hosts.sh restore I [--name NAME]            and up again
#   deploy/hosts.sh rate I RATE [--name NAME]          set host I's link rate (tc tbf)
#   deploy/hosts.sh status [--name NAME]               what exists
#   deploy/hosts.sh exec I CMD... [--name NAME first]  run CMD on host I
#
# Host I is the namespace NAME-hI with one interface, eth0, address
# 10.231.0.(I+1)/24, and loopback.  Its eth0 is a veth whose other end sits in
# the switch namespace NAME-sw, on the bridge br0.  Nothing is added to the
# machine's own namespace: the addresses exist only inside these namespaces,
# so traffic between hosts never leaves them.  RATE (tc's units: 100mbit,
# 1gbit, 10mbit; "none" for no limit) shapes both directions of a link with
# the tbf qdisc: egress of the host's eth0 and of the switch port towards it.
# A process on a host reaches other hosts at 10.231.0.x; ipc:// sockets (the
# file system) still join it to processes outside.  Needs root (or
# CAP_NET_ADMIN) and iproute2.  Idempotent: `up` replaces hosts of the same
# NAME, `down` of nothing is fine.  Default NAME: scape.
set -euo pipefail

name=scape
rate=none
args=()
while [ $# -gt 0 ]; do
    case "$1" in
    --name) name=$2; shift 2 ;;
    --rate) rate=$2; shift 2 ;;
    exec) args+=("$@"); break ;;
    *) args+=("$1"); shift ;;
    esac
done
set -- "${args[@]}"
SUBNET=10.231.0
sw="$name-sw"

die() { echo "hosts: $*" >&2; exit 1; }
ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }
hosts_of() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${name}-h[0-9]+$" | sort -V || true; }

# The tbf qdisc on dev in namespace ns: rate, or none (removed).  Burst:
# 10 ms at the rate, at least 32 KiB; latency bound 50 ms.
shape() {
    local ns=$1 dev=$2 r=$3
    ip -n "$ns" link show "$dev" >/dev/null 2>&1 || die "no $dev in $ns"
    tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
    [ "$r" = none ] && return 0
    local bits
    bits=$(rate_bits "$r") || die "rate '$r': use tc units, e.g. 100mbit, 1gbit, 10mbit, or none"
    local burst=$((bits / 8 / 100))
    [ "$burst" -ge 32768 ] || burst=32768
    tc -n "$ns" qdisc add dev "$dev" root tbf rate "$r" burst "$burst" latency 50ms
}

rate_bits() {
    local r=${1,,} num unit
    num=${r%%[a-z]*}
    unit=${r#"$num"}
    [[ "$num" =~ ^[0-9]+$ ]] || return 1
    case "$unit" in
    bit) echo "$num" ;;
    kbit) echo $((num * 1000)) ;;
    mbit) echo $((num * 1000000)) ;;
    gbit) echo $((num * 1000000000)) ;;
    *) return 1 ;;
    esac
}

down() {
    local n=0
    for h in $(hosts_of); do
        ip netns del "$h"
        n=$((n + 1))
    done
    if ns_exists "$sw"; then
        ip netns del "$sw"
        n=$((n + 1))
    fi
    echo "hosts: removed $n namespace(s) of $name"
}

up() {
    local count=$1
    [[ "$count" =~ ^[0-9]+$ ]] && [ "$count" -ge 1 ] && [ "$count" -le 250 ] ||
        die "up: a host count 1..250, not '$count'"
    [ "$rate" = none ] || rate_bits "$rate" >/dev/null ||
        die "rate '$rate': use tc units, e.g. 100mbit, 1gbit, 10mbit, or none"
    down >/dev/null
    ip netns add "$sw"
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    ip -n "$sw" link set lo up
    for i in $(seq 0 $((count - 1))); do
        local h="$name-h$i"
        ip netns add "$h"
        ip -n "$h" link set lo up
        ip -n "$h" link add eth0 type veth peer name "p$i" netns "$sw"
        ip -n "$h" addr add "$SUBNET.$((i + 1))/24" dev eth0
        ip -n "$h" link set eth0 up
        ip -n "$sw" link set "p$i" master br0
        ip -n "$sw" link set "p$i" up
        shape "$h" eth0 "$rate"
        shape "$sw" "p$i" "$rate"
    done
    echo "hosts: $count host(s) $name-h0..$name-h$((count - 1)) at $SUBNET.1..$SUBNET.$count/24," \
         "switch $sw, link rate $rate"
}

host_ns() {
    local i=$1
    [[ "$i" =~ ^[0-9]+$ ]] || die "host index '$i'"
    ns_exists "$name-h$i" || die "no host $name-h$i (deploy/hosts.sh up first)"
    echo "$name-h$i"
}

link() {
    local i=$1 state=$2
    host_ns "$i" >/dev/null
    ip -n "$sw" link set "p$i" "$state"
    echo "hosts: $name-h$i link $state"
}

status() {
    local hs
    hs=$(hosts_of)
    if [ -z "$hs" ]; then
        echo "hosts: none of $name"
        return 0
    fi
    for h in $hs; do
        local i=${h##*-h} addr st q
        addr=$(ip -n "$h" -4 -o addr show dev eth0 | awk '{print $4}')
        st=$(ip -n "$sw" -o link show "p$i" | grep -q "state UP\|,UP" && echo up || echo down)
        q=$(tc -n "$h" qdisc show dev eth0 | awk '/tbf/ {for (k = 1; k <= NF; k++) if ($k == "rate") print $(k + 1)}')
        echo "$h $addr link ${st} rate ${q:-none}"
    done
}

[ "$(id -u)" -eq 0 ] || die "needs root (network namespaces); run as root or with sudo"
command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
case "${1:-}" in
up) [ $# -eq 2 ] || die "usage: up N [--rate RATE] [--name NAME]"; up "$2" ;;
down) down ;;
cut) [ $# -eq 2 ] || die "usage: cut I"; link "$2" down ;;
restore) [ $# -eq 2 ] || die "usage: restore I"; link "$2" up ;;
rate) [ $# -eq 3 ] || die "usage: rate I RATE"
      h=$(host_ns "$2"); shape "$h" eth0 "$3"; shape "$name-sw" "p$2" "$3"
      echo "hosts: $h link rate $3" ;;
status) status ;;
exec) [ $# -ge 3 ] || die "usage: exec I CMD..."
      h=$(host_ns "$2"); shift 2; exec ip netns exec "$h" "$@" ;;
*) sed -n '2,13p' "$0" >&2; exit 64 ;;
esac
