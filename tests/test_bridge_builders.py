"""The engine bridge's model builders and its C array reader.

:mod:`kvstream.events.trusted` builds model objects without validation, in Python (no native
code writes a model's fields); ``kvstream.engines._wire_native`` reads the msgpack arrays of
vLLM-family payloads as :mod:`kvstream.engines.vllm` does through msgspec. Skipped when the
wire extension is not built. Properties: the builders' objects are indistinguishable from
validated ones (``==``, repr, ``model_dump``, ``model_fields_set``, field order, a validation
round trip); the C arrays equal msgspec's; a whole decode + convert gives the same batches
with and without the native parts; bad arguments raise, never crash; memory stays flat.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part
from pydantic import BaseModel

from kvstream._types import TokenIds
from kvstream.engines import vllm as vllm_mod
from kvstream.engines.stream import EngineStream
from kvstream.engines.vllm import decode_payload
from kvstream.errors import InteropError
from kvstream.events import trusted as trusted_mod
from kvstream.events.model import (
    EventBatch,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)

wire = native_part("kvstream.engines._wire_native")

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = trusted_mod.trusted_stored_blocks
TOKENS = trusted_mod.token_blocks
_OPTIONAL = ("cache_level", "lora_id", "lora_name", "cache_salt")


def _same(c: BaseModel, py: BaseModel) -> None:
    """c and py are indistinguishable, and a validation round trip gives c back."""
    assert type(c) is type(py)
    assert c == py
    assert repr(c) == repr(py)
    assert c.model_dump() == py.model_dump()
    assert c.model_fields_set == py.model_fields_set
    assert list(c.__dict__) == list(py.__dict__) == list(type(c).model_fields)
    assert c.__pydantic_extra__ is None
    assert c.__pydantic_private__ is None
    assert type(c.__pydantic_fields_set__) is set
    assert hash(c) == hash(py)
    again = type(c).model_validate(c.model_dump())
    assert again == c
    assert repr(again) == repr(c)


# ------------------------------------------------------------------------------- strategies

_atom = st.one_of(st.text(max_size=6), st.integers(-(2**63), 2**64 - 1), st.binary(max_size=12))
_extra_key = st.one_of(_atom, st.tuples(_atom, _atom), st.lists(_atom, max_size=3).map(tuple))


@st.composite
def _event_blocks(draw: st.DrawFn) -> tuple[tuple[bytes, ...], tuple[TokenIds, ...], Any, dict]:
    n = draw(st.integers(1, 6))
    width = draw(st.sampled_from([8, 32]))
    hashes = tuple(draw(st.binary(min_size=width, max_size=width)) for _ in range(n))
    tokens = tuple(
        TokenIds(draw(st.lists(st.integers(0, 2**32 - 1), max_size=9))) for _ in range(n)
    )
    extra = draw(
        st.one_of(
            st.none(),
            st.lists(
                st.one_of(st.none(), st.lists(_extra_key, max_size=3).map(tuple)),
                min_size=n,
                max_size=n,
            ).map(tuple),
        )
    )
    shared = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "lora_id": st.one_of(st.none(), st.integers(0, 2**64 - 1)),
                "lora_name": st.one_of(st.none(), st.text(max_size=5)),
                "cache_level": st.integers(0, 2**31 - 1),
                "cache_salt": st.one_of(st.none(), st.text(max_size=5)),
            },
        )
    )
    given_names = draw(st.frozensets(st.sampled_from(_OPTIONAL)))
    shared["fields_set"] = frozenset(("block_hash", "token_ids")) | given_names
    return hashes, tokens, extra, shared


@settings(max_examples=300, deadline=None)
@given(_event_blocks())
def test_blocks_equal_one_block_at_a_time(case: Any) -> None:
    hashes, tokens, extra, shared = case
    fields_set = shared.pop("fields_set")
    built = BLOCKS(hashes, tokens, extra_keys=extra, fields_set=fields_set, **shared)
    assert type(built) is tuple
    assert len(built) == len(hashes)
    for i, a in enumerate(built):
        keys = None if extra is None else extra[i]
        one = trusted_mod.trusted_stored_block(
            hashes[i],
            tokens[i],
            extra_keys=keys,
            fields_set=fields_set | {"extra_keys"} if keys is not None else fields_set,
            **shared,
        )
        _same(a, one)
        assert a.block_hash is hashes[i]
        assert a.token_ids is tokens[i]
        assert a.extra_keys is keys
        assert ("extra_keys" in a.model_fields_set) is (keys is not None)
    # every block owns its fields set
    if len(built) > 1:
        assert built[0].__pydantic_fields_set__ is not built[1].__pydantic_fields_set__


def test_blocks_defaults_equal_a_validated_block() -> None:
    h, t = b"\x00" * 7 + b"\x01", TokenIds([1, 2])
    (c,) = BLOCKS((h,), (t,))
    _same(c, trusted_mod.trusted_stored_block(h, t))
    _same(c, StoredBlock(block_hash=h, token_ids=t))


_tokens = st.lists(st.integers(0, 2**32 - 1), max_size=5).map(TokenIds)
_values = {
    StoredBlock: st.fixed_dictionaries(
        {"block_hash": st.binary(min_size=8, max_size=8), "token_ids": _tokens},
        optional={"lora_id": st.integers(0, 9), "priority": st.integers(0, 100)},
    ),
    Removed: st.fixed_dictionaries(
        {"block_hashes": st.lists(st.binary(min_size=8, max_size=8), min_size=1).map(tuple)},
        optional={"cache_level": st.one_of(st.none(), st.integers(0, 3))},
    ),
    Stored: st.fixed_dictionaries(
        {
            "blocks": st.lists(
                st.builds(
                    StoredBlock,
                    block_hash=st.binary(min_size=8, max_size=8),
                    token_ids=_tokens,
                ),
                min_size=1,
                max_size=3,
            ).map(tuple)
        },
        optional={"parent_hash": st.one_of(st.none(), st.binary(min_size=8, max_size=8))},
    ),
}


@st.composite
def _model_values(draw: st.DrawFn) -> tuple[type[BaseModel], dict[str, Any]]:
    cls = draw(st.sampled_from([StoredBlock, Removed, Stored, KVCacheEvent, EventBatch]))
    if cls is KVCacheEvent:
        data_cls = draw(st.sampled_from([Removed, Stored]))
        values = {
            "event_id": draw(st.integers(0, 2**63 - 1)),
            "window_size": draw(st.integers(1, 2**31 - 1)),
            "data": data_cls(**draw(_values[data_cls])),
        }
        if draw(st.booleans()):
            values["hash_algo"] = "vllm_sha256_64"
        if draw(st.booleans()):
            values["layer_group_id"] = draw(st.integers(0, 5))
        return cls, values
    if cls is EventBatch:
        event = KVCacheEvent(
            event_id=0,
            hash_algo="v2_sha256_64",
            window_size=1,
            data=Removed(**draw(_values[Removed])),
        )
        values = {"source": SourceId(instance_id="w"), "ts_ns": draw(st.integers(0, 2**62))}
        if draw(st.booleans()):
            values["events"] = (event,) * draw(st.integers(0, 3))
        return cls, values
    return cls, draw(_values[cls])


@settings(max_examples=200, deadline=None)
@given(_model_values())
def test_trusted_equals_the_validated_model(case: tuple[type[BaseModel], dict[str, Any]]) -> None:
    cls, values = case
    c = trusted_mod.trusted(cls, values)  # type: ignore[type-var]
    _same(c, trusted_mod.trusted_builder(cls)(values))  # type: ignore[type-var]
    assert c.model_fields_set == set(values)
    _same(c, cls(**values))


def test_trusted_builder_refuses_other_classes() -> None:
    with pytest.raises(TypeError, match="builds"):
        trusted_mod.trusted_builder(SourceId)  # type: ignore[type-var]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64).map(lambda b: b[: len(b) // 4 * 4]), st.integers(1, 6))
def test_token_blocks_cut_the_ids_in_steps(raw: bytes, words: int) -> None:
    step = 4 * words
    blocks = TOKENS(raw, step)
    assert all(type(t) is TokenIds for t in blocks)
    assert [len(t.raw) for t in blocks[:-1]] == [step] * (len(blocks) - 1)
    assert 0 < len(blocks[-1].raw) <= step if raw else blocks == ()
    assert b"".join(t.raw for t in blocks) == raw


@pytest.mark.parametrize(("raw", "step"), [(b"\x00" * 6, 4), (b"\x00" * 8, 6), (b"", 0), (b"", -4)])
def test_token_blocks_refuse_what_python_refuses(raw: bytes, step: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        TOKENS(raw, step)


# ------------------------------------------------------------------------ msgpack arrays


def _ref_u32(buf: bytes) -> bytes | None:
    try:
        values = msgspec.msgpack.decode(buf)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    if not isinstance(values, list) or any(
        type(v) is not int or not 0 <= v < 2**32 for v in values
    ):
        return None
    return array("I", values).tobytes() if sys.byteorder == "little" else None


def _ref_be64(buf: bytes) -> tuple[bytes, ...] | None:
    try:
        values = msgspec.msgpack.decode(buf)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None
    if not isinstance(values, list) or any(
        type(v) is not int or not 0 <= v < 2**64 for v in values
    ):
        return None
    return tuple(v.to_bytes(8, "big") for v in values)


def _int_forms(v: int) -> list[bytes]:
    """Every msgpack encoding of the non-negative int v (unsigned and signed families)."""
    out = []
    if v < 0x80:
        out.append(bytes([v]))
    for tag, fmt, signed_tag, signed_fmt, bits in (
        (0xCC, ">B", 0xD0, ">b", 8),
        (0xCD, ">H", 0xD1, ">h", 16),
        (0xCE, ">I", 0xD2, ">i", 32),
        (0xCF, ">Q", 0xD3, ">q", 64),
    ):
        if v < 1 << bits:
            out.append(bytes([tag]) + struct.pack(fmt, v))
        if v < 1 << (bits - 1):
            out.append(bytes([signed_tag]) + struct.pack(signed_fmt, v))
    return out


def _array_header(n: int, form: int) -> bytes:
    if form == 0 and n < 16:
        return bytes([0x90 | n])
    if form <= 1 and n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), max_size=40),
    st.integers(0, 2),
    st.data(),
)
def test_arrays_in_every_int_encoding(values: list[int], header: int, data: st.DataObject) -> None:
    body = b"".join(data.draw(st.sampled_from(_int_forms(v))) for v in values)
    buf = _array_header(len(values), header) + body
    assert wire.be64_array(buf) == tuple(v.to_bytes(8, "big") for v in values)
    assert wire.be64_array(memoryview(buf)) == wire.be64_array(msgspec.Raw(buf))
    if all(v < 2**32 for v in values):
        assert wire.u32_array(buf) == array("I", values).tobytes()
    else:
        with pytest.raises(ValueError, match="not a msgpack array of uint32"):
            wire.u32_array(buf)


_msgpack_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=4),
        st.binary(max_size=4),
    ),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(st.one_of(_msgpack_values.map(msgspec.msgpack.encode), st.binary(max_size=24)))
def test_arrays_accept_exactly_what_the_reference_reads(buf: bytes) -> None:
    """On any bytes: the C reader either gives the reference's value or raises ValueError
    (the caller then decodes generically); canonical uint arrays are never refused."""
    for fn, ref in ((wire.u32_array, _ref_u32(buf)), (wire.be64_array, _ref_be64(buf))):
        try:
            got = fn(buf)
        except ValueError:
            assert ref is None
        else:
            assert got == ref


@pytest.mark.parametrize(
    "buf",
    [
        b"",
        b"\x92\x01",  # truncated
        b"\x91\x01\x02",  # trailing bytes
        b"\xdc\x00",  # truncated header
        b"\xdd\xff\xff\xff\xff\x01",  # claims 4G elements
        b"\x91\xcf\x00",  # truncated uint64
        b"\x91\xd0\xff",  # -1
        b"\x91\xc3",  # true
        b"\x91\x91\x01",  # nested
        b"\x81\x01\x02",  # a map
        b"\x91\xcb" + struct.pack(">d", 1.0),  # a float
    ],
)
def test_arrays_refuse_malformed_input(buf: bytes) -> None:
    for fn in (wire.u32_array, wire.be64_array):
        with pytest.raises(ValueError, match="not a msgpack array"):
            fn(buf)


def test_u32_refuses_ids_beyond_32_bits() -> None:
    with pytest.raises(ValueError, match="uint32"):
        wire.u32_array(msgspec.msgpack.encode([1, 2**32]))
    assert wire.u32_array(msgspec.msgpack.encode([2**32 - 1])) == b"\xff\xff\xff\xff"


def test_unreadable_arrays_send_the_payload_to_the_generic_path() -> None:
    # msgspec skips a Raw field without checking its strings; reading it must not escape as
    # anything but the generic path's InteropError (as when the whole payload is bad UTF-8)
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["ab"], "block_size": 1}]]
    ).replace(b"\xa2ab", b"\xa2\xff\xfe")
    with pytest.raises(InteropError, match="not msgpack"):
        decode_payload(payload, width=8)
    hashes = payload.replace(b"\x91\x01", b"\x91\xa1\xff", 1)
    with pytest.raises(InteropError, match="not msgpack"):
        decode_payload(hashes, width=8)


def test_arrays_need_a_buffer() -> None:
    for fn in (wire.u32_array, wire.be64_array):
        with pytest.raises(TypeError):
            fn([1, 2])  # type: ignore[arg-type]


# ------------------------------------------------------------------------ bad arguments


def test_builders_refuse_bad_arguments() -> None:
    h, t = (b"\x00" * 8,), (TokenIds([1]),)
    bad_calls: list[tuple[Any, tuple[Any, ...], dict[str, Any], type[Exception]]] = [
        (BLOCKS, (h, t * 2), {}, ValueError),
        (BLOCKS, (h, t), {"extra_keys": (None, None)}, ValueError),
        (BLOCKS, (h, t), {"colour": 1}, TypeError),
        (BLOCKS, (h, t, None), {}, TypeError),  # keyword-only
        (TOKENS, (b"\x00" * 4, 0), {}, ValueError),
        (TOKENS, (b"\x00" * 4,), {}, TypeError),
    ]
    for fn, args, kwargs, exc in bad_calls:
        with pytest.raises(exc):
            fn(*args, **kwargs)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_memory_stays_flat_over_many_conversions() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [1, 2, 3],
        "parent_block_hash": 7,
        "token_ids": list(range(40)),
        "block_size": 16,
        "lora_name": "a",
        "medium": "GPU",
        "extra_keys": [["a", ["mm", 3]], None, [b"x"]],
    }
    removed = {"type": "BlockRemoved", "block_hashes": [5, 6], "medium": "GPU"}
    payload = msgspec.msgpack.encode([1.0, [ev, removed, removed], 0])
    stream = EngineStream("w", 0, "vllm_sha256_64", clock_ns=lambda: 1)

    def run(n: int) -> None:
        for _ in range(n):
            stream.convert(decode_payload(payload, width=8))

    run(20_000)
    gc.collect()
    before = _rss()
    run(100_000)
    gc.collect()
    grown = _rss() - before
    # one leaked block dict per conversion would be ~100 MB here
    assert grown < 4 * 2**20, f"RSS grew {grown / 2**20:.1f} MiB over 1e5 conversions"


# ------------------------------------------------ the bridge, native against pure Python

_SCRIPT = r"""
import json, random, sys
import msgspec
from pydantic import BaseModel
from kvstream._types import TokenIds
from kvstream.engines import vllm
from kvstream.engines.sglang import SGLANG
from kvstream.engines.stream import EngineStream
from kvstream.events import trusted

