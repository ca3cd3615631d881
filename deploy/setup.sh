#!/usr/bin/env bash
# Idempotent set-up for a Debian 12 machine: installs the Debian packages scaped
# needs to build and test, and says what it installs.  Safe to run again.
# usage: deploy/setup.sh [--tests]   (--tests: also what only the tests need:
#                                     clang and libFuzzer for tests/fuzz)
set -euo pipefail

PKGS=(
  build-essential cmake pkg-config
  libzmq3-dev libsodium-dev libmunge-dev libprotobuf-c-dev protobuf-c-compiler
  libyaml-dev check libsubunit-dev
  python3 python3-pytest python3-numpy python3-zmq python3-venv python3-pip python3-wheel python3-setuptools
  munge slurmctld slurmd slurm-client lmod
  fortunes python3-torch iproute2
)
if [ "${1:-}" = "--tests" ]; then
  PKGS+=(clang libclang-rt-14-dev)
fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PKGS[@]} Debian packages already present"
else
  echo "setup: installing ${#missing[@]} Debian package(s): ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root or sudo to install packages" >&2; exit 1; }
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  echo "setup: installed ${missing[*]}"
fi

# The .debs that tests/install/prefix.sh unpacks into its private prefix
# (fetched here, at set-up time, so that the test itself reaches no mirror).
if [ "${1:-}" = "--tests" ]; then
  if [ "$(id -u)" -eq 0 ]; then
    bash "$(dirname "${BASH_SOURCE[0]}")/../tests/install/prefix.sh" --fetch
  else
    echo "setup: not root: tests/install/prefix.sh (install_prefix, root only) is skipped"
  fi
fi

if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "setup: CUDA toolkit found ($(command -v nvcc || echo /usr/local/cuda/bin/nvcc)); the CUDA code will be built"
else
  echo "setup: no CUDA toolkit; building the CPU-only configuration"
fi
