"""scape - the Python binding of libscape, the trainer's side of scaped.

    import scape
    with scape.attach(layout=[("w", 1000), ("b", 10)]) as s:
        s.params[:] = init          # numpy views of the shared buffers
        s.sync()                    # s.params: the job's parameters
        for _ in range(steps):
            s.grads[:] = grad(s.params)
            info = s.step(lr=1e-3)  # s.params now holds the new parameters

See docs/python.md.  scape.torch holds a torch.optim.Optimizer on top.

Importing the package loads nothing: the binding (numpy, and libscape
through ctypes) loads when one of its names is first used, so that
scape-run (python -m scape.run) needs nothing but Python.
"""
__version__ = "0.1.0"  # scaped's version: CMakeLists.txt's project(VERSION), pyproject's

__all__ = ["Rc", "ScapeError", "StepInfo", "Session", "attach", "version"]


def __getattr__(name):
    """The binding's names, loaded on first use (PEP 562); an ImportError
    names where libscape was looked for and the fix."""
    if name not in __all__:
        raise AttributeError("module 'scape' has no attribute %r" % name)
    from . import _binding
    globals().update({n: getattr(_binding, n) for n in __all__})
    return globals()[name]


def __dir__():
    return sorted(list(globals()) + __all__)
