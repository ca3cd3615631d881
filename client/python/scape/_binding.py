"""The binding itself: what `scape` exports, loaded on first use (scape/__init__.py)
with numpy and libscape, so that importing the package (scape.run) needs neither."""
import ctypes
import dataclasses
import enum
import sys
import time

import numpy as np

from ._lib import (DTYPE_BF16, DTYPE_F32, INTERRUPT_FN, MAX_GROUPS, MEMORY_CUDA, MEMORY_HOST,
                   CheckpointInfo as _CheckpointInfo, Options, StepInfo as _StepInfo, Tensor,
                   lib)

__all__ = ["Rc", "ScapeError", "StepInfo", "Session", "attach", "version"]

_DTYPES = {"float32": (DTYPE_F32, ctypes.c_float), "bfloat16": (DTYPE_BF16, ctypes.c_uint16)}


class Rc(enum.IntEnum):
    """scape_rc, value for value (kernels/scape_rc.h)."""
    OK = 0
    INVALID = 1
    NOMEM = 2
    SYSTEM = 3
    CUDA = 4
    NCCL = 5
    ZMQ = 6
    PROTO = 7
    REMOTE = 8
    TIMEOUT = 9
    UNSUPPORTED = 10


class ScapeError(Exception):
    """A libscape call failed: .code is an Rc, .message scape_last_error()'s text."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (Rc(code).name, message))
        self.code = Rc(code)
        self.message = message


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """The daemon's figures for one step (scape_step_info)."""
    step: int
    k: int
    density: float
    bytes: int
    wire_bytes: int
    residual_norm: float
    mask_churn: float
    step_seconds: float
    wait_seconds: float
    grad_norm: float = 0.0   # with max_grad_norm: g_hat's norm before clipping (what
                             # the daemons sent: for scape the residual at the mask too)
    clip: float = 1.0        # the factor g_hat was scaled by (1: not clipped)
    mean_grad_norm: float = -1.0  # with max_grad_norm: the norm torch's clip_grad_norm_
                             # would see (the trainers' mean gradient); -1: none
    mean_grad_exact: int = 0  # 1: exact; 0: the bound (1/T) sum over daemons of |G_r|


def _check(rc):
    if rc != Rc.OK:
        raise ScapeError(rc, lib.scape_last_error().decode(errors="replace"))


_check_signals = ctypes.pythonapi.PyErr_CheckSignals
_check_signals.restype = ctypes.c_int
_check_signals.argtypes = []


class _Signals:
    """A session's scape_options.interrupt.  Python runs its signal handlers
    only between bytecodes, and a libscape call waits in C: libscape calls
    this after each signal and about every 100 ms, and it runs the handlers
    there (PyErr_CheckSignals).  A handler that returns (SIGUSR1, Lightning's
    SIGTERM) leaves the wait going on, so no step is lost.  One that raises
    (KeyboardInterrupt on Ctrl-C) is held while the wait goes on for up to
    settle_s, so that the step settles; a second one, or that bound, gives
    the wait up.  The call then raises what the handler raised."""

    def __init__(self, settle_s):
        self.settle_s = settle_s
        self.pending = None   # what a handler raised during the wait
        self.since = 0.0
        self.fn = INTERRUPT_FN(self._poll)  # kept alive as long as the session

    def hold(self, e):
        """A handler raised e during a wait: 1 when the wait is to be given up."""
        if self.pending is not None:
            return 1
        self.pending, self.since = e, time.monotonic()
        return 0

    def _poll(self, _arg, give_up):
        # A pending handler may already run on entry, before this try: that
        # exception leaves ctypes as unraisable, _unraisable holds it, and
        # give_up stays 0.
        try:
            _check_signals()
        except BaseException as e:  # noqa: B036 - held, raised once the call returns
            if self.hold(e):
                give_up[0] = 1
        if self.pending is not None and time.monotonic() - self.since >= self.settle_s:
            give_up[0] = 1

    def settle(self, rc):
        """After a call: raise what a signal handler raised during it, else
        ScapeError for rc."""
        msg = None if rc == Rc.OK else lib.scape_last_error().decode(errors="replace")
        e, self.pending = self.pending, None
        if e is not None:
            raise e
        if msg is not None:
            raise ScapeError(rc, msg)


