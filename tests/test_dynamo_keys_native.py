"""The Dynamo-keyed index's keys in C (``kvstream.hashing._chainnative``'s ``dynamo_keys``
and ``dynamo_link``) against their pure-Python twins in :mod:`kvstream.index.keys` (``py_*``,
which hash with the ``xxhash`` package), the token table's stored keys against Dynamo's own
local hashes (the engines' vectors), and a Dynamo-keyed index against the key definition
node by node.

Property tests run the public functions (C when built) and the twins on the same inputs:
equal keys, or the same error (type and message). The C-path tests are skipped when the
extension is not built or ``KVSTREAM_NO_NATIVE`` is set; ``KVSTREAM_NO_NATIVE=1`` selecting
the pure-Python path, with the same index, is checked in a subprocess.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_hash_cases import case_blocks
from hypothesis import given, settings
from hypothesis import strategies as st
from index_support import Producer

from kvstream.errors import HashingError
from kvstream.events.model import MmKey, Removed, Stored, StoredBlock
from kvstream.hashing import get_hasher, split_blocks
from kvstream.hashing.dynamo import block_hash_seed, link_hash
from kvstream.index import PrefixIndex
from kvstream.index import keys as K
from kvstream.index.stats import SourceStats
from kvstream.index.token_table import TOKEN_TABLE_TYPES, token_table_type

TPB = 4
PEERS = json.loads(
    (Path(__file__).parent / "data" / "peers" / "hash_vectors.json").read_text("utf-8")
)
native_only = pytest.mark.skipif(
    not K.NATIVE_DYNAMO_KEYS, reason="the C extension is not built or KVSTREAM_NO_NATIVE is set"
)

u32 = st.integers(0, 2**32 - 1)
lora_names = st.one_of(st.none(), st.text(max_size=12))
block_sizes = st.integers(1, 80)  # up to 320 bytes a block: XXH3's long-input path too
bad_ids = st.one_of(
    st.integers(max_value=-1),
    st.integers(min_value=2**32),
    st.text(max_size=3),
    st.floats(allow_nan=False),
    st.none(),
)


def outcome(f: Any, *args: Any) -> Any:
    """``("ok", value)`` or ``("err", type, message)``."""
    try:
        return ("ok", f(*args))
    except Exception as exc:  # compared, not swallowed
        return ("err", type(exc), str(exc))


# ------------------------------------------------------------------ request keys (/query)


@native_only
@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(u32, max_size=400),
    tpb=block_sizes,
    lora=lora_names,
    drop_last=st.booleans(),
)
def test_request_keys_equal_the_python_twin(
    tokens: list[int], tpb: int, lora: str | None, drop_last: bool
) -> None:
    lora = lora or None
    want = K.py_dynamo_request_keys(tokens, tpb, lora, drop_last)
    assert K.dynamo_request_keys(tokens, tpb, lora, drop_last) == want
    assert K.dynamo_request_keys(tuple(tokens), tpb, lora, drop_last) == want
    raw = struct.pack(f"<{len(tokens)}I", *tokens)
    assert K.dynamo_request_keys(raw, tpb, lora, drop_last) == want
    assert K.py_dynamo_request_keys(raw, tpb, lora, drop_last) == want
    # the whole C path, not the fallback: the C function itself answers
    seed = block_hash_seed(lora)
    assert K._c.dynamo_keys(tokens, tpb, seed, K.ROOT_KEY, drop_last) == want
    n_full = (len(tokens) - (1 if drop_last and tokens else 0)) // tpb
    assert len(want) == n_full


@native_only
@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(u32, max_size=60),
    bad=bad_ids,
    data=st.data(),
    tpb=st.integers(1, 8),
    drop_last=st.booleans(),
)
def test_bad_token_ids_raise_the_python_error(
    tokens: list[int], bad: Any, data: st.DataObject, tpb: int, drop_last: bool
) -> None:
    at = data.draw(st.integers(0, len(tokens)))
    tokens.insert(at, bad)
    got = outcome(K.dynamo_request_keys, tokens, tpb, None, drop_last)
    want = outcome(K.py_dynamo_request_keys, tokens, tpb, None, drop_last)
    assert got == want
    assert got[0] == "err"
    assert got[1] is HashingError
    assert f"tokens[{at}]" in got[2]
    # the C function declines the list (None) and leaves the error to the validating path
    assert K._c.dynamo_keys(tokens, tpb, 1337, K.ROOT_KEY, drop_last) is None


@native_only
@pytest.mark.parametrize(
    ("tokens", "tpb"),
    [(b"\x01\x00\x00", 1), (bytearray(7), 1), ([1, 2], 0), ([1, 2], -3), (b"", 0)],
)
def test_malformed_inputs_raise_the_same_error(tokens: Any, tpb: int) -> None:
    got = outcome(K.dynamo_request_keys, tokens, tpb, None)
    assert got == outcome(K.py_dynamo_request_keys, tokens, tpb, None)
    assert got[0] == "err"
    assert got[1] is HashingError


def test_request_keys_are_dynamo_local_hashes_chained() -> None:
    """The definition: key i = XXH3(key i-1 || local i) || local i, local i being Dynamo's
    ``tokens_hash`` of block i (the ``dynamo_xxh3_64`` hasher), from the zero root."""
    rng = random.Random(5)
    tokens = [rng.randrange(2**32) for _ in range(16 * 9 + 5)]
    for lora in (None, "adapter-a"):
        locs = get_hasher("dynamo_xxh3_64").chain_bytes(
            split_blocks(tokens, 16)[:9], lora_name=lora
        )
        keys = K.dynamo_request_keys(tokens, 16, lora)
        parent = K.ROOT_KEY
        for local, key in zip(locs, keys, strict=True):
            assert key == link_hash(parent, local) + local
            parent = key


@native_only
@pytest.mark.parametrize(
    "case",
    [c for c in PEERS["cases"] if c["algo"] == "dynamo_xxh3_64" and "mm_keys" not in c],
    ids=lambda c: c["id"],
)
def test_native_local_hashes_equal_dynamo_vectors(case: dict[str, Any]) -> None:
    """Every block's local hash from C equals the value Dynamo's own code computed
    (ai-dynamo-runtime 1.6.1, tests/data/peers/hash_vectors.json)."""
    blocks = case_blocks(case, PEERS["token_sets"])
    scope = case.get("scope", {})
    seed = block_hash_seed(scope.get("lora_name"), scope.get("cache_salt"))
    raws = [struct.pack(f"<{len(b)}I", *b) for b in blocks]
    table: Any = token_table_type()(1, True)  # the index's C path: keys from stored tokens
    hashes = [i.to_bytes(8, "big") for i in range(1, len(raws) + 1)]
    sizes = [len(b) for b in blocks]
    table.store_tokens(None, hashes, 0, b"".join(raws), sizes, seed, SourceStats())
    locs = [table.key_of(h)[8:] for h in hashes]
    assert [int.from_bytes(x, "big") for x in locs] == case["expect"]
    if len({len(b) for b in blocks}) == 1 and not scope.get("cache_salt"):
        flat = [t for b in blocks for t in b]
        lora = scope.get("lora_name") or None
        assert [k[8:] for k in K.dynamo_request_keys(flat, len(blocks[0]), lora)] == locs


# ------------------------------------------------------------------ local hashes (/query_by_hash)


@native_only
@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(min_size=8, max_size=8), max_size=200))
def test_keys_from_local_equal_the_python_twin(local: list[bytes]) -> None:
    want = K.py_keys_from_local(local)
    assert K.keys_from_local(local) == want
    assert K.keys_from_local(tuple(local)) == want
    assert K._c.dynamo_link(local, K.ROOT_KEY, False) == want
    signed = [int.from_bytes(h, "big", signed=True) for h in local]
    assert K.keys_from_i64(signed) == want
    assert K.py_keys_from_i64(signed) == want


@native_only
def test_keys_from_local_of_odd_items_take_the_python_path() -> None:
    odd: list[Any] = [b"\x00" * 8, b"\x01" * 7, bytearray(8)]
    assert K._c.dynamo_link(odd, K.ROOT_KEY, False) is None
    assert K.keys_from_local(odd) == K.py_keys_from_local(odd)


@native_only
@settings(max_examples=200, deadline=None)
@given(
    good=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30),
    bad=st.one_of(
        st.integers(min_value=2**63),
        st.integers(max_value=-(2**63) - 1),
        st.booleans(),
        st.floats(),
        st.text(max_size=3),
        st.none(),
    ),
    data=st.data(),
)
def test_bad_i64_hashes_raise_the_python_error(good: list[int], bad: Any, data: Any) -> None:
    at = data.draw(st.integers(0, len(good)))
    values: list[Any] = [*good[:at], bad, *good[at:]]
    got = outcome(K.keys_from_i64, values)
    assert got == outcome(K.py_keys_from_i64, values)
    assert got[:2] == ("err", HashingError)
    assert got[2].startswith(f"block_hashes[{at}]: invalid value")
    assert "expected i64" in got[2]


@native_only
@pytest.mark.parametrize("value", [-(2**63), -1, 0, 1, 2**63 - 1])
def test_i64_bounds(value: int) -> None:
    assert K.keys_from_i64([value]) == K.py_keys_from_local([(value % 2**64).to_bytes(8, "big")])


# ------------------------------------------------------------------ stored events (ingest)


def _block(h: int, tokens: list[int], **kw: Any) -> StoredBlock:
    return StoredBlock(block_hash=h.to_bytes(8, "big"), token_ids=tokens, **kw)


def _assert_keys_follow_the_definition(index: PrefixIndex) -> int:
    """Every keyed node's key is link(parent's key or the root, its local hash) || local;
    returns how many keyed nodes there are."""
    keyed = 0
    for _w, _gid, table in index.tables():
        assert isinstance(table, TOKEN_TABLE_TYPES)
        table.check()
        entries = table.keys()  # the table's (hash, key, pending) list
        key_of = {h: k for h, k, _ in entries}
        for h, parent, _refs in table.nodes():
            key = key_of[h]
            if not key:
                continue
            pkey = key_of[parent] if isinstance(parent, bytes) else K.ROOT_KEY
            assert parent is None or isinstance(parent, bytes)  # keyed: under a known parent
            assert key == link_hash(pkey, key[8:]) + key[8:]
            keyed += 1
    return keyed


def test_store_keys_blocks_by_the_definition() -> None:
    """Random stores (new chains, repeats, extensions, unknown parents, LoRA names, mixed
    names in one event, multimodal blocks, tokenless placeholders) and removals: every key
    the table holds chains its parent's key and its own local hash, each local hash equals
    ``dynamo_payload`` of the block, and queries find what was stored."""
    rng = random.Random(11)
    index = PrefixIndex(key_mode="dynamo", default_tokens_per_block=TPB)
    p = Producer("w", algo="blake3_64", tpb=TPB)
    locals_of: dict[bytes, bytes] = {}
    stored: list[list[StoredBlock]] = []
    next_hash = 1
    for _ in range(300):
        r = rng.random()
        if r < 0.2 and stored:
            chain = rng.choice(stored)
            gone = tuple(b.block_hash for b in chain[rng.randrange(len(chain)) :])
            index.apply(p.batch(p._ev(Removed(block_hashes=gone))))
            continue
        parent: bytes | None = None
        if r < 0.5 and stored:  # extend, or hang off, a known (or forgotten) block
            base = rng.choice(stored)
            parent = rng.choice(base).block_hash
        elif r < 0.55:
            parent = (10**9 + next_hash).to_bytes(8, "big")  # an unknown parent
        blocks: list[StoredBlock] = []
        lora = rng.choice([None, None, "adapter-a", "adapter-b"])
        for _ in range(rng.randrange(1, 7)):
            kw: dict[str, Any] = {"lora_name": lora}
            roll = rng.random()
            if roll < 0.05:
                kw["lora_name"] = "adapter-mixed"  # a second name in the same event
            elif roll < 0.1:
                kw["mm_keys"] = (MmKey(hash=rng.randbytes(32), start_offset=0),)
            if rng.random() < 0.1 and stored:  # a block stored before, again
                old = rng.choice(rng.choice(stored))
                blocks.append(old)
                continue
            toks = [rng.randrange(2**32) for _ in range(TPB)]
            if rng.random() < 0.05:
                toks = []  # a tokenless placeholder
            b = _block(next_hash, toks, **kw)
            next_hash += 1
            if toks:
                locals_of[b.block_hash] = K.dynamo_payload(b.__dict__, b.token_ids.raw)
            blocks.append(b)
        index.apply(p.batch(p._ev(Stored(parent_hash=parent, blocks=tuple(blocks)))))
        stored.append(blocks)
    assert _assert_keys_follow_the_definition(index) > 100
    for _w, _gid, table in index.tables():
        assert isinstance(table, TOKEN_TABLE_TYPES)
        entries = table.keys()  # the table's (hash, key, pending) list
        for h, key, _pending in entries:
            if key:
                assert key[8:] == locals_of[h]


def test_a_block_stored_again_under_another_parent_keys_what_follows_from_its_key() -> None:
    """The event's precomputed chain assumes each block hangs off the one before as stored;
    a block the table already holds (keyed under another parent) breaks that assumption,
    and the blocks after it chain from the key the table holds."""
    index = PrefixIndex(key_mode="dynamo", default_tokens_per_block=TPB)
    p = Producer("w", algo="blake3_64", tpb=TPB)
    a, b, c, d = ([i] * TPB for i in (1, 2, 3, 4))
    first = (_block(1, a), _block(2, b))
    index.apply(p.batch(p._ev(Stored(parent_hash=None, blocks=first))))
    second = (_block(3, c), _block(2, b), _block(4, d))  # block 2 again, under block 3
    index.apply(p.batch(p._ev(Stored(parent_hash=None, blocks=second))))
    assert _assert_keys_follow_the_definition(index) == 4
    (_, _, table) = index.tables()[0]
    assert isinstance(table, TOKEN_TABLE_TYPES)
    want = K.py_dynamo_request_keys(a + b, TPB)[1]
    assert table.key_of((2).to_bytes(8, "big")) == want
    assert (
        table.key_of((4).to_bytes(8, "big"))
        == K.py_keys_from_local(
            [K.dynamo_payload(_block(4, d).__dict__, _block(4, d).token_ids.raw)], want
        )[0]
    )


# ------------------------------------------------------------------ the switch

_WORKLOAD = """
import json, random
from kvstream.index import PrefixIndex
from kvstream.index import keys as K
from kvstream.hashing import accel
from kvstream.events.model import Stored, StoredBlock
import sys
sys.path.insert(0, {tests!r})
from index_support import Producer
rng = random.Random(3)
index = PrefixIndex(key_mode="dynamo", default_tokens_per_block=4)
p = Producer("w", algo="blake3_64", tpb=4)
for i in range(40):
    blocks = tuple(
        StoredBlock(block_hash=(i * 100 + j).to_bytes(8, "big"),
                    token_ids=[rng.randrange(2**32) for _ in range(4)],
                    lora_name=None if i % 3 else "adapter")
        for j in range(5)
    )
    parent = None if i % 4 == 0 else ((i - 1) * 100 + 4).to_bytes(8, "big")
    index.apply(p.batch(p._ev(Stored(parent_hash=parent, blocks=blocks))))
