"""The cache manager's single-group paths against its general ones, on random operations.

A manager of one full-attention group without tiers admits requests (and appends tokens)
through its plain paths (``KVCacheManager._plain``). The same manager with ``_plain`` off
takes the general, per-group paths. Both are driven through the same random operations and
must agree on every result: returned matches and block counts, raised errors, each request's
blocks, the LRU order, the tree, the counters, and every event, ids included.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.clock import ManualClock
from kvstream.errors import KVStreamError
from kvstream.events.model import SourceId

TPB = 4
# Prompts are built from a few shared block contents so that prefixes (hits), repeated
# blocks after a miss (pins) and evictions all occur.
BLOCKS = [[b * 10 + t for t in range(TPB)] for b in range(6)]


def _manager(plain: bool, num_blocks: int) -> KVCacheManager:
    cfg = CacheConfig(
        tokens_per_block=TPB,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=num_blocks)],
        metadata_only=True,
    )
    m = KVCacheManager(cfg, source=SourceId(instance_id="w", incarnation=1), clock=ManualClock())
    assert m._plain
    m._plain = plain
    return m


def _state(m: KVCacheManager) -> Any:
    pool = m._pools[0]
    return (
        {r: (m.block_ids(r, 0), m.block_hashes(r), m.num_tokens(r)) for r in m.request_ids()},
        [(b.block_id, b.block_hash) for b in pool.lru],
        sorted(
            (
                h,
                b.block_id,
                b.ref_cnt,
                b.num_children,
                None if b.parent is None else b.parent.block_id,
            )
            for h in pool.tree.hashes()
            if (b := pool.tree.get(h)) is not None
        ),
        {
            r: sorted((i, b.block_id) for i, b in m._requests[r].groups[0].pins.items())
            for r in m._requests
        },
        m.stats(),
    )


def _call(m: KVCacheManager, op: tuple[Any, ...]) -> Any:
    kind = op[0]
    try:
        if kind == "add":
            _, rid, prompt, hashed, priority = op
            kw: dict[str, Any] = {} if priority is None else {"priority": priority}
            if hashed:
                kw["hashed"] = m.hash_prompt(prompt)
            return m.add_request(rid, prompt, **kw)
        if kind == "append":
            return m.append_tokens(op[1], op[2])
        if kind == "free":
            return m.free_request(op[1])
        batch = m.flush_events()
        return None if batch is None else [(e.event_id, e.data) for e in batch.events]
    except KVStreamError as exc:
        return (type(exc).__name__, str(exc))


@st.composite
def _ops(draw: st.DrawFn) -> list[tuple[Any, ...]]:
    ops: list[tuple[Any, ...]] = []
    for j in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["add", "add", "append", "free", "flush"]))
        rid = f"r{draw(st.integers(0, 5))}"
        if kind == "add":
            blocks = draw(st.lists(st.integers(0, len(BLOCKS) - 1), min_size=0, max_size=6))
            tail = draw(st.integers(0 if blocks else 1, TPB - 1))
            prompt = [t for b in blocks for t in BLOCKS[b]] + [100 + j] * tail
            priority = draw(st.sampled_from([None, None, 7]))
            ops.append(("add", rid, prompt, draw(st.booleans()), priority))
        elif kind == "append":
            # whole blocks' contents, so that a block an append fills may be cached (a pin)
            src = [
                t
                for b in draw(st.lists(st.integers(0, 5), min_size=1, max_size=3))
                for t in BLOCKS[b]
            ]
            ops.append(("append", rid, src[: draw(st.integers(1, len(src)))]))
        elif kind == "free":
            ops.append(("free", rid))
        else:
            ops.append(("flush",))
    ops.append(("flush",))
    return ops


@settings(max_examples=400, deadline=None)
@given(ops=_ops(), num_blocks=st.integers(3, 16))
def test_plain_paths_equal_general_paths(ops: list[tuple[Any, ...]], num_blocks: int) -> None:
    plain, general = _manager(True, num_blocks), _manager(False, num_blocks)
    for op in ops:
        assert _call(plain, op) == _call(general, op), op
        assert _state(plain) == _state(general), op
    plain.check_invariants()
    general.check_invariants()


def test_only_one_full_attention_group_without_tiers_is_plain() -> None:
    def make(**kw: Any) -> KVCacheManager:
        groups = kw.pop(
            "groups", [LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=8)]
        )
        return KVCacheManager(
            CacheConfig(tokens_per_block=TPB, groups=groups, metadata_only=True, **kw)
        )

    assert make()._plain
    two = [LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=8)] * 2
    assert not make(groups=two)._plain
    window = [LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=8, window_size=8)]
    assert not make(groups=window)._plain


def test_pins_of_a_prompt_and_of_an_append_equal_general_paths() -> None:
    # "b" repeats "a"'s first block within its uncacheable last token (a pin at admission),
    # then appends "a"'s second block (a pin at the append)
    ops: list[tuple[Any, ...]] = [
        ("add", "a", BLOCKS[0] + BLOCKS[1] + [100], False, None),
        ("add", "b", BLOCKS[0], True, None),
        ("append", "b", [*BLOCKS[1], 5]),
        ("flush",),
        ("free", "a"),
        ("free", "b"),
        ("flush",),
    ]
    plain, general = _manager(True, 8), _manager(False, 8)
    for op in ops:
        assert _call(plain, op) == _call(general, op), op
        assert _state(plain) == _state(general), op
        if op[0] == "append":
            assert set(plain._requests["b"].groups[0].pins) == {0, 1}
    assert plain.stats().groups[0].cached_blocks == 2
    plain.check_invariants()
