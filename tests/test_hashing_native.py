"""The v1_block_key C extension (kvstream.hashing._v1native) against the pure-Python reference.

Skipped when the extension is not built (no C compiler at install time) or when
KVSTREAM_NO_NATIVE forces the pure-Python path. Vectors: tests/data/block_hashes.json and
TensorRT-LLM §3.4; properties: native == pure Python for every input the hasher takes; bad
inputs raise HashingError (TypeError for a wrong call signature) and never crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part
from v1_vectors import DIGEST, V1_CHAINS

from kvstream._types import TokenIds
from kvstream.errors import HashingError, KVStreamError
from kvstream.hashing import ChainState, cache_salt_id, get_hasher, split_blocks
from kvstream.hashing import trtllm as trtllm_mod
from kvstream.hashing.trtllm import V1BlockKeyHasher

native = native_part("kvstream.hashing._v1native")
if not trtllm_mod.NATIVE_AVAILABLE:  # pragma: no cover - only under KVSTREAM_NO_NATIVE
    pytest.skip("KVSTREAM_NO_NATIVE forces the pure-Python path", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "tests" / "data" / "block_hashes.json").read_text())
V1_CASES = [c for c in DATA["cases"] if c["algo"] == "v1_block_key"]
NAT = V1BlockKeyHasher(native=True)
PY = V1BlockKeyHasher(native=False)

ALL_VECTORS = [(c["id"], c["blocks"], c.get("params", {}), c["expect"]) for c in V1_CASES] + [
    (f"s3.4-{c[0]}", *c[1:]) for c in V1_CHAINS
]


def raw(tokens: list[int]) -> bytes:
    return TokenIds(tokens).raw


def u64s(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


def mm_records(keys: list[tuple[bytes, int]]) -> bytes:
    return b"".join(d + off.to_bytes(4, "little") for d, off in keys)


def fold(h: V1BlockKeyHasher, blocks: list[Any], state: ChainState, **kw: Any) -> list[int]:
    mm = kw.get("mm_keys")
    extra = kw.get("token_extra_ids")
    out = []
    for i, b in enumerate(blocks):
        pub, state = h.extend(
            state, b, mm[i] if mm else (), extra[i] if extra is not None else None
        )
        out.append(int.from_bytes(pub, "big"))
    return out


def scope_of(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if k not in ("mm_keys", "token_extra_ids")}


# ------------------------------------------------------------------------------- vectors


def test_default_hasher_is_native() -> None:
    assert get_hasher("v1_block_key").native is True  # type: ignore[attr-defined]
    assert native.ALGORITHM == "v1_block_key"
    assert native.MM_RECORD_SIZE == 36


@pytest.mark.parametrize(
    ("blocks", "kw", "expect"), [v[1:] for v in ALL_VECTORS], ids=[v[0] for v in ALL_VECTORS]
)
def test_vectors_through_the_native_path(
    blocks: list[list[int]], kw: dict[str, Any], expect: list[int]
) -> None:
    assert NAT.chain(blocks, **kw) == expect
    assert NAT.chain([TokenIds(b) for b in blocks], **kw) == expect
    assert NAT.chain_bytes(blocks, **kw) == [v.to_bytes(8, "big") for v in expect]
    assert fold(NAT, blocks, NAT.root(**scope_of(kw)), **kw) == expect
    # The module directly: one buffer cut by sizes, and a list of per-block buffers.
    salt = kw.get("salt_id")
    if "cache_salt" in kw:
        salt = cache_salt_id(kw["cache_salt"])
    args: dict[str, Any] = {"salt_id": salt, "lora_id": kw.get("lora_id")}
    if "token_extra_ids" in kw:
        args["extra_ids"] = u64s([x for e in kw["token_extra_ids"] for x in e])
    if "mm_keys" in kw:
        args["mm_keys"] = [mm_records(k) for k in kw["mm_keys"]]
    concat = b"".join(raw(b) for b in blocks)
    sizes = [len(b) for b in blocks]
    assert native.chain(concat, sizes, **args) == expect
    assert native.chain([raw(b) for b in blocks], **args) == expect
    assert native.chain_buffer(concat, sizes, **args) == b"".join(
        v.to_bytes(8, "big") for v in expect
    )
    if "mm_keys" not in kw:
        assert native.chain(concat, len(blocks[0]), **args) == expect  # tokens per block


def test_router_chunking_with_tokens_per_block() -> None:
    """§3.4: tpb 4, tokens[:-1] cut with the trailing partial chunk kept."""
    for toks, expect in (
        (list(range(1, 10)), [924206229973855, 2728178455351807326]),
        (list(range(1, 8)), [924206229973855, 6875034662206558884]),
    ):
        assert native.chain(raw(toks[:-1]), 4) == expect
        blocks = split_blocks(toks, 4, drop_last_token=True, include_partial=True)
        assert NAT.chain(blocks) == expect
    assert native.chain(b"", 4) == []
    assert native.chain(b"", []) == []
    assert native.chain([]) == []
    assert native.chain_buffer(b"", 4) == b""
    assert NAT.chain([]) == PY.chain([]) == []


def test_buffer_kinds() -> None:
    toks = [1, 2, 3, 4, 5, 6]
    expect = [924206229973855, 6875034662206558884]
    bufs: list[Any] = [
        raw(toks),
        bytearray(raw(toks)),
        memoryview(raw(toks)),
        array("I", toks),
        np.array(toks, dtype="<u4"),
    ]
    for buf in bufs:
        assert native.chain(buf, [4, 2]) == expect
        view = memoryview(buf).cast("B")
        assert native.chain([view[:16], view[16:]]) == expect
        assert native.chain_bytes(buf, 4) == [v.to_bytes(8, "big") for v in expect]
    assert native.chain(raw(toks), np.array([4, 2])) == expect  # sizes: any ints with __index__
    assert native.chain(raw(toks), (4, 2)) == expect
    assert native.block_key(np.array([1, 2, 3, 4], dtype="<u4")) == expect[0]
    assert native.block_key(raw([5, 6]), parent=expect[0]) == expect[1]


def test_long_request_releases_the_gil_and_matches() -> None:
    """>= 16384 tokens in one buffer: hashed without the GIL; threads agree."""
    rng = np.random.default_rng(3)
    toks = rng.integers(0, 2**32, 40_000, dtype=np.uint64).astype("<u4")
    blocks = [TokenIds.from_bytes(toks[i : i + 64].tobytes()) for i in range(0, len(toks), 64)]
    want = PY.chain(blocks, salt_id=9, lora_id=5)
    assert native.chain(toks, 64, 0, 9, 5) == want
    assert NAT.chain(blocks, salt_id=9, lora_id=5) == want
    results: list[list[int]] = []
    threads = [
        threading.Thread(target=lambda: results.append(native.chain(toks.tobytes(), 64, 0, 9, 5)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 4


# ---------------------------------------------------------------------------- properties

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
TOKEN = st.one_of(st.integers(0, 300_000), U32, st.sampled_from([0, 2**32 - 1, 2**31]))
BLOCK = st.lists(TOKEN, min_size=1, max_size=40)
MM_KEY = st.tuples(st.binary(min_size=32, max_size=32), U32)


@st.composite
def requests(draw: st.DrawFn) -> tuple[list[list[int]], dict[str, Any]]:
    blocks = draw(st.lists(BLOCK, min_size=1, max_size=6))
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["lora_id"] = draw(U64)
    salt = draw(st.sampled_from(["none", "id", "str"]))
    if salt == "id":
        kw["salt_id"] = draw(st.one_of(U64, st.just(0)))
    elif salt == "str":
        kw["cache_salt"] = draw(st.text(max_size=8))
    if draw(st.booleans()):
        kw["token_extra_ids"] = [
            None if draw(st.booleans()) else draw(st.lists(U64, min_size=len(b), max_size=len(b)))
            for b in blocks
        ]
    if draw(st.booleans()):
        kw["mm_keys"] = [draw(st.lists(MM_KEY, max_size=2)) for _ in blocks]
    return blocks, kw


@settings(max_examples=400, deadline=None)
@given(requests())
def test_native_equals_pure_python(req: tuple[list[list[int]], dict[str, Any]]) -> None:
    blocks, kw = req
    want = PY.chain(blocks, **kw)
    assert NAT.chain(blocks, **kw) == want
    assert NAT.chain([TokenIds(b) for b in blocks], **kw) == want
    assert NAT.chain_bytes(blocks, **kw) == PY.chain_bytes(blocks, **kw)
    assert fold(NAT, blocks, NAT.root(**scope_of(kw)), **kw) == want
    # States are interchangeable between the two implementations.
    assert fold(NAT, blocks, PY.root(**scope_of(kw)), **kw) == want
    assert fold(PY, blocks, NAT.root(**scope_of(kw)), **kw) == want


@settings(max_examples=400, deadline=None)
@given(
    blocks=st.lists(BLOCK, min_size=1, max_size=6),
    parent=st.one_of(U64, st.just(0)),
    salt=st.one_of(st.none(), U64),
    lora=st.one_of(st.none(), U64),
    with_extra=st.booleans(),
    data=st.data(),
)
def test_module_entry_points_equal_pure_python(
    *,
    blocks: list[list[int]],
    parent: int,
    salt: int | None,
    lora: int | None,
    with_extra: bool,
    data: st.DataObject,
) -> None:
    """Any parent (salt enters only where a block's parent is 0), every input form."""
    extra = (
        [data.draw(st.lists(U64, min_size=len(b), max_size=len(b))) for b in blocks]
        if with_extra
        else None
    )
    state = PY.root(lora_id=lora, salt_id=salt)._replace(key=parent)
    want = fold(PY, blocks, state, token_extra_ids=extra)
    concat = b"".join(raw(b) for b in blocks)
    sizes = [len(b) for b in blocks]
    flat_extra = None if extra is None else u64s([x for e in extra for x in e])
    per_block_extra = None if extra is None else [u64s(e) for e in extra]
    assert native.chain(concat, sizes, parent, salt, lora, flat_extra) == want
    assert native.chain(concat, sizes, parent, salt, lora, per_block_extra) == want
    assert native.chain([raw(b) for b in blocks], None, parent, salt, lora, flat_extra) == want
    assert (
        native.chain(tuple(raw(b) for b in blocks), None, parent, salt, lora, per_block_extra)
        == want
    )
    assert native.chain_bytes(concat, sizes, parent, salt, lora, flat_extra) == [
        v.to_bytes(8, "big") for v in want
    ]
    assert native.chain_buffer(concat, sizes, parent, salt, lora, flat_extra) == b"".join(
        v.to_bytes(8, "big") for v in want
    )
    tpb = len(blocks[0])
    uniform = [concat[i : i + 4 * tpb] for i in range(0, len(concat), 4 * tpb)]
    uniform_want = fold(PY, [TokenIds.from_bytes(b) for b in uniform], state)
    assert native.chain(concat, tpb, parent, salt, lora) == uniform_want
    key = parent
    for i, b in enumerate(blocks):
        e = None if extra is None else u64s(extra[i])
        key = native.block_key(raw(b), key, salt, lora, e)
        assert key == want[i]


# ---------------------------------------------------------------------------- bad inputs

GOOD = raw([1, 2, 3, 4])


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: native.chain(b"\x01\x00\x00", 1), "whole number of token ids"),
        (lambda: native.chain([GOOD, b"\x01\x00"]), r"blocks\[1\]: 2 bytes"),
        (lambda: native.block_key(b"\x01\x00\x00\x00\x00"), "whole number of token ids"),
        (lambda: native.block_key(b""), "at least one token"),
        (lambda: native.chain([GOOD, b""]), r"blocks\[1\]: a block needs at least one token"),
        (lambda: native.chain(GOOD, [3]), "sum to 3 tokens but tokens holds 4"),
        (lambda: native.chain(GOOD, [3, 3]), "sum to more than the 4 tokens"),
        (lambda: native.chain(GOOD, [4, 0]), r"block_sizes\[1\] = 0: a block needs"),
        (lambda: native.chain(GOOD, [5, -1]), "sum to more than"),
        (lambda: native.chain(GOOD, [-1, 5]), r"block_sizes\[0\] = -1: block sizes must be"),
        (lambda: native.chain(GOOD, [2**70]), r"block_sizes\[0\] = \d+ is out of range"),
        (lambda: native.chain(GOOD, [2.0, 2]), r"block_sizes\[0\] must be an int, got float"),
        (lambda: native.chain(GOOD, [True, 3]), r"block_sizes\[0\] must be an int, got bool"),
        (lambda: native.chain(GOOD, 0), "tokens per block.*positive, got 0"),
        (lambda: native.chain(GOOD, -4), "positive, got -4"),
        (lambda: native.chain(GOOD, 2**80), "out of range"),
        (lambda: native.chain(GOOD, True), "got bool"),
        (lambda: native.chain(GOOD, "4"), "block_sizes must be an int or a sequence"),
        (lambda: native.chain(GOOD, 4.0), "block_sizes must be an int or a sequence"),
        (lambda: native.chain(GOOD), "block_sizes is required"),
        (lambda: native.chain([GOOD], 4), "block_sizes must be None"),
        (lambda: native.chain("1234", 1), "tokens must be a C-contiguous bytes-like"),
        (lambda: native.chain(7, 1), "got int"),
        (lambda: native.chain(None, 1), "got NoneType"),
        (lambda: native.chain(TokenIds([1]), 1), "got TokenIds"),
        (lambda: native.chain([GOOD, "ab"]), r"blocks\[1\] must be a C-contiguous"),
        (lambda: native.chain([GOOD, [1, 2]]), r"blocks\[1\] must be a C-contiguous"),
        (
            lambda: native.chain(np.arange(8, dtype="<u4")[::2], 4),
            "C-contiguous bytes-like object, got numpy.ndarray",
        ),
        (lambda: native.chain(GOOD, 4, -1), "parent must be in 0..2..64-1, got -1"),
        (lambda: native.chain(GOOD, 4, 2**64), "parent must be in 0..2..64-1"),
        (lambda: native.chain(GOOD, 4, 0, -1), "salt_id must be in 0..2..64-1, got -1"),
        (lambda: native.chain(GOOD, 4, 0, None, 2**64), "lora_id must be in 0..2..64-1"),
        (lambda: native.chain(GOOD, 4, 0, True), "salt_id must be an int, got bool"),
        (lambda: native.chain(GOOD, 4, 0, None, "3"), "lora_id must be an int, got str"),
        (lambda: native.chain(GOOD, 4, 1.5), "parent must be an int, got float"),
        (lambda: native.block_key(GOOD, -1), "parent must be in"),
        (lambda: native.block_key(GOOD, 0, 2**64), "salt_id must be in"),
        (lambda: native.chain(GOOD, 4, extra_ids=bytes(24)), "has 3 entries for 4 tokens"),
        (lambda: native.chain(GOOD, 4, extra_ids=bytes(31)), "whole number of extra ids"),
        (lambda: native.chain(GOOD, 2, extra_ids=[bytes(16)]), "one entry per block: got 1"),
        (
            lambda: native.chain(GOOD, 2, extra_ids=[bytes(16), bytes(8)]),
            r"extra_ids\[1\] has 1 entries for 2 tokens",
        ),
        (lambda: native.chain(GOOD, 2, extra_ids=[bytes(16), 5]), r"extra_ids\[1\] must be a"),
        (lambda: native.chain([GOOD], extra_ids=bytes(8)), "fewer than the tokens"),
        (lambda: native.chain([GOOD], extra_ids=bytes(40)), "has 5 entries for 4 tokens"),
        (lambda: native.chain(GOOD, 4, extra_ids="x" * 32), "extra_ids must be a C-contiguous"),
        (lambda: native.block_key(GOOD, extra_ids=bytes(8)), "has 1 entries for 4 tokens"),
        (lambda: native.chain(GOOD, 4, mm_keys=[bytes(35)]), r"mm_keys\[0\]: 35 bytes"),
        (lambda: native.chain(GOOD, 4, mm_keys=bytes(36)), "mm_keys must be None or a list"),
        (lambda: native.chain(GOOD, 4, mm_keys=[]), "one entry per block: got 0 for 1"),
        (lambda: native.block_key(GOOD, mm_keys=bytes(37)), "mm_keys: 37 bytes"),
    ],
)
def test_bad_inputs_raise_hashing_error(call: Any, match: str) -> None:
    with pytest.raises(HashingError, match=match) as info:
        call()
    assert isinstance(info.value, KVStreamError)


