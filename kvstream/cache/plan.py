"""Planning an operation on one layer group before anything changes (all-or-nothing).

A :class:`Plan` says which cached blocks a request takes, which positions it releases and
how many free blocks the operation consumes; the manager checks every group's plan against
its pool and only then applies them, so a request that does not fit changes nothing.
"""

from __future__ import annotations

from kvstream.cache.block import Block
from kvstream.cache.block_pool import BlockPool
from kvstream.cache.errors import CacheInvariantError
from kvstream.cache.request import GroupState
from kvstream.cache.windows import first_needed_block, reuse_boundary

__all__ = ["Plan", "plan_append", "plan_prompt"]


class Plan:
    """What one operation will do to one layer group.

    ``k``: reuse boundary in blocks (prompts); ``first``: first position the request holds;
    ``hits``: cached blocks taken for positions ``[first, k)``; ``pins``: position -> the
    committed block carrying that position's hash, held besides the request's own block;
    ``release_to``: positions ``[released, release_to)`` leave a sliding window; ``frees``:
    blocks that release makes free; ``cost``: free blocks the operation takes.
    """

    __slots__ = ("cost", "first", "frees", "hits", "k", "pins", "release_to")

    def __init__(self) -> None:
        self.k = 0
        self.first = 0
        self.hits: list[Block] = []
        self.pins: dict[int, Block] = {}
        self.release_to = 0
        self.frees = 0
        self.cost = 0


def plan_prompt(
    pool: BlockPool, window: int | None, *, tokens_per_block: int, hashes: list[bytes], n: int
) -> Plan:
    """Plan a new request of ``n`` prompt tokens whose full blocks hash to ``hashes``.

    The boundary is the group's own (:func:`reuse_boundary`), capped so that the last prompt
    token is always computed; the request takes the cached blocks its window needs before
    the boundary and gets a new block for every later position. In a full-attention group a
    later position whose hash is already committed (the capped last block) is pinned.
    """
    tpb = tokens_per_block
    get = pool.tree.get
    plan = Plan()
    found = [get(h) for h in hashes]
    plan.k = k = reuse_boundary([b is not None for b in found], window, tpb, (n - 1) // tpb)
    plan.first = first = first_needed_block(k * tpb, window, tpb)
    hits = found[first:k]
    plan.hits = [b for b in hits if b is not None]
    if len(plan.hits) != len(hits):
        raise CacheInvariantError("reuse boundary covers an uncached block")
    if window is None:
        plan.pins = {i: b for i, b in enumerate(found[k:], k) if b is not None}
    plan.cost = (
        (-(-n // tpb) - k)
        + sum(1 for b in plan.hits if b.ref_cnt == 0)
        + sum(1 for b in plan.pins.values() if b.ref_cnt == 0)
    )
    return plan


def plan_append(
    pool: BlockPool,
    window: int | None,
    *,
    tokens_per_block: int,
    gs: GroupState,
    num_tokens: int,
    hashes: list[bytes],
    new_blocks: int,
) -> Plan:
    """Plan appending to a request of ``num_tokens`` tokens: ``new_blocks`` new positions and
    newly full blocks hashing to ``hashes`` (positions from ``num_tokens // T`` on).

    A sliding-window group releases the positions the next token no longer needs (their
    blocks count as free when the request held the last reference); a full-attention group
    pins the committed block of every newly full position whose hash is already committed.
    """
    plan = Plan()
    if window is not None:
        plan.release_to = max(gs.released, first_needed_block(num_tokens, window, tokens_per_block))
        plan.frees = sum(
            1 for b in gs.blocks[gs.released : plan.release_to] if b is not None and b.ref_cnt == 1
        )
    else:
        get = pool.tree.get
        done = num_tokens // tokens_per_block
        for j, h in enumerate(hashes):
            b = get(h)
            if b is not None:
                plan.pins[done + j] = b
    plan.cost = new_blocks + sum(1 for b in plan.pins.values() if b.ref_cnt == 0)
    return plan