_hook_before = sys.unraisablehook


def _unraisable(u):
    """A signal handler that raised as _Signals._poll was entered: ctypes
    reports that as unraisable; it belongs to that session's wait."""
    owner = getattr(u.object, "__self__", None)
    if isinstance(owner, _Signals) and u.exc_value is not None:
        owner.hold(u.exc_value)
        return
    _hook_before(u)


sys.unraisablehook = _unraisable


def version():
    """libscape's version string."""
    return lib.scape_version().decode()


def _tensors(layout):
    """(name, offset, length) triples, or (name, numel) pairs packed in order."""
    layout = [tuple(t) for t in layout]
    if not layout or {len(t) for t in layout} not in ({2}, {3}):
        raise ValueError("layout: a non-empty list of (name, offset, length) or of "
                         "(name, numel), not a mix")
    if len(layout[0]) == 3:
        return layout
    out, pos = [], 0
    for name, numel in layout:
        out.append((name, pos, numel))
        pos += numel
    return out


def _memory(device):
    """device "cpu", "cuda" or "cuda:N" -> (scape_memory, ordinal)."""
    kind, _, ordinal = str(device).partition(":")
    if kind == "cpu" and not ordinal:
        return MEMORY_HOST, 0
    if kind == "cuda":
        return MEMORY_CUDA, int(ordinal or 0)
    raise ValueError("device: 'cpu', 'cuda' or 'cuda:N', not %r" % (device,))


def _view(ptr, ctype, n):
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctype)), shape=(n,))


class _CudaBuffer:
    """n elements of device memory at ptr, for torch.as_tensor (no copy)."""

    def __init__(self, ptr, n, typestr):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": typestr,
                                          "data": (ptr, False), "version": 2}


def _cuda_view(ptr, ctype, n, ordinal):
    """A torch CUDA tensor over libscape's device buffer: float32, or bfloat16
    (handed over as int16 bits: the interface has no bfloat16)."""
    try:
        import torch
    except ImportError:
        raise ScapeError(Rc.UNSUPPORTED, "device buffers are torch tensors: torch is not "
                                         "installed (device_ptrs holds the addresses)") from None
    bf16 = ctype is ctypes.c_uint16
    t = torch.as_tensor(_CudaBuffer(ptr, n, "<i2" if bf16 else "<f4"),
                        device="cuda:%d" % ordinal)
    return t.view(torch.bfloat16) if bf16 else t


