#!/bin/sh
# fortunes-corpus.sh OUT - write the GPT demo's corpus to OUT: the regular
# files of the Debian package 'fortunes' under .../games/fortunes/ (not the
# .dat indexes, not the .u8 links), concatenated in sorted path order (LC_ALL=C),
# so the same package version always gives the same bytes.
set -eu
export LC_ALL=C

if [ $# -ne 1 ] || [ -z "$1" ]; then
    echo "usage: fortunes-corpus.sh OUT" >&2
    exit 2
fi
out=$1

status=$(dpkg-query -W -f='${Status}' fortunes 2>/dev/null || true)
if [ "$status" != "install ok installed" ]; then
    echo "fortunes-corpus.sh: the Debian package 'fortunes' is not installed" \
         "(apt-get install fortunes)" >&2
    exit 1
fi

list=$(dpkg -L fortunes | grep '/games/fortunes/' | grep -v -e '\.dat$' -e '\.u8$' | sort |
       while IFS= read -r f; do
           if [ -f "$f" ] && [ ! -L "$f" ]; then printf '%s\n' "$f"; fi
       done)
if [ -z "$list" ]; then
    echo "fortunes-corpus.sh: package 'fortunes' lists no files under games/fortunes/" >&2
    exit 1
fi

tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
printf '%s\n' "$list" | while IFS= read -r f; do cat "$f"; done >"$tmp"
mv "$tmp" "$out"
trap - EXIT
echo "fortunes-corpus.sh: $(printf '%s\n' "$list" | wc -l) files, $(wc -c <"$out") bytes -> $out"
