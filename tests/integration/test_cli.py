"""The command lines of the installed C programs, as their users type them:
--version and -h on scaped and scapectl, YAML's booleans in a file, a flag
and the environment, a warning for an unknown SCAPE_* variable (and none for
the variables the rest of SCAPE reads), error lines without the C source
position, and a --listen endpoint given by host name."""
import os
import re
import subprocess

from conftest import SOURCE, BUILD, binary, free_endpoints, run_trainer
from test_multinode import ENGINE, data_endpoint


def project_version():
    """The version in CMakeLists.txt's project() call."""
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        m = re.search(r"project\(scaped\s+VERSION\s+([0-9.]+)", f.read())
    assert m, "no project(scaped VERSION ...) in CMakeLists.txt"
    return m.group(1)


def cmake_cache():
    with open(os.path.join(BUILD, "CMakeCache.txt")) as f:
        return dict(re.findall(r"^([A-Za-z_]+):[A-Z]+=(.*)$", f.read(), re.M))


def clean_env(**extra):
    """The environment without SCAPE_* variables, plus extra."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCAPE_")}
    env.update(extra)
    return env


def scaped(*args, env=None):
    return subprocess.run([binary("daemon", "scaped"), *args], capture_output=True, text=True,
                          timeout=60, env=env if env is not None else clean_env())


def scapectl(*args):
    return subprocess.run([binary("client", "scapectl"), *args], capture_output=True,
                          text=True, timeout=60, env=clean_env())


def printed(res):
    """key -> value of --print-config's output."""
    assert res.returncode == 0, res.stderr
    return {l.split(":", 1)[0]: l.split(":", 1)[1].split("#")[0].strip()
            for l in res.stdout.splitlines() if ":" in l}


def test_scaped_version_names_the_build():
    res = scaped("--version")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "scaped " + project_version(), res.stdout
    fields = dict(l.split(":", 1) for l in lines[1:])
    executors = fields["executor"].strip()
    backends = fields["comm_backend"].strip()
    auth = fields["auth"].strip()
    assert executors.startswith("host, sim") and backends.startswith("host"), res.stdout
    assert "secret, none" in auth, res.stdout
    # munge is there exactly when CMake found libmunge's header and library
    cache = cmake_cache()
    munge = all(cache.get(k) and not cache[k].endswith("NOTFOUND")
                for k in ("MUNGE_INCLUDE_DIR", "MUNGE_LIBRARY"))
    assert auth.startswith("munge, ") == munge, (auth, munge)
    assert ("no munge" in auth) != munge, auth
    if cache.get("SCAPE_CUDA") == "OFF":
        assert "no cuda" in executors and "no nccl" in backends, res.stdout
    # --version wins over the rest of the line, which is not checked
    assert scaped("--version", "--rho", "7").stdout == res.stdout


def test_scaped_help_short_and_long():
    long_, short = scaped("--help"), scaped("-h")
    assert long_.returncode == 0 and short.returncode == 0, long_.stderr + short.stderr
    assert long_.stdout == short.stdout
    assert long_.stdout.startswith("usage: scaped"), long_.stdout
    assert "--version" in long_.stdout and "--mask_deltas" in long_.stdout, long_.stdout


def test_scapectl_version_and_help():
    res = scapectl("--version")
    assert res.returncode == 0 and res.stdout == "scapectl %s\n" % project_version(), \
        res.stdout + res.stderr
    for flag in ("-h", "--help"):
        res = scapectl(flag)
        assert res.returncode == 0 and res.stdout.startswith("usage: scapectl"), res.stderr
        assert "--version" in res.stdout


