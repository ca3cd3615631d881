#!/usr/bin/env python3
"""cu2cpp.py - a .cu file as C++ for scaped's CUDA emulator: every
`kernel<<<grid, block[, shmem[, stream]]>>>(args)` becomes
`emu_launch("kernel", emu_config(grid, block, ...), [](auto &&...a) {
kernel(a...); }, args)`, so that a kernel template's arguments are deduced
from the call as nvcc deduces them; nothing else changes, and line numbers
are kept (a #line names the .cu file).

    cu2cpp.py IN.cu OUT.cpp
"""
import re
import sys

LAUNCH = re.compile(r"\b([A-Za-z_]\w*(?:\s*<[^<>;{}()]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)


def convert(text):
    out, pos, n = [], 0, 0
    for m in LAUNCH.finditer(text):
        name, cfg = m.group(1), m.group(2)
        rest = text[m.end():]
        empty = rest.lstrip().startswith(")")
        out.append(text[pos:m.start()])
        label = " ".join(name.split())
        out.append('emu_launch("%s", emu_config(%s), [](auto &&...emu_a) { %s(emu_a...); }%s'
                   % (label, cfg, name, "" if empty else ", "))
        pos = m.end()
        n += 1
    out.append(text[pos:])
    return "".join(out), n


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: cu2cpp.py IN.cu OUT.cpp")
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        text = f.read()
    body, n = convert(text)
    if "<<<" in body:
        sys.exit("cu2cpp.py: %s: a launch it could not rewrite is left" % src)
    with open(dst, "w") as f:
        f.write('#line 1 "%s"\n' % src)
        f.write(body)
    print("cu2cpp.py: %s: %d launches" % (src, n))


if __name__ == "__main__":
    main()
