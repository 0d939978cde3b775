"""Property tests of kvstream.hashing: incremental == whole-chain, fast encoders == references."""

from __future__ import annotations

from typing import Any

import cbor2
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream._types import TokenIds
from kvstream.hashing import available_hashers, get_hasher
from kvstream.hashing import cbor as kv_cbor
from kvstream.hashing.trtllm import _NUMPY_MIN_TOKENS, _w32, _w32_all, _w64, _w64_all

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
# Mostly vocabulary-sized ids, with every CBOR size class represented.
TOKEN = st.one_of(st.integers(0, 300), st.integers(0, 300_000), U32)
BLOCK = st.lists(TOKEN, min_size=1, max_size=24)
DIGEST = st.binary(min_size=32, max_size=32)
MM_KEY = st.tuples(DIGEST, st.integers(0, 4096))
ALGOS = sorted(available_hashers())


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, list[list[int]], dict[str, Any]]:
    """An algorithm, a request's blocks and its scope / per-block extras valid for it."""
    name = draw(st.sampled_from(ALGOS))
    blocks = draw(st.lists(BLOCK, min_size=1, max_size=5))
    kw: dict[str, Any] = {}
    vllm = name.startswith("vllm")
    # How each algorithm names a request's LoRA adapter and salt (engine algorithms take names
    # and strings; SGLang's adapter id is a uuid string; only TensorRT-LLM-style ids take ints).
    by_name = vllm or name == "dynamo_xxh3_64"
    sglang = name == "sglang_sha256_64"
    if draw(st.booleans()):
        if by_name:
            kw["lora_name"] = draw(st.text(max_size=8))
            if vllm:
                kw["lora_path"] = draw(st.text(max_size=8))
        elif sglang:
            kw["lora_id"] = draw(st.text("0123456789abcdef", min_size=32, max_size=32))
        else:
            kw["lora_id"] = draw(U64)
    salt = draw(st.sampled_from(["none", "str"] if by_name or sglang else ["none", "str", "id"]))
    if salt == "str":
        kw["cache_salt"] = draw(st.text(max_size=8))
    elif salt == "id":
        kw["salt_id"] = draw(U64)
    if not sglang and draw(st.booleans()):  # SGLang hashes pad token ids, not mm keys
        kw["mm_keys"] = [draw(st.lists(MM_KEY, max_size=2)) for _ in blocks]
    if name in ("v1_block_key", "blake3", "blake3_64") and draw(st.booleans()):
        kw["token_extra_ids"] = [
            None if draw(st.booleans()) else draw(st.lists(U64, min_size=len(b), max_size=len(b)))
            for b in blocks
        ]
    return name, blocks, kw


@settings(max_examples=300, deadline=None)
@given(requests())
def test_extend_fold_equals_chain(req: tuple[str, list[list[int]], dict[str, Any]]) -> None:
    name, blocks, kw = req
    h = get_hasher(name)
    want = h.chain_bytes(blocks, **kw)
    scope = {k: v for k, v in kw.items() if k not in ("mm_keys", "token_extra_ids")}
    state = h.root(**scope)
    got = []
    for i, block in enumerate(blocks):
        published, state = h.extend(
            state,
            TokenIds(block),
            kw["mm_keys"][i] if "mm_keys" in kw else (),
            kw["token_extra_ids"][i] if "token_extra_ids" in kw else None,
        )
        got.append(published)
    assert got == want
    assert state.depth == len(blocks)
    chained = h.chain(blocks, **kw)
    if h.width == 8:
        assert chained == [int.from_bytes(b, "big") for b in want]
    else:
        assert chained == want
    # The TokenIds fast path and plain lists agree.
    assert h.chain_bytes([TokenIds(b) for b in blocks], **kw) == want


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(ALGOS), st.lists(st.lists(TOKEN, min_size=16, max_size=16), min_size=33))
def test_vectorised_chain_equals_fold(name: str, blocks: list[list[int]]) -> None:
    """Requests long enough for the numpy paths (>= 512 tokens) agree with per-block extend."""
    h = get_hasher(name)
    state = h.root()
    got = []
    for b in blocks:
        published, state = h.extend(state, b)
        got.append(published)
    assert h.chain_bytes(blocks) == got


# ------------------------------------------------------------ canonical CBOR encoder

CBOR_LEAF = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**64), 2**64 - 1),
    st.integers(-(2**70), 2**70),  # beyond 64 bits: delegated to cbor2 (bignums)
    st.binary(max_size=300),
    st.text(max_size=300),
    st.floats(allow_nan=False),  # delegated to cbor2
)
CBOR_VALUE = st.recursive(
    CBOR_LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=30).map(tuple), st.lists(inner, max_size=30)),
    max_leaves=60,
)


@settings(max_examples=500, deadline=None)
@given(CBOR_VALUE)
def test_cbor_dumps_equals_cbor2_canonical(value: Any) -> None:
    assert kv_cbor.dumps(value) == cbor2.dumps(value, canonical=True)


@settings(max_examples=200, deadline=None)
@given(DIGEST, st.lists(TOKEN, max_size=64), st.none() | CBOR_VALUE)
def test_vllm_payload_encoding_equals_cbor2(parent: bytes, toks: list[int], extra: Any) -> None:
    """The payload vLLM hashes, as kvstream builds it, equals cbor2's canonical encoding."""
    raw = TokenIds(toks).raw
    built = b"\x83\x58\x20" + parent + kv_cbor.token_array(raw) + kv_cbor.dumps(extra)
    assert built == cbor2.dumps((parent, tuple(toks), extra), canonical=True)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(TOKEN, min_size=1, max_size=40), min_size=1, max_size=12))
def test_token_arrays_equal_per_block_encoding(blocks: list[list[int]]) -> None:
    raw = b"".join(TokenIds(b).raw for b in blocks)
    lengths = [len(b) for b in blocks]
    want = [cbor2.dumps(tuple(b), canonical=True) for b in blocks]
    assert kv_cbor.token_arrays(raw, lengths) == want
    assert kv_cbor.token_arrays(raw, lengths, none_tail=True) == [w + b"\xf6" for w in want]
    assert [kv_cbor.token_array(TokenIds(b).raw) for b in blocks] == want


def test_token_arrays_of_nothing() -> None:
    assert kv_cbor.token_arrays(b"", []) == []


# --------------------------------------------------- v1_block_key vectorised mix terms


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        st.lists(st.integers(0, 2**18 - 1), max_size=3 * _NUMPY_MIN_TOKENS),  # table lookups
        st.lists(U32, max_size=3 * _NUMPY_MIN_TOKENS),
    )
)
def test_v1_vectorised_mix32_terms(tokens: list[int]) -> None:
    raw = TokenIds(tokens).raw
    assert _w32_all(raw) == [_w32(t) for t in tokens]
    assert np.frombuffer(raw, "<u4").tolist() == tokens


@settings(max_examples=200, deadline=None)
@given(st.lists(U64, max_size=3 * _NUMPY_MIN_TOKENS))
def test_v1_vectorised_mix64_terms(values: list[int]) -> None:
    assert _w64_all(values) == [_w64(v) for v in values]
