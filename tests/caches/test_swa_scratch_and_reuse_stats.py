"""SWA scratch reuse (D6, D7) and the reuse / copy statistics (M2, M3)."""

import pytest

import gpukv
from gpukv import introspect
from tests.support.backends import make_manager

T = 32


def scratch_manager(layers, rewind, **config):
    return make_manager(
        "cpu", tokens_per_block=T, layers=layers, swa_scratch_reuse=gpukv.SwaScratchReuse(rewind),
        pages_per_life_cycle=64, **config,
    )


@pytest.mark.parametrize("rewind, scratch", [(0, list(range(7))), (64, list(range(5)))])
def test_D7_scratch_blocks_share_one_slot_and_the_tail_keeps_real_pages(rewind, scratch):
    mgr = scratch_manager([gpukv.Attention(window=32)] * 8, rewind)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(256)
    assert kv.scratch_blocks(0).tolist() == scratch
    assert len(kv.scratch_page_indices(0)) == 1  # W = T: one block of window
    pages = kv.page_indices(0)
    assert (pages[scratch] == -1).all()
    assert (pages[len(scratch):] >= 0).all()  # block 7 always has a real page
    kv.close()
    introspect.check_sanity(mgr)


@pytest.mark.parametrize("rewind, chunk1, chunk2", [(0, list(range(6)), [8]), (32, list(range(5)), [])])
def test_D7_scratch_ranges_per_window_and_chunk(rewind, chunk1, chunk2):
    mgr = scratch_manager([gpukv.Attention(window=64), gpukv.Attention(window=256)], rewind)
    prompt = list(range(352))
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(256)
    assert kv.scratch_blocks(0).tolist() == chunk1
    assert kv.scratch_blocks(1).tolist() == []  # the window covers the whole chunk
    kv.commit(prompt[:256])
    kv.suspend()  # frees the scratch slots
    assert kv.scratch_page_indices(0).tolist() == []
    assert kv.resume() and kv.resize(352, 256)
    assert kv.scratch_blocks(0).tolist() == chunk2
    assert kv.scratch_blocks(1).tolist() == []
    kv.close()
    introspect.check_sanity(mgr)


def test_scratch_rules_for_capacity_changes():
    mgr = scratch_manager([gpukv.Attention(window=64)], 0)
    kv = mgr.create_kv_cache()
    kv.resume()
    with pytest.raises(ValueError, match="swa_scratch_reuse"):
        kv.resize(128, 64)  # history must stay within [old capacity - R, old capacity] = [0, 0]
    assert kv.resize(128)
    kv.close()

    mgr = scratch_manager([gpukv.Attention(window=64)], 64)
    kv = mgr.create_kv_cache()
    kv.resume()
    assert kv.resize(256) and len(kv.scratch_page_indices(0)) > 0
    with pytest.raises(ValueError, match="scratch slots"):
        kv.resize(200, 200)  # a rewind (shrinking) is refused while scratch slots are held
    kv.suspend()
    kv.resume()
    assert kv.resize(200, 200) and kv.capacity == 200
    kv.close()
    introspect.check_sanity(mgr)