@pytest.mark.parametrize(
    "call",
    [
        native.chain,
        lambda: native.chain(GOOD, 4, 0, None, None, None, None, None),
        lambda: native.chain(GOOD, 4, bogus=1),
        lambda: native.chain(GOOD, 4, block_sizes=4),
        lambda: native.block_key(GOOD, block_sizes=4),
        native.block_key,
    ],
)
def test_bad_signatures_raise_type_error(call: Any) -> None:
    with pytest.raises(TypeError):
        call()


@pytest.mark.parametrize(
    ("blocks", "kw"),
    [
        ([[1, 2], [1, -1, 3]], {}),
        ([[1, 2], [2**32]], {}),
        ([[1, 2], (1, 2.5)], {}),
        ([[1, 2], []], {}),
        ([[1, 2], np.zeros((2, 2), dtype=np.int64)], {}),
        ([[1, 2], b"\x01\x00\x00\x00"], {}),
        ([[1, 2], "1234"], {}),
        ([[1, 2], [DIGEST, 1]], {}),
        ([[1]], {"lora_id": -1}),
        ([[1]], {"salt_id": 2**64}),
        ([[1]], {"salt_id": 1, "cache_salt": "a"}),
        ([[1]], {"lora_name": "x"}),
        ([[1], [2]], {"token_extra_ids": [[0]]}),
        ([[1, 2]], {"token_extra_ids": [[0]]}),
        ([[1]], {"token_extra_ids": [[-1]]}),
        ([[1]], {"token_extra_ids": [[2**64]]}),
        ([[1]], {"token_extra_ids": ["ab"]}),
        ([[1], [2]], {"mm_keys": [[]]}),
        ([[1]], {"mm_keys": [[(b"short", 0)]]}),
        ([[1]], {"mm_keys": [[(DIGEST, -1)]]}),
        ([[1]], {"mm_keys": [[(DIGEST, 2**32)]]}),
        ([[1]], {"mm_keys": [[("abc", 0)]]}),
        ([[], [1]], {"token_extra_ids": [[], [0]]}),
    ],
)
def test_hasher_errors_match_the_pure_python_path(blocks: list[Any], kw: dict[str, Any]) -> None:
    """Every bad input the hasher can get raises HashingError on both paths."""
    for h in (PY, NAT):
        with pytest.raises(HashingError):
            h.chain(blocks, **kw)
        with pytest.raises(HashingError):
            h.chain_bytes(blocks, **kw)
    scope = scope_of(kw)
    try:
        PY.root(**scope)
    except HashingError:
        return
    mm = kw.get("mm_keys")
    extra = kw.get("token_extra_ids")
    if len(blocks) == 1 or (mm is None and extra is None):
        block = blocks[-1]
        args = (mm[-1] if mm else (), extra[-1] if extra else None)
        for h in (PY, NAT):
            with pytest.raises(HashingError):
                h.extend(h.root(**scope), block, *args)


