"""Where libscape is looked for, in order.  Shared by the binding, which
loads the first place that loads (scape._lib), by scape-run, which looks
for scaped next to it, and by setup.py, whose install-time check asks for
the first that exists.  It loads nothing and imports nothing of the
package (setup.py runs it by path from the source tree), and reads its
environment variables once, here; docs/python.md lists them."""
import os
import runpy
import shutil
import subprocess

ENV_LIB = os.environ.get("SCAPE_LIB")
ENV_BUILD = os.environ.get("SCAPE_BUILD_DIR")
_HERE = os.path.dirname(os.path.abspath(__file__))

FIX = ("Install scaped first (cmake --install BUILD --prefix PREFIX, or `module load scaped`), "
       "then make its libscape.so findable: install the package the prefix ships (pip install "
       "PREFIX/share/scaped/python, which knows PREFIX), or set PKG_CONFIG_PATH=PREFIX/lib/"
       "pkgconfig (lib64 on RHEL-family systems), SCAPE_LIB=/path/to/libscape.so or "
       "SCAPE_BUILD_DIR=BUILD (a build tree); see docs/python.md, \"Installing\".")


def installed_prefix():
    """(libdir, bindir) the CMake install wrote into scape/_prefix.py when it
    installed this package's source under PREFIX/share/scaped/python, or None."""
    path = os.path.join(_HERE, "_prefix.py")
    if not os.path.isfile(path):
        return None
    pre = runpy.run_path(path)
    return pre["LIBDIR"], pre["BINDIR"]


def _pkg_config_libdir():
    """(libdir of scape.pc, or None; what pkg-config said when it has none)."""
    if shutil.which("pkg-config") is None:
        return None, "no pkg-config on PATH"
    try:
        r = subprocess.run(["pkg-config", "--variable=libdir", "scape"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return None, "pkg-config failed: %s" % e
    if r.returncode != 0 or not r.stdout.strip():
        return None, "no scape.pc on its path (PKG_CONFIG_PATH=%s)" \
            % os.environ.get("PKG_CONFIG_PATH", "")
    return r.stdout.strip(), None


def _linker():
    import ctypes.util  # runs ldconfig/ld; loads no library
    return ctypes.util.find_library("scape")


def candidates(beside=True):
    """(where, path or None, why none) in the order the binding tries them,
    each looked up only when asked for: $SCAPE_LIB, when set, alone; else
    $SCAPE_BUILD_DIR's build tree, the prefix the package was installed
    from, PREFIX/lib next to a package inside PREFIX (beside=False leaves it
    out: setup.py's package is not yet where it will run from), pkg-config,
    the linker's path (a soname)."""
    if ENV_LIB:
        yield "$SCAPE_LIB", ENV_LIB, None
        return
    yield ("$SCAPE_BUILD_DIR",
           os.path.join(ENV_BUILD, "client", "libscape.so") if ENV_BUILD else None, "not set")
    pre = installed_prefix()
    yield ("the prefix it came from (scape/_prefix.py)",
           os.path.join(pre[0], "libscape.so") if pre else None,
           "none, this is not the copy a scaped prefix ships")
    if beside:
        yield ("beside the package",
               os.path.normpath(os.path.join(_HERE, "..", "..", "lib", "libscape.so")), None)
    pc, why = _pkg_config_libdir()
    yield "pkg-config scape", os.path.join(pc, "libscape.so") if pc else None, why
    yield 'ctypes.util.find_library("scape")', _linker(), "nothing found"


def present(path):
    """Whether a candidate is there: a file, or a soname the linker found."""
    return path is not None and (os.sep not in path or os.path.isfile(path))


def tried(where, path, why):
    """One candidate as an error message lists it."""
    return "%s: %s" % (where, why if path is None else "%s (%s)" % (path, why))


def first_present(beside=True):
    """(the path of the first candidate that is there, or None; the ones
    before it, as tried() words them)."""
    seen = []
    for where, path, why in candidates(beside):
        if present(path):
            return path, seen
        seen.append(tried(where, path, why or "missing"))
    return None, seen
