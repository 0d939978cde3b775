"""The cache manager's recording fast paths: ``EventEmitter.stored_chain_trusted`` /
``removed_many_trusted`` (no per-hash checks) and ``EventEmitter(dedup=False)`` (no set of
announced blocks: the manager's prefix tree is it).

- random operation sequences (chains with announced and repeated hashes, single blocks,
  removals pending, coalescing targets) give equal batches through the trusted and the
  public calls;
- under the ``dedup=False`` contract (stores of new blocks, removals of announced ones) a
  non-deduplicating emitter gives the batches a deduplicating one gives, and still checks
  every public call's hashes;
- the group and the token count are still checked, all or nothing;
- a manager stepping through prefills, decodes and evictions (GPU only, and with a host
  tier) hands over the same batches with its own emitter (trusted paths, no dedup) as with
  an ``EventEmitter`` subclass (public calls, dedup).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.cache.tier_config import HostTierConfig
from kvstream.clock import ManualClock
from kvstream.errors import EmitterError
from kvstream.events.emitter import EventEmitter
from kvstream.events.model import EventBatch, SourceId

TPB = 2
HASHES = [bytes([i + 1]) * 8 for i in range(10)]


def _emitter(*, dedup: bool = True, capacity: int = 8192) -> EventEmitter:
    em = EventEmitter(
        SourceId(instance_id="t"),
        hash_algo="v2_sha256_64",
        clock=ManualClock(7),
        dedup=dedup,
        capacity=capacity,
    )
    em.created(0, window_size=64, num_blocks_per_cache_level=[16], tokens_per_block=TPB)
    return em


def _tokens(idx: list[int]) -> TokenIds:
    return TokenIds([t for i in idx for t in (i, i + 100)])


_OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("chain"),
            st.one_of(st.none(), st.integers(0, 9)),
            st.lists(st.integers(0, 9), min_size=1, max_size=5),
        ),
        st.tuples(st.just("remove"), st.none(), st.lists(st.integers(0, 9), max_size=4)),
        st.tuples(st.just("flush"), st.none(), st.just([])),
    ),
    max_size=25,
)


def _run(em: EventEmitter, ops: list[tuple[str, int | None, list[int]]], trusted: bool) -> list:
    out: list[EventBatch | None] = []
    for kind, parent, idx in ops:
        if kind == "chain":
            p = None if parent is None else HASHES[parent]
            hs = [HASHES[i] for i in idx]
            if trusted:
                em.stored_chain_trusted(0, p, hs, _tokens(idx))
            else:
                em.stored_chain(0, parent_hash=p, block_hashes=hs, token_ids=_tokens(idx))
        elif kind == "remove":
            hs = [HASHES[i] for i in idx]
            if trusted and hs:
                em.removed_many_trusted(0, hs, 0)
            else:
                em.removed_many(0, hs, cache_level=0)
        else:
            out.append(em.flush())
    out.append(em.flush())
    return out


@settings(max_examples=200, deadline=None)
@given(_OPS)
def test_trusted_chain_records_what_stored_chain_records(ops: list) -> None:
    a, b = _emitter(), _emitter()
    assert _run(a, ops, trusted=False) == _run(b, ops, trusted=True)
    assert a.stats() == b.stats()


@st.composite
def _contract_ops(draw: st.DrawFn) -> list[tuple[str, int, list[int]]]:
    """Operations a dedup=False caller may record: chains and single blocks of blocks not
    announced (each chain's parent the last stored block or the root), removals and updates
    of announced ones, iteration flushes."""
    announced: list[int] = []
    fresh = iter(range(10_000))
    ops: list[tuple[str, int, list[int]]] = []
    for _ in range(draw(st.integers(0, 30))):
        kind = draw(st.sampled_from(["chain", "one", "remove", "remove_one", "update", "flush"]))
        if kind in ("chain", "one"):
            n = 1 if kind == "one" else draw(st.integers(1, 6))
            idx = [next(fresh) for _ in range(n)]
            parent = announced[-1] if announced and draw(st.booleans()) else -1
            ops.append((kind, parent, idx))
            announced += idx
        elif kind in ("remove", "remove_one", "update") and announced:
            k = 1 if kind != "remove" else draw(st.integers(1, len(announced)))
            picked = draw(st.permutations(announced))[:k]
            if kind != "update":
                announced = [h for h in announced if h not in picked]
            ops.append((kind, -1, picked))
        else:
            ops.append(("flush", -1, []))
    return ops


def _h(i: int) -> bytes:
    return (i + 1).to_bytes(8, "big")


def _run_contract(em: EventEmitter, ops: list[tuple[str, int, list[int]]], fast: bool) -> list:
    out: list[EventBatch | None] = []
    for kind, parent, idx in ops:
        p = None if parent < 0 else _h(parent)
        hs = [_h(i) for i in idx]
        if kind == "chain" and fast:
            em.stored_chain_trusted(0, p, hs, _tokens(idx))
        elif kind == "chain":
            em.stored_chain(0, parent_hash=p, block_hashes=hs, token_ids=_tokens(idx))
        elif kind == "one":
            em.stored(0, parent_hash=p, block_hash=hs[0], token_ids=_tokens(idx))
        elif kind == "remove" and fast:
            em.removed_many_trusted(0, hs, 1)
        elif kind == "remove":
            em.removed_many(0, hs, cache_level=1)
        elif kind == "remove_one":
            em.removed(0, hs[0], cache_level=None)
        elif kind == "update":
            em.updated(0, hs[0], priority=(35, 80))
        else:
            out.append(em.flush_deferred())
    out.append(em.flush_deferred())
    return [None if d is None else d.materialize() for d in out]


@settings(max_examples=200, deadline=None)
@given(_contract_ops(), st.booleans(), st.sampled_from([2, 3, 8192]))
def test_no_dedup_under_its_contract_records_what_dedup_records(
    ops: list[tuple[str, int, list[int]]], fast: bool, capacity: int
) -> None:
    # (small capacities: overflow, lost markers, a dropped coalescing target)
    a, b = _emitter(capacity=capacity), _emitter(dedup=False, capacity=capacity)
    assert _run_contract(a, ops, fast=False) == _run_contract(b, ops, fast=fast)
    sa, sb = a.stats(), b.stats()
    assert (sa.duplicate_stores_suppressed, sa.unknown_removals_ignored) == (0, 0)
    assert sa == sb


def test_no_dedup_still_checks_public_hashes() -> None:
    em = _emitter(dedup=False)
    for call in (
        lambda: em.removed(0, b"short"),
        lambda: em.removed_many(0, [HASHES[0], b"short"]),
        lambda: em.removed_many(0, [HASHES[0], "text"]),  # type: ignore[list-item]
        lambda: em.updated(0, b"short", priority=(35, 80)),
        lambda: em.stored(0, parent_hash=None, block_hash=b"short", token_ids=_tokens([0])),
    ):
        with pytest.raises(EmitterError):
            call()
    assert em.stats().pending_removals == 0
    assert em.next_event_id == 1  # only the created event


def test_checks_group_and_token_count_and_records_nothing_on_error() -> None:
    em = _emitter()
    with pytest.raises(EmitterError, match="not registered"):
        em.stored_chain_trusted(3, None, HASHES[:1], _tokens([0]))
    with pytest.raises(EmitterError, match="tokens for 2 blocks"):
        em.stored_chain_trusted(0, None, HASHES[:2], _tokens([0]))
    with pytest.raises(EmitterError, match="tokens for 0 blocks"):
        em.stored_chain_trusted(0, None, [], TokenIds([]))
    assert em.next_event_id == 1  # only the created event
    assert em.stats().blocks_stored_announced == 0


def test_accepts_trusted_only_for_its_pinned_width() -> None:
    assert _emitter().accepts_trusted(8)
    assert not _emitter().accepts_trusted(32)
    unknown = EventEmitter(SourceId(instance_id="t"), hash_algo="someone_elses")
    assert not unknown.accepts_trusted(8)  # width not pinned yet


class _PublicPath(EventEmitter):
    """An emitter the manager does not trust (a subclass): it gets the public calls."""


def _manager(recorder: EventEmitter | None, host: bool) -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=4,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=24)],
        hash_algo="vllm_sha256_cbor_64",
        metadata_only=True,
        host_tier=HostTierConfig(blocks=[12]) if host else None,
    )
    return KVCacheManager(
        cfg, recorder=recorder, source=SourceId(instance_id="m"), clock=ManualClock(5)
    )


def _steps(mgr: KVCacheManager) -> list[EventBatch | None]:
    out = []
    system = list(range(1000, 1010))
    for i in range(6):  # prefills sharing a prefix; later ones evict earlier blocks
        mgr.add_request(f"p{i}", system + [i * 50 + t for t in range(30)])
        out.append(mgr.flush_events())
        mgr.free_request(f"p{i}")
    for i in range(3):
        mgr.add_request(f"d{i}", [*system, 7000 + i])
    for step in range(10):  # decode: a block fills every 4 tokens
        for i in range(3):
            mgr.append_tokens(f"d{i}", (step * 3 + i,))
        out.append(mgr.flush_events())
    return out


@pytest.mark.parametrize("host", [False, True])
def test_manager_batches_equal_through_trusted_and_public_paths(host: bool) -> None:
    own = _manager(None, host)
    assert own._trusted_chain is not None
    public = _manager(
        _PublicPath(
            SourceId(instance_id="m"), hash_algo="vllm_sha256_cbor_64", clock=ManualClock(5)
        ),
        host,
    )
    assert public._trusted_chain is None
    got, want = _steps(own), _steps(public)
    assert any(b is not None and b.events for b in got)
    assert got == want
    stats = public.recorder.stats()  # type: ignore[attr-defined]
    assert stats.blocks_removed_announced > 0  # evictions (or tier moves) were recorded
    assert (stats.duplicate_stores_suppressed, stats.unknown_removals_ignored) == (0, 0)
