"""One request's turn, as the scenario tests play it."""

from __future__ import annotations


def finished(mgr, tokens, **create):
    """A turn that commits ``tokens`` and closes: its pages stay cached."""
    kv = mgr.create_kv_cache(**create)
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(tokens)
    kv.close()


def seq(i: int, n: int = 8) -> list[int]:
    """The tokens of request ``i`` (two blocks at T = 4 by default): no two requests share a token."""
    return [100 * i + j for j in range(n)]
