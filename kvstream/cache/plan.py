"""Planning an operation on one layer group before anything changes (all-or-nothing).

A :class:`Plan` says which cached blocks a request takes, which positions it releases and
how many free blocks the operation consumes; the manager checks every group's plan against
its pool and only then applies them, so a request that does not fit changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from kvstream.cache.block import Block
from kvstream.cache.block_pool import BlockPool
from kvstream.cache.errors import CacheInvariantError
from kvstream.cache.request import GroupState
from kvstream.cache.windows import first_needed_block, reuse_boundary

__all__ = [
    "LowerTierLookup",
    "Plan",
    "full_cost",
    "plan_append",
    "plan_full",
    "plan_import",
    "plan_prompt",
]

_REF_CNT = attrgetter("ref_cnt")

#: Where below the GPU a block hash is cached (1 host, 2 disk), 0 when nowhere.
LowerTierLookup = Callable[[bytes], int]


class Plan:
    """What one operation will do to one layer group.

    ``k``: reuse boundary in blocks (prompts); ``first``: first position the request holds;
    ``hits``: for each position of ``[first, k)`` the cached GPU block it takes, or None when
    the block comes from a lower tier; ``onboard``: those positions as ``(position, hash,
    level)``; ``pins``: position -> the
    committed block carrying that position's hash, held besides the request's own block;
    ``release_to``: positions ``[released, release_to)`` leave a sliding window; ``frees``:
    blocks that release makes free; ``cost``: free blocks the operation takes.
    """

    __slots__ = ("cost", "first", "frees", "hits", "k", "onboard", "pins", "release_to")

    def __init__(self) -> None:
        self.k = 0
        self.first = 0
        self.hits: list[Block | None] = []
        self.onboard: list[tuple[int, bytes, int]] = []
        self.pins: dict[int, Block] = {}
        self.release_to = 0
        self.frees = 0
        self.cost = 0


def plan_prompt(
    pool: BlockPool,
    window: int | None,
    *,
    tokens_per_block: int,
    hashes: list[bytes],
    n: int,
    lower: LowerTierLookup | None = None,
    limit: int | None = None,
) -> Plan:
    """Plan a new request of ``n`` tokens whose full blocks hash to ``hashes``.

    The boundary is the group's own (:func:`reuse_boundary`), at most ``limit`` blocks
    (default: capped so that the last prompt token is always computed); a block counts as
    cached when the GPU pool or, through ``lower``, a lower tier holds it (those are
    onboarded). The request takes the cached blocks its window needs before the boundary
    and gets a new block for every later position. In a
    full-attention group a later position whose hash is committed on the GPU is pinned.
    """
    tpb = tokens_per_block
    plan = Plan()
    found = pool.tree.lookup(hashes)
    cap = (n - 1) // tpb if limit is None else limit
    if lower is None and window is None:
        plan.k, plan.hits, plan.pins = plan_full(found, cap)
        plan.cost = full_cost(-(-n // tpb), plan.hits, plan.pins)
        return plan
    levels = [0] * len(hashes)
    if lower is not None:
        for i, b in enumerate(found):
            if b is None:
                levels[i] = lower(hashes[i])
                if not levels[i] and window is None:
                    break  # full attention: nothing after the first miss is reusable
    cached = [b is not None or lv > 0 for b, lv in zip(found, levels, strict=True)]
    plan.k = k = reuse_boundary(cached, window, tpb, cap)
    plan.first = first = first_needed_block(k * tpb, window, tpb)
    plan.hits = hits = found[first:k]
    for i in range(first, k):
        if hits[i - first] is None:
            if not levels[i]:
                raise CacheInvariantError("reuse boundary covers an uncached block")
            plan.onboard.append((i, hashes[i], levels[i]))
    if window is None:
        plan.pins = {i: b for i, b in enumerate(found[k:], k) if b is not None}
    plan.cost = _prompt_cost(plan, -(-n // tpb))
    return plan


def plan_full(
    found: list[Block | None], cap: int
) -> tuple[int, list[Block | None], dict[int, Block]]:
    """:func:`plan_prompt` of a full-attention group without lower tiers (the common case,
    kept cheap), from ``found``, the committed block of each full block's hash (None where
    there is none), reusing at most ``cap`` blocks.

    Returns ``(k, hits, pins)`` as in :class:`Plan` (``first`` is 0): the leading cached
    blocks up to the cap are hits, any later cached block is pinned. Their cost is
    :func:`full_cost`.
    """
    stop = min(cap, len(found))
    try:
        k = found.index(None, 0, stop)  # the first miss (a scan in C)
    except ValueError:
        k = stop
    pins: dict[int, Block] = {}
    if found.count(None) != len(found) - k:  # (hits hold no None) a cached block after k
        pins = {i: b for i, b in enumerate(found[k:], k) if b is not None}
    return k, found[:k], pins


def full_cost(num_blocks: int, hits: list[Block | None], pins: dict[int, Block]) -> int:
    """The free blocks a :func:`plan_full` plan of a request of ``num_blocks`` blocks takes:
    one per position after the hits, plus one per hit or pin no request holds (it leaves
    the LRU queue). At most ``num_blocks + len(pins)``."""
    cost = num_blocks - len(hits) + list(map(_REF_CNT, hits)).count(0)
    if pins:
        cost += list(map(_REF_CNT, pins.values())).count(0)
    return cost


def plan_import(
    pool: BlockPool,
    window: int | None,
    *,
    tokens_per_block: int,
    hashes: list[bytes],
    n: int,
    lower: LowerTierLookup | None = None,
) -> Plan:
    """Plan a request of ``n`` tokens whose K/V will be transferred in, not computed.

    Every full block may be reused (no token needs computing), and a sliding-window group
    holds only the window of the next token: positions before
    ``first_needed_block(n)`` are neither reused nor received. New blocks start at
    ``max(k, first)``.
    """
    tpb = tokens_per_block
    plan = plan_prompt(
        pool, window, tokens_per_block=tpb, hashes=hashes, n=n, lower=lower, limit=n // tpb
    )
    f = first_needed_block(n, window, tpb)
    if plan.first < f:
        plan.hits = plan.hits[f - plan.first :]
        plan.onboard = [o for o in plan.onboard if o[0] >= f]
        plan.first = f
        plan.cost = _prompt_cost(plan, -(-n // tpb))
    return plan


def _prompt_cost(plan: Plan, num_blocks: int) -> int:
    cost = num_blocks - max(plan.k, plan.first) + len(plan.onboard)
    for b in plan.hits:
        if b is not None and not b.ref_cnt:
            cost += 1
    for b in plan.pins.values():
        if not b.ref_cnt:
            cost += 1
    return cost


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
    plan.cost = new_blocks
    if plan.pins:
        plan.cost += list(map(_REF_CNT, plan.pins.values())).count(0)
    return plan
