"""scape.torch - a torch.optim.Optimizer whose step is scaped's.

The parameters and their .grad become views of libscape's flat shared
buffers, so backward() writes gradients straight into the memory the daemon
reads, and the daemon's update lands in the parameters with no copy.
"""
import contextlib
import math
import os
import warnings
import weakref

import torch

import scape
import scape._binding  # libscape loads with scape.torch: an ImportError here says the fix


_DTYPES = (torch.float32, torch.bfloat16)


def _one_dtype(named):
    """The parameters' one dtype (float32 or bfloat16); ValueError naming the
    parameters of each dtype when they mix, or of a dtype scaped cannot keep."""
    by = {}
    for n, p in named:
        by.setdefault(p.dtype, []).append(n)
    def names(ns):
        return ", ".join(ns[:3]) + (", ..." if len(ns) > 3 else "")
    if len(by) != 1 or next(iter(by)) not in _DTYPES:
        raise ValueError("ScapeOptimizer: every parameter float32, or every one bfloat16 "
                         "(the daemon keeps float32 master weights either way); got %s" %
                         "; ".join("%s (%s)" % (str(d).replace("torch.", ""), names(ns))
                                   for d, ns in sorted(by.items(), key=lambda x: str(x[0]))))
    return next(iter(by))


def _groups(params):
    """torch's params argument (tensors, (name, tensor) pairs, or a list of
    group dicts whose "params" are either) -> the named parameters in order,
    each one's group index, and the groups for torch.optim.Optimizer."""
    params = list(params)
    groups = params if params and isinstance(params[0], dict) else [{"params": params}]
    named, tgroup, torch_groups = [], [], []
    for gi, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise ValueError("ScapeOptimizer: parameter groups are dicts with 'params'")
        ps = g["params"]
        ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        mine = []
        for p in ps:
            n, t = p if isinstance(p, tuple) else ("p%d" % len(named), p)
            named.append((n, t))
            tgroup.append(gi)
            mine.append(t)
        d = dict(g)
        d["params"] = mine
        torch_groups.append(d)
    return named, tgroup, torch_groups


def _host_tensor(array, dtype):
    """A torch tensor over a session's host buffer (numpy float32, or uint16
    holding bfloat16 bits), sharing its memory."""
    if dtype == torch.float32:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view("int16")).view(torch.bfloat16)


_DEFAULTS = {}  # attach_defaults()'s, for the ScapeOptimizers made inside it

# bucket_mb when neither the argument nor $SCAPE_BUCKET_MB sets it: the
# size with the shortest iteration in tests/bench/buckets.py --torch
# (docs/benchmarks.md, "Bucket size")
DEFAULT_BUCKET_MB = 4.0


def _bucket_mb(value):
    """(size, chosen): bucket_mb as given, or $SCAPE_BUCKET_MB when None, or
    when that is unset or empty DEFAULT_BUCKET_MB (chosen False: nobody
    asked for it); ValueError naming where a bad value came from."""
    where = "bucket_mb=%r" % (value,)
    if value is None:
        raw = os.environ.get("SCAPE_BUCKET_MB", "").strip()
        if not raw:
            return DEFAULT_BUCKET_MB, False
        where = "SCAPE_BUCKET_MB=%r" % raw
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value < 0:
        raise ValueError("ScapeOptimizer: %s: the size of a gradient bucket in MB (2**20 "
                         "bytes) handed to the daemon as backward() fills it, or 0 to hand "
                         "every gradient over at step()" % where)
    return float(value), True


def _buckets(sizes, cap):
    """Runs of consecutive tensors (sizes in bytes) formed from the last tensor
    back, as backward produces the last layers' gradients first, each closed
    once it holds cap bytes: (first, count) pairs, the last tensors' first."""
    out, end, acc = [], len(sizes), 0
    for i in range(len(sizes) - 1, -1, -1):
        acc += sizes[i]
        if acc >= cap:
            out.append((i, end - i))
            end, acc = i, 0
    if end > 0:
        out.append((0, end))
    return out