toks = [rng.randrange(2**32) for _ in range(4 * 20 + 3)]
print(json.dumps({{
    "native": K.NATIVE_DYNAMO_KEYS,
    "state": repr(index.canonical_state()),
    "query": [k.hex() for k in K.dynamo_request_keys(toks, 4, "adapter")],
    "by_hash": [k.hex() for k in K.keys_from_i64([-1, 0, 2**63 - 1])],
    "json_native": accel._json_ids_c is not None,
    "json": [accel.json_ids(t) and accel.json_ids(t).hex() for t in (b" [1, 2]", b"[01]")],
}}))
"""


def _run_workload(no_native: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTREAM_NO_NATIVE"}
    if no_native:
        env["KVSTREAM_NO_NATIVE"] = "1"
    script = _WORKLOAD.format(tests=str(Path(__file__).parent))
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@native_only
def test_no_native_switch_selects_the_python_path_with_the_same_index() -> None:
    fast = _run_workload(no_native=False)
    slow = _run_workload(no_native=True)
    assert fast["native"] is True
    assert slow["native"] is False
    assert fast["state"] == slow["state"]
    assert fast["query"] == slow["query"]
    assert fast["by_hash"] == slow["by_hash"]
    assert (fast["json_native"], slow["json_native"]) == (True, False)
    assert fast["json"] == slow["json"] == ["0100000002000000", None]
