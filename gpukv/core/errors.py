"""Every error gpukv raises on purpose, in one place; all are exported by ``gpukv``.

A rejected call changes nothing, whichever of these it raises (the message
names the argument or entry). Built-in errors are used where they say it
already: ``TypeError`` for a value of the wrong type, ``ValueError`` for one
out of range, ``MemoryError`` only from the allocator itself.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid configuration; the message names the field."""


class BackendError(RuntimeError):
    """The requested backend cannot run in this process."""


class TokenError(ValueError):
    """A token sequence holds something that is not a valid token."""


class LogicError(RuntimeError):
    """A call that is not allowed in the current state."""


class BusyError(LogicError):
    """A call on a manager while another call on it is in progress: from a
    callback inside that call, or from another thread (a manager, its caches
    and its sequences are driven from one thread, one call at a time)."""


class StaleMatchError(LogicError):
    """``admit_batch`` got a match older than a removal from the tree (an
    eviction, a freed block): its rows may no longer hold what it found, so
    the call is refused before it changes anything; match again."""


class IndexFullError(RuntimeError):
    """A call needs more block rows than ``CacheConfig.max_blocks``
    preallocated. The call is refused before it changes anything."""


class TreeError(RuntimeError):
    """A tree kernel stopped on a condition the host should have prevented:
    a defect in gpukv, not in the caller's input. The call's effects on the
    tables are as the kernel left them; report it."""