def _stamp(g):
    """What says whether a .grad changed: the tensor's memory and its version
    counter, which every in-place operation on it (or on a view or a
    detach() of it) advances.  The views of the shared gradient buffer share
    one counter, the buffer's: their stamp is FLAT, checked against the
    buffer's counter as the last hook left it."""
    return None if g is None else (g.data_ptr(), g._version)


FLAT = "flat"


class _Handover:
    """Bucketed hand-over of one ScapeOptimizer: gradient hooks on every
    parameter post a bucket (Session.post_tensors) once this backward has
    produced all of its gradients, so that the daemon packs it while
    backward computes the rest; step() posts what is left.  A posted
    gradient is the daemon's until step() returns: a tensor hook, which runs
    before the gradient is accumulated, refuses a second backward into it."""

    def __init__(self, opt, names, cap, probe=False):
        self._opt = weakref.ref(opt)  # the model's hooks must not keep it alive
        # probe (the default size, not asked for): the first step posts
        # nothing and only watches for a second backward() into a gradient
        # (accumulation without no_post()) or a gradient changed before
        # step() (a local clip, GradScaler.unscale_), which turn it off
        self.probing, self.accumulated = probe, False
        views = opt._views
        self.names = names
        self.buckets = _buckets([gv.numel() * gv.element_size() for _, _, gv in views], cap)
        self.of = [0] * len(views)  # tensor -> its bucket
        for b, (first, count) in enumerate(self.buckets):
            self.of[first:first + count] = [b] * count
        takes = [p.requires_grad for p, _, _ in views]
        self.need = [sum(takes[f:f + c]) for f, c in self.buckets]  # hooked tensors
        self.paused = 0  # no_post() depth
        self.handles, self.nodes = [], []
        for i, (p, _, _) in enumerate(views):
            if takes[i]:
                self._hook(i, p)
        self.reset()

    def _hook(self, i, p):
        self.handles.append(p.register_hook(lambda g, i=i: self._before(i)))
        if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1
            self.handles.append(p.register_post_accumulate_grad_hook(
                lambda _p, i=i: self._after(i)))
            return
        # older torch: the hook of the parameter's AccumulateGrad node, as DDP
        # used; the parameter holds the node weakly, so it is kept here
        with torch.enable_grad():
            node = p.expand_as(p).grad_fn.next_functions[0][0]
        self.nodes.append(node)
        self.handles.append(node.register_hook(lambda *_a, i=i: self._after(i)))

    def reset(self):
        """A new step: nothing posted, no gradient produced."""
        self.posted = [False] * len(self.of)
        self.fired = [False] * len(self.of)
        self.seen = [None] * len(self.of)  # .grad's stamp when produced (probe) or posted
        self.flat_seen = None  # the buffer's version counter after the last hook
        self.left = list(self.need)
        self.nposted = 0

    def changed(self, opt, which):
        """The first tensor i with which[i] whose .grad is no longer the one
        stamped when backward produced it (probe) or it was posted, or None;
        one in the shared buffer counts as changed when anything in the
        buffer changed after the last hook."""
        moved = opt._flat_grads._version != self.flat_seen
        for i, (p, _, gv) in enumerate(opt._views):
            if not which[i]:
                continue
            g = p.grad
            if self.seen[i] == FLAT:
                if g is None or g.data_ptr() != gv.data_ptr() or moved:
                    return i
            elif _stamp(g) != self.seen[i]:
                return i
        return None

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles, self.nodes = [], []

    def _before(self, i):
        """A gradient is about to be accumulated into tensor i (any backward,
        no_post() too): refused when the daemon may be reading what it would
        change."""
        if self.probing:
            self.accumulated |= self.fired[i] and not self.paused
            return
        if self.posted[i] or (self.fired[i] and self.nposted):
            opt = self._opt()
            what = ("the gradient of tensor %d (%s) was" % (i, self.names[i]) if self.posted[i]
                    else "%d tensors' gradients were" % self.nposted)
            raise RuntimeError(
                "ScapeOptimizer: a second backward() before step(): %s handed to the daemon "
                "for step %d by the first one (bucketed hand-over), and must not change until "
                "step() returns. For gradient accumulation run the earlier micro-batches' "
                "backward() inside `with optimizer.no_post():` (only the last one hands "
                "gradients over), or turn bucketed hand-over off (bucket_mb=0, "
                "SCAPE_BUCKET_MB=0)" % (what, opt.session.next_step if opt is not None else 0))

    def _after(self, i):
        """Tensor i has this backward's gradient: post its bucket once every
        hooked tensor of it has one."""
        if self.paused or self.fired[i]:
            return
        self.fired[i] = True
        opt = self._opt()
        if opt is None or opt._flat_grads is None:
            return
        self.flat_seen = opt._flat_grads._version  # after this accumulation
        if self.probing:
            p, _, gv = opt._views[i]
            self.seen[i] = FLAT if p.grad is not None and \
                p.grad.data_ptr() == gv.data_ptr() else _stamp(p.grad)
            return
        b = self.of[i]
        self.left[b] -= 1
        if self.left[b] == 0 and opt.attached:
            self._post(opt, *self.buckets[b])

    def _post(self, opt, first, count):
        """Each gradient of the bucket into the shared buffer (a fresh .grad,
        after zero_grad(set_to_none=True), copied there and the view made
        .grad again), then the bucket to the daemon."""
        with torch.no_grad():
            for p, _, gv in opt._views[first:first + count]:
                g = p.grad
                if g is None:
                    gv.zero_()
                elif g.data_ptr() != gv.data_ptr():
                    gv.copy_(g)
                p.grad = gv
        self.seen[first:first + count] = [FLAT] * count
        self.flat_seen = opt._flat_grads._version
        opt._follow_stream()  # on CUDA the daemon waits for those copies
        opt.session.post_tensors(first, count)
        self.posted[first:first + count] = [True] * count
        self.nposted += count


