"""``EventEmitter.stored_chain_trusted`` (the cache manager's path for chains of new blocks)
records exactly what ``stored_chain`` records, and the manager uses it only for its own
emitter of its hash width.

- random operation sequences (chains with announced and repeated hashes, single blocks,
  removals pending, coalescing targets) give equal batches through either call;
- the group and the token count are still checked, all or nothing;
- a manager stepping through prefills, decodes and evictions hands over the same batches
  with its own emitter (trusted path) as with an ``EventEmitter`` subclass (public path).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream._types import TokenIds
from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.clock import ManualClock
from kvstream.errors import EmitterError
from kvstream.events.emitter import EventEmitter
from kvstream.events.model import EventBatch, SourceId

TPB = 2
HASHES = [bytes([i + 1]) * 8 for i in range(10)]


def _emitter() -> EventEmitter:
    em = EventEmitter(SourceId(instance_id="t"), hash_algo="v2_sha256_64", clock=ManualClock(7))
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
            em.removed_many(0, [HASHES[i] for i in idx], cache_level=0)
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


def _manager(recorder: EventEmitter | None) -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=4,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=24)],
        hash_algo="vllm_sha256_cbor_64",
        metadata_only=True,
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


def test_manager_batches_equal_through_trusted_and_public_paths() -> None:
    own = _manager(None)
    assert own._trusted_chain is not None
    public = _manager(
        _PublicPath(
            SourceId(instance_id="m"), hash_algo="vllm_sha256_cbor_64", clock=ManualClock(5)
        )
    )
    assert public._trusted_chain is None
    got, want = _steps(own), _steps(public)
    assert any(b is not None and b.events for b in got)
    assert got == want
