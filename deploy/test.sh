#!/usr/bin/env bash
# The README's test command: set up, build, and run every test twice -- once
# in the normal build (warnings are errors) and once under ASan+UBSan -- then
# a coverage-guided libFuzzer campaign over every tests/fuzz target (clang),
# and the Slurm tests on a local cluster.
# Usage: deploy/test.sh            (from anywhere inside the repository)
# Env:   SCAPE_CUDA=AUTO|ON|OFF    (default AUTO: build the CUDA code when nvcc+NCCL exist)
#        JOBS=N                    (parallel build jobs, default: nproc)
#        FUZZ_SECONDS=S            (libFuzzer time per fuzz target, default 30)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
jobs=${JOBS:-$(nproc)}
cuda=${SCAPE_CUDA:-AUTO}

bash deploy/setup.sh --tests

run_suite() {  # name, build dir, extra cmake args...
  local name=$1 dir=$2
  shift 2
  echo "==> [$name] configure ($dir)"
  cmake -S . -B "$dir" -DSCAPE_WERROR=ON -DSCAPE_CUDA="$cuda" "$@" >"$dir.configure.log" 2>&1 ||
    { cat "$dir.configure.log"; exit 1; }
  grep -E "scaped: CUDA" "$dir.configure.log" || true
  echo "==> [$name] build"
  cmake --build "$dir" -j"$jobs"
  echo "==> [$name] test"
  (cd "$dir" && ctest --output-on-failure --timeout 1200)
}

mkdir -p build-test
# the Python stacks the integration tests train with: HF transformers +
# accelerate against Debian's torch 1.13, and torch 2.x + Lightning from PyPI
bash deploy/hf-venv.sh build-test/release/hf-venv
SCAPE_TORCH2_VENV=$root/build-test/torch2-venv
export SCAPE_TORCH2_VENV
bash deploy/torch2-venv.sh "$SCAPE_TORCH2_VENV"
run_suite release build-test/release -DCMAKE_BUILD_TYPE=RelWithDebInfo
run_suite sanitize build-test/asan -DCMAKE_BUILD_TYPE=Debug -DSCAPE_SANITIZE=ON

# tests/fuzz: the same targets ctest replayed, now coverage-guided (libFuzzer
# with ASan+UBSan); only the targets and what they link are built.
echo "==> [fuzz] configure (build-test/fuzz: clang, libFuzzer, ASan+UBSan)"
CC=clang cmake -S . -B build-test/fuzz -DSCAPE_FUZZ=ON -DSCAPE_CUDA=OFF -DSCAPE_WERROR=ON \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >build-test/fuzz.configure.log 2>&1 ||
  { cat build-test/fuzz.configure.log; exit 1; }
fuzz_targets=$(cd tests/fuzz && ls fuzz_*.c | grep -v '^fuzz_common' | sed 's/\.c$//')
echo "==> [fuzz] build $(echo $fuzz_targets)"
cmake --build build-test/fuzz -j"$jobs" --target $fuzz_targets
bash tests/fuzz/run.sh build-test/fuzz "${FUZZ_SECONDS:-30}"

# tests/slurm: a real 4-node Slurm cluster on this machine (needs root), its
# slurmds inside test hosts (network namespaces) where they can be made.
echo "==> [slurm] local 4-node cluster"
bash tests/slurm/smoke.sh
bash tests/slurm/template.sh build-test/release 1 pair  # + two jobs at once
bash tests/slurm/template.sh build-test/release 2 requeue  # + SIGUSR1, requeue, resume; cut links
echo "==> all tests passed (release and ASan+UBSan builds, libFuzzer campaign, Slurm cluster)"
