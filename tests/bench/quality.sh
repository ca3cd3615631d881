#!/usr/bin/env bash
# The quality benchmark (not part of the test command: about an hour on two
# cores): builds bench_quality, writes the fortunes corpus, trains the example
# GPT with every optimizer (4 ranks, the same seeds and steps), then
# quality_report.py checks the targets against dense AdamS, appends the rows
# to docs/benchmarks.md and writes docs/img/quality.svg.
# Usage: tests/bench/quality.sh [bench_quality options, e.g. --steps 3000]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
bash deploy/setup.sh
cmake -S . -B build-bench -DCMAKE_BUILD_TYPE=Release >build-bench.configure.log 2>&1 ||
  { cat build-bench.configure.log; exit 1; }
cmake --build build-bench -j"$(nproc)" --target bench_quality >/dev/null
out=build-bench/quality
mkdir -p "$out" docs/img
bash client/examples/fortunes-corpus.sh "$out/fortunes.txt"
./build-bench/tests/bench/bench_quality --corpus "$out/fortunes.txt" --out "$out" "$@" |
  tee "$out/out.txt"
python3 tests/bench/quality_report.py --dir "$out" --table "$out/out.txt" \
  --svg docs/img/quality.svg --markdown docs/benchmarks.md \
  --command "tests/bench/quality.sh $*"
