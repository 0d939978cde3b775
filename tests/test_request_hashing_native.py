"""The SHA-256/BLAKE3 chain C extension (kvstream.hashing._chainnative) against the references.

Skipped when the extension is not built (no C compiler) or KVSTREAM_NO_NATIVE is set. Vectors:
/work/shared's block_hashes.json (tests/data/block_hashes.json) and the engines' own vectors
(tests/data/peers/hash_vectors.json); properties: the C path equals the pure-Python hashers
(``native=False``) bit for bit, on both SHA-256 implementations (x86 SHA extensions and
portable C), for every block size, scope and chain entry point.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3
from engine_hash_cases import case_blocks, case_kwargs
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream._types import TokenIds
from kvstream.errors import HashingError
from kvstream.hashing import BlockHasher, accel, get_hasher, split_blocks
from kvstream.hashing.native import Blake3Hasher
from kvstream.hashing.trtllm import V2Sha256Hasher
from kvstream.hashing.vllm import VllmSha256CborHasher

native = native_part("kvstream.hashing._chainnative")
if not accel.NATIVE_CHAINS:  # pragma: no cover - only under KVSTREAM_NO_NATIVE
    pytest.skip("KVSTREAM_NO_NATIVE forces the pure-Python path", allow_module_level=True)

DATA = Path(__file__).parent / "data"
REF = json.loads((DATA / "block_hashes.json").read_text("utf-8"))
PEERS = json.loads((DATA / "peers" / "hash_vectors.json").read_text("utf-8"))
NATIVE_ALGOS = ("v2_sha256", "v2_sha256_64", "vllm_sha256_cbor", "vllm_sha256_cbor_64", "blake3")
NATIVE_ALGOS += ("blake3_64",)


def pair(name: str, **params: Any) -> tuple[BlockHasher, BlockHasher]:
    """(C, pure Python) hashers of ``name``."""
    width = 8 if name.endswith("_64") else 32
    if name.startswith("v2_sha256"):
        return (
            V2Sha256Hasher(width, native=True, **params),
            V2Sha256Hasher(width, native=False, **params),
        )
    if name.startswith("vllm_sha256_cbor"):
        return (
            VllmSha256CborHasher(width, native=True, **params),
            VllmSha256CborHasher(width, native=False, **params),
        )
    return Blake3Hasher(width, native=True), Blake3Hasher(width, native=False)


@pytest.fixture(params=["simd", "portable"])
def sha_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test on the SIMD (SHA extensions, SSE4.1 BLAKE3) and on the portable code."""
    before = native.has_sha_ni()
    if request.param == "simd" and not native.set_simd(True):
        native.set_simd(before)
        pytest.skip("this CPU has no SHA extensions")
    if request.param == "portable":
        native.set_simd(False)
    try:
        yield request.param
    finally:
        native.set_simd(before)


# --------------------------------------------------------------------------- primitives


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=5000))
def test_primitives_equal_hashlib_and_blake3(data: bytes) -> None:
    before = native.has_sha_ni()
    try:
        for on in (True, False):
            native.set_simd(on)
            assert native.sha256(data) == hashlib.sha256(data).digest()
            assert native.blake3(data) == blake3(data).digest()
    finally:
        native.set_simd(before)


@pytest.mark.parametrize("n", [0, 1, 55, 56, 63, 64, 65, 119, 120, 1023, 1024, 1025, 2048, 2049])
def test_primitive_boundaries(n: int, sha_impl: str) -> None:
    """Padding and BLAKE3 chunk boundaries (1024-byte chunks, the tree above them)."""
    data = os.urandom(n)
    assert native.sha256(data) == hashlib.sha256(data).digest()
    assert native.blake3(data) == blake3(data).digest()
    big = os.urandom(1024 * 9 + n)  # 10 chunks: a non-power-of-two tree
    assert native.blake3(big) == blake3(big).digest()


# ------------------------------------------------------------------------------ vectors