def test_D6_scratch_across_prefill_turns_keeps_only_the_window():
    mgr = scratch_manager([gpukv.Attention(window=64)], 0, page_bytes=8 * T)
    prompt1, prompt2 = list(range(127)), list(range(200))
    kv1 = mgr.create_kv_cache()
    assert kv1.resume() and kv1.resize(127, 0)
    assert kv1.scratch_blocks(0).tolist() == [0, 1]  # stale at 127 within the input blocks [0, 4)
    # the engine writes the window's tokens into the real pages (blocks 2, 3)
    mem = mgr.page_memory(0).view("int64")
    for pos in range(64, 127):
        mem[kv1.page_indices(0)[pos // T], pos % T] = 1000 + pos
    kv1.commit(prompt1)
    kv1.close()  # the partial block 3 (31 tokens) is committed here
    n, pages = introspect.reuse_match_pages(mgr, prompt1, 0)
    assert n == 127 and [p is not None for p in pages] == [False, False, True, True]
    assert mgr.probe_reuse(prompt2) == 127  # at 127 only B2 (32 >= 32) and B3/31 are needed
    kv2 = mgr.create_kv_cache(prompt2)
    assert kv2.num_committed_tokens == 127 and kv2.resume()
    got = mgr.page_memory(0).view("int64")
    for pos in range(64, 127):  # the reused window holds what kv1 wrote (the tail via its private copy)
        assert got[kv2.page_indices(0)[pos // T], pos % T] == 1000 + pos
    kv2.close()
    introspect.check_sanity(mgr)


SSM_LAYERS = [gpukv.Attention(), gpukv.Attention(), gpukv.Ssm(), gpukv.Ssm()]


def seed(mgr, n):
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(n, n)
    kv.commit(list(range(n)), is_end=True)
    kv.close()


@pytest.mark.parametrize(
    "seed_len, lookup, partial, expected",
    [
        (None, 48, False, dict(lookups=1, hits=0, misses=1, reused_tokens=0, unreused_tokens=48, aligned_hits=0, unaligned_hits=0)),
        (32, 48, False, dict(lookups=1, hits=1, misses=0, reused_tokens=32, unreused_tokens=16, aligned_hits=1, unaligned_hits=0)),
        (48, 64, True, dict(lookups=1, hits=1, misses=0, reused_tokens=48, unreused_tokens=16, aligned_hits=0, unaligned_hits=1)),
    ],
)
def test_M2_ssm_snapshot_statistics(seed_len, lookup, partial, expected):
    mgr = make_manager("cpu", tokens_per_block=T, layers=SSM_LAYERS, commit_min_snapshot=True,
                       enable_partial_reuse=partial, pages_per_life_cycle=64)
    if seed_len:
        seed(mgr, seed_len)
    mgr.get_and_reset_ssm_snapshot_iteration_stats()  # only the lookup below counts
    kv = mgr.create_kv_cache(list(range(96))[:lookup])
    assert kv.num_committed_tokens == expected["reused_tokens"]
    stats = mgr.get_and_reset_ssm_snapshot_iteration_stats()
    assert {k: stats[k] for k in expected} == expected
    assert stats["hit_rate"] == expected["hits"] / expected["lookups"]
    assert mgr.get_and_reset_ssm_snapshot_iteration_stats() == {}
    kv.close()


def test_reuse_statistics_split_full_and_partial_block_reuse():
    mgr = make_manager("cpu", tokens_per_block=4, layers=[gpukv.Attention()], pages_per_life_cycle=64)
    introspect.insert_sequence(mgr, list(range(10)))
    for tokens in (list(range(8)), list(range(6)) + [99], [50, 51]):
        mgr.create_kv_cache(tokens).close()
    assert mgr.get_and_reset_reuse_stats() == dict(
        lookups=3, lookup_tokens=17, reused_tokens=14, full_block_reuses=1, partial_block_reuses=1,
        ssm_lookups=0, ssm_hits=0, ssm_misses=0, ssm_reused_tokens=0, ssm_unreused_tokens=0,
        ssm_aligned_hits=0, ssm_unaligned_hits=0,
    )
    assert mgr.get_and_reset_reuse_stats()["lookups"] == 0


def test_M3_first_resume_of_a_reused_ssm_cache_records_one_copy():
    mgr = make_manager("cpu", tokens_per_block=T, layers=SSM_LAYERS, commit_min_snapshot=True,
                       enable_partial_reuse=False, pages_per_life_cycle=64, page_bytes=64)
    seed(mgr, 32)
    mgr.get_and_reset_iteration_stats()
    kv = mgr.create_kv_cache(list(range(48)))
    assert kv.num_committed_tokens == 32
    assert kv.resume()
    ssm = mgr.ssm_life_cycle_id
    stats = mgr.get_and_reset_iteration_stats()
    assert stats[ssm]["iter_intra_device_copy_blocks"] == 1
    assert stats[ssm]["iter_intra_device_copy_bytes"] > 0
    assert 0 not in stats  # the reused prefix is whole blocks: no attention tail to copy
    kv.close()


def test_a_snapshot_copy_that_finds_no_page_is_skipped_and_the_older_snapshot_stays():
    mgr = make_manager("cpu", tokens_per_block=4, layers=[gpukv.Attention()], commit_min_snapshot=True,
                       pages_per_life_cycle=3)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8, 0)  # 2 of the 3 pages
    kv.commit([0, 1])  # the partial snapshot copies into the last free page: B0/2 {F2}
    n, pages = introspect.reuse_match_pages(mgr, [0, 1], 0)
    assert n == 2 and pages[0][1] == 2
    reader = mgr.create_kv_cache([0, 1])  # holds the snapshot: no page is evictable now
    assert reader.num_committed_tokens == 2
    kv.commit([2])  # B0/3 adopts B0/2's page; its own copy finds no page, even by eviction, and is skipped
    assert kv.num_committed_tokens == 3
    assert mgr.get_and_reset_eviction_stats()["evicted"] == 0
    n, pages = introspect.reuse_match_pages(mgr, [0, 1, 2], 0, enable_partial=True)
    assert n == 2 and pages[0][1] == 2  # the narrower snapshot survived on the longer block
    assert mgr.probe_reuse([0, 1, 2, 3]) == 2
    introspect.check_sanity(mgr)
    kv.close()
    reader.close()
    introspect.check_sanity(mgr)


def test_a_snapshot_copy_may_evict_the_narrower_snapshot_it_would_replace():
    """Eviction makes room for the copy; the only candidate is the block's own
    narrower page, whose death (full attention) removes the block: the later,
    wider snapshot is lost with it and nothing stays reusable."""
    mgr = make_manager("cpu", tokens_per_block=4, layers=[gpukv.Attention()], commit_min_snapshot=True,
                       pages_per_life_cycle=3)
    kv = mgr.create_kv_cache()
    assert kv.resume() and kv.resize(8, 0)
    kv.commit([0, 1])
    kv.commit([2])
    assert mgr.get_and_reset_eviction_stats() == {"evicted": 1, "migrated": 0, "dropped": 1}
    assert mgr.probe_reuse([0, 1, 2, 3]) == 0
    introspect.check_sanity(mgr)
    kv.close()
    introspect.check_sanity(mgr)