def test_scape_node_version_and_help():
    """slurm/scape-node.sh, installed with the templates: -h/--help outside a
    Slurm job, --version from the scaped it would run."""
    node = os.path.join(SOURCE, "slurm", "scape-node.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for flag in ("-h", "--help"):
        res = subprocess.run(["bash", node, flag], capture_output=True, text=True, env=env,
                             timeout=30)
        assert res.returncode == 0 and "the per-node half of the sbatch" in res.stdout, \
            res.stdout + res.stderr
    env["SCAPE_BIN"] = os.path.dirname(binary("daemon", "scaped"))
    res = subprocess.run(["bash", node, "--version"], capture_output=True, text=True, env=env,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "scape-node.sh (scaped %s)\n" % project_version(), res.stdout


def test_yaml_booleans_in_file_flag_and_environment(tmp_path):
    cfg = tmp_path / "scaped.yaml"
    cfg.write_text("mask_deltas: True\ndefer_select: OFF\nresidual_on_device: yes\n")
    got = printed(scaped("--config", str(cfg), "--print-config"))
    assert (got["mask_deltas"], got["defer_select"], got["residual_on_device"]) == \
        ("true", "false", "true")
    got = printed(scaped("--mask-deltas", "yes", "--defer-select=N", "--print-config"))
    assert (got["mask_deltas"], got["defer_select"]) == ("true", "false")
    got = printed(scaped("--print-config", env=clean_env(SCAPE_MASK_DELTAS="On")))
    assert got["mask_deltas"] == "true"
    res = scaped("--mask-deltas", "tRUE", "--print-config")
    assert res.returncode == 2 and "'tRUE' is not a boolean" in res.stderr, res.stderr


def test_unknown_flag_names_the_closest_key():
    for flag, hint in (("--warmupp", "--warmup"), ("--mask-delta=yes", "--mask-deltas"),
                       ("--mask_delta", "--mask_deltas")):
        res = scaped(flag, "1", "--print-config")
        assert res.returncode == 2 and res.stdout == "", res.stdout
        assert "unknown option %s (did you mean %s?)" % (flag.split("=")[0], hint) \
            in res.stderr, res.stderr
    res = scaped("--frobnicate", "1")
    assert res.returncode == 2 and "unknown option --frobnicate" in res.stderr, res.stderr


def tree_env_vars():
    """The SCAPE_* variables that the tree's code and scripts read (C getenv,
    Python os.environ, shell ${...}/$... and assignments): jobs set them for
    libscape, scapectl, scape-run, the Slurm scripts and the test tools."""
    pats = [r'getenv\("(SCAPE_[A-Z0-9_]+)"',
            r'environ(?:\.get\(|\[|\.setdefault\(|\.pop\()\s*"(SCAPE_[A-Z0-9_]+)"']
    shell = [r'\$\{?(SCAPE_[A-Z0-9_]+)', r'(?:^|[\s;(])(?:export\s+)?(SCAPE_[A-Z0-9_]+)=']
    found = set()
    for top in ("client", "slurm", "deploy", "tests"):
        for dirpath, _, files in os.walk(os.path.join(SOURCE, top)):
            for name in files:
                if name.startswith("CMakeLists") or name.endswith(".cmake"):
                    continue  # ${SCAPE_...} there are CMake variables
                if name == os.path.basename(__file__):
                    continue  # this file sets unknown ones on purpose
                is_shell = name.endswith((".sh", ".sbatch", ".py")) or "." not in name
                try:
                    with open(os.path.join(dirpath, name), errors="replace") as f:
                        text = f.read()
                except OSError:
                    continue
                for p in pats + (shell if is_shell else []):
                    found.update(re.findall(p, text, re.M))
    return found


def test_unknown_environment_variable_warns_with_the_closest_key():
    res = scaped("--print-config", env=clean_env(SCAPE_WARMUPP="7"))
    got = printed(res)
    assert got["warmup"] == "1"  # ignored
    assert "unknown environment variable SCAPE_WARMUPP, ignored (did you mean SCAPE_WARMUP?)" \
        in res.stderr, res.stderr
    assert len(res.stderr.splitlines()) == 1, res.stderr


def test_variables_the_tree_reads_get_no_warning():
    names = tree_env_vars()
    # the scan must see the ones named in the issue, or it scans nothing
    assert {"SCAPE_INDEX", "SCAPE_DAEMON_LOST_MS", "SCAPE_START_WAIT_MS", "SCAPE_BUILD_DIR",
            "SCAPE_PYTHON_ENV", "SCAPE_ARGS"} <= names, sorted(names)
    # those that are scaped's own keys (SCAPE_RHO) are not the point here
    keys = {"SCAPE_" + k.upper() for k in printed(scaped("--print-config"))}
    env = clean_env(**{n: "1" for n in names - keys})
    res = scaped("--print-config", env=env)
    assert res.returncode == 0, res.stderr
    assert res.stderr == "", res.stderr


def test_error_lines_name_the_cause_not_the_source_line(tmp_path):
    rt = str(tmp_path / "rt")
    res = scaped("--runtime-dir", rt, "--world", "2", "--auth", "none")
    assert res.returncode == 1, res.stdout + res.stderr
    err = [l for l in res.stderr.splitlines() if " ERROR " in l]
    assert err and "needs coordinator and listen endpoints" in err[0], res.stderr
    assert not re.search(r"\.c:[0-9]+\)", res.stderr), res.stderr
    # at log level debug the lines say where in the code they come from
    res = scaped("--runtime-dir", rt, "--world", "2", "--auth", "none", "--log-level", "debug")
    err = [l for l in res.stderr.splitlines() if " ERROR " in l]
    assert err and re.search(r" \(main\.c:[0-9]+\)$", err[0]), res.stderr


def test_listen_by_host_name(daemon_factory, tmp_path):
    """tcp://localhost:* binds localhost's address (/etc/hosts, no DNS): a
    two-daemon job trains through it and publishes the address."""
    coord = free_endpoints(1)[0]
    daemons = [daemon_factory(*ENGINE, "--world", "2", "--rank", str(r), "--coordinator", coord,
                              "--listen", "tcp://localhost:*", "--job", "9", "--trainers", "1",
                              "--comm-timeout-ms", "20000") for r in range(2)]
    procs = [run_trainer(d.endpoint, 0, 2000, 5, seed=1 + r, wait=False)
             for r, d in enumerate(daemons)]
    for p in procs:
        o, e = p.communicate(timeout=120)
        assert p.returncode == 0, o + e
    for d in daemons:
        assert re.fullmatch(r"tcp://127\.0\.0\.1:[0-9]+", data_endpoint(d)), data_endpoint(d)


def test_listen_host_name_that_does_not_resolve(tmp_path):
    """Refused at start, naming the name.  ('!' makes the C library refuse
    it as a host name without asking DNS: the tests send nothing off this
    machine.)"""
    coord = free_endpoints(1)[0]
    res = scaped("--runtime-dir", str(tmp_path / "rt"), "--world", "2", "--rank", "1",
                 "--auth", "none", "--coordinator", coord, "--listen", "tcp://no-such-host!:*",
                 "--comm-timeout-ms", "2000")
    assert res.returncode == 1, res.stderr
    assert "cannot listen on tcp://no-such-host!:*: 'no-such-host!' is neither an IPv4 " \
        "address nor an interface of this host, and as a host name it does not resolve" \
        in res.stderr, res.stderr
