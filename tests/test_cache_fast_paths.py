"""The cache's fast paths against their reference paths, on random pool states.

- ``plan_prompt`` of a full-attention group without lower tiers (the C-level scans) plans
  exactly what its general path (taken whenever a lower-tier lookup is given) plans when no
  lower tier holds anything;
- ``PrefixTree.insert_run`` (parent taken from the block it just committed) leaves the tree
  exactly as ``insert`` called position by position does;
- a request's tokens, kept in pieces, read back as every token it was given.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.cache import CacheConfig, KVCacheManager, LayerGroupSpec
from kvstream.cache.block import Block
from kvstream.cache.block_pool import BlockPool
from kvstream.cache.plan import Plan, plan_prompt
from kvstream.cache.prefix_tree import PrefixTree
from kvstream.cache.request import RequestState
from kvstream.events.emitter import NULL_RECORDER

TPB = 4
HASHES = [bytes([i]) * 8 for i in range(12)]


def _pool(chains: list[list[int]], held: list[int]) -> BlockPool:
    """A pool whose tree holds each chain of hash indexes (committed in order, as requests
    would), with the listed committed positions still referenced, the rest evictable."""
    pool = BlockPool(0, 64, NULL_RECORDER, linked=True)
    committed: list[Block] = []
    for chain in chains:
        parent: bytes | None = None
        for i in chain:
            h = HASHES[i]
            if h not in pool.tree:
                b = pool.allocate()
                pool.commit(b, h, parent)
                committed.append(b)
            parent = h
    for j, b in enumerate(reversed(committed)):  # leaf first, as requests release
        if j not in held:
            pool.release(b)
    return pool


def _plan_view(plan: Plan) -> Any:
    return (
        plan.k,
        plan.first,
        [None if b is None else id(b) for b in plan.hits],
        plan.onboard,
        {i: id(b) for i, b in plan.pins.items()},
        plan.cost,
    )


@settings(max_examples=300, deadline=None)
@given(
    chains=st.lists(st.lists(st.integers(0, 11), min_size=1, max_size=6), max_size=4),
    held=st.lists(st.integers(0, 20), max_size=6),
    prompt=st.lists(st.integers(0, 11), max_size=8),
    extra=st.integers(0, TPB - 1),
)
def test_plan_prompt_fast_path_equals_general_path(
    chains: list[list[int]], held: list[int], prompt: list[int], extra: int
) -> None:
    pool = _pool(chains, held)
    hashes = [HASHES[i] for i in prompt]
    n = max(1, len(hashes) * TPB + extra)  # the prompt whose full blocks these are
    fast = plan_prompt(pool, None, tokens_per_block=TPB, hashes=hashes, n=n)
    general = plan_prompt(pool, None, tokens_per_block=TPB, hashes=hashes, n=n, lower=lambda h: 0)
    assert _plan_view(fast) == _plan_view(general)


def _tree_view(tree: PrefixTree, blocks: list[Block]) -> Any:
    return (
        sorted(tree.hashes()),
        [
            (
                b.block_hash,
                None if b.parent is None else b.parent.block_id,
                b.num_children,
            )
            for b in blocks
        ],
    )


@settings(max_examples=300, deadline=None)
@given(
    before=st.lists(st.integers(0, 11), max_size=6),
    run=st.lists(st.integers(0, 11), min_size=1, max_size=8, unique=True),
    lo=st.integers(0, 7),
    linked=st.booleans(),
)
def test_insert_run_equals_insert_one_by_one(
    before: list[int], run: list[int], lo: int, linked: bool
) -> None:
    lo = min(lo, len(run) - 1)

    def build() -> tuple[PrefixTree, list[Block], list[Block]]:
        tree = PrefixTree(linked=linked)
        old: list[Block] = []
        parent: bytes | None = None
        for j, i in enumerate(before):  # a committed chain the run may share hashes with
            if HASHES[i] not in tree:
                b = Block(100 + j)
                tree.insert(b, HASHES[i], parent)
                old.append(b)
            parent = HASHES[i]
        # the run's own parents, before lo, are committed (as a request's prefix hits are)
        for i in range(lo):
            h = HASHES[run[i]]
            if h not in tree:
                b = Block(200 + i)
                tree.insert(b, h, HASHES[run[i - 1]] if i else None)
                old.append(b)
        table = [Block(i) for i in range(len(run))]
        return tree, old, table

    hashes = [HASHES[i] for i in run]
    tree_a, old_a, table_a = build()
    skipped = tree_a.insert_run(table_a, hashes, lo, len(run))
    tree_b, old_b, table_b = build()
    want_skipped = []
    for i in range(lo, len(run)):
        if hashes[i] in tree_b:
            want_skipped.append(i)
        else:
            tree_b.insert(table_b[i], hashes[i], hashes[i - 1] if i else None)
    assert skipped == want_skipped
    assert _tree_view(tree_a, old_a + table_a) == _tree_view(tree_b, old_b + table_b)


def test_request_tokens_read_back_whole() -> None:
    req = RequestState("r", lora_id=None, lora_name=None, cache_salt=None, mm_items=(), priority=50)
    assert req.token_bytes() == b""
    req.token_parts += [b"\x01\x00\x00\x00", b"\x02\x00\x00\x00\x03\x00\x00\x00"]
    whole = req.token_bytes()
    assert whole == b"\x01\x00\x00\x00\x02\x00\x00\x00\x03\x00\x00\x00"
    assert req.token_parts == [whole]  # joined once
    assert req.token_bytes() is whole


@settings(max_examples=60, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 50), min_size=1, max_size=20),
    appends=st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=7), max_size=4),
)
def test_export_carries_prompt_and_appended_tokens(
    prompt: list[int], appends: list[list[int]]
) -> None:
    cfg = CacheConfig(
        tokens_per_block=TPB,
        groups=[LayerGroupSpec(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=64)],
        metadata_only=False,
        device="cpu",
    )
    with KVCacheManager(cfg) as mgr:
        mgr.add_request("r", prompt)
        tokens = list(prompt)
        for more in appends:
            mgr.append_tokens("r", more)
            tokens += more
        assert mgr.num_tokens("r") == len(tokens)
        assert list(mgr.export_kv("r").tokens) == tokens
