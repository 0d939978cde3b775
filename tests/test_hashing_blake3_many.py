"""Several BLAKE3 chains side by side: ``_chainnative.chain_many`` against one chain at a time.

``chain_many(KIND_BLAKE3, raws, block_tokens, parent, width, offset)`` advances (AVX2) up to
eight requests together, one block each per step, a lane refilled with the next request when
its request ends: whole messages while requests wait, then, for what the last requests have
left, their parent-free chunks eight at a time and the lanes on each block's first chunk and
tree nodes, the last one or two requests one block at a time; without AVX2
(``set_simd(False)``) it hashes one request after the other.

Whatever the number of requests (fewer, as many as, more than the lanes), their lengths
(equal, unequal, without a full block), the block size (one chunk, a chunk boundary, a short
last chunk, a deep tree) and the published width/offset, each request's result equals
``chain(KIND_BLAKE3, raw, block_tokens, parent, width=, offset=, every=n)`` and the ``blake3``
package's hash of ``parent || tokens`` chained block by block, on the SIMD code and on the
portable C. ``BlockHasher.chain_raw_many`` of both BLAKE3 hashers uses it and equals their
pure-Python chains; ``BlockHasher.resume`` builds the state ``_replace`` would.

Skipped when the extension is not built (no C compiler) or KVSTREAM_NO_NATIVE is set.
"""

from __future__ import annotations

import random

import pytest
from blake3 import blake3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream.errors import HashingError
from kvstream.hashing import accel, get_hasher
from kvstream.hashing.native import Blake3Hasher

native = native_part("kvstream.hashing._chainnative")
if not accel.NATIVE_CHAINS:  # pragma: no cover - only under KVSTREAM_NO_NATIVE
    pytest.skip("KVSTREAM_NO_NATIVE forces the pure-Python path", allow_module_level=True)

#: Tokens per block around the chunk boundaries of a ``32 + 4 * n``-byte message: one chunk
#: (<= 248), exactly 2 / 3 chunks (504, 760), a short last chunk (512), a deep tree (3000).
SIZES = [1, 2, 16, 247, 248, 249, 504, 505, 512, 760, 1016, 3000]


def _one_by_one(
    raws: list[bytes], tpb: int, parent: bytes, width: int = 32, offset: int = 0
) -> list[tuple[list[bytes], list[bytes]]]:
    out: list[tuple[list[bytes], list[bytes]]] = []
    for raw in raws:
        n = len(raw) // (4 * tpb)
        if n == 0:
            out.append(([], []))
        else:
            out.append(
                native.chain(
                    native.KIND_BLAKE3, raw, tpb, parent, width=width, offset=offset, every=n
                )
            )
    return out


