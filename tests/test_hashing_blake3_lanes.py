"""The BLAKE3 chain's split path against the reference.

``_chainnative.chain(KIND_BLAKE3, ...)`` hashes the chunks of a block that do not hold the
parent key (all but the first 1024 message bytes) for every block of a request first, eight
at a time on AVX2 (one chunk per lane; one by one otherwise), then each block's first chunk
and its tree nodes in chain order. Whatever the block sizes (one chunk, several, an exact
multiple of the chunk size, a short last chunk, different sizes in one request) and however
many blocks (lane groups of 8 and a remainder; more values than the on-stack scratch), the
keys equal the ``blake3`` package's hash of ``parent || tokens``, on the SIMD code and on the
portable C (``set_simd(False)``).

Skipped when the extension is not built (no C compiler) or KVSTREAM_NO_NATIVE is set.
"""

from __future__ import annotations

import random

import pytest
from blake3 import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream._types import TokenIds
from kvstream.hashing import accel, get_hasher

native = native_part("kvstream.hashing._chainnative")
if not accel.NATIVE_CHAINS:  # pragma: no cover - only under KVSTREAM_NO_NATIVE
    pytest.skip("KVSTREAM_NO_NATIVE forces the pure-Python path", allow_module_level=True)

#: Tokens per block around the chunk boundaries of a ``32 + 4 * n``-byte message: one chunk
#: (<= 248), just over, exactly 2 / 3 / 4 chunks (504, 760, 1016), a short last chunk (512).
SIZES = [1, 2, 247, 248, 249, 250, 256, 503, 504, 505, 512, 759, 760, 761, 1016, 1024, 2040]


def _reference(parent: bytes, blocks: list[bytes]) -> list[bytes]:
    out, key = [], parent
    for b in blocks:
        key = blake3(key + b).digest()
        out.append(key)
    return out


def _raw(rng: random.Random, n_tokens: int) -> bytes:
    return rng.randbytes(4 * n_tokens)


@pytest.mark.parametrize("block_tokens", SIZES)
@pytest.mark.parametrize("n_blocks", [0, 1, 7, 8, 9, 17])
def test_flat_chain_equals_blake3(simd: bool, block_tokens: int, n_blocks: int) -> None:
    rng = random.Random(block_tokens * 100 + n_blocks)
    raw = _raw(rng, block_tokens * n_blocks + block_tokens // 2)  # a partial tail, not hashed
    parent = rng.randbytes(32)
    want = _reference(
        parent, [raw[4 * block_tokens * i : 4 * block_tokens * (i + 1)] for i in range(n_blocks)]
    )
    published, _ = native.chain(native.KIND_BLAKE3, raw, block_tokens, parent)
    assert published == want
    eight, _ = native.chain(native.KIND_BLAKE3, raw, block_tokens, parent, width=8)
    assert eight == [k[:8] for k in want]


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(
        st.one_of(st.sampled_from(SIZES), st.integers(1, 3000)), min_size=1, max_size=24
    ),
    seed=st.integers(0, 2**32),
)
def test_mixed_block_sizes_equal_blake3(sizes: list[int], seed: int) -> None:
    """Per-block buffers of different sizes: chunks of several lengths in one request (the
    lanes take the whole chunks and one short length; other lengths go one by one)."""
    rng = random.Random(seed)
    blocks = [_raw(rng, n) for n in sizes]
    parent = rng.randbytes(32)
    want = _reference(parent, blocks)
    before = native.has_sha_ni()
    try:
        for on in (True, False):
            native.set_simd(on)
            assert native.chain(native.KIND_BLAKE3, blocks, 0, parent)[0] == want
    finally:
        native.set_simd(before)


@settings(max_examples=60, deadline=None)
@given(
    block_tokens=st.integers(1, 2500),
    n_blocks=st.integers(0, 40),
    start=st.integers(0, 5),
    every=st.integers(0, 4),
    seed=st.integers(0, 2**32),
)
def test_simd_equals_portable(
    block_tokens: int, n_blocks: int, start: int, every: int, seed: int
) -> None:
    """Random lengths, a start block and resume points: SIMD and portable agree, and both
    equal the reference."""
    rng = random.Random(seed)
    raw = _raw(rng, block_tokens * n_blocks + rng.randrange(block_tokens))
    parent = rng.randbytes(32)
    blocks = [raw[4 * block_tokens * i : 4 * block_tokens * (i + 1)] for i in range(n_blocks)]
    keys = _reference(parent, blocks[start:])
    want_cps = [k for i, k in enumerate(keys, start) if every and (i + 1) % every == 0]
    before = native.has_sha_ni()
    try:
        got = []
        for on in (True, False):
            native.set_simd(on)
            got.append(
                native.chain(native.KIND_BLAKE3, raw, block_tokens, parent, start, every=every)
            )
    finally:
        native.set_simd(before)
    assert got[0] == got[1] == (keys, want_cps)


def test_long_request_beyond_stack_scratch(simd: bool) -> None:
    """More parent-free chunks than the on-stack scratch holds (the heap path)."""
    rng = random.Random(7)
    raw = _raw(rng, 512 * 300)  # 300 blocks of 3 chunks: 600 values
    parent = rng.randbytes(32)
    want = _reference(parent, [raw[2048 * i : 2048 * (i + 1)] for i in range(300)])
    assert native.chain(native.KIND_BLAKE3, raw, 512, parent)[0] == want


def test_hasher_chain_raw_equals_python_path() -> None:
    """``blake3_64``'s chain_raw (the cache's whole-request path) against the hasher's
    pure-Python loop, on a Mooncake-sized request."""
    rng = random.Random(3)
    raw = _raw(rng, 512 * 23 + 100)
    c = get_hasher("blake3_64")
    assert c.native
    py = type(c)(8, native=False)
    root = c.root()
    assert c.chain_raw(root, raw, 512) == py.chain_raw(root, raw, 512)
    blocks = [TokenIds.from_bytes(raw[2048 * i : 2048 * (i + 1)]) for i in range(23)]
    assert c.chain_raw(root, raw, 512)[0] == py.chain_bytes(blocks)
