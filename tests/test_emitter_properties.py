"""Properties of the event emitter over random call sequences (hypothesis).

A small model says what the cache told the emitter (which full blocks each group holds) and
which announcements that implies, in order, per group. Replaying the emitted events must
rebuild exactly the model's blocks, ids must be contiguous, and with a small capacity every
id must still be accounted for, by an event or by a lost marker's range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.clock import ManualClock
from kvstream.events.emitter import EventEmitter
from kvstream.events.model import (
    AttentionKind,
    Cleared,
    Created,
    EventBatch,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
    Stored,
    Updated,
)

TPB = 4
GROUPS = {0: 4096, 1: 128, 2: 32}  # layer group -> window
N_HASHES = 6
PARTIAL = {5}  # hash indexes whose blocks are partial (TPB - 2 tokens)


def h(i: int) -> bytes:
    return (1000 + i).to_bytes(8, "big")


def unh(b: bytes) -> int:
    return int.from_bytes(b, "big") - 1000


def toks(i: int) -> list[int]:
    return [i] * (TPB - 2 if i in PARTIAL else TPB)


group = st.sampled_from(sorted(GROUPS))
hash_ix = st.integers(0, N_HASHES - 1)
STORED = st.tuples(
    st.just("stored"), group, hash_ix, st.one_of(st.none(), st.just("prev"), hash_ix)
)
CHAINED = st.tuples(st.just("stored"), group, hash_ix, st.just("prev"))  # coalescing
REMOVED = st.tuples(st.just("removed"), group, hash_ix, st.sampled_from([None, 0, 1]))
UPDATED = st.tuples(st.just("updated"), group, hash_ix)
CREATED = st.tuples(st.just("created"), group)
CLEARED = st.tuples(st.just("cleared"), st.one_of(st.none(), group))
# Weighted like an engine's calls: mostly stores and removals, flushes now and then.
# (one_of would pick each distinct branch equally often, repeats or not.)
_WEIGHTED = [
    *[STORED] * 4,
    *[CHAINED] * 3,
    *[REMOVED] * 5,
    *[UPDATED] * 2,
    CREATED,
    CLEARED,
    st.tuples(st.just("flush_iteration")),
    st.tuples(st.just("take")),
    st.tuples(st.just("flush")),
]
OPS = st.integers(0, len(_WEIGHTED) - 1).flatmap(lambda i: _WEIGHTED[i])
SEQUENCES = st.lists(OPS, min_size=20, max_size=150)


@dataclass
class Model:
    """What the cache told the emitter, and the announcements it implies per group."""

    blocks: dict[int, set[int]] = field(default_factory=lambda: {g: set() for g in GROUPS})
    # Per group, the (kind, hash) items its events must carry, in id order.
    expected: dict[int, list[tuple[str, int | None]]] = field(
        default_factory=lambda: {g: [] for g in GROUPS}
    )
    pending: dict[int, int] = field(default_factory=lambda: dict.fromkeys(GROUPS, 0))
    prev: dict[int, int | None] = field(default_factory=lambda: dict.fromkeys(GROUPS))

    def flush_all(self) -> None:
        self.pending = dict.fromkeys(GROUPS, 0)


def register(em: EventEmitter, g: int) -> None:
    em.created(
        g,
        window_size=GROUPS[g],
        num_blocks_per_cache_level=[16, 4],
        tokens_per_block=TPB,
        attention_kind=AttentionKind.FULL if g == 0 else AttentionKind.SLIDING_WINDOW,
    )


def run(ops: list[tuple[Any, ...]], capacity: int) -> tuple[EventEmitter, Model, list[Any]]:
    """Apply ``ops`` to an emitter and to the model. Returns the emitter, the model, and the
    taken batches interleaved with ("checkpoint", snapshot of model.blocks) after each
    ``flush`` op (when everything recorded so far has been handed over)."""
    em = EventEmitter(SourceId(instance_id="w"), capacity=capacity, clock=ManualClock())
    m = Model()
    out: list[Any] = []
    for g in GROUPS:
        register(em, g)
        m.expected[g].append(("created", None))
    for op in ops:
        kind = op[0]
        if kind == "stored":
            _, g, i, parent = op
            p = m.prev[g] if parent == "prev" else parent
            em.stored(
                g, parent_hash=None if p is None else h(p), block_hash=h(i), token_ids=toks(i)
            )
            m.prev[g] = i
            if i not in PARTIAL and i not in m.blocks[g]:
                m.blocks[g].add(i)
                m.expected[g].append(("stored", i))
                m.pending[g] = 0
        elif kind == "removed":
            _, g, i, level = op
            em.removed(g, h(i), cache_level=level)
            if i in m.blocks[g]:
                m.blocks[g].discard(i)
                m.expected[g].append(("removed", i))
                m.pending[g] += 1
        elif kind == "updated":
            _, g, i = op
            em.updated(g, h(i), cache_level=(0, 1))
            if i in m.blocks[g]:
                m.flush_all()
                m.expected[g].append(("updated", i))
        elif kind == "created":
            register(em, op[1])
            m.flush_all()
            m.expected[op[1]].append(("created", None))
        elif kind == "cleared":
            targets = list(GROUPS) if op[1] is None else [op[1]]
            em.cleared(op[1])
            for g in targets:
                if m.pending[g]:  # the clear subsumes them: never announced
                    del m.expected[g][-m.pending[g] :]
            m.flush_all()
            for g in targets:
                m.blocks[g].clear()
                m.expected[g].append(("cleared", None))
        elif kind == "flush_iteration":
            em.flush_iteration()
            m.flush_all()
        elif kind == "take":
            out.append(em.take())
        else:
            out.append(em.flush())
            m.flush_all()
            out.append(("checkpoint", {g: set(s) for g, s in m.blocks.items()}))
    return em, m, out


def replay_strict(events: list[KVCacheEvent], state: dict[int, set[int]]) -> None:
    """A consumer's prefix index, reduced to sets: fails on anything out of order."""
    for ev in events:
        g, d = ev.layer_group_id, ev.data
        assert ev.window_size == GROUPS[g]
        if isinstance(d, Stored):
            for b in d.blocks:
                assert unh(b.block_hash) not in state[g], "stored twice without a removal"
                state[g].add(unh(b.block_hash))
        elif isinstance(d, Removed):
            for x in d.block_hashes:
                state[g].remove(unh(x))  # KeyError: removed before (or without) its store
        elif isinstance(d, Updated):
            assert unh(d.block_hash) in state[g]
        elif isinstance(d, Cleared):
            state[g].clear()
        else:
            assert isinstance(d, Created)