class Session:
    """One attached trainer.  params and grads view the shared buffers: numpy
    arrays in host memory (float32, or uint16 holding the bits of bfloat16),
    torch CUDA tensors in device memory (float32 or bfloat16), whose raw
    addresses are also device_ptrs (params, grads); None after detach()."""

    def __init__(self, handle, layout, param_ctype, grad_ctype, host, ordinal=0, ngroups=0,
                 signals=None):
        self._handle = handle
        self._signals = signals or _Signals(0.0)
        self.layout = layout
        self.ngroups = ngroups  # parameter groups (0: none)
        self.numel = lib.scape_numel(handle)
        self.index = lib.scape_index(handle)
        p, g = lib.scape_params(handle), lib.scape_grads(handle)
        self.device_ptrs = None if host else (p, g)
        if host:
            self.params = _view(p, param_ctype, self.numel)
            self.grads = _view(g, grad_ctype, self.numel)
            return
        try:
            self.params = _cuda_view(p, param_ctype, self.numel, ordinal)
            self.grads = _cuda_view(g, grad_ctype, self.numel, ordinal)
        except BaseException:
            self.params = self.grads = self.device_ptrs = None
            lib.scape_detach(ctypes.byref(self._handle))
            raise

    @property
    def next_step(self):
        """The step step() posts next: libscape's count, so that it stays true
        whichever bytecode a signal handler raised at (0 after detach)."""
        return lib.scape_next_step(self._handle)

    def _live(self):
        if self._handle.value is None:
            raise ScapeError(Rc.INVALID, "the session is detached")
        return self._handle

    def sync(self):
        """Once params holds this trainer's initial values and before the first
        step: wait until params holds the job's (trainer 0's at the start, the
        current ones when joining a running job)."""
        self._signals.settle(lib.scape_sync(self._live()))

    def set_stream(self, stream, blocking=False):
        """CUDA buffers: order the hand-over on `stream` (a cudaStream_t as an
        int, e.g. torch.cuda.current_stream().cuda_stream; 0 for the legacy
        default stream) instead of synchronising the device: each step's
        gradients are taken once that stream has made them, and the stream
        waits for the new parameters (blocking=True: step_wait waits for them
        on the host)."""
        _check(lib.scape_set_stream(self._live(), ctypes.c_void_p(stream or None),
                                    1 if blocking else 0))

    def post_tensors(self, first, count):
        """Bucketed hand-over: the gradients of tensors [first, first + count)
        (indices into the layout) are final for next_step, and the daemon may
        take them at once; they must stay as they are until that step's
        step() (or step_wait()) returns, and step() posts the rest.  Refused
        (ScapeError INVALID, naming the tensor) outside the layout, for a
        tensor already posted for that step, and while a step is in flight."""
        _check(lib.scape_post_tensors(self._live(), first, count))

    def step(self, lr, step=None, loss=None):
        """Post step `step` (default: next_step) with the gradients in place and
        wait for the new parameters; returns the daemon's StepInfo.  lr: one
        learning rate, or with parameter groups a list of one per group."""
        self.step_begin(lr, step, loss)
        return self.step_wait()

    def step_begin(self, lr, step=None, loss=None):
        """Post a step and return at once; step_wait() completes it."""
        step = self.next_step if step is None else step
        c_loss = None if loss is None else ctypes.byref(ctypes.c_float(loss))
        if isinstance(lr, (list, tuple)):
            lrs = (ctypes.c_float * max(1, len(lr)))(*lr)
            _check(lib.scape_step_begin_groups(self._live(), step, lrs, len(lr), c_loss))
        else:
            _check(lib.scape_step_begin(self._live(), step, lr, c_loss))

    def step_wait(self):
        """Wait for the posted step's parameters.  TIMEOUT leaves it in flight,
        and so does a KeyboardInterrupt that gave the wait up (see attach's
        interrupt_settle_ms): step_wait() again completes it."""
        info = _StepInfo()
        self._signals.settle(lib.scape_step_wait(self._live(), ctypes.byref(info)))
        return StepInfo(**{f: getattr(info, f) for f, _ in _StepInfo._fields_})

    def checkpoint(self):
        """The job's checkpoint of the state after the last completed step
        (between steps), on disk when this returns, with one daemon or several:
        {"dir", "name", "job", "step", "layout_hash", "pending"}.  name is dir
        relative to the daemon's checkpoint_dir ("" when not under it).  Before
        the first step of a fresh job: step 0, dir and name ""."""
        if lib.scape_step_in_flight(self._live()):
            # a step posted and not waited for: Ctrl-C between the post and
            # the wait (the KeyboardInterrupt handler then asks for this)
            self.step_wait()
        info = _CheckpointInfo()
        self._signals.settle(lib.scape_checkpoint(self._live(), ctypes.byref(info)))
        return {"dir": info.dir.decode(), "name": info.name.decode(), "job": info.job,
                "step": info.step, "layout_hash": info.layout_hash,
                "pending": bool(info.pending)}

    def resume(self, path, step=0, layout_hash=0):
        """Before the first step: restart the job from the checkpoint at path
        (absolute, or relative to the daemon's checkpoint_dir; every trainer
        asks); params then hold its parameters and next_step is the step after
        it.  step and layout_hash, when given, must match.  In a job restored
        at resumed_step and not stepped since, that step is a no-op and any
        other is refused."""
        self._signals.settle(lib.scape_resume(self._live(), str(path).encode(), step,
                                              layout_hash))

    @property
    def resumed_step(self):
        """The step whose checkpoint the job was restored from (the daemons'
        --resume or SCAPE_RESUME after a requeue, or a resume()), 0 for a
        fresh job; asked of the daemon each time (between steps)."""
        step = ctypes.c_uint64(0)
        _check(lib.scape_resumed_step(self._live(), ctypes.byref(step)))
        return step.value

    def detach(self):
        """Say goodbye and free the buffers; idempotent.  Views taken from
        params/grads before this point must not be used afterwards."""
        if self._handle.value is None:
            return
        self.params = self.grads = self.device_ptrs = None
        self._signals.settle(lib.scape_detach(ctypes.byref(self._handle)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()


def attach(endpoint=None, layout=(), dtype="float32", grad_dtype=None, index=-1,
           timeout_ms=600000, device="cpu", start_wait_ms=None, max_grad_norm=None,
           groups=None, tensor_groups=None, daemon_lost_ms=None, interrupt_settle_ms=10000):
    """Attach to scaped at endpoint (None: $SCAPE_ENDPOINT, else the default
    runtime directory) with layout, and return a Session.  With no daemon
    there it fails at once (ScapeError, saying where it looked), unless
    start_wait_ms (None: $SCAPE_START_WAIT_MS, else 0) gives a daemon that is
    still starting that long.  A call whose daemon dies fails once it has
    been gone for daemon_lost_ms (None: $SCAPE_DAEMON_LOST_MS, else 2000).
    A signal handler that raises during a call (Ctrl-C) has its exception
    raised once the call's reply came, or after interrupt_settle_ms more (or
    a second Ctrl-C) with the call given up (see docs/python.md).
    max_grad_norm (None: the daemon's) is the clipping bound this trainer
    expects; a daemon configured with another one refuses the attach.
    Parameter groups: groups lists each group's weight decay (None: the
    daemon's weight_decay), tensor_groups each tensor's group; step() then
    takes one learning rate per group."""
    tensors = _tensors(layout)
    try:
        (pd, pc), (gd, gc) = _DTYPES[dtype], _DTYPES[grad_dtype or dtype]
    except KeyError:
        raise ValueError("dtype: one of %s" % ", ".join(_DTYPES)) from None
    opts = Options()
    lib.scape_options_default(ctypes.byref(opts))
    opts.param_dtype, opts.grad_dtype = pd, gd
    opts.memory, opts.device = _memory(device)
    opts.index, opts.timeout_ms = index, timeout_ms
    opts.start_wait_ms = -1 if start_wait_ms is None else start_wait_ms
    opts.daemon_lost_ms = -1 if daemon_lost_ms is None else daemon_lost_ms
    signals = _Signals(interrupt_settle_ms / 1000.0)
    opts.interrupt = signals.fn
    if max_grad_norm is not None:
        if not max_grad_norm >= 0:
            raise ValueError("max_grad_norm: >= 0 (0: no clipping), or None for the daemon's")
        opts.max_grad_norm = max_grad_norm
    ngroups = 0 if groups is None else len(groups)
    tg = list(tensor_groups) if tensor_groups is not None else [0] * len(tensors)
    if len(tg) != len(tensors) or not 0 <= ngroups <= MAX_GROUPS or \
            any(not 0 <= g < max(1, ngroups) for g in tg):
        raise ValueError("parameter groups: at most %d, and one group index per tensor, each "
                         "below the number of groups" % MAX_GROUPS)
    if ngroups:
        wds = (ctypes.c_float * ngroups)(*[float("nan") if w is None else w for w in groups])
        opts.ngroups, opts.group_weight_decay = ngroups, wds
    names = [str(name).encode() for name, _, _ in tensors]
    c_layout = (Tensor * len(tensors))(*[Tensor(nm, off, n, g)
                                         for nm, (_, off, n), g in zip(names, tensors, tg)])
    handle = ctypes.c_void_p()
    rc = lib.scape_attach(None if endpoint is None else endpoint.encode(), c_layout,
                          len(tensors), ctypes.byref(opts), ctypes.byref(handle))
    if rc == Rc.OK and signals.pending is not None:
        lib.scape_detach(ctypes.byref(handle))  # attached, but the caller was interrupted
    signals.settle(rc)
    return Session(handle, tensors, pc, gc, opts.memory == MEMORY_HOST, opts.device, ngroups,
                   signals)


for _c in (Rc, ScapeError, StepInfo, Session):
    _c.__module__ = "scape"  # as users name them