@pytest.mark.parametrize(
    "case",
    [c for c in REF["cases"] if c["algo"] in NATIVE_ALGOS],
    ids=lambda c: c["id"],
)
def test_reference_vectors(case: dict[str, Any], sha_impl: str) -> None:
    params = dict(case.get("params", {}))
    algo_params = {k: params.pop(k) for k in list(params) if k == "seed"}
    c, _ = pair(case["algo"], **algo_params)
    assert c.native
    got = c.chain(case["blocks"], **params)
    want = [v if isinstance(v, int) else bytes.fromhex(v) for v in case["expect"]]
    assert got == want


@pytest.mark.parametrize(
    "case",
    [c for c in PEERS["cases"] if c["algo"].startswith("vllm_sha256_cbor")],
    ids=lambda c: c["id"],
)
def test_engine_vectors(case: dict[str, Any]) -> None:
    """vLLM 0.33's own sha256_cbor digests (and their ``_64`` form) through the C chain, and
    through chain_raw where it applies (equal full blocks, no per-block keys)."""
    blocks = case_blocks(case, PEERS["token_sets"])
    kwargs = case_kwargs(case)
    digests = [bytes.fromhex(v) for v in case["expect"]]
    plain = "mm_keys" not in kwargs and "prompt_embeds" not in kwargs
    sizes = {len(b) for b in blocks}
    for width in (32, 8):
        c, _ = pair(case["algo"] + ("_64" if width == 8 else ""), **case["params"])
        want = [d[-width:] for d in digests]
        assert c.chain_bytes(blocks, **kwargs) == want
        if plain and len(sizes) == 1:
            raw = b"".join(TokenIds(b).raw for b in blocks)
            published, _ = c.chain_raw(c.root(**kwargs), raw, len(blocks[0]))
            assert published == want


# --------------------------------------------------------------------------- properties

tokens_st = st.lists(
    st.one_of(
        st.integers(0, 2**32 - 1),
        st.sampled_from([0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]),
        st.integers(0, 200_000),
    ),
    max_size=300,
)


@settings(max_examples=120, deadline=None)
@given(
    algo=st.sampled_from(NATIVE_ALGOS),
    tokens=tokens_st,
    tpb=st.integers(1, 70),
    salt=st.sampled_from([None, "", "s", "salt-β"]),
    lora=st.booleans(),
    start_every=st.tuples(st.integers(0, 8), st.integers(0, 5)),
)
def test_native_equals_python(  # noqa: PLR0917
    algo: str,
    tokens: list[int],
    tpb: int,
    salt: str | None,
    lora: bool,
    start_every: tuple[int, int],
) -> None:
    params: dict[str, Any] = {}
    scope: dict[str, Any] = {"cache_salt": salt}
    if algo.startswith("vllm"):
        params["lora_paths"] = {"ad": "/p/ad"}
        if lora:
            scope["lora_name"] = "ad"
    elif lora:
        scope["lora_id"] = 7
    c, py = pair(algo, **params)
    blocks = split_blocks(tokens, tpb, include_partial=True)
    assert c.chain_bytes(blocks, **scope) == py.chain_bytes(blocks, **scope)
    as_lists = [b.tolist() for b in blocks]
    assert c.chain_bytes(as_lists, **scope) == py.chain_bytes(as_lists, **scope)
    # chain_raw, from the root and resumed at a checkpoint
    raw = TokenIds(tokens).raw
    root = c.root(**scope)
    full_c, keys_c = c.chain_raw(root, raw, tpb, every=start_every[1])
    full_py, keys_py = py.chain_raw(py.root(**scope), raw, tpb, every=start_every[1])
    assert full_c == full_py == py.chain_bytes(split_blocks(tokens, tpb), **scope)
    assert keys_c == keys_py
    start = min(start_every[0], len(full_c))
    if start:
        state = py.root(**scope)
        for b in split_blocks(tokens, tpb)[:start]:
            _, state = py.extend(state, b)
        resumed = c.resume(root, state.key, start)
        assert resumed == state
        tail_c, _ = c.chain_raw(resumed, raw, tpb, start=start)
        assert tail_c == full_py[start:]