def flatten(events: list[KVCacheEvent], g: int) -> list[tuple[str, int | None]]:
    items: list[tuple[str, int | None]] = []
    for ev in events:
        if ev.layer_group_id != g:
            continue
        d = ev.data
        if isinstance(d, Stored):
            items.extend(("stored", unh(b.block_hash)) for b in d.blocks)
        elif isinstance(d, Removed):
            items.extend(("removed", unh(x)) for x in d.block_hashes)
        elif isinstance(d, Updated):
            items.append(("updated", unh(d.block_hash)))
        else:
            items.append((d.type, None))
    return items


@settings(max_examples=300, deadline=None)
@given(SEQUENCES)
def test_replaying_the_events_rebuilds_what_the_cache_holds(ops: list[tuple[Any, ...]]) -> None:
    em, m, out = run(ops, capacity=100_000)
    final = em.flush()
    out.append(final)
    events: list[KVCacheEvent] = []
    state: dict[int, set[int]] = {g: set() for g in GROUPS}
    for item in out:
        if isinstance(item, tuple):  # at a flush, the replay has caught up with the cache
            assert state == item[1]
        elif item is not None:
            assert isinstance(item, EventBatch)
            replay_strict(list(item.events), state)
            events.extend(item.events)
    assert state == m.blocks
    # ids: 0..N-1, contiguous, in order across batches
    assert [ev.event_id for ev in events] == list(range(em.next_event_id))
    assert not any(isinstance(ev.data, Lost) for ev in events)
    # per group, the events carry exactly the announcements the model implies, in order
    # (so every removal precedes the group's later stores)
    for g in GROUPS:
        assert flatten(events, g) == m.expected[g]
    stats = em.stats()
    assert stats.events_taken == stats.events_emitted
    assert (stats.pending_removals, stats.buffered_events) == (0, 0)
    assert stats.blocks_stored_announced == sum(
        len(ev.data.blocks) for ev in events if isinstance(ev.data, Stored)
    )


