#!/usr/bin/env bash
# Install the build into a temporary prefix and build a trainer against it
# twice: with pkg-config and with find_package(Scape).  Usage: run.sh BUILD_DIR
# CFLAGS, when set (the sanitizer build sets it), is used for the consumers.
set -euo pipefail
build=$1
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
test -x "$tmp/prefix/bin/scaped" && test -x "$tmp/prefix/bin/scapectl"
libdir=$(ls -d "$tmp"/prefix/lib*/ | head -n1)
export PKG_CONFIG_PATH="$libdir/pkgconfig"
# shellcheck disable=SC2046,SC2086  # flags lists are meant to split
cc -std=c11 -Wall -Werror ${CFLAGS:-} "$here/consumer.c" $(pkg-config --cflags --libs scape) \
   -Wl,-rpath,"$libdir" -o "$tmp/consumer-pc"
"$tmp/consumer-pc"
mkdir "$tmp/cm"
cp "$here/consumer.c" "$tmp/cm/"
cp "$here/CMakeLists.txt.in" "$tmp/cm/CMakeLists.txt"
cmake -S "$tmp/cm" -B "$tmp/cm/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" -DCMAKE_C_FLAGS="${CFLAGS:-}" \
      -DCMAKE_BUILD_RPATH="$libdir" >/dev/null
cmake --build "$tmp/cm/build" >/dev/null
"$tmp/cm/build/consumer"
# The Lmod modulefile puts the installed tree on the paths.
# shellcheck disable=SC1091
source /usr/share/lmod/lmod/init/bash
module use "$tmp/prefix/share/modulefiles"
module load scaped
[ "$(command -v scaped)" = "$tmp/prefix/bin/scaped" ] && [ "$SCAPE_HOME" = "$tmp/prefix" ]
test -x "$SCAPE_HOME/slurm/generic.sbatch"
module unload scaped
echo "install: pkg-config and find_package(Scape) consumers built and ran; module load scaped works"
