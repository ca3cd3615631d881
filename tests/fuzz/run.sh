#!/usr/bin/env bash
# A coverage-guided libFuzzer campaign over every target in tests/fuzz, from
# a build configured with CC=clang -DSCAPE_FUZZ=ON (deploy/test.sh makes one).
#
# usage: tests/fuzz/run.sh BUILD_DIR [SECONDS_PER_TARGET]   (default 30)
# env:   SCAPE_FUZZ_WORK   where corpora, logs and crash inputs go
#                          (default BUILD_DIR/tests/fuzz/campaign; kept between
#                          runs, so a later campaign starts where this one ended)
#
# Each target starts from its seeds (written by the target itself) plus
# tests/fuzz/regress/<target>/, runs for the given time, and must end without
# a crash, a leak, a timeout or a broken check.  A failing input is kept as
# WORK/crash-<target>-*; replay it with the target (either build):
#   BUILD/tests/fuzz/fuzz_<target> WORK/crash-<target>-...
# and, once fixed, commit it to tests/fuzz/regress/<target>/.
set -uo pipefail
build=${1:?usage: tests/fuzz/run.sh BUILD_DIR [SECONDS_PER_TARGET]}
secs=${2:-30}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
build=$(cd "$build" && pwd)
work=${SCAPE_FUZZ_WORK:-$build/tests/fuzz/campaign}
mkdir -p "$work"

targets=$(cd "$build/tests/fuzz" 2>/dev/null && ls fuzz_* 2>/dev/null | grep -v '\.' || true)
if [ -z "$targets" ]; then
  echo "fuzz: no fuzz targets in $build/tests/fuzz (configure with CC=clang -DSCAPE_FUZZ=ON and build)" >&2
  exit 2
fi
if ! nm "$build/tests/fuzz/$(echo "$targets" | head -1)" 2>/dev/null | grep LLVMFuzzerRunDriver >/dev/null; then
  echo "fuzz: $build was not built with -DSCAPE_FUZZ=ON: its targets have no libFuzzer" >&2
  exit 2
fi

failed=0
rows=()
for exe in $targets; do
  name=${exe#fuzz_}
  corpus=$work/corpus-$name
  log=$work/$name.log
  mkdir -p "$corpus"
  SCAPE_FUZZ_SEEDS=$corpus "$build/tests/fuzz/$exe" >/dev/null 2>&1 ||
    { echo "fuzz: $exe could not write its seeds" >&2; failed=1; continue; }
  [ -d "$here/regress/$name" ] && cp "$here/regress/$name"/* "$corpus"/ 2>/dev/null
  echo "==> fuzz $name: ${secs}s from $(ls "$corpus" | wc -l) inputs"
  # -timeout: one input running 30 s is a hang; -rss_limit_mb: a runaway
  # allocation; leaks are reported by LeakSanitizer (on by default).
  "$build/tests/fuzz/$exe" -max_total_time="$secs" -timeout=30 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$work/crash-$name-" "$corpus" >"$log" 2>&1
  rc=$?
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  speed=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  size=$(ls "$corpus" | wc -l)
  if [ $rc -eq 0 ]; then
    result=ok
  else
    result="FAILED (exit $rc)"
    failed=1
    echo "---- $name: the end of $log"
    grep -v '^#[0-9]' "$log" | tail -40
    ls "$work"/crash-"$name"-* "$work"/leak-"$name"-* "$work"/timeout-"$name"-* 2>/dev/null |
      sed 's/^/fuzz: failing input: /'
  fi
  rows+=("$(printf '%-12s %10s %8s %8s %8s  %s' "$name" "${runs:-?}" "${speed:-?}" "${cov:-?}" "$size" "$result")")
done

echo
printf '%-12s %10s %8s %8s %8s  %s\n' target runs "exec/s" edges corpus result
printf '%s\n' "${rows[@]}"
[ $failed -eq 0 ] && echo "fuzz: every target ran ${secs}s without a failure" ||
  echo "fuzz: FAILED (inputs and logs in $work)"
exit $failed
