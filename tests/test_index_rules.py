"""The prefix index's rules (DESIGN §7): every robustness rule, tiers, domains, matching."""

from __future__ import annotations

import pytest
from index_support import Producer, tokens

from kvstream.index import HashConfigMismatchError, HashRequest, PrefixIndex, WorkerKey
from kvstream.index.table import GroupTable

W0 = WorkerKey("w0")


def fresh(p: Producer | None = None, **kw: object) -> tuple[PrefixIndex, Producer]:
    p = p or Producer(**kw)  # type: ignore[arg-type]
    idx = PrefixIndex()
    idx.apply(p.batch(p.created()))
    return idx, p


def depth(idx: PrefixIndex, toks: list[int], worker: WorkerKey = W0, **kw: object) -> int:
    m = idx.match(toks, **kw).get(worker)  # type: ignore[arg-type]
    assert m is not None
    return m.matched_blocks


def test_stored_chain_matches_its_prefix() -> None:
    idx, p = fresh()
    t = tokens(17)  # 4 full blocks of 4 tokens + 1
    idx.apply(p.batch(p.stored(p.chain(t))))
    m = idx.match(t).get(W0)
    assert m is not None
    assert (m.matched_blocks, m.request_blocks, m.matched_tokens) == (4, 4, 16)
    assert m.trusted
    assert m.hash_algo == "blake3_64"
    assert m.tokens_per_block == 4
    # the last token never counts: 16 tokens -> blocks of tokens[:-1] -> 3 full blocks
    assert depth(idx, t[:16]) == 3
    assert depth(idx, t[:16], request=HashRequest(drop_last_token=False)) == 4
    # another continuation shares only the common prefix
    other = t[:8] + tokens(12, seed=5)
    assert depth(idx, other) == 2
    idx.check()


def test_removed_leaf_and_middle_block() -> None:
    idx, p = fresh()
    t = tokens(21)
    hs = p.chain(t)
    idx.apply(p.batch(p.stored(hs)))
    idx.apply(p.batch(p.removed([hs[4]])))
    assert depth(idx, t) == 4
    idx.apply(p.batch(p.removed([hs[1]])))  # a middle block: its descendants are unusable
    assert depth(idx, t) == 1
    table = idx.table(W0)
    assert table is not None
    assert table.ghosts == 1
    assert table.present == 3
    assert table.rooted_count == 1
    idx.apply(p.batch(p.stored([hs[1]], parent=hs[0])))  # back: the chain is whole again
    assert depth(idx, t) == 4
    idx.check()
    # removing every block leaves nothing behind (ghosts are collected)
    idx.apply(p.batch(p.removed([hs[3], hs[2], hs[1], hs[0]])))
    assert len(table) == 0
    assert idx.domain_of(W0) is not None
    assert idx.match_hashes(idx.domain_of(W0), hs) == {}  # type: ignore[arg-type]
    idx.check()


def test_duplicate_stores_and_removals_are_reference_counted() -> None:
    idx, p = fresh()
    t = tokens(9)
    hs = p.chain(t)
    idx.apply(p.batch(p.stored(hs), p.stored(hs[:1])))
    st = idx.info(W0).stats
    assert st.duplicate_stores == 1
    idx.apply(p.batch(p.removed([hs[0]])))  # one reference left
    assert depth(idx, t) == 2
    assert idx.info(W0).stats.refcounted_removes == 1
    idx.apply(p.batch(p.removed([hs[1]]), p.removed([hs[0]])))
    assert depth(idx, t) == 0
    idx.apply(p.batch(p.removed([hs[0]])))  # already gone: counted, ignored
    assert idx.info(W0).stats.unknown_removes == 1
    idx.check()


def test_removal_and_update_of_unknown_blocks_are_counted() -> None:
    idx, p = fresh()
    t = tokens(9)
    hs = p.chain(t)
    idx.apply(p.batch(p.removed([b"\x01" * 8, b"\x02" * 8]), p.updated(b"\x03" * 8, 0, 1)))
    st = idx.info(W0).stats
    assert (st.unknown_removes, st.unknown_updates) == (2, 1)
    idx.apply(p.batch(p.stored(hs)))
    assert depth(idx, t) == 2
    idx.check()


