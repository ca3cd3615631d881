#!/usr/bin/env bash
# prefix.sh SOURCE_DIR - the build a cluster user does alone: scaped and
# libscape configured, built and installed by an unprivileged user
# (scapebuild), with every dependency (libzmq, protobuf-c and its protoc-c,
# libyaml, libsodium, libmunge) taken from a private prefix that is not /usr,
# and BUILD_TESTING=OFF (no Check); then a two-daemon group runs from the
# install, with a trainer built against the installed libscape on each daemon.
#
# The private prefix holds the files of the Debian packages (their .debs,
# which `prefix.sh --fetch` -- run by deploy/setup.sh --tests -- keeps in
# /var/cache/scape/debs; the test reaches no mirror), unpacked with dpkg -x. The
# build runs in a private mount namespace where overlays hide /usr's copies
# of those packages (and Check's): whiteouts, so they do not exist there, and
# anything that still looks for them in /usr fails. The user is made once
# (useradd) and kept; everything else goes with the temporary directory.
# Needs root (for the namespace, the overlays and the user); without root it
# says so and exits 77 (skipped).
set -euo pipefail
stage=outer
if [ "${1:-}" = --inner ] || [ "${1:-}" = --user ] || [ "${1:-}" = --fetch ]; then
  stage=${1#--}
  shift
fi
say() { echo "install_prefix: $*"; }
die() {
  echo "install_prefix: FAIL: $*" >&2
  exit 1
}
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || gcc -print-multiarch)
# the packages whose files come from the private prefix (and are hidden in /usr)
deps=(libzmq3-dev libzmq5 libprotobuf-c-dev libprotobuf-c1 protobuf-c-compiler libyaml-dev
      libyaml-0-2 libsodium-dev libsodium23 libmunge-dev libmunge2)
