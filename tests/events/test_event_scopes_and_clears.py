"""What the event manager adds for router publishers: each stored event's
reuse scope (``KVCacheStoredData.scope``) and the position of tree clears in
the event stream (``mark_clear`` / ``take_clear_marks``)."""

from __future__ import annotations

from gpukv import ReuseScope
from gpukv.event_types import KVCacheRemovedData, KVCacheStoredData
from tests.support.backends import make_manager


def commit(mgr, tokens, scope=None):
    kv = mgr.create_kv_cache(input_tokens=tokens[:-1], scope=scope)
    n = kv.num_committed_tokens
    assert kv.resume() and kv.resize(len(tokens))
    kv.commit(tokens[n:])
    kv.close()


def stored(events):
    return [e.data for e in events if isinstance(e.data, KVCacheStoredData)]


def test_stored_events_carry_their_scope_down_the_chain():
    mgr = make_manager("cpu", tokens_per_block=4, max_kv_event_entries=1000)
    lora, salted = ReuseScope(lora_id=4), ReuseScope(lora_id=4, salt=2)
    commit(mgr, list(range(9)))
    commit(mgr, list(range(9)), scope=lora)
    commit(mgr, list(range(9)), scope=salted)
    assert [d.scope for d in stored(mgr.get_latest_events())] == [None, lora, salted]
    # Continuations under deep parents inherit the scope of their chain.
    commit(mgr, list(range(13)), scope=salted)
    commit(mgr, list(range(13)), scope=lora)
    commit(mgr, list(range(13)))
    data = stored(mgr.get_latest_events())
    assert [d.scope for d in data] == [salted, lora, None]
    assert all(d.parent_hash is not None for d in data)
    # ReuseScope() is the default scope: reported as None.
    commit(mgr, list(range(20, 25)), scope=ReuseScope())
    assert [d.scope for d in stored(mgr.get_latest_events())] == [None]


def test_a_clear_is_marked_where_it_begins():
    mgr = make_manager("cpu", tokens_per_block=4, max_kv_event_entries=1000)
    ev = mgr._events
    commit(mgr, list(range(8)))
    mgr.clear_reusable_blocks()
    commit(mgr, list(range(30, 38)))
    events = mgr.get_latest_events()
    (mark,) = ev.take_clear_marks()
    before = [e for e in events if e.event_id < mark]
    after = [e for e in events if e.event_id >= mark]
    assert [type(e.data).__name__ for e in before][-1] == "KVCacheStoredData"
    assert isinstance(after[0].data, KVCacheRemovedData)  # the clear's own removals come after the mark
    assert ev.take_clear_marks() == []


def test_a_clear_works_with_events_off():
    mgr = make_manager("cpu", tokens_per_block=4)
    mgr.clear_reusable_blocks()
    assert mgr._events is None
