"""The rules of each life-cycle kind, in one table (docs/semantics.md §1.5, §2.4-§2.9).

A life cycle's kind decides how its pages serve reuse. Every kernel and the
host ask the predicates below instead of testing a kind themselves; they are
plain functions of integers, compiled as kernel helpers (``kernels/link.py``)
and called as they are on the host.

| rule | full attention | sliding window | SSM |
|---|---|---|---|
| pages | one per block | one per block | one checkpoint per block; the live state has no block |
| needed at an endpoint (``is_checkpoint``, ``has_window``) | every block | every block outside the stale range | exactly a checkpoint at the endpoint |
| stale range (``has_window``) | empty | ``[sinks, window start)`` | not used |
| a page's death (``death_removes_subtree``) | removes the subtree | a sink block: the subtree; else that life cycle only | that life cycle only |
| planned drop starts at (``planned_drop_start``) | never | the stale end (the window) | the last block (its checkpoint) |

To add a kind: give it a ``KIND_*`` number here, answer every predicate for
it, and teach ``config.life_cycle_of`` which layer spec maps to it.
"""

from __future__ import annotations

KIND_FULL = 0  # full attention: every block up to the endpoint must be covered
KIND_SWA = 1  # sliding-window attention: only sink and in-window blocks
KIND_SSM = 2  # recurrent state: the endpoint must be exactly a checkpoint

NO_DROP = -1  # planned_drop_start: the kind keeps every block for later turns


def is_checkpoint(kind):
    """The kind keeps one state, not a page per block: its tree pages are
    checkpoints, an endpoint must be exactly one, and a sequence holds one
    live state page (fresh on its first resume) instead of per-block pages."""
    return kind == KIND_SSM


def has_window(kind):
    """Blocks between the sinks and the window go stale as the history grows
    (the stale range is not empty, scratch reuse applies)."""
    return kind == KIND_SWA


def death_removes_subtree(kind, is_sink_block):
    """When a page of a block dies (``is_sink_block``: one of the first
    ``sinks`` blocks of its chain), can nothing below it be reused any
    more? Full attention reads every block, a windowed kind its sinks; a
    checkpoint kind loses one checkpoint only."""
    if kind == KIND_FULL:
        return True
    if has_window(kind):
        return is_sink_block
    return False


def planned_drop_start(kind, stale_end, num_blocks):
    """The first of a turn's ``num_blocks`` committed blocks whose page a later
    turn will not need (§2.9), or ``NO_DROP``: the window (from the end of the
    stale range) for a windowed kind, the last checkpoint for a checkpoint
    kind, nothing for full attention."""
    if has_window(kind):
        return min(stale_end, num_blocks)
    if is_checkpoint(kind):
        return num_blocks - 1
    return NO_DROP
