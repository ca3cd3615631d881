#!/usr/bin/env bash
# The README's main command: set up, build, and train a small GPT on the
# fortunes corpus with a local group of 2 scaped daemons (host backend over
# loopback TCP, sharded) and 2 trainer processes on each: first SCAPE at
# rho 0.01, then dense AdamS with the same model, data and seeds.  Shows a
# progress bar, prints a closing table and writes a plot (SVG).  Both runs
# use the settings docs/operations.md recommends for a GPT: gradients clipped
# at 1.0, and for SCAPE the norms and biases sent whole (dense_below 256),
# masks as deltas and the parameters' changes on the wire; --plain runs
# SCAPE and AdamS with scaped's defaults instead.
#
# Run as root (as deploy/setup.sh needs), the two daemons sit on two test
# hosts (network namespaces, deploy/hosts.sh) joined by a link of --link RATE
# (tc's units, e.g. 100mbit); --link none, or no root, keeps them on
# loopback.  The default, --link calibrated, first trains dense AdamS for 30
# steps over loopback to measure its compute per step here, and takes the
# rate at which dense AdamS then spends 82% of its step communicating, as
# the SCAPE paper's dense AdamS does at 64 GPUs (its derivation is printed;
# client/examples/calibrate_link.py).
#
# Usage: deploy/demo.sh [--steps N] [--rho X] [--link RATE|calibrated|none] [--plain]
#        (STEPS, RHO, LINK, PLAIN=1 in the environment too)
# While it runs, `build-demo/client/scapectl --runtime-dir DIR watch` (the
# directory is printed) follows a daemon from another terminal.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
STEPS=${STEPS:-300}
RHO=${RHO:-0.01}
LINK=${LINK:-calibrated}
PLAIN=${PLAIN:-0}
while [ $# -gt 0 ]; do
  case "$1" in
  --steps) STEPS=$2; shift 2 ;;
  --rho) RHO=$2; shift 2 ;;
  --link) LINK=$2; shift 2 ;;
  --plain) PLAIN=1; shift ;;
  *) echo "usage: deploy/demo.sh [--steps N] [--rho X] [--link RATE|calibrated|none] [--plain]" >&2; exit 64 ;;
  esac
done
if [ "$PLAIN" = 1 ]; then
  both=() scape_extra=() settings="scaped's defaults"
else
  both=(--max-grad-norm 1)
  scape_extra=(--dense-below 256 --mask-deltas true --gather-values delta)
  settings="clipped at 1.0; norms and biases whole, mask deltas, changes on the wire"
fi

bash deploy/setup.sh
echo "==> build (Release) in build-demo"
cmake -S . -B build-demo -DCMAKE_BUILD_TYPE=Release -DSCAPE_CUDA="${SCAPE_CUDA:-AUTO}" \
  >build-demo.configure.log 2>&1 || { cat build-demo.configure.log; exit 1; }
cmake --build build-demo -j"$(nproc)" --target scaped scapectl gpt_train trainer_c >build-demo.build.log 2>&1 ||
  { tail -n 40 build-demo.build.log; exit 1; }

out=$root/build-demo/demo
mkdir -p "$out"
corpus=$out/fortunes.txt
bash client/examples/fortunes-corpus.sh "$corpus"
# Runtime directories hold ipc:// sockets, whose paths must stay short.
rt=$(mktemp -d /tmp/scape-demo.XXXXXX)
pids=()
hosts=""
cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$rt"
  [ -z "$hosts" ] || bash deploy/hosts.sh down --name "$hosts" >/dev/null 2>&1 || true
  [ "$rc" -eq 0 ] || echo "demo: failed; logs are in $out" >&2
  exit "$rc"
}
trap cleanup EXIT INT TERM
# The two daemons prove to each other that they are this job's with a shared
# key (auth: secret; a Slurm cluster would use its munged), and their data
# plane runs CURVE: authenticated and encrypted.
build-demo/daemon/scaped keygen "$rt/job.key" >/dev/null

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

ctl() { build-demo/client/scapectl --runtime-dir "$1" "${@:2}"; }

# run_group (below) runs RUN_STEPS steps; QUIET=1 leaves out the progress
# bar and the validation (the calibration's probe).
RUN_STEPS=$STEPS QUIET=0

