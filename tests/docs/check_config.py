#!/usr/bin/env python3
"""Compare docs/configuration.md's key table with the daemon as built.

usage: check_config.py SCAPED SOURCE_DIR

The keys are those `scaped --print-config` prints.  The table under "## Keys"
must have one row per key and none for a key that does not exist; each row's
default must be what --print-config prints with no file, no flag and no
environment; and each row's environment variable must be the one the daemon
reads for that key: the test sets it to a value no key accepts and expects
scaped to refuse it, naming the variable.  Prints one line per difference and
exits 1 if there is any.
"""

import os
import re
import subprocess
import sys

PRINTED = re.compile(r"^([a-z][a-z0-9_]*): (\"(?:[^\"\\]|\\.)*\"|\S*)")
CODE = re.compile(r"`([^`]*)`")
# Longer than any string key's bound, and neither a number, an enum nor a
# boolean: every key refuses it.
INVALID = "x" * 100000
RUN_TIMEOUT_S = 30


def clean_env():
    """No SCAPE_* or SLURM_* variable: the daemon's own defaults."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("SCAPE_") and not k.startswith("SLURM_")}


def run_scaped(scaped, env):
    return subprocess.run([scaped, "--print-config"], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=RUN_TIMEOUT_S)


def printed_config(scaped):
    """{key: value as printed} from scaped --print-config, in its order."""
    r = run_scaped(scaped, clean_env())
    if r.returncode != 0:
        sys.exit("%s --print-config failed (rc %d): %s" % (scaped, r.returncode, r.stderr))
    keys = {}
    for line in r.stdout.splitlines():
        m = PRINTED.match(line)
        if not m:
            sys.exit("%s --print-config printed a line that is not 'key: value  # doc': %r"
                     % (scaped, line))
        keys[m.group(1)] = m.group(2)
    if not keys:
        sys.exit("%s --print-config printed no key" % scaped)
    return keys


def cells(row):
    """A table row's cells, '|' inside `code` or escaped as '\\|' kept."""
    out, cur, code, i = [], [], False, 0
    row = row.strip()
    if row.startswith("|"):
        row = row[1:]
    if row.endswith("|") and not row.endswith("\\|"):
        row = row[:-1]
    while i < len(row):
        ch = row[i]
        if ch == "\\" and i + 1 < len(row) and row[i + 1] == "|":
            cur.append("|")
            i += 2
            continue
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    out.append("".join(cur).strip())
    return out


def documented_table(path):
    """(header cells, [(line number, cells)]) of the first table under ## Keys."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    start = next((i for i, l in enumerate(lines) if l.strip() == "## Keys"), None)
    if start is None:
        sys.exit("%s: no '## Keys' section" % path)
    i = start + 1
    while i < len(lines) and not lines[i].lstrip().startswith("|"):
        if lines[i].startswith("## "):
            sys.exit("%s: no table under '## Keys'" % path)
        i += 1
    if i + 1 >= len(lines):
        sys.exit("%s: no table under '## Keys'" % path)
    header = [c.lower() for c in cells(lines[i])]
    rows = []
    for n in range(i + 2, len(lines)):
        if not lines[n].lstrip().startswith("|"):
            break
        rows.append((n + 1, cells(lines[n])))
    return header, rows


def column(header, name, path):
    if name not in header:
        sys.exit("%s: the key table has no '%s' column (it has %s)" % (path, name, header))
    return header.index(name)


def env_read(scaped, var):
    """None when scaped refuses an invalid value in var and names var, else why not."""
    env = clean_env()
    env[var] = INVALID
    r = run_scaped(scaped, env)
    if r.returncode == 0:
        return "scaped accepted %s set to an invalid value: it does not read it" % var
    if var not in r.stderr:
        return "scaped refused %s set to an invalid value without naming it: %s" % (
            var, r.stderr.strip()[:300])
    return None


def compare(scaped, path):
    printed = printed_config(scaped)
    header, rows = documented_table(path)
    key_col = column(header, "key", path)
    env_col = column(header, "environment", path)
    def_col = column(header, "default", path)
    problems, seen = [], {}
    where = os.path.basename(path)
    for n, row in rows:
        if len(row) != len(header):
            problems.append("%s:%d: %d cells, the header has %d (%s)" % (
                where, n, len(row), len(header), " | ".join(header)))
            continue
        names = CODE.findall(row[key_col])
        if len(names) != 1:
            problems.append("%s:%d: the key cell must hold one `key`, not %r" % (
                where, n, row[key_col]))
            continue
        key = names[0]
        if key in seen:
            problems.append("%s:%d: key '%s' documented twice (also line %d)" % (
                where, n, key, seen[key]))
            continue
        seen[key] = n
        if key not in printed:
            problems.append("%s:%d: documents key '%s', which scaped --print-config does "
                            "not have: remove the row or fix its name" % (where, n, key))
            continue
        want_var = "SCAPE_" + key.upper()
        doc_vars = CODE.findall(row[env_col])
        if doc_vars != [want_var]:
            problems.append("%s:%d: key '%s': environment cell %r, expected `%s`" % (
                where, n, key, row[env_col], want_var))
        else:
            why = env_read(scaped, want_var)
            if why:
                problems.append("%s:%d: key '%s': %s" % (where, n, key, why))
        defaults = CODE.findall(row[def_col])
        if not defaults or defaults[0] != printed[key]:
            problems.append("%s:%d: key '%s': documented default %r, --print-config "
                            "prints %s" % (where, n, key, row[def_col], printed[key]))
    for key in printed:
        if key not in seen:
            problems.append("%s: key '%s' (scaped --print-config) has no row in the table "
                            "under '## Keys': add one, with its environment variable `%s`"
                            % (where, key, "SCAPE_" + key.upper()))
    return printed, rows, problems


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: check_config.py SCAPED SOURCE_DIR\n")
        return 2
    scaped, root = argv[1], argv[2]
    path = os.path.join(root, "docs", "configuration.md")
    printed, rows, problems = compare(scaped, path)
    for p in problems:
        print(p)
    print("%d keys printed, %d rows documented, %d problems" % (
        len(printed), len(rows), len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
