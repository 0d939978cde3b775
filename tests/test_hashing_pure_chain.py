"""The pure-Python SHA-256 CBOR chain's numpy path (what runs without the C chain).

``VllmSha256CborHasher._chain_raw`` builds every block's CBOR token array in one numpy pass
(:func:`kvstream.hashing.cbor.block_arrays`) when a request has at least 512 tokens: equal to
the per-block reference (:meth:`chain_bytes`, cbor2's canonical encoding) for every scope,
start, checkpoint spacing, width and the ids where CBOR's head changes size. Runs with or
without the native core (the hashers are built with ``native=False``).
"""

from __future__ import annotations

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream._types import TokenIds
from kvstream.hashing import cbor, split_blocks
from kvstream.hashing.vllm import VllmSha256CborHasher

#: Where CBOR's head grows (24, 2**8, 2**16, 2**32).
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]
IDS = st.one_of(st.sampled_from(EDGES), st.integers(0, 300), st.integers(0, 2**32 - 1))
SCOPES = st.sampled_from(
    [
        {},
        {"cache_salt": "tenant"},
        {"lora_id": 3, "lora_name": "ad"},
        {"cache_salt": "s", "lora_id": 1, "lora_name": "x"},
    ]
)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(IDS, min_size=1, max_size=300), tpb=st.integers(1, 300))
def test_block_arrays_equal_token_arrays(ids: list[int], tpb: int) -> None:
    n = len(ids) // tpb
    if n == 0:
        return
    raw = TokenIds(ids[: n * tpb]).raw
    got = cbor.block_arrays(raw, tpb)
    assert got == cbor.token_arrays(raw, [tpb] * n, none_tail=True)
    assert got[0] == cbor2.dumps(tuple(ids[:tpb]), canonical=True) + b"\xf6"


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(IDS, min_size=512, max_size=1400),
    tpb=st.sampled_from([1, 7, 16, 32, 64, 513]),
    scope=SCOPES,
    width=st.sampled_from([8, 32]),
    start_every=st.tuples(st.integers(0, 5), st.integers(0, 4)),
)
def test_pure_chain_raw_equals_chain_bytes(
    ids: list[int], tpb: int, scope: dict[str, object], width: int, start_every: tuple[int, int]
) -> None:
    h = VllmSha256CborHasher(width, native=False, lora_paths={"ad": "/a", "x": "/x"})
    start, every = start_every
    blocks = split_blocks(ids, tpb)
    root = h.root(**scope)
    start = min(start, len(blocks))
    # the 256-bit chain keys of the first ``start`` blocks give the state to resume from
    full = VllmSha256CborHasher(32, native=False, lora_paths={"ad": "/a", "x": "/x"})
    keys = full.chain_bytes(blocks, **scope)
    state = root if start == 0 else h.resume(root, keys[start - 1], start)
    got, checkpoints = h.chain_raw(state, TokenIds(ids).raw, tpb, start=start, every=every)
    want = h.chain_bytes(blocks, **scope)
    assert got == want[start:]
    if every:
        assert checkpoints == [keys[i] for i in range(start, len(blocks)) if (i + 1) % every == 0]
    else:
        assert checkpoints == []


def test_pure_chain_raw_on_a_long_request_equals_the_c_chain() -> None:
    c = VllmSha256CborHasher(8)
    if not c.native:  # pragma: no cover - without the C chain there is nothing to compare
        pytest.skip("the C chain is not built or KVSTREAM_NO_NATIVE is set")
    py = VllmSha256CborHasher(8, native=False)
    raw = TokenIds([(i * 7919) % 150_000 for i in range(8192 + 5)]).raw
    assert py.chain_raw(py.root(), raw, 32, every=4) == c.chain_raw(c.root(), raw, 32, every=4)
