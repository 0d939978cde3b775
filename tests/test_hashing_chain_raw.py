"""``BlockHasher.chain_raw``: one base method for every algorithm.

The algorithms plug in their C chain kind (``_c``, ``_c_kind``, ``_c_args``) or their own loop
(``_chain_raw``: TensorRT-LLM V1's C extension, Dynamo's unchained XXH3 over views of the
packed request), and the results equal the reference (slice the request, fold ``extend``)
with checkpoints (``every``) and resumption (``start``). The C chains' own equality tests are
in test_hashing_fastpaths.py and test_request_hashing_native.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream._types import TokenIds
from kvstream.hashing import BlockHasher, available_hashers, get_hasher, split_blocks
from kvstream.hashing.trtllm import NATIVE_AVAILABLE, V1BlockKeyHasher


def test_chain_raw_is_defined_once() -> None:
    """The C chains plug into BlockHasher.chain_raw by kind; no hasher redefines it."""
    for algo in available_hashers():
        cls = type(get_hasher(algo))
        owners = [k.__name__ for k in cls.__mro__ if "chain_raw" in vars(k)]
        assert owners == ["BlockHasher"], (algo, owners)


@pytest.mark.skipif(not NATIVE_AVAILABLE, reason="the v1_block_key C extension is not built")
@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=120),
    tpb=st.integers(1, 20),
    start=st.integers(0, 6),
    every=st.integers(0, 4),
    salt=st.sampled_from([None, "s"]),
)
def test_v1_chain_raw_native_equals_python(
    ids: list[int], tpb: int, start: int, every: int, salt: str | None
) -> None:
    c, py = V1BlockKeyHasher(native=True), V1BlockKeyHasher(native=False)
    raw = TokenIds(ids).raw
    full, keys = c.chain_raw(c.root(cache_salt=salt), raw, tpb, every=every)
    assert (full, keys) == py.chain_raw(py.root(cache_salt=salt), raw, tpb, every=every)
    assert full == py.chain_bytes(split_blocks(ids, tpb), cache_salt=salt)
    start = min(start, len(full))
    if start:
        state = py.root(cache_salt=salt)
        for b in split_blocks(ids, tpb)[:start]:
            _, state = py.extend(state, b)
        got = c.chain_raw(state, raw, tpb, start=start, every=every)
        assert got == py.chain_raw(state, raw, tpb, start=start, every=every)
        assert got[0] == full[start:]


@settings(max_examples=80, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), max_size=150),
    tpb=st.integers(1, 20),
    start=st.integers(0, 10),
    every=st.integers(0, 4),
    scope=st.sampled_from([{}, {"cache_salt": "t"}, {"lora_name": "ad"}]),
)
def test_dynamo_chain_raw_equals_folding_extend(
    ids: list[int], tpb: int, start: int, every: int, scope: dict[str, str]
) -> None:
    """Dynamo's unchained hashes straight from the packed request equal BlockHasher's
    reference (slice, fold ``extend``), and Dynamo's own definition (chain_bytes)."""
    h = get_hasher("dynamo_xxh3_64")
    root = h.root(**scope)
    state = h.resume(root, None, start) if start else root
    raw = TokenIds(ids).raw
    got = h.chain_raw(state, raw, tpb, start=start, every=every)
    assert got == BlockHasher._chain_raw(h, state, raw, tpb, start, every)
    assert got[0] == h.chain_bytes(split_blocks(ids, tpb), **scope)[start:]


@pytest.mark.parametrize("algo", available_hashers())
def test_the_unscoped_root_is_computed_once_and_hashes_as_a_fresh_one(algo: str) -> None:
    """``root()`` of an unscoped request is memoised per hasher (with its C arguments): the
    same object every call, equal to the root computed afresh, and a chain from it equals
    the chain from an equal root that is not the memoised object."""
    from kvstream.hashing.scope import EMPTY_SCOPE

    h = get_hasher(algo)
    root = h.root()
    assert h.root() is root
    assert h.root(None, None, None, None) is root
    fresh = h._root(EMPTY_SCOPE)
    assert fresh == root
    raw = bytes(range(256)) * 3
    for tpb in (4, 16):
        assert h.chain_raw(root, raw, tpb, every=2) == h.chain_raw(fresh, raw, tpb, every=2)
        assert h.chain_raw(root, raw, tpb) == h.chain_raw(root, raw, tpb)
