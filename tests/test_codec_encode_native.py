"""The encoder's C helpers (``kvstream.codec._tokens_native``) against their references.

``gather_blocks`` (the batch's stored blocks read in one pass) against the encoder's Python
path, ``planes_encode`` against numpy's bit planes, and the varint coder and size estimate
on batches long enough to cross the C loops' chunk boundaries.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_strategies import batches

from kvstream._types import TokenIds
from kvstream.codec import encoder, tokens
from kvstream.codec.encoder import encode_batch_body
from kvstream.events.model import EventBatch, Stored, StoredBlock

native: Any = pytest.importorskip("kvstream.codec._tokens_native")


def _block_tuples(batch: EventBatch) -> list[tuple[StoredBlock, ...]]:
    return [ev.data.blocks for ev in batch.events if isinstance(ev.data, Stored)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_events=8))
def test_gather_blocks_equals_the_python_path(batch: EventBatch) -> None:
    tuples = _block_tuples(batch)
    assert native.gather_blocks(tuples) == encoder._gather_py(tuples)


def test_gather_blocks_sees_attributes_and_uneven_sizes() -> None:
    def block(h: int, n: int, **kw: Any) -> StoredBlock:
        return StoredBlock(block_hash=bytes([h]) * 8, token_ids=TokenIds(range(n)), **kw)

    plain = block(1, 2)
    level = block(2, 1, cache_level=1)
    default_set = block(3, 2, priority=35)
    tuples = [
        (plain, plain),
        (plain, level),  # only the last block differs: block_size 2, last_block_size 1
        (default_set,),
        (block(4, 1), block(4, 3), block(4, 1)),  # a middle block differs: block_sizes
    ]
    got = native.gather_blocks(tuples)
    assert got == encoder._gather_py(tuples)
    raw, heads, flags = got
    assert raw == TokenIds([0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 0, 1, 2, 0]).raw
    # block_count, hashes' length, hashes, block_size, last_block_size, block_sizes
    assert heads[0] == b"\x04\x20" + b"\x01" * 16 + b"\x04\x04\x00"
    assert heads[1] == b"\x04\x20" + b"\x01" * 8 + b"\x02" * 8 + b"\x04\x02\x00"
    assert heads[2] == b"\x02\x10" + b"\x03" * 8 + b"\x04\x04\x00"
    assert heads[3] == b"\x06\x30" + b"\x04" * 24 + b"\x00\x00\x02" + b"\x06\x02\x06\x02\x00"
    # An explicitly set attribute makes the event take the per-attribute path, even at its
    # default value (the encoder then writes the same bytes).
    assert flags == [True, False, False, True]
    assert native.gather_blocks([]) == (b"", [], [])


class _OddTokens:
    """Not a TokenIds: its ``_raw`` is a bytearray."""

    _raw = bytearray(b"\x01\x00\x00\x00")


@pytest.mark.parametrize(
    "tuples",
    [
        ((),),  # not a list
        [[]],  # a list, not a tuple
        [(object(),)],  # no block_hash
        [()],  # an event without blocks (not a valid Stored)
    ],
)
def test_gather_blocks_declines_what_it_does_not_expect(tuples: Any) -> None:
    assert native.gather_blocks(tuples) is None


def test_gather_blocks_declines_foreign_token_ids() -> None:
    block = StoredBlock.model_construct(block_hash=b"\x01" * 8, token_ids=_OddTokens())
    assert native.gather_blocks([(block,)]) is None
    # the Python path serves it (the encoder falls back to it)
    assert encoder._gather_py([(block,)])[0] == b"\x01\x00\x00\x00"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_events=6))
def test_encoder_without_the_c_gather_writes_the_same_bytes(batch: EventBatch) -> None:
    fast = encode_batch_body(batch, 4)
    saved = encoder._GATHER
    try:
        encoder._GATHER = None  # type: ignore[misc]
        assert encode_batch_body(batch, 4) == fast
    finally:
        encoder._GATHER = saved  # type: ignore[misc]


def _ids(seed: int, n: int, kind: str) -> bytes:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        ids = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    elif kind == "zipf":
        ids = np.minimum(rng.zipf(1.2, n) - 1, 2**32 - 1).astype(np.uint32)
    elif kind == "vocab":
        ids = rng.integers(0, 128_000, n, dtype=np.uint32)
    else:  # runs and steps: small deltas
        ids = (np.cumsum(rng.integers(-3, 4, n)) % 2**32).astype(np.uint32)
    return ids.astype("<u4").tobytes()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.one_of(st.integers(0, 600), st.integers(4000, 20_000)),
    kind=st.sampled_from(["uniform", "zipf", "vocab", "steps"]),
)
def test_long_batches_native_equals_numpy(seed: int, n: int, kind: str) -> None:
    """Across the C loops' chunks (256 ids to encode, 4096 to size)."""
    raw = _ids(seed, n, kind)
    for delta in (False, True):
        data = native.varint_encode(raw, delta)
        assert data == tokens._varint_encode_np(raw, delta)
        assert native.varint_decode(data, n, delta) == raw
    assert native.varint_sizes(raw) == tokens._varint_sizes_np(raw)
    ref = tokens._pack_tokens_np(raw) if raw else tokens.PackedTokens(0, 0, b"", b"")
    assert tokens.pack_tokens(raw) == ref
    if raw:
        assert native.planes_encode(raw) == (ref.high_bits, ref.low16, ref.high_planes)


@pytest.mark.parametrize("bad", [b"\x00", b"\x00" * 5])
def test_planes_encode_refuses_partial_ids(bad: bytes) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        native.planes_encode(bad)


@pytest.mark.native
def test_native_module_is_the_one_loaded() -> None:
    assert tokens.NATIVE
    assert importlib.import_module("kvstream.codec._tokens_native") is native
