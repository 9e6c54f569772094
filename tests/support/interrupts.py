"""Interrupts where a signal handler would raise them: a ``KeyboardInterrupt``
before the ``k``-th line of gpukv's host code that runs, from a trace
function (``sys.settrace``).

Only lines an asynchronous exception may land in, and the launch protocol
must survive, count (``interruptible``): gpukv's host code, outside the
kernels and outside the call guard's own entry and exit (``CallGuard.run``
and the ``serialized`` wrapper).
"""

from __future__ import annotations

import os
import sys

import gpukv

HOST = os.path.dirname(gpukv.__file__)
KERNELS = os.path.join(HOST, "kernels")
LAUNCHER = os.path.join(HOST, "launcher.py")


def interruptible(code) -> bool:
    """Whether a line of ``code`` is one an interrupt may land before (see above)."""
    f = code.co_filename
    if not f.startswith(HOST) or f.startswith(KERNELS):
        return False
    return not (f == LAUNCHER and code.co_name in ("run", "call"))


def interrupt_at_line(k: int, where=None):
    """A trace function raising KeyboardInterrupt before the ``k``-th line of
    gpukv's host code (``interruptible``; and ``where(code)`` if given) that
    runs while it is set, as a signal handler would; returns (trace, fired:
    the lines it fired at)."""
    left, fired = [k], []

    def local(frame, event, arg):
        if event == "line" and left[0] > 0:
            left[0] -= 1
            if left[0] == 0:
                fired.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}")
                raise KeyboardInterrupt(f"injected at {fired[-1]}")
        return local

    def trace(frame, event, arg):
        return local if interruptible(frame.f_code) and (where is None or where(frame.f_code)) else None

    return trace, fired


def run_interrupted_at_line(k: int, call, where=None):
    """``call()`` with ``interrupt_at_line(k, where)`` set: ``(its value, or
    None when it was interrupted, the lines the interrupt fired at)``."""
    trace, fired = interrupt_at_line(k, where)
    sys.settrace(trace)
    try:
        value = call()
    except KeyboardInterrupt:
        value = None
    finally:
        sys.settrace(None)
    return value, fired


class Interrupter:
    """Raises KeyboardInterrupt before the ``k``-th line gpukv's host code runs
    in the next call, as a signal handler would (kernels, and the call guard's
    own entry and exit, which the interpreter cannot interrupt between
    instructions that matter, are left alone)."""

    def __init__(self, only: str | None = None):
        self.k = 0
        self.fired = 0
        self.only = only  # count lines of the functions of this name only

    def arm(self, k):
        self.k = k

    def _local(self, frame, event, arg):
        if event == "line" and self.k:
            self.k -= 1
            if self.k == 0:
                self.fired += 1
                raise KeyboardInterrupt("interrupted")
        return self._local

    def _global(self, frame, event, arg):
        if not interruptible(frame.f_code):
            return None
        if self.only is not None and frame.f_code.co_name != self.only:
            return None
        return self._local

    def __call__(self, fn, *args, **kwargs):
        """``fn(...)``; None when it was interrupted."""
        sys.settrace(self._global)
        try:
            return fn(*args, **kwargs)
        except KeyboardInterrupt:
            return None
        finally:
            sys.settrace(None)
            self.k = 0