def test_store_with_unknown_parent_is_kept_unmatchable_until_the_parent_arrives() -> None:
    idx, p = fresh()
    t = tokens(17)
    hs = p.chain(t)
    idx.apply(p.batch(p.stored(hs[2:], parent=hs[1])))
    assert idx.info(W0).stats.unknown_parent_stores == 1
    assert depth(idx, t) == 0
    info = idx.info(W0).groups[0]
    assert (info.blocks, info.rooted_blocks, info.ghost_blocks) == (2, 0, 1)
    idx.apply(p.batch(p.stored(hs[:1])))
    assert depth(idx, t) == 1
    idx.apply(p.batch(p.stored(hs[1:2], parent=hs[0])))  # the missing link
    assert depth(idx, t) == 4
    idx.check()


def test_a_parent_cycle_is_refused() -> None:
    idx, p = fresh()
    a, b = b"\xaa" * 8, b"\xbb" * 8
    idx.apply(p.batch(p.stored([b], parent=a)))  # a: ghost with unknown parent
    idx.apply(p.batch(p.stored([a], parent=b)))  # would make a -> b -> a
    assert idx.info(W0).stats.parent_mismatches == 1
    table = idx.table(W0)
    assert table is not None
    assert table.rooted_count == 0
    idx.check()


def test_event_id_gap_makes_the_worker_stale_until_every_group_clears() -> None:
    idx, p = fresh()
    idx.apply(p.batch(p.created(group=1)))
    t = tokens(9)
    hs = p.chain(t)
    idx.apply(p.batch(p.stored(hs)))
    p.skip(3)
    idx.apply(p.batch(p.stored(hs[:1], group=1)))
    info = idx.info(W0)
    assert info.stale
    assert "gap" in info.stale_reason
    assert info.stats.gaps == 1
    assert info.stats.gap_events == 3
    m = idx.match(t).get(W0)
    assert m is not None
    assert m.matched_blocks == 2
    assert not m.trusted
    assert m.usable_blocks == 0
    assert m.note.startswith("stale")
    assert not idx.is_trusted(W0)
    idx.apply(p.batch(p.cleared(group=0)))
    assert idx.info(W0).stale  # group 1 not cleared yet
    idx.apply(p.batch(p.cleared(group=1)))
    info = idx.info(W0)
    assert not info.stale
    assert info.stats.resyncs == 1
    assert depth(idx, t) == 0
    idx.check()


def test_lost_marker_makes_the_worker_stale_and_ids_continue_after_its_range() -> None:
    idx, p = fresh()
    t = tokens(9)
    hs = p.chain(t)
    marker = p.lost(5)
    assert marker.event_id == marker.data.first_event_id + 4  # type: ignore[union-attr]
    idx.apply(p.batch(marker, p.stored(hs)))
    info = idx.info(W0)
    assert info.stale
    assert "lost 5" in info.stale_reason
    assert (info.stats.lost_markers, info.stats.lost_events, info.stats.gaps) == (1, 5, 0)
    assert info.next_event_id == p.next_id
    idx.apply(p.batch(marker))  # redelivered: a duplicate
    assert idx.info(W0).stats.duplicate_events == 1


def test_new_incarnation_purges_and_trusts_again() -> None:
    idx, p = fresh()
    t = tokens(9)
    hs = p.chain(t)
    idx.apply(p.batch(p.stored(hs)))
    p.skip()
    idx.apply(p.batch(p.stored(hs[:1])))
    assert idx.info(W0).stale
    old = p.batch(p.stored(hs))
    p.restart(2)
    idx.apply(p.batch(p.created()))
    info = idx.info(W0)
    assert not info.stale
    assert info.incarnation == 2
    assert info.stats.incarnation_changes == 1
    assert info.stats.purges == 1
    assert depth(idx, t) == 0
    idx.apply(old)  # a late batch of the old process
    assert idx.info(W0).stats.old_incarnation_batches == 1
    assert depth(idx, t) == 0
    idx.check()


def test_joining_mid_stream_is_stale() -> None:
    p = Producer()
    p.created()
    idx = PrefixIndex()
    idx.apply(p.batch(p.stored(p.chain(tokens(9)))))
    info = idx.info(W0)
    assert info.stale
    assert "mid-stream" in info.stale_reason


def test_redelivered_batches_are_skipped_not_recounted() -> None:
    idx, p = fresh()
    t = tokens(9)
    hs = p.chain(t)
    b = p.batch(p.stored(hs))
    idx.apply(b)
    idx.apply(b)
    st = idx.info(W0).stats
    assert st.duplicate_events == 1
    assert st.duplicate_stores == 0
    idx.apply(p.batch(p.removed(hs[::-1])))
    assert depth(idx, t) == 0


