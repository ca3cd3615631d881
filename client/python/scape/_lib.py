"""ctypes declarations for libscape: the structs of scape.h field for field,
and argtypes/restype for every function the binding calls."""
import ctypes
import ctypes.util
import os

# Read once, here; documented in docs/python.md.
_ENV_LIB = os.environ.get("SCAPE_LIB")
_ENV_BUILD = os.environ.get("SCAPE_BUILD_DIR")

DTYPE_F32, DTYPE_BF16 = 0, 1
MEMORY_HOST, MEMORY_CUDA = 0, 1


class Tensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p),
                ("offset", ctypes.c_size_t),
                ("length", ctypes.c_size_t),
                ("group", ctypes.c_uint)]

MAX_GROUPS = 16

# scape_options.interrupt: void (*)(void *arg, int *give_up)
INTERRUPT_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


class Options(ctypes.Structure):
    _fields_ = [("param_dtype", ctypes.c_int),
                ("grad_dtype", ctypes.c_int),
                ("memory", ctypes.c_int),
                ("device", ctypes.c_int),
                ("index", ctypes.c_int),
                ("timeout_ms", ctypes.c_int),
                ("start_wait_ms", ctypes.c_int),
                ("ngroups", ctypes.c_int),
                ("group_weight_decay", ctypes.POINTER(ctypes.c_float)),
                ("max_grad_norm", ctypes.c_float),
                ("daemon_lost_ms", ctypes.c_int),
                ("interrupt", INTERRUPT_FN),
                ("interrupt_arg", ctypes.c_void_p)]


class StepInfo(ctypes.Structure):
    _fields_ = [("step", ctypes.c_uint64),
                ("k", ctypes.c_uint64),
                ("density", ctypes.c_double),
                ("bytes", ctypes.c_uint64),
                ("wire_bytes", ctypes.c_uint64),
                ("residual_norm", ctypes.c_double),
                ("mask_churn", ctypes.c_double),
                ("step_seconds", ctypes.c_double),
                ("wait_seconds", ctypes.c_double),
                ("grad_norm", ctypes.c_double),
                ("clip", ctypes.c_double),
                ("mean_grad_norm", ctypes.c_double),
                ("mean_grad_exact", ctypes.c_int)]


class CheckpointInfo(ctypes.Structure):
    _fields_ = [("step", ctypes.c_uint64),
                ("layout_hash", ctypes.c_uint64),
                ("pending", ctypes.c_int),
                ("dir", ctypes.c_char * 1024),
                ("name", ctypes.c_char * 256),
                ("job", ctypes.c_uint32)]


def _installed_prefix():
    """(libdir, bindir) the CMake install wrote into scape/_prefix.py when it
    installed this package's source under PREFIX/share/scaped/python, or None."""
    try:
        from scape import _prefix
    except ImportError:
        return None
    return _prefix.LIBDIR, _prefix.BINDIR


def _pkg_config_libdir():
    """libscape's directory as pkg-config knows it (scape.pc), or None."""
    import shutil
    import subprocess
    if shutil.which("pkg-config") is None:
        return None
    try:
        r = subprocess.run(["pkg-config", "--variable=libdir", "scape"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def _candidates():
    """Where to look, in order; $SCAPE_LIB, when set, is the only place:
    $SCAPE_BUILD_DIR's build tree, the prefix the package was installed from,
    PREFIX/lib next to a package inside PREFIX, pkg-config, the linker's path."""
    if _ENV_LIB:
        return [_ENV_LIB]
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.join(_ENV_BUILD, "client", "libscape.so")] if _ENV_BUILD else []
    pre = _installed_prefix()
    if pre:
        paths.append(os.path.join(pre[0], "libscape.so"))
    paths.append(os.path.normpath(os.path.join(here, "..", "..", "lib", "libscape.so")))
    pc = _pkg_config_libdir()
    if pc:
        paths.append(os.path.join(pc, "libscape.so"))
    return paths + [ctypes.util.find_library("scape")]


LOADED_FROM = None  # the path libscape was loaded from (None: by soname)


def _load():
    tried = []
    for path in _candidates():
        if path is None:
            tried.append('ctypes.util.find_library("scape") (nothing found)')
        elif os.sep in path and not os.path.exists(path):
            tried.append("%s (missing)" % path)
        else:
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append("%s (%s)" % (path, e))
                continue
            global LOADED_FROM
            LOADED_FROM = path if os.sep in path else None
            return lib
    raise ImportError("scape: cannot load libscape.so; set SCAPE_LIB or SCAPE_BUILD_DIR. "
                      "Tried: " + "; ".join(tried))


def _declare(lib):
    P = ctypes.POINTER
    sess = ctypes.c_void_p
    rc = ctypes.c_int
    sigs = {
        "scape_options_default": (None, [P(Options)]),
        "scape_attach": (rc, [ctypes.c_char_p, P(Tensor), ctypes.c_size_t, P(Options),
                              P(sess)]),
        "scape_params": (ctypes.c_void_p, [sess]),
        "scape_grads": (ctypes.c_void_p, [sess]),
        "scape_numel": (ctypes.c_size_t, [sess]),
        "scape_index": (ctypes.c_int, [sess]),
        "scape_next_step": (ctypes.c_uint64, [sess]),
        "scape_sync": (rc, [sess]),
        "scape_step": (rc, [sess, ctypes.c_uint64, ctypes.c_float, P(ctypes.c_float),
                            P(StepInfo)]),
        "scape_step_begin": (rc, [sess, ctypes.c_uint64, ctypes.c_float, P(ctypes.c_float)]),
        "scape_step_begin_groups": (rc, [sess, ctypes.c_uint64, P(ctypes.c_float), ctypes.c_int,
                                         P(ctypes.c_float)]),
        "scape_step_wait": (rc, [sess, P(StepInfo)]),
        "scape_set_stream": (rc, [sess, ctypes.c_void_p, ctypes.c_int]),
        "scape_checkpoint": (rc, [sess, P(CheckpointInfo)]),
        "scape_resume": (rc, [sess, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64]),
        "scape_resumed_step": (rc, [sess, P(ctypes.c_uint64)]),
        "scape_detach": (rc, [P(sess)]),
        "scape_version": (ctypes.c_char_p, []),
        "scape_rc_name": (ctypes.c_char_p, [ctypes.c_int]),
        "scape_last_error": (ctypes.c_char_p, []),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


lib = _declare(_load())