@settings(max_examples=300, deadline=None)
@given(SEQUENCES, st.integers(2, 5))
def test_with_a_small_capacity_every_id_is_accounted_for(
    ops: list[tuple[Any, ...]], capacity: int
) -> None:
    em, _, out = run(ops, capacity=capacity)
    out.append(em.flush())
    covered: list[int] = []
    marker_total = 0
    delivered_blocks = 0
    for batch in out:
        if not isinstance(batch, EventBatch):
            continue
        assert 1 <= len(batch.events) <= capacity
        ids = [ev.event_id for ev in batch.events]
        assert ids == sorted(ids)
        for k, ev in enumerate(batch.events):
            if isinstance(ev.data, Lost):
                assert k == 0, "a lost marker only heads a batch"
                first, count = ev.data.first_event_id, ev.data.count
                assert ev.event_id == first + count - 1
                assert ev.data.reason == "overflow"
                covered.extend(range(first, first + count))
                marker_total += count
            else:
                covered.append(ev.event_id)
                if isinstance(ev.data, Stored):
                    delivered_blocks += len(ev.data.blocks)
    assert covered == list(range(em.next_event_id))
    stats = em.stats()
    assert stats.events_dropped == marker_total
    assert stats.events_emitted == stats.events_taken + stats.events_dropped
    # every announced block was delivered or dropped with its event, none appended to a
    # dropped event
    assert stats.blocks_stored_announced == delivered_blocks + stats.blocks_dropped


# Batched recording: stored_chain/removed_many against the same calls one by one.
FULL_IX = [i for i in range(N_HASHES) if i not in PARTIAL]
CHAIN = st.tuples(
    st.just("chain"),
    group,
    st.one_of(st.none(), st.just("prev"), hash_ix),
    st.one_of(  # distinct blocks (the fast path when all are new) or any
        st.lists(st.sampled_from(FULL_IX), min_size=1, max_size=4, unique=True),
        st.lists(st.sampled_from(FULL_IX), min_size=0, max_size=5),
    ),
    st.sampled_from([{}, {"priority": 90}, {"lora_id": 3, "cache_salt": "s"}]),
)
REMOVED_MANY = st.tuples(
    st.just("removed_many"),
    group,
    st.lists(hash_ix, min_size=0, max_size=5),
    st.sampled_from([None, 0, 1]),
)
_BATCHED = [CHAIN, CHAIN, CHAIN, REMOVED_MANY, REMOVED_MANY, *_WEIGHTED]
BATCHED_OPS = st.integers(0, len(_BATCHED) - 1).flatmap(lambda i: _BATCHED[i])


def run_batched(ops: list[tuple[Any, ...]], capacity: int, *, batched: bool) -> list[Any]:
    """Apply ``ops`` with the batched calls (and deferred takes), or with the same calls one
    by one (and plain takes); returns what was taken, materialised, and the final stats."""
    em = EventEmitter(SourceId(instance_id="w"), capacity=capacity, clock=ManualClock())
    for g in GROUPS:
        register(em, g)
    prev: dict[int, int | None] = dict.fromkeys(GROUPS)
    out: list[Any] = []
    for op in ops:
        kind = op[0]
        if kind == "chain":
            _, g, parent, ixs, attrs = op
            p = prev[g] if parent == "prev" else parent
            if batched:
                em.stored_chain(
                    g,
                    parent_hash=None if p is None else h(p),
                    block_hashes=[h(i) for i in ixs],
                    token_ids=[t for i in ixs for t in toks(i)],
                    **attrs,
                )
            else:
                for i in ixs:
                    em.stored(
                        g,
                        parent_hash=None if p is None else h(p),
                        block_hash=h(i),
                        token_ids=toks(i),
                        **attrs,
                    )
                    p = i
            if ixs:
                prev[g] = ixs[-1]
        elif kind == "removed_many":
            _, g, ixs, level = op
            if batched:
                em.removed_many(g, [h(i) for i in ixs], cache_level=level)
            else:
                for i in ixs:
                    em.removed(g, h(i), cache_level=level)
        elif kind == "stored":
            _, g, i, parent = op
            p = prev[g] if parent == "prev" else parent
            em.stored(
                g, parent_hash=None if p is None else h(p), block_hash=h(i), token_ids=toks(i)
            )
            prev[g] = i
        elif kind == "removed":
            em.removed(op[1], h(op[2]), cache_level=op[3])
        elif kind == "updated":
            em.updated(op[1], h(op[2]), cache_level=(0, 1))
        elif kind == "created":
            register(em, op[1])
        elif kind == "cleared":
            em.cleared(op[1])
        elif kind == "flush_iteration":
            em.flush_iteration()
        elif kind == "take" and batched:
            d = em.take_deferred()
            out.append(None if d is None else d.materialize())
        elif kind == "take":
            out.append(em.take())
        elif batched:
            d = em.flush_deferred()
            out.append(None if d is None else d.materialize())
        else:
            out.append(em.flush())
        out.append(em.stats())
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(BATCHED_OPS, min_size=10, max_size=120), st.sampled_from([3, 100_000]))
def test_batched_recording_and_deferred_takes_match_the_one_by_one_calls(
    ops: list[tuple[Any, ...]], capacity: int
) -> None:
    ops = [*ops, ("flush",)]
    assert run_batched(ops, capacity, batched=True) == run_batched(ops, capacity, batched=False)