def test_chain_errors() -> None:
    with pytest.raises(HashingError, match="parent must be 32 bytes"):
        native.chain(native.KIND_V2, b"\0" * 8, 1, b"short")
    with pytest.raises(HashingError, match=r"blocks\[1\]: a block needs at least one token"):
        native.chain(native.KIND_V2, [b"\0" * 4, b""], 0, bytes(32))
    with pytest.raises(HashingError, match="whole u32 ids"):
        native.chain(native.KIND_BLAKE3, b"\0" * 5, 1, bytes(32))
    with pytest.raises(HashingError, match="block_tokens must be >= 1"):
        native.chain(native.KIND_V2, b"\0" * 8, 0, bytes(32))
    with pytest.raises(HashingError, match="unknown chain kind"):
        native.chain(9, b"", 1, bytes(32))
    with pytest.raises(HashingError, match="bytes-like"):
        native.chain(native.KIND_V2, [[1, 2]], 0, bytes(32))
    with pytest.raises(TypeError):
        native.chain(native.KIND_V2)
    c, _ = pair("v2_sha256")
    with pytest.raises(HashingError, match=r"blocks\[1\]"):
        c.chain_bytes([[1, 2], []])
    with pytest.raises(HashingError, match="chain state of blake3"):
        c.chain_raw(get_hasher("blake3").root(), b"\0" * 8, 1)


def test_digest_tokens_take_the_python_path() -> None:
    """v2 blocks holding 32-byte digest tokens hash verbatim (the reference loop)."""
    c, py = pair("v2_sha256")
    blocks = [[1, bytes(range(32)), 3], [4, 5]]
    assert c.chain_bytes(blocks) == py.chain_bytes(blocks)


def test_pack_request() -> None:
    assert accel.pack_request([1, 2, 3]) == TokenIds([1, 2, 3]).raw
    assert accel.pack_request((1, 2, 3), drop_last_token=True) == TokenIds([1, 2]).raw
    assert accel.pack_request([], drop_last_token=True) == b""
    assert accel.pack_request(TokenIds([5, 6]), drop_last_token=True) == TokenIds([5]).raw
    assert native.pack([2**32 - 1, True]) == TokenIds([2**32 - 1, 1]).raw
    for bad in ([1, -1], [1, 2**32], [1, "x"], [1.0]):
        assert native.pack(bad) is None
        with pytest.raises(HashingError, match=r"tokens\[\d\]"):
            accel.pack_request(bad)
    with pytest.raises(TypeError):
        native.pack(b"abcd")


def test_fingerprints_and_same_prefix() -> None:
    raw = os.urandom(4 * 100)
    fps = accel.fingerprints(raw, 40)
    assert len(fps) == 10
    assert len(set(fps)) == 10
    other = raw[:200] + os.urandom(200)
    assert accel.fingerprints(other, 40)[:5] == fps[:5]
    assert accel.fingerprints(other, 40)[5:] != fps[5:]
    assert accel.same_prefix(raw, other, 200)
    assert not accel.same_prefix(raw, other, 204)
    assert not accel.same_prefix(raw, raw[:8], 12)
    assert accel.fingerprints(raw, 40, True) == fps  # ends on a checkpoint
    with_whole = accel.fingerprints(raw[:396], 40, True)
    assert with_whole[:9] == fps[:9]
    assert len(with_whole) == 10
    assert with_whole[9] not in fps
    for stride, data in ((6, raw), (40, raw[:5])):
        with pytest.raises(HashingError, match="multiple of 4"):
            native.fingerprints(data, stride)


def test_split() -> None:
    blob = bytes(range(24))
    assert accel.split(blob, 8, 3) == [blob[:8], blob[8:16], blob[16:]]
    assert accel.split(blob, 8, 1) == [blob[:8]]
    assert accel.split(blob, 8, 0) == []
    for width, count in ((8, 4), (0, 1), (8, -1)):
        with pytest.raises(HashingError, match="cannot split"):
            accel.split(blob, width, count)