def dump(x):
    if isinstance(x, BaseModel):
        return [type(x).__name__, [[k, dump(v)] for k, v in x.__dict__.items()],
                sorted(x.model_fields_set), x.__pydantic_extra__, x.__pydantic_private__,
                repr(x)]
    if isinstance(x, tuple):
        return ["tuple", [dump(v) for v in x]]
    if isinstance(x, bytes):
        return ["bytes", x.hex()]
    if isinstance(x, TokenIds):
        return ["tokens", x.raw.hex()]
    return [type(x).__name__, repr(x)]

rng = random.Random(int(sys.argv[1]))
MEDIA = ["GPU", "cpu", "CPU_TIER2", "EXTERNAL", None, None, "TAPE"]

def h():
    r = rng.random()
    if r < 0.7:
        return rng.randrange(2**64)
    if r < 0.85:
        return -rng.randrange(1, 2**63)
    return rng.randbytes(rng.choice([8, 32]))

def stored():
    n, bs = rng.randint(1, 5), rng.randint(1, 6)
    ntok = 0 if rng.random() < 0.1 else (n - 1) * bs + rng.randint(1, bs)
    ev = {"type": "BlockStored", "block_hashes": [h() for _ in range(n)],
          "parent_block_hash": h() if rng.random() < 0.5 else None,
          "token_ids": [rng.randrange(2**32) for _ in range(ntok)], "block_size": bs,
          "lora_id": rng.choice([None, 0, 7, 2**63]), "medium": rng.choice(MEDIA),
          "lora_name": rng.choice([None, "", "ad"])}
    for k, v in (("cache_salt", rng.choice(["s", ""])), ("group_idx", rng.randint(0, 2)),
                 ("kv_cache_spec_sliding_window", rng.choice([None, 64, 0])),
                 ("locality", rng.choice(["REMOTE", "local"])),
                 ("extra_keys", [rng.choice([None, ["x", ["mm", 3]], [b"e"], "z"])
                                 for _ in range(n)])):
        if rng.random() < 0.3:
            ev[k] = v
    return ev