# run_group NAME SCAPED-FLAGS...: 2 daemons x 2 trainers; trainer 0 of rank 0
# reports (validation loss, CSV log, progress bar).
run_group() {
  local name=$1; shift
  local coord listen on=()
  pids=()
  if [ -n "$hosts" ]; then
    coord="tcp://10.231.0.1:29517"
  else
    coord="tcp://127.0.0.1:$(free_port)"
  fi
  for r in 0 1; do
    if [ -n "$hosts" ]; then
      on=(ip netns exec "$hosts-h$r")
      listen="tcp://10.231.0.$((r + 1)):*"
    else
      listen="tcp://127.0.0.1:$(free_port)"
    fi
    "${on[@]}" build-demo/daemon/scaped --runtime-dir "$rt/$name-$r" --world 2 --rank "$r" \
      --coordinator "$coord" --listen "$listen" --job $$ \
      --auth secret --auth-key-file "$rt/job.key" \
      --trainers 2 --mode sharded --log-level warn "$@" >"$out/$name-scaped-$r.log" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do
    local deadline=$((SECONDS + 60))
    until ctl "$rt/$name-$r" --timeout-ms 1000 status >/dev/null 2>&1; do
      [ "$SECONDS" -lt "$deadline" ] || { cat "$out/$name-scaped-$r.log" >&2; exit 1; }
      sleep 0.2
    done
  done
  [ "$QUIET" = 1 ] || echo "    watch it: build-demo/client/scapectl --runtime-dir $rt/$name-0 watch"
  local trainers=()
  for r in 0 1; do
    for j in 0 1; do
      local extra=()
      if [ "$r$j" = 00 ] && [ "$QUIET" = 1 ]; then
        extra=(--log "$out/$name.csv")
      elif [ "$r$j" = 00 ]; then
        extra=(--report --progress --log "$out/$name.csv")
      fi
      build-demo/client/examples/gpt_train --endpoint "ipc://$rt/$name-$r/control" \
        --index "$j" --corpus "$corpus" --steps "$RUN_STEPS" --seed $((1 + 1000 * r + j)) \
        "${extra[@]}" >"$out/$name-trainer-$r-$j.log" 2>"$out/$name-trainer-$r-$j.err" &
      trainers+=($!)
    done
  done
  tail -f -n +1 "$out/$name-trainer-0-0.err" --pid "${trainers[0]}" 2>/dev/null &
  local tailer=$! failed=0
  for p in "${trainers[@]}"; do wait "$p" || failed=1; done
  wait "$tailer" 2>/dev/null || true
  if [ "$failed" = 1 ]; then
    tail -n 5 "$out/$name"-trainer-*.err "$out/$name"-scaped-*.log >&2
    exit 1
  fi
  for r in 0 1; do ctl "$rt/$name-$r" shutdown >/dev/null; done
  for p in "${pids[@]}"; do wait "$p"; done
  pids=()
}

# Two test hosts with a LINK-rate link, when root can make them; a calibrated
# rate first from dense AdamS's compute, measured over loopback.
if [ "$LINK" != none ] && [ "$(id -u)" -ne 0 ]; then
  echo "==> not root: the daemons talk over loopback (--link needs network namespaces)"
  LINK=none
fi
if [ "$LINK" = calibrated ]; then
  echo "==> calibrating the link: dense AdamS, 30 steps over loopback, for its compute per step"
  RUN_STEPS=30 QUIET=1
  run_group probe --optimizer adams "${both[@]}"
  RUN_STEPS=$STEPS QUIET=0
  LINK=$(python3 client/examples/calibrate_link.py "$out/probe.csv" 2>"$out/calibration.txt") ||
    { cat "$out/calibration.txt" >&2; exit 1; }
  echo "    $(cat "$out/calibration.txt")"
fi
if [ "$LINK" != none ]; then
  if bash deploy/hosts.sh up 2 --rate "$LINK" --name "scdemo$$" >"$out/hosts.log" 2>&1; then
    hosts="scdemo$$"
    echo "==> two test hosts joined by a $LINK link: $(cat "$out/hosts.log")"
  else
    echo "==> no test hosts here ($(tail -n 1 "$out/hosts.log")): the daemons talk over loopback"
    LINK=none
  fi
fi

where="loopback"
[ -z "$hosts" ] || where="a $LINK link"
echo "==> SCAPE, rho $RHO: 2 daemons x 2 trainers over $where, $STEPS steps (GPT d=64, 2 layers, fortunes)"
echo "    settings: $settings"
run_group scape --optimizer scape --rho "$RHO" --warmup 10 "${both[@]}" "${scape_extra[@]}"
echo "==> dense AdamS, the same model, data and seeds (the baseline)"
run_group adams --optimizer adams "${both[@]}"
echo "==> results"
python3 client/examples/demo_report.py --svg "$out/demo.svg" --link "$where" \
  "scape rho=$RHO=$out/scape.csv" "dense adams=$out/adams.csv"
echo "logs: $out"
