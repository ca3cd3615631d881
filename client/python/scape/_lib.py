"""ctypes declarations for libscape: the structs of scape.h field for field,
and argtypes/restype for every function the binding calls.  Importing it
loads libscape from the first place of scape._find's list that loads."""
import ctypes
import os

from . import _find

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


LOADED_FROM = None  # the path libscape was loaded from (None: by soname)


def _load():
    tried = []
    for where, path, why in _find.candidates():
        if not _find.present(path):
            tried.append(_find.tried(where, path, why or "missing"))
        else:
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append(_find.tried(where, path, str(e)))
                continue
            global LOADED_FROM
            LOADED_FROM = path if os.sep in path else None
            return lib
    raise ImportError("scape: cannot load libscape.so; tried %s. %s"
                      % ("; ".join(tried), _find.FIX))


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
        "scape_step_in_flight": (ctypes.c_int, [sess]),
        "scape_post_tensors": (rc, [sess, ctypes.c_size_t, ctypes.c_size_t]),
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