# where --fetch (run by deploy/setup.sh --tests) keeps their .debs
cache=${SCAPE_DEB_CACHE:-/var/cache/scape/debs}
# the .deb file name of an installed package's installed version
deb_of() {
  local ver a
  ver=$(dpkg-query -W -f='${Version}' "$1" 2>/dev/null) || return 1
  a=$(dpkg-query -W -f='${Architecture}' "$1")
  echo "${1}_${ver/:/%3a}_$a.deb"
}
# ---- --fetch: the packages' .debs into the cache, once (set-up time) ----------
fetch_stage() {
  local name deb want=()
  mkdir -p "$cache"
  for name in "${deps[@]}"; do
    deb=$(deb_of "$name") || die "$name is not installed (deploy/setup.sh installs it)"
    if [ -f "/var/cache/apt/archives/$deb" ] && [ ! -f "$cache/$deb" ]; then
      cp "/var/cache/apt/archives/$deb" "$cache/"
    fi
    [ -f "$cache/$deb" ] || want+=("$name=$(dpkg-query -W -f='${Version}' "$name")")
  done
  if [ ${#want[@]} -eq 0 ]; then
    say "the ${#deps[@]} packages of the private prefix are in $cache"
    return 0
  fi
  chown _apt "$cache" 2>/dev/null || true  # apt downloads as _apt where it can
  # the installed versions; if the archive has moved on, its current ones
  # (the prefix is complete either way, and /usr's copies stay hidden)
  if ! (cd "$cache" && apt-get download -q "${want[@]}") >/tmp/scape-fetch.log 2>&1; then
    (cd "$cache" && apt-get download -q "${want[@]%%=*}") >>/tmp/scape-fetch.log 2>&1 ||
      { cat /tmp/scape-fetch.log >&2; die "apt-get download ${want[*]%%=*} failed (is a Debian mirror reachable?)"; }
  fi
  for name in "${deps[@]}"; do  # an archive that moved on: its version under the installed name
    deb=$(deb_of "$name")
    if [ ! -f "$cache/$deb" ]; then
      local got
      got=$(ls "$cache/${name}_"*.deb 2>/dev/null | head -n 1) || true
      [ -n "$got" ] || die "apt-get download gave no $name"
      cp "$got" "$cache/$deb"
    fi
  done
  say "downloaded ${#want[@]} package(s) into $cache"
}
# hidden in /usr, not provided: the build must not need them
absent=(check)
user=scapebuild
pids=()  # the user stage's daemons
# the directories where the hidden files are: overlays go over these
overlaid=(/usr/include /usr/lib/"$multiarch" /usr/bin /usr/share/pkgconfig)

# ---- as the user, in the namespace ----------------------------------------------
user_stage() {
  local src=$1 work=$2 pfx=$3
  local plib=$pfx/lib/$multiarch build=$work/build inst=$work/inst
  stop_daemons() {
    local p
    for p in "${pids[@]}"; do
      kill -TERM "$p" 2>/dev/null || true
    done
    for p in "${pids[@]}"; do
      wait "$p" 2>/dev/null || true
    done
  }
  trap stop_daemons EXIT
  [ "$(id -un)" = "$user" ] || die "the user stage runs as $(id -un), not $user"
  for f in /usr/include/zmq.h /usr/include/yaml.h /usr/include/sodium.h /usr/include/munge.h \
           /usr/include/protobuf-c/protobuf-c.h /usr/include/check.h /usr/bin/protoc-c \
           "/usr/lib/$multiarch/libzmq.so.5" "/usr/lib/$multiarch/pkgconfig/libzmq.pc"; do
    [ ! -e "$f" ] || die "$f is still visible in the namespace"
  done
  say "as $(id -un) (uid $(id -u)); /usr's zmq, protobuf-c, yaml, sodium, munge and check hidden"

  say "configure (BUILD_TESTING=OFF, CMAKE_PREFIX_PATH=$pfx, libdir lib64)"
  cmake -S "$src" -B "$build" -DCMAKE_BUILD_TYPE=Release -DBUILD_TESTING=OFF -DSCAPE_CUDA=OFF \
        -DCMAKE_PREFIX_PATH="$pfx" -DCMAKE_INSTALL_PREFIX="$inst" -DCMAKE_INSTALL_LIBDIR=lib64 \
        >"$work/configure.log" 2>&1 || { cat "$work/configure.log" >&2; die "configure failed"; }
  grep -q "auth munge with $plib/libmunge.so" "$work/configure.log" ||
    { cat "$work/configure.log" >&2; die "libmunge was not found in the private prefix"; }
  grep -qx "PROTOC_C:FILEPATH=$pfx/bin/protoc-c" "$build/CMakeCache.txt" ||
    die "protoc-c is not the private prefix's: $(grep '^PROTOC_C:' "$build/CMakeCache.txt")"
  say "build (-j2)"
  cmake --build "$build" -j2 >"$work/build.log" 2>&1 ||
    { tail -n 40 "$work/build.log" >&2; die "build failed"; }
  say "install into $inst"
  cmake --install "$build" >"$work/install.log" 2>&1 ||
    { cat "$work/install.log" >&2; die "install failed"; }
  [ ! -e "$build/tests" ] || die "BUILD_TESTING=OFF still configured tests/"
  for f in bin/scaped bin/scapectl lib64/libscape.so include/scape/scape.h lib64/pkgconfig/scape.pc; do
    [ -e "$inst/$f" ] || die "the install has no $f"
  done

  # The Lmod module puts the install's real library directory (lib64) on the paths.
  # shellcheck disable=SC1091
  source /usr/share/lmod/lmod/init/bash
  module use "$inst/share/modulefiles"
  module load scaped
  local modlib=${LD_LIBRARY_PATH%%:*}
  { [ "$modlib" = "$inst/lib64" ] && [ -e "$modlib/libscape.so" ]; } ||
    die "module load scaped put $modlib on LD_LIBRARY_PATH, not $inst/lib64 (with libscape.so)"
  [ "${PKG_CONFIG_PATH%%:*}" = "$inst/lib64/pkgconfig" ] ||
    die "module load scaped put ${PKG_CONFIG_PATH%%:*} first on PKG_CONFIG_PATH"
  [ "$(command -v scaped)" = "$inst/bin/scaped" ] || die "scaped on PATH is $(command -v scaped)"
  say "module load scaped: LD_LIBRARY_PATH starts with $modlib"

  # The installed programs find the private prefix's libraries by their RUNPATH.
  local key=$work/job.key
  (unset LD_LIBRARY_PATH; "$inst/bin/scaped" keygen "$key") >"$work/keygen.log" 2>&1 ||
    { cat "$work/keygen.log" >&2; die "the installed scaped does not run without LD_LIBRARY_PATH"; }
  # ...and the dependencies of those libraries by LD_LIBRARY_PATH, as on a cluster.
  export LD_LIBRARY_PATH=$inst/lib64:$plib

  say "a trainer built against the install (pkg-config scape)"
  # shellcheck disable=SC2046  # the flags are meant to split
  cc -std=c11 -O2 -Wall -Werror -I"$src/tests/integration" "$src/tests/integration/trainer_c.c" \
     $(pkg-config --cflags --libs scape) -lm -o "$work/trainer" ||
    die "the trainer does not build against the install"

  # A port for rank 0's rendezvous below the ephemeral range (as the
  # integration tests choose it), free a moment ago.
  local low port="" try
  low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range)
  for try in $(seq 1 50); do
    try=$((10000 + RANDOM % (low - 10000)))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$try") 2>/dev/null; then
      port=$try
      break
    fi
  done
  [ -n "$port" ] || die "no free port below $low in 50 tries"

  say "two daemons (world 2, auth secret) from $inst/bin, coordinator 127.0.0.1:$port"
  local r
  for r in 0 1; do
    "$inst/bin/scaped" --runtime-dir "$work/rt$r" --rho 0.01 --warmup 3 --world 2 --rank "$r" \
      --coordinator "tcp://127.0.0.1:$port" --listen "tcp://127.0.0.1:*" --job 7 --trainers 1 \
      --comm-timeout-ms 20000 --auth secret --auth-key-file "$key" >"$work/scaped$r.log" 2>&1 &
    pids+=($!)
  done
  local tpids=()
  for r in 0 1; do
    "$work/trainer" --endpoint "ipc://$work/rt$r/control" --index 0 --n 3000 --steps 5 \
      --seed $((1 + 1000 * r)) --start-wait-ms 30000 --out "$work/params$r" \
      >"$work/trainer$r.log" 2>&1 &
    tpids+=($!)
  done
  for r in 0 1; do
    wait "${tpids[$r]}" || {
      cat "$work/trainer$r.log" "$work/scaped0.log" "$work/scaped1.log" >&2
      die "the trainer of daemon $r failed"
    }
  done
  say "both trainers ran 5 steps"
  local js
  for r in 0 1; do
    js=$("$inst/bin/scapectl" --runtime-dir "$work/rt$r" status --json) ||
      { cat "$work/scaped$r.log" >&2; die "daemon $r does not answer scapectl status"; }
    { grep -q '"step": *5[,}]' <<<"$js" && grep -q '"peers_connected": *1[,}]' <<<"$js"; } ||
      die "daemon $r's status is not step 5 with its peer connected: $js"
  done
  say "the installed scapectl: both daemons at step 5, each connected to the other"
  for r in 0 1; do
    kill -TERM "${pids[$r]}"
  done
  for r in 0 1; do
    wait "${pids[$r]}" || { cat "$work/scaped$r.log" >&2; die "daemon $r did not stop cleanly"; }
  done
  pids=()
  say "both daemons stopped"
}

# ---- as root, in the namespace: hide /usr's copies, then become the user --------
inner_stage() {
  local tmp=$1 pfx=$2
  local ovl=$tmp/ovl
  # the overlays' upper and work directories on a tmpfs (an upper directory
  # cannot be on every file system, overlayfs included)
  mkdir -p "$ovl"
  mount -t tmpfs -o mode=0755 scape-ovl "$ovl" || die "cannot mount a tmpfs in the namespace"
  local d name n=0
  for d in "${overlaid[@]}"; do
    n=$((n + 1))
    mkdir -p "$ovl/up$n" "$ovl/work$n"
  done
  # a whiteout (character device 0/0) for every file of those packages
  local f rel
  while read -r f; do
    n=0
    for d in "${overlaid[@]}"; do
      n=$((n + 1))
      case $f in
        "$d"/*)
          rel=${f#"$d"/}
          mkdir -p "$ovl/up$n/$(dirname "$rel")"
          [ -e "$ovl/up$n/$rel" ] || mknod "$ovl/up$n/$rel" c 0 0
          ;;
      esac
    done
  done < <(for name in "${deps[@]}" "${absent[@]}"; do dpkg -L "$name"; done |
             sed "s|^/lib/|/usr/lib/|; s|^/bin/|/usr/bin/|" | sort -u |
             while read -r f; do [ -d "$f" ] && [ ! -L "$f" ] || echo "$f"; done)
  n=0
  for d in "${overlaid[@]}"; do
    n=$((n + 1))
    [ -d "$d" ] || continue
    mount -t overlay scape-hide -o "lowerdir=$d,upperdir=$ovl/up$n,workdir=$ovl/work$n" "$d" ||
      die "cannot mount an overlay over $d"
  done
  setpriv --reuid="$user" --regid="$user" --clear-groups --inh-caps=-all --bounding-set=-all \
    env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$tmp/user/home" TMPDIR="$tmp/user" \
    LANG=C.UTF-8 bash "$tmp/src/tests/install/prefix.sh" --user "$tmp/src" "$tmp/user" "$pfx"
}

# ---- as root: the private prefix, the user, the namespace -------------------------
outer_stage() {
  local src
  src=$(cd "$1" && pwd)
  if [ "$(id -u)" != 0 ]; then
    echo "SKIP: install_prefix needs root (a mount namespace, overlays and a build user)"
    exit 77
  fi
  local t0=$SECONDS tmp
  tmp=$(mktemp -d /tmp/scape-prefix.XXXXXX)
  # shellcheck disable=SC2064  # expand tmp now
  trap "rm -rf '$tmp'" EXIT
  chmod 755 "$tmp"
  if ! id "$user" >/dev/null 2>&1; then
    useradd --system --user-group --no-create-home --shell /usr/sbin/nologin "$user" ||
      die "useradd $user failed"
    say "made the build user $user"
  fi

  say "the private prefix: ${deps[*]}"
  mkdir "$tmp/debs" "$tmp/deps"
  local name deb
  for name in "${deps[@]}"; do
    deb=$(deb_of "$name") || die "$name is not installed (deploy/setup.sh installs it)"
    if [ -f "$cache/$deb" ]; then
      cp "$cache/$deb" "$tmp/debs/"
    elif [ -f "/var/cache/apt/archives/$deb" ]; then
      cp "/var/cache/apt/archives/$deb" "$tmp/debs/"
    else
      die "no $deb in $cache or apt's cache: deploy/setup.sh --tests fetches the packages" \
          "(tests/install/prefix.sh --fetch); the test itself reaches no mirror"
    fi
  done
  for deb in "$tmp"/debs/*.deb; do
    dpkg -x "$deb" "$tmp/deps" || die "dpkg -x $deb failed"
  done
  local pfx=$tmp/deps/usr
  # the .pc files name /usr: point them at the prefix
  local pc
  for pc in "$pfx"/lib/"$multiarch"/pkgconfig/*.pc "$pfx"/share/pkgconfig/*.pc; do
    [ -e "$pc" ] || continue
    sed -i "s|^prefix=/usr\$|prefix=$pfx|" "$pc"
    grep -q "^prefix=$pfx\$" "$pc" || die "$pc: no prefix=/usr line to rewrite"
  done
  # absolute links (into /usr) would lead back to the hidden copies
  local l
  while read -r l; do
    ln -sfn "$tmp/deps$(readlink "$l")" "$l"
  done < <(find "$tmp/deps" -type l -lname '/*')
  { [ -x "$pfx/bin/protoc-c" ] && [ -e "$pfx/include/zmq.h" ]; } || die "the private prefix is incomplete"

  # the source as a user has it (a copy the build user can read), without build trees
  mkdir "$tmp/src" "$tmp/user" "$tmp/user/home"
  tar -C "$src" --exclude='./build*' --exclude=./.git -cf - . | tar -C "$tmp/src" -xf - ||
    die "cannot copy the source"
  chmod -R a+rX "$tmp/src"
  chown -R "$user:$user" "$tmp/user"
  say "a private mount namespace; the build as $user"
  unshare --mount --propagation private bash "$tmp/src/tests/install/prefix.sh" --inner "$tmp" "$pfx"
  say "passed in $((SECONDS - t0)) s: built and installed by $user from a private prefix" \
      "without Check, and a two-daemon group with trainers ran from the install"
}

case $stage in
  fetch) fetch_stage ;;
  outer) outer_stage "$@" ;;
  inner) inner_stage "$@" ;;
  user) user_stage "$@" ;;
esac
