"""The request-hashing fast paths against their references.

- ``_chainnative.pack`` reads exact ints from their digits (a generic path for the rest): equal
  to the ``struct`` packing on every digit-count boundary, and None for what it must refuse.
- The vLLM CBOR chain encodes token arrays four ids at a time with SSE4.1 (a scalar loop
  otherwise): on both, equal to the pure-Python reference for every block size, including
  the ids where CBOR's head changes size.
- vLLM's default ``sha256`` (pickle) chain builds its pickle payloads in C: equal to Python's
  pickle for every scope (one-character strs whose identity pickle memoizes included),
  extra-key format and width, and pickle itself wherever the C chain does not apply.
- SGLang's page chain runs in C for u32 pages (its namespaced published hashes too): equal
  to the pure-Python reference for every scope and event format.

Skipped when the extension is not built (no C compiler) or KVSTREAM_NO_NATIVE is set.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream._types import TokenIds
from kvstream.errors import HashingError
from kvstream.hashing import BlockHasher, accel, split_blocks
from kvstream.hashing.sglang import SglangSha256Hasher
from kvstream.hashing.vllm import VllmSha256CborHasher
from kvstream.hashing.vllm_pickle import VllmSha256PickleHasher

native = native_part("kvstream.hashing._chainnative")
if not accel.NATIVE_CHAINS:  # pragma: no cover - only under KVSTREAM_NO_NATIVE
    pytest.skip("KVSTREAM_NO_NATIVE forces the pure-Python path", allow_module_level=True)

#: Where CBOR's head grows (24, 2**8, 2**16) and where CPython's digits do (2**30).
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**30 - 1, 2**30, 2**31, 2**32 - 1]


class _Int(int):
    pass


def test_pack_digit_boundaries() -> None:
    ids = [*EDGES, *(e - 1 for e in EDGES if e), *(e + 1 for e in EDGES if e < 2**32 - 1)]
    want = struct.pack(f"<{len(ids)}I", *ids)
    assert native.pack(ids) == want
    assert native.pack(tuple(ids), True) == want[:-4]
    # int subclasses and bools take the generic path, with the same values
    assert native.pack([_Int(7), _Int(2**31), True, False]) == struct.pack("<4I", 7, 2**31, 1, 0)
    for bad in (-1, -(2**30), -(2**31), 2**32, 2**33, 2**60, 2**64, -(2**64), 2**100):
        assert native.pack([1, bad]) is None
        assert native.pack([1, bad], True) is None  # the dropped id is validated too


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.one_of(st.sampled_from(EDGES), st.integers(0, 2**32 - 1)), max_size=64))
def test_pack_equals_struct(ids: list[int]) -> None:
    assert native.pack(ids) == struct.pack(f"<{len(ids)}I", *ids)


def _cbor_pair() -> tuple[BlockHasher, BlockHasher]:
    return VllmSha256CborHasher(native=True), VllmSha256CborHasher(native=False)


def _pickle_pair() -> tuple[BlockHasher, BlockHasher]:
    return VllmSha256PickleHasher(native=True), VllmSha256PickleHasher(native=False)


@pytest.mark.parametrize("kind", ["cbor", "pickle"])
@pytest.mark.parametrize("tpb", [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32, 33])
def test_token_encodings_on_size_boundaries(kind: str, tpb: int, simd: bool) -> None:
    """Every pair of size classes (CBOR heads, pickle int opcodes) inside a four-id group, and
    every remainder length."""
    ids = [a for a in EDGES for b in EDGES for a in (a, b)]
    c, py = _cbor_pair() if kind == "cbor" else _pickle_pair()
    raw = TokenIds(ids).raw
    got, _ = c.chain_raw(c.root(), raw, tpb)
    assert got == py.chain_bytes(split_blocks(ids, tpb))


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(
        st.one_of(st.sampled_from(EDGES), st.integers(0, 300), st.integers(0, 2**32 - 1)),
        max_size=200,
    ),
    tpb=st.integers(1, 40),
    on=st.booleans(),
)
def test_cbor_chain_equals_python(ids: list[int], tpb: int, on: bool) -> None:
    c, py = _cbor_pair()
    before = native.has_sha_ni()
    native.set_simd(on)
    try:
        got, _ = c.chain_raw(c.root(cache_salt="s"), TokenIds(ids).raw, tpb)
    finally:
        native.set_simd(before)
    assert got == py.chain_bytes(split_blocks(ids, tpb), cache_salt="s")


sglang_scopes = st.sampled_from(
    [{}, {"cache_salt": "tenant"}, {"extra_key": "e"}, {"lora_id": "ad", "cache_salt": "t"}]
)


@settings(max_examples=80, deadline=None)
@given(
    ids=st.lists(st.one_of(st.sampled_from(EDGES), st.integers(0, 2**32 - 1)), max_size=150),
    tpb=st.integers(1, 40),
    scope=sglang_scopes,
    event_format=st.sampled_from(["default", "dynamo"]),
    start_every=st.tuples(st.integers(0, 6), st.integers(0, 4)),
    on=st.booleans(),
)
def test_sglang_native_equals_python(  # noqa: PLR0917
    ids: list[int],
    tpb: int,
    scope: dict[str, str],
    event_format: str,
    start_every: tuple[int, int],
    on: bool,
) -> None:
    c = SglangSha256Hasher(event_format=event_format, native=True)
    py = SglangSha256Hasher(event_format=event_format, native=False)
    assert c.native
    assert not py.native
    start, every = start_every
    before = native.has_sha_ni()
    native.set_simd(on)
    try:
        blocks = split_blocks(ids, tpb, include_partial=True)
        want = py.chain_bytes(blocks, **scope)
        assert c.chain_bytes(blocks, **scope) == want
        assert c.chain_bytes([b.tolist() for b in blocks], **scope) == want
        raw = TokenIds(ids).raw
        full, keys = c.chain_raw(c.root(**scope), raw, tpb, every=every)
        assert (full, keys) == py.chain_raw(py.root(**scope), raw, tpb, every=every)
        assert full == want[: len(ids) // tpb]
        start = min(start, len(full))
        if start:
            state = py.root(**scope)
            for b in blocks[:start]:
                _, state = py.extend(state, b)
            got = c.chain_raw(state, raw, tpb, start=start, every=every)
            assert got == py.chain_raw(state, raw, tpb, start=start, every=every)
            assert got[0] == full[start:]
    finally:
        native.set_simd(before)


def test_sglang_wide_pages_and_errors_on_the_native_hasher() -> None:
    """Pages with ids >= 2**32 take the reference loop; errors read as the reference's."""
    c, py = SglangSha256Hasher(native=True), SglangSha256Hasher(native=False)
    blocks = [[1, 2], [2**40, 3], [4]]
    assert c.chain_bytes(blocks) == py.chain_bytes(blocks)
    for bad in ([[1], []], [[1], [-1]], [[1], ["x"]]):
        with pytest.raises(HashingError) as want:
            py.chain_bytes(bad)
        with pytest.raises(HashingError) as got:
            c.chain_bytes(bad)
        assert str(got.value) == str(want.value)
    with pytest.raises(HashingError, match=r"blocks\[1\]: a block needs at least one token"):
        c.chain_bytes([[1], []])
    with pytest.raises(HashingError, match="parent must be 32 bytes"):
        native.chain(native.KIND_V2, b"\0" * 8, 1, b"")


