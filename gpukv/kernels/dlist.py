"""Intrusive doubly linked lists threaded through table rows.

A list's members are rows of a ``nodes`` table that hold their neighbours in
two of its columns (``prev``, ``next_``; NULL at either end); the list itself
is a row (``owner``) of an ``owners`` table that holds its two ends in two
more (``head``, ``tail``). The eviction lists (page rows under a row of
``lru_lists``) are such lists; a block's children keep one end only
(``blocks.append_child``). What a list means, and counting its
members, is the caller's business: these two only keep the links.
"""

from __future__ import annotations

from ..core.layout import NULL
from .link import helper


@helper
def dlist_insert_after(nodes, prev, next_, owners, owner, head, tail, r, after):
    """Link row ``r`` (in no list) into ``owner``'s list right after row
    ``after`` (NULL: at the head)."""
    nxt = owners[owner, head] if after == NULL else nodes[after, next_]
    nodes[r, prev] = after
    nodes[r, next_] = nxt
    if after == NULL:
        owners[owner, head] = r
    else:
        nodes[after, next_] = r
    if nxt == NULL:
        owners[owner, tail] = r
    else:
        nodes[nxt, prev] = r


@helper
def dlist_remove(nodes, prev, next_, owners, owner, head, tail, r):
    """Take row ``r`` out of ``owner``'s list; its links become NULL."""
    prv = nodes[r, prev]
    nxt = nodes[r, next_]
    if prv == NULL:
        owners[owner, head] = nxt
    else:
        nodes[prv, next_] = nxt
    if nxt == NULL:
        owners[owner, tail] = prv
    else:
        nodes[nxt, prev] = prv
    nodes[r, prev] = NULL
    nodes[r, next_] = NULL
