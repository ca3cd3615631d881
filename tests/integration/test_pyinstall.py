"""The scape package's install with a real pip, and scape-run's --help, -h
and --version under an interpreter that has no numpy.  pip install of
client/python is refused, at install time and saying what to do, when no
libscape can be found; with one it installs.  The package's version is
scaped's (CMakeLists.txt's project(VERSION)).  tests/install/run.sh
installs the package from an installed prefix and trains through it."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import SOURCE, binary

PKG = os.path.join(SOURCE, "client", "python")

# Packaging and argument parsing, no instrumented code to speak of: the
# sanitizer build's run (libasan preloaded into every pip) skips it.
pytestmark = pytest.mark.skipif("libasan" in os.environ.get("LD_PRELOAD", ""),
                                reason="packaging only: nothing for the sanitizers to check")


def project_version():
    """scaped's version as CMakeLists.txt declares it."""
    with open(os.path.join(SOURCE, "CMakeLists.txt")) as f:
        m = re.search(r"project\(scaped\s+VERSION\s+([0-9.]+)", f.read())
    assert m, "no project(scaped VERSION ...) in CMakeLists.txt"
    return m.group(1)


def bare_env(**extra):
    """This environment without any way to find a libscape: no SCAPE_*, no
    PKG_CONFIG_PATH, no LD_LIBRARY_PATH, no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCAPE_") and
           k not in ("PKG_CONFIG_PATH", "LD_LIBRARY_PATH", "PYTHONPATH")}
    env.update(PYTHONDONTWRITEBYTECODE="1", PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    return env


def run(cmd, env, cwd):
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def pip(venv, *args, env):
    """The system's pip acting on venv's interpreter (the venvs have no pip
    of their own): offline, no wheel cache, the build with venv's setuptools."""
    return run([sys.executable, "-m", "pip", "--python", os.path.join(venv, "bin", "python"),
                *args], env, os.path.dirname(venv))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A copy of the package's source (pip builds in the tree it is given)
    and two virtual environments: `site` lends the system's numpy,
    setuptools and wheel; `bare` has nothing but Python."""
    d = str(tmp_path_factory.mktemp("pyinstall"))
    shutil.copytree(PKG, os.path.join(d, "src"),
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__",
                                                  "_prefix.py"))
    for name, flags in (("site", ["--system-site-packages"]), ("bare", [])):
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", *flags,
                        os.path.join(d, name)], check=True, timeout=60)
    return d


def skip_if_system_libscape(cwd):
    """The refusal needs a machine where bare_env() finds no libscape."""
    env = bare_env()
    r = run([sys.executable, "-c", "import ctypes.util; print(ctypes.util.find_library('scape'))"],
            env, cwd)
    pc = run(["pkg-config", "--exists", "scape"], env, cwd).returncode == 0
    if r.stdout.strip() != "None" or pc:
        pytest.skip("a libscape is installed system-wide (linker: %s, pkg-config scape: %s): "
                    "no install can be refused here" % (r.stdout.strip(), pc))


@pytest.mark.parametrize("lib", ["none", "missing"])
def test_install_refused_without_libscape(work, lib):
    """No libscape anywhere ($SCAPE_LIB naming a missing file, or nothing
    set): pip install fails, saying where it looked and the fix, and
    nothing of the package is installed."""
    if lib == "none":
        skip_if_system_libscape(work)
    venv = os.path.join(work, "site")
    missing = os.path.join(work, "nowhere", "libscape.so")
    env = bare_env(**({"SCAPE_LIB": missing} if lib == "missing" else {}))
    r = pip(venv, "install", "--no-cache-dir", "--no-build-isolation", "--no-index",
            os.path.join(work, "src"), env=env)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "refusing to install: no libscape.so was found" in out, out
    if lib == "missing":
        assert "$SCAPE_LIB: %s (missing)" % missing in out, out
    else:
        assert "$SCAPE_BUILD_DIR: not set" in out and "pkg-config scape: no scape.pc" in out, out
    for fix in ("PKG_CONFIG_PATH=PREFIX/lib/pkgconfig", "SCAPE_LIB=", "PREFIX/share/scaped/python",
                "docs/python.md"):
        assert fix in out, out
    assert pip(venv, "show", "scape", env=env).returncode != 0
    r = run([os.path.join(venv, "bin", "python"), "-c", "import scape"], env, work)
    assert r.returncode != 0 and "No module named 'scape'" in r.stderr, r.stderr


def test_install_with_libscape(work):
    """The same install with the build tree's libscape findable installs, at
    scaped's version; the installed `import scape` then loads the library
    when first used, and without one says where it looked and the fix."""
    venv = os.path.join(work, "site")
    build = os.path.dirname(os.path.dirname(binary("client", "libscape.so")))
    env = bare_env(SCAPE_BUILD_DIR=build)
    r = pip(venv, "install", "--no-cache-dir", "--no-build-isolation", "--no-index",
            os.path.join(work, "src"), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = pip(venv, "show", "scape", env=env)
    assert r.returncode == 0 and "Version: %s\n" % project_version() in r.stdout, r.stdout
    py = os.path.join(venv, "bin", "python")
    r = run([py, "-c", "import scape, scape._lib as l; print(scape.version(), l.LOADED_FROM)"],
            env, work)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[1] == os.path.join(build, "client", "libscape.so"), r.stdout
    assert r.stdout.split()[0] == project_version(), r.stdout  # libscape's, from CMake
    skip_if_system_libscape(work)
    r = run([py, "-c", "import scape; scape.attach"], bare_env(), work)
    assert r.returncode != 0 and "ImportError: scape: cannot load libscape.so" in r.stderr, \
        r.stderr
    assert "SCAPE_LIB=" in r.stderr and "tried $SCAPE_BUILD_DIR: not set;" in r.stderr, r.stderr


def test_run_help_and_version_without_numpy(work):
    """python -m scape.run from the source tree, and the scape-run a wheel
    installs, under an interpreter without numpy and without any libscape:
    --help and -h print the usage, --version scaped's version."""
    bare = os.path.join(work, "bare")
    py = os.path.join(bare, "bin", "python")
    env = bare_env()
    r = run([py, "-c", "import numpy"], env, work)
    assert r.returncode != 0 and "No module named 'numpy'" in r.stderr, r.stderr
    build = os.path.dirname(os.path.dirname(binary("client", "libscape.so")))
    r = pip(os.path.join(work, "site"), "wheel", "--no-cache-dir", "--no-build-isolation",
            "--no-index", "--no-deps", "-w", os.path.join(work, "dist"),
            os.path.join(work, "src"), env=bare_env(SCAPE_BUILD_DIR=build))
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = [os.path.join(work, "dist", w) for w in os.listdir(os.path.join(work, "dist"))]
    r = pip(bare, "install", "--no-cache-dir", "--no-index", "--no-deps", *wheel, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    for launcher, lenv in (([py, "-m", "scape.run"], bare_env(PYTHONPATH=PKG)),
                           ([os.path.join(bare, "bin", "scape-run")], env)):
        outs = {}
        for flag in ("--help", "-h", "--version"):
            r = run(launcher + [flag], lenv, work)
            assert r.returncode == 0, (launcher, flag, r.stderr)
            outs[flag] = r.stdout
        assert outs["--help"].startswith("usage: scape-run ") and "--nproc-per-node" in \
            outs["--help"], outs["--help"]
        assert outs["-h"] == outs["--help"]
        assert outs["--version"] == "scape-run %s\n" % project_version(), outs["--version"]
