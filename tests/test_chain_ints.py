"""chain_ints: a request's ids packed and hashed in one C pass, equal to pack + chain.

``_chainnative.chain_ints`` against ``pack`` then ``chain`` for every chain kind (edge ids,
block sizes, start, every, drop_last, bad items), and ``RequestHasher.hashes`` (which takes
that pass when the prefix cache is off) against the two-step path and the block-by-block
chain, in both lanes: under KVSTREAM_NO_NATIVE the pass never applies.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.errors import HashingError
from kvstream.hashing import accel, available_hashers, get_hasher, split_blocks
from kvstream.index.matching import HashRequest, RequestHasher

U32 = st.one_of(
    st.sampled_from([0, 1, 255, 256, 65535, 65536, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1)
)
TOKENS = st.lists(U32, max_size=300)
BLOCK = st.sampled_from([1, 2, 3, 16, 31, 32, 33])
KINDS = (accel.KIND_V2, accel.KIND_CBOR, accel.KIND_BLAKE3, accel.KIND_SGLANG, accel.KIND_PICKLE)
BAD = st.sampled_from([-1, 2**32, 2**64, 1.0, "7", None, True, False, np.int64(5), np.uint32(9)])

native_only = pytest.mark.skipif(
    not accel.NATIVE_CHAINS, reason="KVSTREAM_NO_NATIVE forces the pure-Python path"
)


def _tails(kind: int, salted: bool) -> tuple[bytes, bytes | None]:
    """A parent and tail the C chain of ``kind`` takes."""
    if kind == accel.KIND_SGLANG:
        return (bytes(range(32)) if salted else b""), (b"ns-seed" if salted else None)
    return bytes(range(32)), (b"\x81\x02" if salted else None) if kind != accel.KIND_PICKLE else (
        b"\x4e\x85\x94."
    )


def _two_step(kind, tokens, bt, parent, *, start, tail, every, drop_last):
    c = accel._native
    raw = c.pack(tokens, drop_last)
    if raw is None:
        return None
    return raw, c.chain(kind, raw, bt, parent, start, 32, 0, None, tail, every)


@native_only
@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    tokens=TOKENS,
    bt=BLOCK,
    start=st.integers(0, 12),
    every=st.integers(0, 3),
    drop_last=st.booleans(),
    salted=st.booleans(),
    as_tuple=st.booleans(),
)
def test_chain_ints_equals_pack_then_chain(
    *, kind, tokens, bt, start, every, drop_last, salted, as_tuple
):
    parent, tail = _tails(kind, salted)
    seq = tuple(tokens) if as_tuple else tokens
    want = _two_step(
        kind, seq, bt, parent, start=start, tail=tail, every=every, drop_last=drop_last
    )
    got = accel._native.chain_ints(
        kind, seq, bt, parent, start, 32, 0, None, tail, every, drop_last
    )
    assert got == want


@native_only
@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    tokens=st.lists(U32, min_size=1, max_size=200),
    bt=BLOCK,
    bad=BAD,
    where=st.floats(0, 1, exclude_max=True),
    drop_last=st.booleans(),
)
def test_chain_ints_bad_item_is_none_or_same_as_pack(*, kind, tokens, bt, bad, where, drop_last):
    """Any item pack rejects (the dropped last one too) gives None; bool (an int subclass)
    packs as pack packs it."""
    tokens[int(where * len(tokens))] = bad
    parent, tail = _tails(kind, True)
    want = _two_step(kind, tokens, bt, parent, start=0, tail=tail, every=0, drop_last=drop_last)
    got = accel._native.chain_ints(kind, tokens, bt, parent, 0, 32, 0, None, tail, 0, drop_last)
    assert got == want


@native_only
def test_chain_ints_rejects_other_containers():
    with pytest.raises(TypeError, match="list or tuple"):
        accel._native.chain_ints(accel.KIND_CBOR, b"\0" * 8, 1, bytes(32))
    with pytest.raises(HashingError, match="block_tokens"):
        accel._native.chain_ints(accel.KIND_CBOR, [1, 2], 0, bytes(32))


ALGOS = sorted(available_hashers())


@settings(max_examples=200, deadline=None)
@given(
    algo=st.sampled_from(ALGOS),
    tokens=TOKENS,
    bt=BLOCK,
    drop_last=st.booleans(),
    salt=st.sampled_from([None, "s1"]),
)
def test_request_hasher_fused_equals_blocks(algo, tokens, bt, drop_last, salt):
    """hashes() (fused when it applies) equals the block-by-block chain of the same request."""
    req = HashRequest(drop_last_token=drop_last, cache_salt=salt)
    got = RequestHasher().hashes(tokens, algo, bt, req)
    h = get_hasher(algo)
    blocks = split_blocks(tokens, bt, drop_last_token=drop_last)
    assert got == h.chain_bytes(blocks, None, salt)
    assert RequestHasher().hashes(tuple(tokens), algo, bt, req) == got


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "3"])
def test_request_hasher_bad_ids_still_raise(algo, bad):
    tokens = [1] * 40
    tokens[33] = bad
    with pytest.raises(HashingError, match=r"tokens\[33\]"):
        RequestHasher().hashes(tokens, algo, 16)


@pytest.mark.parametrize("algo", ALGOS)
def test_request_hasher_numpy_ids_match_ints(algo):
    tokens = list(range(100))
    want = RequestHasher().hashes(tokens, algo, 16)
    assert RequestHasher().hashes([np.int64(t) for t in tokens], algo, 16) == want
    assert RequestHasher().hashes([True, *tokens[1:]], algo, 16) == RequestHasher().hashes(
        [1, *tokens[1:]], algo, 16
    )


@native_only
@pytest.mark.parametrize("algo", ["vllm_sha256_cbor_64", "v2_sha256", "blake3"])
def test_hasher_chain_ints_is_taken_and_equals_chain_raw(algo):
    h = get_hasher(algo)
    tokens = [(i * 2654435761) % 2**32 for i in range(32 * 7 + 5)]
    root = h.root()
    raw = accel.pack_request(tokens, True)
    assert h._chain_ints(root, tokens, 32, True) == (raw, h.chain_raw(root, raw, 32)[0])
    assert h._chain_ints(root, [*tokens[:-1], -1], 32, True) is None