@contextlib.contextmanager
def attach_defaults(**kwargs):
    """Within the block, a ScapeOptimizer made without endpoint, timeout_ms,
    start_wait_ms or max_grad_norm takes these: how an integration (the
    Lightning strategy) hands its settings, such as the Trainer's
    gradient_clip_val, to the optimizer the user's code makes.  adopt: a
    ScapeOptimizer still attached (of an earlier fit) whose session the new
    one takes over when it has the same parameters, groups and settings (so
    the trainer never leaves the job), and which is detached otherwise."""
    bad = set(kwargs) - {"endpoint", "timeout_ms", "start_wait_ms", "max_grad_norm", "adopt"}
    if bad:
        raise TypeError("attach_defaults: no setting %s" % ", ".join(sorted(bad)))
    saved = dict(_DEFAULTS)
    _DEFAULTS.update(kwargs)
    try:
        yield
    finally:
        _DEFAULTS.clear()
        _DEFAULTS.update(saved)


class ScapeOptimizer(torch.optim.Optimizer):
    """ScapeOptimizer(model.parameters()) or ScapeOptimizer(model.named_parameters()).

    Construction attaches and syncs: it returns once the parameters are the
    job's (trainer 0's at the start, after every expected trainer is there).
    Parameter groups as torch has them (a list of dicts with "params" and
    any of "lr" and "weight_decay"): every group's lr at each step and its
    weight decay (None: the daemon's weight_decay) go to the daemon, which
    applies them per tensor; a change of a group's lr between steps takes
    effect at the next step.  Parameters
    must be all float32 or all bfloat16 (the daemon keeps float32 master
    weights and hands back their bfloat16 rounding), all on the CPU or all
    on one CUDA device; on CUDA the
    flat buffers are libscape's cudaMalloc'd IPC buffers, which scape.attach
    hands over as CUDA tensors (unverified on a GPU so far).

    Gradient clipping happens in the daemon, on the reduced mean gradient
    (torch.nn.utils.clip_grad_norm_ on the local .grad would clip something
    else): max_grad_norm=1.0 states that the daemon must be configured with
    max_grad_norm: 1.0, and attaching fails with the reason when it is not;
    None takes the daemon's.  last_info.grad_norm is the norm before
    clipping, last_info.clip the factor applied.

    bucket_mb > 0 hands the gradients over in buckets of about that many MB
    (2**20 bytes) of consecutive tensors, formed from the last tensor back,
    as DDP's: a bucket goes to the daemon as soon as backward() has
    produced all its gradients, and the daemon packs it while backward
    computes the rest; step() hands over what is left.  Every backward()
    outside no_post() hands its gradients over for the next step, and they
    must not change until step() returns: a second backward() into them
    raises (gradient accumulation: no_post() around the earlier
    micro-batches).  0 hands everything over at step().  None takes
    $SCAPE_BUCKET_MB, or when that is unset DEFAULT_BUCKET_MB (measured,
    as DDP's 25 MB was): then the first step hands everything over and
    only watches; when it saw a second backward() into a gradient (gradient
    accumulation without no_post()) or a gradient changed between
    backward() and step() (a local clip, GradScaler.unscale_), the
    hand-over stays off, with a warning, instead of refusing the loop.  With
    a size asked for, a posted gradient changed before step() makes step()
    raise RuntimeError."""

    def __init__(self, params, endpoint=None, lr=1e-3, weight_decay=None, index=-1,
                 timeout_ms=None, start_wait_ms=None, max_grad_norm=None, bucket_mb=None):
        endpoint = _DEFAULTS.get("endpoint") if endpoint is None else endpoint
        timeout_ms = _DEFAULTS.get("timeout_ms", 600000) if timeout_ms is None else timeout_ms
        start_wait_ms = (_DEFAULTS.get("start_wait_ms", 0) if start_wait_ms is None
                         else start_wait_ms)
        if max_grad_norm is None:
            max_grad_norm = _DEFAULTS.get("max_grad_norm")
        self.max_grad_norm = max_grad_norm  # the bound stated at attach (None: the daemon's)
        self.bucket_mb, self._bucket_chosen = _bucket_mb(bucket_mb)
        self._handover = None  # bucketed hand-over's hooks (None: bucket_mb 0)
        named, tgroup, torch_groups = _groups(params)
        super().__init__(torch_groups, dict(lr=lr, weight_decay=weight_decay))
        # parameter groups go to the daemon when there are several, or any sets
        # a weight decay; otherwise one group with the daemon's weight_decay
        self._grouped = len(self.param_groups) > 1 or any(
            g["weight_decay"] is not None for g in self.param_groups)
        for g in self.param_groups:
            if g["weight_decay"] is not None and not g["weight_decay"] >= 0:
                raise ValueError("ScapeOptimizer: weight_decay %r: >= 0, or None for the "
                                 "daemon's" % (g["weight_decay"],))
        self._weight_decays = [g["weight_decay"] for g in self.param_groups]  # as registered
        self._registered = (endpoint, max_grad_norm, tgroup, self._grouped, self._weight_decays,
                            [n for n, _ in named])
        old = _DEFAULTS.get("adopt")
        if old is not None and old.attached:
            if old._registered == self._registered and len(named) == len(old._views) and \
                    all(p is q for (_, p), (q, _, _) in zip(named, old._views)):
                self._take_over(old)
                self._hand_over()
                return
            old.detach()
        dtype = _one_dtype(named)
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError("ScapeOptimizer: parameters on one device, got %s" %
                             ", ".join(sorted(str(d) for d in devices)))
        device = devices.pop()
        name = "bfloat16" if dtype == torch.bfloat16 else "float32"
        self.session = scape.attach(endpoint, [(n, p.numel()) for n, p in named],
                                    dtype=name, index=index, timeout_ms=timeout_ms,
                                    device=str(device), start_wait_ms=start_wait_ms,
                                    max_grad_norm=max_grad_norm,
                                    groups=[g["weight_decay"] for g in self.param_groups]
                                    if self._grouped else None,
                                    tensor_groups=tgroup if self._grouped else None)
        self._device = device if device.type == "cuda" else None
        try:  # the daemon holds a slot for us from here: give it back on any failure
            if self.session.device_ptrs is None:
                flat_p = _host_tensor(self.session.params, dtype)
                flat_g = _host_tensor(self.session.grads, dtype)
            else:
                flat_p, flat_g = self.session.params, self.session.grads
            spans = [(p, off, n) for (_, p), (_, off, n) in zip(named, self.session.layout)]
            with torch.no_grad():
                for p, off, n in spans:
                    flat_p[off:off + n].copy_(p.reshape(-1))
            self._follow_stream()  # the initial copies are on torch's current stream
            self.session.sync()
        except BaseException:
            self.session.detach()
            raise
        self._views = []  # (parameter, its view of the params buffer, of the grads one)
        with torch.no_grad():
            for p, off, n in spans:
                p.data = flat_p[off:off + n].view(p.shape)
                p.grad = flat_g[off:off + n].view(p.shape)
                self._views.append((p, p.data, p.grad))
        self._flat_grads = flat_g
        self.last_info = None  # the StepInfo of the latest step
        self._hand_over()

    def _hand_over(self):
        """With bucket_mb > 0: the gradient hooks of bucketed hand-over."""
        if self.bucket_mb > 0:
            self._handover = _Handover(self, self._registered[-1], self.bucket_mb * 2 ** 20,
                                       probe=not self._bucket_chosen)

    @contextlib.contextmanager
    def no_post(self):
        """Within the block, backward() hands no gradient over to the daemon
        (bucket_mb > 0): for the earlier micro-batches of gradient
        accumulation, whose gradients the last backward() adds to; with
        bucket_mb 0 it changes nothing."""
        h = self._handover
        if h is None:
            yield
            return
        h.paused += 1
        try:
            yield
        finally:
            h.paused -= 1

    def _pending(self, what):
        """RuntimeError when the last backward() handed gradients over that no
        step() has taken yet: `what` would change them."""
        h = self._handover
        if h is not None and h.nposted:
            raise RuntimeError(
                "ScapeOptimizer.%s: %d tensors' gradients were handed to the daemon for step %d "
                "by backward() (bucketed hand-over, bucket_mb=%g) and must not change until "
                "step() returns: call step() first, run a backward() that no step() follows "
                "inside `with optimizer.no_post():`, or use bucket_mb=0"
                % (what, h.nposted, self.session.next_step, self.bucket_mb))

    def state_dict(self):
        """The optimizer's state as torch keeps it ("state", "param_groups"
        with each group's hyper-parameters and parameter indices), where the
        state is the job's checkpoint of the state after the last step, on
        disk in the daemons' checkpoint_dir when this returns (with one daemon
        or several, and at the last step too).  It is named by
        "scaped_checkpoint" (the step directory as the daemon saw it),
        "checkpoint_name" (that directory relative to checkpoint_dir, which
        load_state_dict resolves against the loading daemon's checkpoint_dir)
        and "job".  Before the first step of a fresh job it describes that
        fresh job (step 0, no checkpoint; no checkpoint_dir needed): loading
        it then is a no-op.  Save it with torch.save next to the model's."""
        info = self.session.checkpoint()
        fresh = info["step"] == 0
        groups, index = [], 0
        for g in self.param_groups:
            saved = {k: v for k, v in g.items() if k != "params"}
            saved["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(saved)
        return {"state": {},
                "scaped_checkpoint": None if fresh else info["dir"],
                "checkpoint_name": info["name"] or None,
                "job": info["job"],
                "step": info["step"], "layout_hash": info["layout_hash"],
                "param_groups": groups}

    @property
    def resumed_step(self):
        """The step whose checkpoint the daemons restored (0: a fresh job).
        After a requeue they resume from their newest checkpoint on their own
        (scaped --resume, SCAPE_RESUME): restore the data position and the
        learning-rate schedule from this step; load_state_dict of a state_dict
        of this same step is a no-op, of any other step refused."""
        return self.session.resumed_step

    def load_state_dict(self, state_dict):
        """Before the first step: restart the job from that checkpoint (every
        trainer calls it); the parameters become the checkpoint's and the
        next step the one after it (session.next_step).  A fresh job's
        state_dict (step 0) is a no-op before the first step; a state_dict of
        the step the job was restored at (resumed_step) is a no-op until the
        next step.  Refused, with the reason, for another layout, groups or
        optimizer, a checkpoint pruned by checkpoint_keep or missing, or
        another step than the one a resumed job was restored at."""
        if not isinstance(state_dict, dict) or "scaped_checkpoint" not in state_dict:
            raise ValueError("ScapeOptimizer.load_state_dict: not a ScapeOptimizer "
                             "state_dict (no 'scaped_checkpoint')")
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            raise ValueError("ScapeOptimizer.load_state_dict: %d parameter groups saved, "
                             "this optimizer has %d" % (len(groups), len(self.param_groups)))
        where = state_dict["scaped_checkpoint"]
        if where is None:  # a fresh job's: nothing to restore
            if self.session.next_step != 1:
                raise ValueError("ScapeOptimizer.load_state_dict: a fresh job's state_dict "
                                 "(step 0) loads only before the first step; this job is at "
                                 "step %d" % (self.session.next_step - 1))
        else:
            name = state_dict.get("checkpoint_name")
            if name and where.rstrip("/").endswith("/" + name):
                where = name  # resolved against the daemon's checkpoint_dir
            self._pending("load_state_dict")
            self._follow_stream()  # the model's own load_state_dict copies land first
            self.session.resume(where, state_dict["step"], state_dict["layout_hash"])
        for g, saved in zip(self.param_groups, groups):
            g.update({k: v for k, v in saved.items() if k != "params"})

    def add_param_group(self, param_group):
        """torch.optim.Optimizer's, while constructing; refused afterwards: the
        parameters and their groups are registered with scaped at attach."""
        if getattr(self, "session", None) is not None:
            raise ValueError("ScapeOptimizer.add_param_group: the parameters and their groups "
                             "are registered with scaped when the optimizer is made; pass "
                             "every group to ScapeOptimizer(...) (for another set of "
                             "parameters: detach() and make a new ScapeOptimizer)")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none=True):
        """Zero the shared gradient buffer; .grad stays a view of it either way
        (set_to_none or not; step() would re-own a fresh .grad anyway).
        Refused (RuntimeError) while gradients handed over by backward()
        (bucket_mb) wait for step().  After detach(), torch's zero_grad."""
        if self._flat_grads is None:
            return super().zero_grad(set_to_none=set_to_none)
        self._pending("zero_grad")
        self._flat_grads.zero_()
        if self._handover is not None:
            self._handover.reset()

    def step(self, closure=None):
        """Evaluate closure (if any) for the loss, hand the step to scaped and
        return the loss.  The new parameters are in place on return.  A loss
        the closure returns is sent to the daemon for its metrics; on CUDA
        reading it waits for the stream that made it, as loss.item() does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr = [float(g["lr"]) for g in self.param_groups]  # a scheduler's may be a tensor
        for i, (g, wd) in enumerate(zip(self.param_groups, self._weight_decays)):
            if g["weight_decay"] != wd:
                raise ValueError("ScapeOptimizer.step: param_groups[%d]['weight_decay'] was "
                                 "changed from %r to %r; the daemon keeps each group's weight "
                                 "decay as registered at attach (only 'lr' may change between "
                                 "steps)" % (i, wd, g["weight_decay"]))
        self._check_handover()
        self._own_grads()
        self._follow_stream()
        self.session.step_begin(lr if self._grouped else lr[0],
                                loss=None if loss is None else
                                float(loss.detach() if torch.is_tensor(loss) else loss))
        if self._handover is not None:  # the step posted the rest
            self._handover.reset()
        self.last_info = self.session.step_wait()
        return loss

    def _check_handover(self):
        """Before step() hands over the rest: after the first step of the
        default bucket size (probe), keep the hand-over on only when the loop
        fits it; with a bucket size asked for, refuse a posted gradient that
        changed since it was posted (the daemon packed the posted one)."""
        h = self._handover
        if h is None:
            return
        if not h.probing:
            i = h.changed(self, h.posted)
            if i is not None:
                raise RuntimeError(
                    "ScapeOptimizer.step: gradients changed after backward() handed them to "
                    "the daemon for step %d (bucketed hand-over, bucket_mb=%g; the first of "
                    "them: tensor %d, %s), which packed them as they were: something changed "
                    ".grad in place or replaced it before step() (a local clip_grad_norm_, "
                    "GradScaler.unscale_). Let the daemon clip (max_grad_norm) and drop the "
                    "local change, or use bucket_mb=0"
                    % (self.session.next_step, self.bucket_mb, i, h.names[i]))
            return
        h.probing = False
        i = h.changed(self, h.fired)
        if not h.accumulated and i is None:
            return  # posting from the next step on
        self._unhook()
        self.bucket_mb = 0.0
        why = ("several backward() passes before step() (gradient accumulation)"
               if h.accumulated else "gradients changed between backward() and step() "
               "(a local clip_grad_norm_ or GradScaler.unscale_; the first of them: tensor "
               "%d, %s)" % (i, h.names[i]))
        warnings.warn(
            "ScapeOptimizer: %s: bucketed hand-over, on by default (bucket_mb=%g), is off "
            "for this optimizer, which hands every gradient over at step(). To keep it: "
            "run the earlier micro-batches' backward() inside `with optimizer.no_post():`, "
            "let the daemon clip (max_grad_norm), and pass bucket_mb (or set "
            "SCAPE_BUCKET_MB)" % (why, DEFAULT_BUCKET_MB), stacklevel=3)

    def _own_grads(self):
        """The daemon reads the gradients from its buffer, which each .grad is
        a view of.  model.zero_grad() (set_to_none, torch's default) drops
        that view, and backward then puts the gradient in a fresh tensor: its
        values are copied into the buffer (on the current stream, so before
        the hand-over's event) and .grad is the view again; a parameter the
        loss did not reach (.grad None) has a zero gradient.  A gradient
        already handed over (bucket_mb) is the buffer's as it is.  A parameter
        whose .data is no longer the buffer's is refused: the daemon's
        parameters would not reach it."""
        posted = self._handover.posted if self._handover is not None else None
        with torch.no_grad():
            for i, (p, pv, gv) in enumerate(self._views):
                if p.data_ptr() != pv.data_ptr():
                    raise RuntimeError(
                        "ScapeOptimizer.step: a parameter of shape %s no longer holds the "
                        "daemon's buffer (its .data was replaced, e.g. by "
                        "load_state_dict(assign=True) or .to()); the daemon's parameters "
                        "would not reach it: load values with load_state_dict() without "
                        "assign, or copy_() into the parameter" % (tuple(p.shape),))
                g = p.grad
                if g is not None and g.data_ptr() == gv.data_ptr():
                    continue
                if posted is not None and posted[i]:
                    p.grad = gv  # handed over: the daemon may be reading gv
                    continue
                if g is None:
                    gv.zero_()
                else:
                    gv.copy_(g)
                p.grad = gv

    def _follow_stream(self):
        """On CUDA: hand over on torch's current stream, which waits for the new
        parameters on the GPU (no device synchronisation, no host wait)."""
        if self._device is not None:
            self.session.set_stream(torch.cuda.current_stream(self._device).cuda_stream,
                                    blocking=False)

    @property
    def attached(self):
        """Whether this optimizer holds an attached session (not after
        detach() or after another ScapeOptimizer took it over)."""
        return self._flat_grads is not None

    def _take_over(self, old):
        """old's session, views and buffers become this optimizer's; old is
        left detached (without detaching the session)."""
        if any(p.data_ptr() != pv.data_ptr() for p, pv, _ in old._views):
            raise RuntimeError("ScapeOptimizer: a parameter no longer holds the daemon's buffer "
                               "since the earlier optimizer was made (its .data was replaced); "
                               "detach() that optimizer first")
        old._pending("take-over by a new ScapeOptimizer")
        old._unhook()
        self.session, self._device, self._views = old.session, old._device, old._views
        self._flat_grads, self.last_info = old._flat_grads, old.last_info
        old.session, old._flat_grads, old._views = None, None, []

    def detach(self):
        """Give the parameters private copies of their values, drop .grad, and
        detach from scaped; idempotent."""
        if self.session is None:  # handed over to another ScapeOptimizer
            return
        if self._flat_grads is not None:
            with torch.no_grad():
                for group in self.param_groups:
                    for p in group["params"]:
                        p.data = p.data.clone()
                        p.grad = None
            # the clones run on torch's current stream, which libscape
            # synchronises before it frees the buffers they read
            self._follow_stream()
        self._unhook()
        self._flat_grads = None
        self._views = []
        self.session.detach()

    def _unhook(self):
        if self._handover is not None:
            self._handover.remove()
            self._handover = None
