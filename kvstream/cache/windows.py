"""Sliding-window arithmetic: which blocks a request still needs, and per-group reuse.

Convention: with window ``W`` a token at position ``p`` needs the K/V of positions
``[p - W, p)`` (one token more than the strictest reading, so nothing needed is ever
released). With ``W`` None (full attention) it needs ``[0, p)``.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["first_needed_block", "reuse_boundary"]


def first_needed_block(num_tokens: int, window: int | None, tokens_per_block: int) -> int:
    """Index of the first block that the next token (at position ``num_tokens``) needs.

    Blocks before it lie entirely outside the window and may be released.
    """
    if window is None:
        return 0
    start = num_tokens - window
    return start // tokens_per_block if start > 0 else 0


def reuse_boundary(
    cached: Sequence[bool], window: int | None, tokens_per_block: int, limit: int
) -> int:
    """The reuse boundary of one layer group, in blocks.

    ``cached[i]`` says whether the request's block ``i`` (by its chained hash) is cached in
    the group. A prefix of ``k`` blocks is reusable when every block the token at position
    ``k * tokens_per_block`` needs is cached: all of ``0..k-1`` for full attention, only those
    inside the window for a sliding window (earlier blocks may be gone). Returns the largest
    reusable ``k <= limit`` (0 when none is).
    """
    limit = min(limit, len(cached))
    if window is None:
        k = 0
        while k < limit and cached[k]:
            k += 1
        return k
    best = 0
    run = 0  # cached blocks ending at block k-1
    for k in range(1, limit + 1):
        run = run + 1 if cached[k - 1] else 0
        if run >= k - first_needed_block(k * tokens_per_block, window, tokens_per_block):
            best = k
    return best