pickle_scopes = st.sampled_from(
    [
        {},
        {"cache_salt": "tenant"},
        {"lora_name": "ad"},
        {"lora_name": "a", "cache_salt": "a"},  # one-character strs: shared objects, memo refs
        {"lora_name": "ad", "cache_salt": "s-β"},
    ]
)


@settings(max_examples=80, deadline=None)
@given(
    ids=st.lists(
        st.one_of(st.sampled_from(EDGES), st.integers(0, 300), st.integers(0, 2**32 - 1)),
        max_size=150,
    ),
    tpb=st.integers(1, 40),
    scope=pickle_scopes,
    width=st.sampled_from([32, 8]),
    extra_keys=st.sampled_from(["tagged", "legacy"]),
    start_every=st.tuples(st.integers(0, 6), st.integers(0, 4)),
    on=st.booleans(),
)
def test_vllm_pickle_native_equals_python(  # noqa: PLR0917
    ids: list[int],
    tpb: int,
    scope: dict[str, str],
    width: int,
    extra_keys: str,
    start_every: tuple[int, int],
    on: bool,
) -> None:
    params: dict[str, Any] = {"lora_paths": {"ad": "/p/ad", "a": "a"}, "extra_keys": extra_keys}
    c = VllmSha256PickleHasher(width, native=True, **params)
    py = VllmSha256PickleHasher(width, native=False, **params)
    assert c.native
    assert not py.native
    start, every = start_every
    blocks = split_blocks(ids, tpb, include_partial=True)
    want = py.chain_bytes(blocks, **scope)
    raw = TokenIds(ids).raw
    before = native.has_sha_ni()
    native.set_simd(on)
    try:
        assert c.chain_bytes(blocks, **scope) == want
        full, keys = c.chain_raw(c.root(**scope), raw, tpb, every=every)
    finally:
        native.set_simd(before)
    assert (full, keys) == py.chain_raw(py.root(**scope), raw, tpb, every=every)
    assert full == want[: len(ids) // tpb]
    start = min(start, len(full))
    if start:
        state = py.root(**scope)
        for b in blocks[:start]:
            _, state = py.extend(state, b)
        got = c.chain_raw(state, raw, tpb, start=start, every=every)
        assert got == py.chain_raw(state, raw, tpb, start=start, every=every)
        assert got[0] == full[start:]


def test_vllm_pickle_paths_the_c_chain_leaves_to_pickle() -> None:
    """Multimodal keys, extra keys too long for the C tail, and blocks too large for one pickle
    frame hash as Python's pickle does."""
    long_path = "/p/" + "x" * 5000
    params: dict[str, Any] = {"lora_paths": {"ad": long_path}}
    c = VllmSha256PickleHasher(native=True, **params)
    py = VllmSha256PickleHasher(native=False, **params)
    ids = list(range(0, 2**32, 2**32 // 50))[:40]
    blocks = split_blocks(ids, 8)
    mm = [None, [("img", 3)], None, None, None]
    assert c.chain_bytes(blocks, mm_keys=mm) == py.chain_bytes(blocks, mm_keys=mm)
    assert c.chain_bytes(blocks, lora_name="ad") == py.chain_bytes(blocks, lora_name="ad")
    raw = TokenIds(ids).raw
    assert c.chain_raw(c.root(lora_name="ad"), raw, 8) == py.chain_raw(
        py.root(lora_name="ad"), raw, 8
    )
    big = [2**32 - 1 - i for i in range(10_000)]  # 70 KB of LONG1: two pickle frames
    assert c.chain_raw(c.root(), TokenIds(big).raw, 10_000) == py.chain_raw(
        py.root(), TokenIds(big).raw, 10_000
    )
    assert c.chain_bytes([big]) == py.chain_bytes([big])
    with pytest.raises(HashingError, match="KIND_PICKLE needs the tail"):
        native.chain(native.KIND_PICKLE, b"\0" * 8, 1, bytes(32))