def _reference(raw: bytes, tpb: int, parent: bytes) -> list[bytes]:
    keys, key = [], parent
    for i in range(len(raw) // (4 * tpb)):
        key = blake3(key + raw[4 * tpb * i : 4 * tpb * (i + 1)]).digest()
        keys.append(key)
    return keys


def _requests(rng: random.Random, tpb: int, blocks: list[int]) -> list[bytes]:
    """One request per entry: that many full blocks, then a partial block of random length."""
    return [rng.randbytes(4 * (tpb * n + rng.randrange(tpb))) for n in blocks]


@pytest.mark.parametrize("tpb", SIZES)
@pytest.mark.parametrize(
    "blocks",
    [
        [1],
        [3, 3],
        [5, 1, 4],
        [2] * 8,
        [6] * 9,
        [0, 7, 0, 1, 12, 3, 0, 2, 9],
        [1] * 17,
        list(range(20)),
        [40, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    ],
    ids=lambda b: f"{len(b)}req",
)
def test_chain_many_equals_one_by_one(simd: bool, tpb: int, blocks: list[int]) -> None:
    rng = random.Random(tpb * 1000 + len(blocks))
    raws = _requests(rng, tpb, blocks)
    parent = rng.randbytes(32)
    got = native.chain_many(native.KIND_BLAKE3, raws, tpb, parent)
    assert got == _one_by_one(raws, tpb, parent)
    for raw, (keys, last) in zip(raws, got, strict=True):
        want = _reference(raw, tpb, parent)
        assert keys == want
        assert last == want[-1:]


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tpb=st.one_of(st.sampled_from(SIZES), st.integers(1, 1100)),
    blocks=st.lists(st.integers(0, 14), max_size=30),
    width_offset=st.sampled_from([(32, 0), (8, 0), (8, 24), (1, 31), (16, 5)]),
    seed=st.integers(0, 2**32),
)
def test_chain_many_property(
    simd: bool, tpb: int, blocks: list[int], width_offset: tuple[int, int], seed: int
) -> None:
    """Random request counts and lengths (0 .. 14 blocks, more requests than lanes), block
    sizes and published slices: equal to one chain per request."""
    rng = random.Random(seed)
    raws = _requests(rng, tpb, blocks)
    parent = rng.randbytes(32)
    width, offset = width_offset
    got = native.chain_many(native.KIND_BLAKE3, raws, tpb, parent, width, offset)
    assert got == _one_by_one(raws, tpb, parent, width, offset)


def test_simd_equals_portable_on_a_long_mix() -> None:
    """A few hundred requests of Mooncake-like lengths (512-token blocks, one long request),
    heap scratch and the GIL released: SIMD lanes and portable C agree."""
    rng = random.Random(11)
    blocks = [rng.choice([1, 2, 5, 11, 23, 40, 90]) for _ in range(300)] + [250]
    raws = _requests(rng, 512, blocks)
    parent = rng.randbytes(32)
    before = native.has_sha_ni()
    try:
        got = []
        for on in (True, False):
            native.set_simd(on)
            got.append(native.chain_many(native.KIND_BLAKE3, raws, 512, parent, 8))
    finally:
        native.set_simd(before)
    assert got[0] == got[1] == _one_by_one(raws, 512, parent, 8)


def test_chain_many_takes_buffers_and_tuples() -> None:
    rng = random.Random(5)
    raws = _requests(rng, 16, [3, 0, 9])
    parent = rng.randbytes(32)
    want = _one_by_one(raws, 16, parent)
    views = (bytearray(raws[0]), memoryview(raws[1]), raws[2])
    assert native.chain_many(native.KIND_BLAKE3, views, 16, bytearray(parent)) == want
    assert native.chain_many(native.KIND_BLAKE3, [], 16, parent) == []


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((native.KIND_V2, [b""], 4, bytes(32)), "KIND_BLAKE3 chains only"),
        ((native.KIND_BLAKE3, [b""], 0, bytes(32)), "block_tokens"),
        ((native.KIND_BLAKE3, [b""], 4, bytes(31)), "parent must be 32 bytes"),
        ((native.KIND_BLAKE3, 7, 4, bytes(32)), "sequence of bytes-like"),
        ((native.KIND_BLAKE3, [b"", 7], 4, bytes(32)), r"raws\[1\] must be a bytes-like"),
        ((native.KIND_BLAKE3, [bytes(16), bytes(18)], 4, bytes(32)), r"raws\[1\].*whole u32"),
        ((native.KIND_BLAKE3, [b""], 4, bytes(32), 33), "width"),
        ((native.KIND_BLAKE3, [b""], 4, bytes(32), 8, 25), "width/offset"),
    ],
)
def test_chain_many_rejects_bad_input(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(HashingError, match=match):
        native.chain_many(*args)


def test_chain_many_skips_requests_without_a_full_block() -> None:
    """Like the default ``chain_raw_many``, a request shorter than a block is ``([], [])``
    whatever its bytes (not validated: nothing of it is hashed)."""
    parent = bytes(32)
    assert native.chain_many(native.KIND_BLAKE3, [b"abc", b""], 4, parent) == [([], []), ([], [])]


@pytest.mark.parametrize("algo", ["blake3", "blake3_64"])
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tpb=st.sampled_from([1, 16, 249, 512]),
    blocks=st.lists(st.integers(0, 6), max_size=20),
    seed=st.integers(0, 2**32),
    scoped=st.booleans(),
)
def test_hasher_chain_raw_many_equals_python_chain(
    simd: bool, algo: str, *, tpb: int, blocks: list[int], seed: int, scoped: bool
) -> None:
    """Both BLAKE3 hashers (scoped roots too) take the lanes and equal their pure-Python
    hasher's ``chain_raw`` per request."""
    rng = random.Random(seed)
    raws = _requests(rng, tpb, blocks)
    c = get_hasher(algo)
    assert isinstance(c, Blake3Hasher)
    assert c.native
    assert c._c_many
    py = Blake3Hasher(c.width, native=False)
    root = c.root(lora_id=3, salt_id=9) if scoped else c.root()
    want = [py.chain_raw(root, raw, tpb, every=len(raw) // (4 * tpb)) for raw in raws]
    assert c.chain_raw_many(root, raws, tpb) == want
    assert py.chain_raw_many(root, raws, tpb) == want


def test_chain_raw_many_rejects_a_foreign_state_and_bad_block_size() -> None:
    b3 = get_hasher("blake3_64")
    other = get_hasher("blake3")
    for hasher in (b3, Blake3Hasher(8, native=False)):
        with pytest.raises(HashingError, match="chain state of blake3"):
            hasher.chain_raw_many(other.root(), [], 4)
        with pytest.raises(HashingError, match="tokens_per_block must be >= 1"):
            hasher.chain_raw_many(hasher.root(), [bytes(16)], 0)
        with pytest.raises(HashingError, match="tokens_per_block must be an int"):
            hasher.chain_raw_many(hasher.root(), [bytes(16)], 4.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", ["blake3_64", "v2_sha256_64", "vllm_sha256_cbor_64"])
def test_resume_equals_replace(algo: str) -> None:
    hasher = get_hasher(algo)
    root = hasher.root()
    raw = bytes(range(64)) * 4
    _, keys = hasher.chain_raw(root, raw, 4, every=2)
    state = hasher.resume(root, keys[-1], 16)
    assert type(state) is type(root)
    assert state == root._replace(key=keys[-1], depth=16)
    # the resumed state continues the chain exactly where it left off
    more = bytes(range(100, 116))
    assert (
        hasher.chain_raw(state, raw + more, 4, start=16)[0]
        == (hasher.chain_raw(root, raw + more, 4)[0][16:])
    )
    with pytest.raises(HashingError):
        hasher.resume(get_hasher("blake3").root(), keys[-1], 16)
