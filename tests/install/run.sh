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
# pip: the package the prefix ships (it knows the prefix), in a fresh virtual
# environment (Debian's numpy from the system site), nothing of the build
# tree or the prefix on any path; then a short training run through the
# installed scape-run, which finds the installed scaped by itself.
py=${SCAPE_PYTHON:-/usr/bin/python3}
"$py" -m venv --system-site-packages "$tmp/venv"
cp -r "$tmp/prefix/share/scaped/python" "$tmp/pysrc"
# --no-cache-dir: a wheel from pip's cache would install without the
# install-time check for libscape (setup.py)
"$tmp/venv/bin/pip" install -q --no-cache-dir --no-build-isolation --no-index "$tmp/pysrc"
clean=(env -i PATH=/usr/bin:/bin HOME="$tmp" TMPDIR="$tmp")
# a sanitizer build's libscape needs its runtime preloaded
[ -z "${LD_PRELOAD:-}" ] || clean+=(LD_PRELOAD="$LD_PRELOAD" ASAN_OPTIONS="${ASAN_OPTIONS:-}")
(cd "$tmp" && "${clean[@]}" "$tmp/venv/bin/python" -c "import scape; print('import scape:', scape.version())")
(cd "$tmp" && "${clean[@]}" "$tmp/venv/bin/scape-run" --nproc-per-node 2 --set rho=0.25 \
    --set warmup=2 -- "$tmp/venv/bin/python" "$here/venv_train.py") 2>"$tmp/run.err" ||
    { cat "$tmp/run.err" >&2; exit 1; }
grep -q "2 trainer(s) done" "$tmp/run.err"
# the source tree's package, found through pkg-config (scape.pc of the prefix)
"$py" -m venv --system-site-packages "$tmp/venv2"
cp -r "$here/../../client/python" "$tmp/pysrc2"
rm -f "$tmp/pysrc2/scape/_prefix.py"
"$tmp/venv2/bin/pip" install -q --no-cache-dir --no-build-isolation --no-index "$tmp/pysrc2"
(cd "$tmp" && "${clean[@]}" PKG_CONFIG_PATH="$libdir/pkgconfig" "$tmp/venv2/bin/python" -c \
    "import scape, scape._lib as l; assert l.LOADED_FROM.startswith('$libdir'), l.LOADED_FROM")
echo "install: pkg-config and find_package(Scape) consumers built and ran; module load scaped works;"
echo "install: pip install of the package into fresh venvs (prefix and pkg-config routes); scape-run trained"
