"""The token coders of ``kvstream.codec._tokens_native`` against their numpy references.

``planes_encode`` against numpy's bit planes, and the varint coder and size estimate on
batches long enough to cross the C loops' chunk boundaries. (The C batch body encoder is
tested against its Python twin in test_encoder_native.py.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream._native import load
from kvstream.codec import tokens

native: Any = native_part("kvstream.codec._tokens_native")


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
    assert load("kvstream.codec._tokens_native") is native