def removed():
    return {"type": "BlockRemoved", "block_hashes": [h() for _ in range(rng.randint(1, 3))],
            "medium": rng.choice(MEDIA[:5]), "group_idx": rng.choice([0, 0, 1])}

print(json.dumps([vllm._wire_native is not None]))
for algo in ("vllm_sha256_64", "vllm_sha256", "mystery_algo"):
    for dialect in (vllm.VLLM, SGLANG):
        s = EngineStream("w", 0, algo, clock_ns=lambda: 1)
        for _ in range(60):
            events = [rng.choice([stored, stored, removed, removed,
                                  lambda: {"type": "AllBlocksCleared"}])()
                      for _ in range(rng.randint(0, 6))]
            payload = msgspec.msgpack.encode([1.5, events, 0])
            batch = s.convert(vllm.decode_payload(payload, width=s.width, dialect=dialect))
            print(json.dumps(dump(batch)))
"""


@pytest.mark.parametrize("seed", [1, 2])
def test_the_bridge_builds_the_same_batches_either_way(seed: int) -> None:
    outs = {}
    for mode in ("0", "1"):
        env = {**os.environ, "KVSTREAM_NO_NATIVE": mode}
        outs[mode] = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(seed)],
            check=True,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        ).stdout.splitlines()
    assert json.loads(outs["0"][0]) == [True]
    assert json.loads(outs["1"][0]) == [False]
    assert len(outs["0"]) == len(outs["1"]) > 300
    kinds = set()
    for native_line, python_line in zip(outs["0"][1:], outs["1"][1:], strict=True):
        assert native_line == python_line
        kinds.update(e[1][4][1][0] for e in json.loads(native_line)[1][3][1][1])
    assert kinds == {"Stored", "Removed", "Cleared", "Lost"}  # every path was taken


@pytest.mark.parametrize(("value", "loaded"), [("1", False), ("0", True)])
def test_env_var_forces_the_pure_python_path(value: str, loaded: bool) -> None:
    code = (
        "import sys\n"
        "from kvstream.engines import vllm\n"
        "native = vllm._wire_native is not None\n"
        "assert ('kvstream.engines._wire_native' in sys.modules) is native\n"
        "print(native)\n"
    )
    env = {**os.environ, "KVSTREAM_NO_NATIVE": value}
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=ROOT, env=env, capture_output=True, text=True
    ).stdout
    assert out.split() == [str(loaded)]


@pytest.mark.skipif(vllm_mod._wire_native is None, reason="KVSTREAM_NO_NATIVE=1")
def test_the_fast_path_uses_the_extension() -> None:
    assert vllm_mod._wire_native is wire