def test_cleared_purges_one_group() -> None:
    idx, p = fresh()
    idx.apply(p.batch(p.created(group=1)))
    t = tokens(9)
    hs = p.chain(t)
    idx.apply(p.batch(p.stored(hs), p.stored(hs, group=1), p.cleared(group=0)))
    assert depth(idx, t) == 0
    assert depth(idx, t, layer_group_id=1) == 2
    assert not idx.info(W0).stale


def test_explicit_resync_and_mark_stale() -> None:
    idx, p = fresh()
    t = tokens(9)
    hs = p.chain(t)
    idx.apply(p.batch(p.stored(hs)))
    idx.mark_stale(W0, "health check failed")
    assert not idx.is_trusted(W0)
    idx.resync(W0)
    assert idx.is_trusted(W0)
    assert depth(idx, t) == 0
    p.skip(10)  # any id is accepted right after an explicit resync
    idx.apply(p.batch(p.stored(hs)))
    assert idx.is_trusted(W0)
    assert depth(idx, t) == 2


def test_skipped_ids_are_not_gaps() -> None:
    idx, p = fresh()
    t = tokens(9)
    hs = p.chain(t)
    p.skip(2)  # two events the decoder could not represent
    idx.apply(p.batch(p.stored(hs)), skipped_ids=[1, 2])
    p.skip(1)
    idx.apply(p.batch(p.stored(hs[:1])), skipped_ids=[4])
    info = idx.info(W0)
    assert not info.stale
    assert info.stats.skipped_events == 3


def test_hash_algorithm_or_block_size_change_purges_the_group() -> None:
    idx, p = fresh()
    t = tokens(9)
    idx.apply(p.batch(p.stored(p.chain(t))))
    other = Producer(algo="v1_block_key")
    hs = other.chain(t)
    idx.apply(p.batch(p.stored(hs, algo="v1_block_key")))
    st = idx.info(W0).stats
    assert st.hash_algo_changes == 1
    assert st.purges == 1
    assert idx.domain_of(W0) == ("v1_block_key", 4, 0)
    assert depth(idx, t) == 2
    idx.apply(p.batch(p.created(tpb=8)))
    assert idx.info(W0).stats.block_size_changes == 1
    assert depth(idx, t) == 0


def test_tiers_weight_the_match_and_move_with_updates() -> None:
    idx, p = fresh()
    t = tokens(13)
    hs = p.chain(t)
    idx.apply(p.batch(p.stored(hs[:1]), p.stored(hs[1:], parent=hs[0], level=1)))
    m = idx.match(t).get(W0)
    assert m is not None
    assert m.matched_blocks == 3
    assert m.weighted_blocks == pytest.approx(1.0 + 0.8 + 0.8)
    idx.apply(p.batch(p.updated(hs[2], 1, 2)))  # host -> disk
    m = idx.match(t, tier_weights=(1.0, 0.5, 0.25)).get(W0)
    assert m is not None
    assert m.weighted_blocks == pytest.approx(1.0 + 0.5 + 0.25)
    table = idx.table(W0)
    assert table is not None
    assert table.tiers_of(hs[2]) == (0, 0, 1, 0)
    # a copy on the GPU and one on the host: removing the GPU copy keeps the block
    idx.apply(p.batch(p.stored([hs[1]], parent=hs[0], level=0), p.removed([hs[1]], level=0)))
    assert table.tiers_of(hs[1]) == (0, 1, 0, 0)
    idx.apply(p.batch(p.removed([hs[1]], level=2)))  # not held there: taken from host
    st = idx.info(W0).stats
    assert st.tier_mismatches == 1
    assert depth(idx, t) == 1
    idx.apply(p.batch(p.priority(hs[0], 35, 80)))
    assert idx.info(W0).stats.priority_updates == 1
    idx.check()


def test_domains_hash_each_worker_its_own_way() -> None:
    idx = PrefixIndex()
    t = tokens(33)
    a = Producer("a", algo="blake3_64", tpb=4)
    b = Producer("b", algo="v2_sha256", tpb=8)
    for p in (a, b):
        idx.apply(p.batch(p.created(), p.stored(p.chain(t)[:3])))
    res = idx.match(t)
    ma, mb = res.get(WorkerKey("a")), res.get(WorkerKey("b"))
    assert ma is not None
    assert mb is not None
    assert (ma.matched_blocks, ma.matched_tokens) == (3, 12)
    assert (mb.matched_blocks, mb.matched_tokens) == (3, 24)
    assert sorted(idx.domains()) == [("blake3_64", 4, 0), ("v2_sha256", 8, 0)]
    with pytest.raises(HashConfigMismatchError, match="v2_sha256"):
        idx.match(t, hash_algo="blake3_64")
    with pytest.raises(HashConfigMismatchError, match="8-token"):
        idx.match(t, tokens_per_block=4)


