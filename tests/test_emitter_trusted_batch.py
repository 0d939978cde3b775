"""take() builds its batch without re-validating what the emitter validated on the way in
(kvstream.events.emitter.emitted_batch): the batch must equal the validated one
(take_deferred().materialize(), which validates every record), fields set included."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from kvstream._types import TokenIds
from kvstream.clock import ManualClock
from kvstream.events.deferred import model_input
from kvstream.events.emitter import EventEmitter, emitted_batch
from kvstream.events.model import AttentionKind, EventBatch, SourceId

TPB = 4
GROUPS = {0: 4096, 1: 128}


def h(i: int) -> bytes:
    return (1000 + i).to_bytes(8, "big")


def toks(i: int, n: int = TPB) -> list[int]:
    return [i * 10 + k for k in range(n)]


hix = st.integers(0, 7)
group = st.sampled_from(sorted(GROUPS))
OPS = st.one_of(
    st.tuples(st.just("stored"), group, hix, st.one_of(st.none(), hix), st.sampled_from([0, 1])),
    st.tuples(st.just("chain"), group, st.lists(hix, min_size=1, max_size=4), st.booleans()),
    st.tuples(st.just("removed"), group, hix, st.sampled_from([None, 0, 1])),
    st.tuples(st.just("removed_many"), group, st.lists(hix, min_size=1, max_size=4)),
    st.tuples(st.just("updated"), group, hix),
    st.tuples(st.just("created"), group),
    st.tuples(st.just("cleared"), st.one_of(st.none(), group)),
    st.tuples(st.just("flush_iteration")),
    st.tuples(st.just("take")),
)


def apply(em: EventEmitter, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "stored":
        _, g, i, parent, variant = op
        extra: dict[str, Any] = {"lora_id": 3, "priority": 40} if variant else {}
        em.stored(
            g,
            parent_hash=None if parent is None else h(parent),
            block_hash=h(i),
            token_ids=toks(i),
            **extra,
        )
    elif kind == "chain":
        _, g, ids, salted = op
        em.stored_chain(
            g,
            parent_hash=None,
            block_hashes=[h(i) for i in ids],
            token_ids=TokenIds([t for i in ids for t in toks(i)]),
            cache_salt="tenant" if salted else None,
        )
    elif kind == "removed":
        em.removed(op[1], h(op[2]), cache_level=op[3])
    elif kind == "removed_many":
        em.removed_many(op[1], [h(i) for i in op[2]])
    elif kind == "updated":
        em.updated(op[1], h(op[2]), cache_level=(0, 1))
    elif kind == "created":
        register(em, op[1])
    elif kind == "cleared":
        em.cleared(op[1])
    elif kind == "flush_iteration":
        em.flush_iteration()


def register(em: EventEmitter, g: int) -> None:
    em.created(
        g,
        window_size=GROUPS[g],
        num_blocks_per_cache_level=[16, 4],
        tokens_per_block=TPB,
        attention_kind=AttentionKind.FULL if g == 0 else AttentionKind.SLIDING_WINDOW,
    )


def fields_sets(m: Any) -> Any:
    """Every model's ``model_fields_set``, recursively (what exclude_unset dumps depend on)."""
    if isinstance(m, BaseModel):
        return (
            type(m).__name__,
            sorted(m.model_fields_set),
            {k: fields_sets(getattr(m, k)) for k in type(m).model_fields},
        )
    if isinstance(m, tuple):
        return [fields_sets(x) for x in m]
    return None


def assert_same(got: EventBatch | None, want: EventBatch | None) -> None:
    assert got == want
    if want is not None:
        assert got is not None
        assert fields_sets(got) == fields_sets(want)
        assert got.model_dump(exclude_unset=True) == want.model_dump(exclude_unset=True)
        assert got.model_dump_json() == want.model_dump_json()


@settings(max_examples=150, deadline=None)
@given(st.lists(OPS, min_size=1, max_size=60), st.sampled_from([3, 1024]))
def test_take_equals_the_validated_batch(ops: list[tuple[Any, ...]], capacity: int) -> None:
    a = EventEmitter(SourceId(instance_id="w"), capacity=capacity, clock=ManualClock(7))
    b = EventEmitter(SourceId(instance_id="w"), capacity=capacity, clock=ManualClock(7))
    for em in (a, b):
        for g in GROUPS:
            register(em, g)
    for op in [*ops, ("flush_iteration",), ("take",)]:
        for em in (a, b):
            apply(em, op)
        if op[0] == "take":
            d = b.take_deferred()
            assert_same(a.take(), None if d is None else d.materialize())


def test_emitted_batch_matches_validation_for_an_unusual_clock() -> None:
    em = EventEmitter(SourceId(instance_id="w"), clock=ManualClock(5))
    register(em, 0)
    em.stored(0, parent_hash=None, block_hash=h(1), token_ids=toks(1))
    recs = list(em._buf)
    want = EventBatch(source=em.source, ts_ns=5, events=model_input(recs))
    assert_same(emitted_batch(em.source, 5, recs), want)