def test_native_true_without_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trtllm_mod, "NATIVE_AVAILABLE", False)
    with pytest.raises(HashingError, match="C extension is not available"):
        V1BlockKeyHasher(native=True)
    assert V1BlockKeyHasher().native is False


@pytest.mark.parametrize(("value", "loaded"), [("1", False), ("0", True)])
def test_env_var_forces_the_pure_python_path(value: str, loaded: bool) -> None:
    code = (
        "import sys\n"
        "from kvstream.hashing import get_hasher, trtllm\n"
        "assert trtllm.NATIVE_AVAILABLE is trtllm.V1BlockKeyHasher().native\n"
        "assert ('kvstream.hashing._v1native' in sys.modules) is trtllm.NATIVE_AVAILABLE\n"
        "print(trtllm.NATIVE_AVAILABLE, get_hasher('v1_block_key').chain([[1, 2, 3, 4]]))\n"
    )
    env = {**os.environ, "KVSTREAM_NO_NATIVE": value}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env=env, capture_output=True, text=True
    ).stdout
    assert out.split() == [str(loaded), "[924206229973855]"]


_JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=6),
    st.binary(max_size=45),
    st.lists(st.one_of(st.integers(-5, 2**65), st.binary(max_size=20), st.none()), max_size=4),
)


@settings(max_examples=500, deadline=None)
@given(st.sampled_from(["chain", "chain_bytes", "chain_buffer", "block_key"]), st.data())
def test_fuzzed_arguments_never_crash(fn: str, data: st.DataObject) -> None:
    n_args = data.draw(st.integers(1, 6 if fn == "block_key" else 7))
    args = [data.draw(_JUNK) for _ in range(n_args)]
    with contextlib.suppress(HashingError, TypeError):
        getattr(native, fn)(*args)