def test_block_size_is_advertised_configured_or_inferred() -> None:
    p = Producer()
    t = tokens(9)
    batch = p.batch(p.stored(p.chain(t)))  # no created event (bridged vLLM/SGLang, schema v1)
    idx = PrefixIndex()
    idx.apply(batch)
    assert depth(idx, t) == 2  # inferred: the largest stored block is a full one (4 tokens)
    idx = PrefixIndex(default_tokens_per_block=4)
    idx.apply(batch)
    assert depth(idx, t) == 2
    three = Producer(tpb=3)  # a worker whose only stored blocks hold 3 tokens
    idx = PrefixIndex()
    idx.apply(three.batch(three.stored(three.chain(t[:3]))))
    assert depth(idx, t) == 1  # matched with 3-token blocks, as the worker hashed them


def test_ranks_are_separate_workers_and_unknown_candidates_are_reported() -> None:
    idx = PrefixIndex()
    t = tokens(9)
    r0, r1 = Producer("inst", rank=0), Producer("inst", rank=1)
    idx.apply(r0.batch(r0.created(), r0.stored(r0.chain(t))))
    idx.apply(r1.batch(r1.created()))
    res = idx.match(t, workers=[("inst", 0), ("inst", 1), ("nobody", None)])
    assert [m.matched_blocks for m in res] == [2, 0, 0]
    assert res.matches[2].note == "unknown worker"
    assert str(res.matches[0].worker) == "inst/0"
    assert WorkerKey.parse("inst/0") == ("inst", 0)
    assert WorkerKey.parse("x/-") == ("x", None)


def test_forget_removes_a_worker() -> None:
    idx, p = fresh()
    t = tokens(9)
    idx.apply(p.batch(p.stored(p.chain(t))))
    idx.forget(W0)
    assert W0 not in idx
    assert idx.workers() == []
    idx.check()


def test_stats_sum_the_workers() -> None:
    idx = PrefixIndex()
    for name in ("a", "b"):
        p = Producer(name)
        idx.apply(p.batch(p.created(), p.stored(p.chain(tokens(9)))))
    s = idx.stats()
    assert (s.workers, s.blocks, s.counters.stored_blocks, s.domains) == (2, 4, 4, 1)
    assert s.as_dict()["stored_events"] == 2


def test_removing_a_branching_block_unroots_every_subtree() -> None:
    from kvstream.index.domain import MaskMap
    from kvstream.index.stats import SourceStats

    table = GroupTable(1)
    masks = MaskMap()
    table.attach(masks)
    p = Producer()
    st = SourceStats()
    base = tokens(8)
    root = p.chain(base)
    table.store(None, p.stored(root).data.blocks, st)  # type: ignore[union-attr]
    for i in range(5):
        hs = p.chain(base + tokens(8, seed=i + 1))
        table.store(root[1], p.stored(hs[2:]).data.blocks, st)  # type: ignore[union-attr]
    assert sum(1 for _, par, _ in table.nodes() if par == root[1]) == 5
    table.check()
    table.remove([root[1]], None, st)
    table.check()
    assert table.rooted_count == 1
    assert table.ghosts == 1
    assert len(masks) == 1
    table.store(root[0], p.stored(root[1:2]).data.blocks, st)  # type: ignore[union-attr]
    table.check()
    assert table.rooted_count == 12
    assert len(masks) == 12
    for i in range(5):  # leaves first, then the branch point: everything is collected
        hs = p.chain(base + tokens(8, seed=i + 1))
        table.remove(hs[:1:-1], None, st)
    table.remove(root[::-1], None, st)
    table.check()
    assert len(table) == 0
    assert masks.as_dict() == {}


def test_more_blocks_than_advertised_means_missed_removals() -> None:
    p = Producer()
    idx = PrefixIndex()
    idx.apply(p.batch(p.created(capacity=(2, 1))))
    hs = p.chain(tokens(17))
    idx.apply(p.batch(p.stored(hs[:3])))
    assert idx.is_trusted(W0)
    idx.apply(p.batch(p.stored(hs[3:], parent=hs[2])))
    info = idx.info(W0)
    assert info.stale
    assert "missed" in info.stale_reason
    assert info.stats.capacity_overflows == 1
