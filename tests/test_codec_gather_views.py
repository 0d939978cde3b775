"""``gather_blocks`` reads a chain's ``TokenIdsView`` blocks straight from the chain's bytes
(no ``_raw`` property call per block): same result as the encoder's Python path on views not
yet read, views already read, views mixed with plain ``TokenIds``, uneven chains, and views
whose slots are not what the fast path expects (it falls back to the property)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream._types import TokenIds, TokenIdsView
from kvstream.codec import encoder
from kvstream.events.model import StoredBlock

native: Any = pytest.importorskip("kvstream.codec._tokens_native")


def _chain(ids: list[int], k: int) -> tuple[TokenIdsView, ...]:
    return TokenIdsView.of_run(TokenIds(ids).raw, k)


def _blocks(tokens: list[Any]) -> tuple[StoredBlock, ...]:
    return tuple(
        StoredBlock(block_hash=(i + 1).to_bytes(8, "big"), token_ids=t)
        for i, t in enumerate(tokens)
    )


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(1, 12),
    size=st.integers(0, 20),
    read=st.sets(st.integers(0, 11)),
    plain_at=st.sets(st.integers(0, 11)),
    seed=st.integers(0, 2**32 - 1),
)
def test_views_gather_as_the_python_path(
    k: int, size: int, read: set[int], plain_at: set[int], seed: int
) -> None:
    ids = [(seed * 2654435761 + i * 40503) % (1 << 32) for i in range(k * size)]
    # two copies: one for each path, so neither sees the other's cut views
    mine, ref = list(_chain(ids, k)), list(_chain(ids, k))
    for i in read:  # some views already read (their bytes cut, their run dropped)
        if i < k:
            _ = mine[i].raw, ref[i].raw
    for i in plain_at:
        if i < k:
            mine[i] = ref[i] = TokenIds(ids[i * size : (i + 1) * size])
    tuples = [_blocks(mine), _blocks([TokenIds([1, 2, 3])])]
    assert native.gather_blocks(tuples) == encoder._gather_py([_blocks(ref), tuples[1]])
    # the fast path leaves unread views as they were: reading them later gives their ids
    assert [list(t) for t in mine] == [ids[i * size : (i + 1) * size] for i in range(k)]


class _OddView(TokenIdsView):
    __slots__ = ()


def test_unexpected_view_slots_fall_back_to_the_property() -> None:
    views = list(_chain(list(range(32)), 4))
    odd = _OddView.of_run(TokenIds(list(range(100, 108))).raw, 1)[0]
    object.__setattr__(odd, "_run", ["not", "a tuple"])  # the fast path must not trust it
    tuples = [_blocks([*views, TokenIds([7, 8])])]
    assert native.gather_blocks(tuples) == encoder._gather_py(tuples)
    with pytest.raises((TypeError, ValueError, AttributeError)):
        _ = odd.raw  # the property itself refuses it
    # gather_blocks hands such a block to the Python path (None) instead of crashing
    assert native.gather_blocks([_blocks([odd])]) is None
