#!/usr/bin/env bash
# The README's main command.  Until the training demo exists it builds scaped
# and runs the kernel benchmark, which prints per-operation bandwidth against
# a memcpy measured in the same run and the top-k speedup over sorting.
# Usage: deploy/demo.sh [bench_kernels flags, e.g. --quick]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
bash deploy/setup.sh
echo "==> build (Release)"
cmake -S . -B build-demo -DCMAKE_BUILD_TYPE=Release -DSCAPE_CUDA="${SCAPE_CUDA:-AUTO}" >build-demo.configure.log 2>&1 ||
  { cat build-demo.configure.log; exit 1; }
cmake --build build-demo -j"$(nproc)" --target bench_kernels
echo "==> kernel benchmark"
./build-demo/tests/bench/bench_kernels "$@"
