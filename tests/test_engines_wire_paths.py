"""The vLLM-family decoder's fast path (typed msgspec structs, the C array readers or their
Python twins) and its generic path give one answer per payload (issue 24, item 6).

The payloads here are built byte by byte, so map keys and strings can hold invalid UTF-8,
which no msgpack library writes. Such a str makes the payload invalid msgpack: the generic
path refuses the whole batch (InteropError), so the fast path must never accept it, even when
the bad str sits in a key (or value) it would otherwise skip as unknown.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.engines import _wire_structs as structs
from kvstream.engines import vllm as wire
from kvstream.engines.sglang import SGLANG
from kvstream.engines.vllm import VLLM, Dialect, WireBatch, decode_payload
from kvstream.errors import InteropError


class RawStr(bytes):
    """A msgpack str holding these bytes as they are (valid UTF-8 or not)."""


def pack(obj: Any) -> bytes:
    """A minimal msgpack writer: nil, bool, int, float, str (RawStr or str), bin, list, dict."""
    if obj is None:
        return b"\xc0"
    if obj is True or obj is False:
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, int):
        if 0 <= obj < 0x80:
            return bytes([obj])
        if 0 <= obj < 1 << 64:
            return b"\xcf" + obj.to_bytes(8, "big")
        return b"\xd3" + obj.to_bytes(8, "big", signed=True)
    if isinstance(obj, float):
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, RawStr | str):
        raw = bytes(obj) if isinstance(obj, RawStr) else obj.encode()
        return b"\xdb" + len(raw).to_bytes(4, "big") + raw
    if isinstance(obj, bytes):
        return b"\xc6" + len(obj).to_bytes(4, "big") + obj
    if isinstance(obj, list):
        return b"\xdd" + len(obj).to_bytes(4, "big") + b"".join(pack(x) for x in obj)
    if isinstance(obj, dict):
        body = b"".join(pack(k) + pack(v) for k, v in obj.items())
        return b"\xdf" + len(obj).to_bytes(4, "big") + body
    raise TypeError(type(obj))


INVALID_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\xfe", b"\xf0\x28\x8c\x28")

# the declared fields: an unknown field is any other key
_KNOWN_KEYS = {
    RawStr(k.encode())
    for k in ("type", *structs.Stored.__struct_fields__, *structs.Removed.__struct_fields__)
}
# strs: valid UTF-8 mostly, invalid sometimes
raw_str = st.one_of(
    st.text(max_size=6).map(lambda t: RawStr(t.encode())),
    st.sampled_from(INVALID_UTF8).map(RawStr),
    st.binary(min_size=1, max_size=6).map(RawStr),
)
unknown_value = st.one_of(st.none(), st.integers(-5, 2**40), raw_str, st.lists(raw_str, max_size=2))
unknown_fields = st.dictionaries(
    raw_str.filter(lambda k: k not in _KNOWN_KEYS), unknown_value, max_size=2
)
medium = st.sampled_from([None, "GPU", "cpu", "STORAGE", "EXTERNAL", "TAPE"]).map(
    lambda m: None if m is None else RawStr(m.encode())
)


@st.composite
def stored_event(draw: st.DrawFn) -> dict[Any, Any]:
    n = draw(st.integers(1, 3))
    size = draw(st.integers(1, 3))
    ev: dict[Any, Any] = {
        RawStr(b"type"): RawStr(b"BlockStored"),
        RawStr(b"block_hashes"): draw(st.lists(st.integers(0, 2**64 - 1), min_size=n, max_size=n)),
        RawStr(b"parent_block_hash"): draw(st.none() | st.integers(0, 2**64 - 1)),
        RawStr(b"token_ids"): draw(
            st.lists(st.integers(0, 2**32 - 1), min_size=n * size, max_size=n * size)
        ),
        RawStr(b"block_size"): size,
        RawStr(b"lora_id"): draw(st.none() | st.integers(0, 9)),
        RawStr(b"medium"): draw(medium),
        RawStr(b"lora_name"): draw(st.none() | raw_str),
    }
    if draw(st.booleans()):
        ev[RawStr(b"extra_keys")] = draw(
            st.lists(st.none() | st.lists(raw_str, max_size=2), min_size=n, max_size=n)
        )
    if draw(st.booleans()):
        ev[RawStr(b"session_id")] = draw(raw_str)
    ev.update(draw(unknown_fields))
    return ev


@st.composite
def removed_event(draw: st.DrawFn) -> dict[Any, Any]:
    ev: dict[Any, Any] = {
        RawStr(b"type"): RawStr(b"BlockRemoved"),
        RawStr(b"block_hashes"): draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=3)),
        RawStr(b"medium"): draw(medium),
    }
    ev.update(draw(unknown_fields))
    return ev


cleared_event = unknown_fields.map(
    lambda extra: {RawStr(b"type"): RawStr(b"AllBlocksCleared")} | extra
)
payloads = st.lists(st.one_of(stored_event(), removed_event(), cleared_event), max_size=3).map(
    lambda events: pack([1.5, events, 0])
)


def _outcome(decode: Callable[[], WireBatch]) -> tuple[str, object]:
    try:
        return "ok", decode()
    except InteropError as exc:
        return "refused", str(exc)


@pytest.fixture(params=["native", "python"])
def fast_paths(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fast path with the C array readers, and with their pure-Python twins."""
    if request.param == "native":
        if wire._wire_native is None:
            pytest.skip("kvstream.engines._wire_native is not built (or KVSTREAM_NO_NATIVE)")
    else:
        monkeypatch.setattr(wire, "_wire_native", None)
    return request.param


def _check_one_answer(payload: bytes, width: int | None, dialect: Dialect) -> tuple[str, object]:
    generic = _outcome(lambda: wire._decode_generic(payload, width, dialect))
    try:
        fast = wire._decode_fast(payload, width, dialect)
    except wire._NotFast:
        pass
    else:
        assert ("ok", fast) == generic
    assert _outcome(lambda: decode_payload(payload, width=width, dialect=dialect)) == generic
    return generic


def _event(unknown_key: bytes, unknown_value: Any = 1) -> dict[Any, Any]:
    return {
        RawStr(b"type"): RawStr(b"BlockStored"),
        RawStr(b"block_hashes"): [1, 2],
        RawStr(b"parent_block_hash"): None,
        RawStr(b"token_ids"): [1, 2, 3, 4],
        RawStr(b"block_size"): 2,
        RawStr(b"lora_id"): None,
        RawStr(b"medium"): RawStr(b"GPU"),
        RawStr(b"lora_name"): None,
        RawStr(unknown_key): unknown_value,
    }


@pytest.mark.usefixtures("fast_paths")
@pytest.mark.parametrize("bad", INVALID_UTF8)
@pytest.mark.parametrize("where", ["key", "value"])
def test_invalid_utf8_in_an_unknown_field_refuses_the_batch_on_both_paths(
    bad: bytes, where: str
) -> None:
    ev = _event(bad) if where == "key" else _event(b"future_field", RawStr(bad))
    kind, detail = _check_one_answer(pack([1.0, [ev], 0]), 8, VLLM)
    assert kind == "refused"
    assert "not msgpack" in str(detail)


@pytest.mark.usefixtures("fast_paths")
def test_a_valid_unknown_field_is_ignored_on_both_paths() -> None:
    plain = _check_one_answer(pack([1.0, [_event(b"future_field")], 0]), 8, VLLM)
    known = dict(_event(b"future_field"))
    del known[RawStr(b"future_field")]
    assert plain == _check_one_answer(pack([1.0, [known], 0]), 8, VLLM)
    assert plain[0] == "ok"


@pytest.mark.usefixtures("fast_paths")
@settings(max_examples=300, deadline=None)
@given(
    payload=payloads,
    width=st.sampled_from([8, 32, None]),
    dialect=st.sampled_from([VLLM, SGLANG]),
)
def test_fast_and_generic_paths_agree(payload: bytes, width: int | None, dialect: Dialect) -> None:
    _check_one_answer(payload, width, dialect)


def test_every_captured_map_era_frame_stays_on_the_fast_path() -> None:
    # declaring the fields vLLM 0.33 and SGLang 0.5 send keeps their payloads fast although
    # an undeclared field now sends a payload to the generic path
    import json
    from pathlib import Path

    golden = Path(__file__).parent / "data" / "golden"
    checked = 0
    for capture in sorted(golden.glob("*/*.json")):
        doc = json.loads(capture.read_text())
        dialect = SGLANG if capture.parent.name.startswith("sglang") else VLLM
        width = 32 if "-bytes-" in capture.name else 8
        for frame in doc["live"]:
            payload = bytes.fromhex(frame["frames"][2])
            if b"\xa4type" not in payload:
                continue  # array era: positional events, the generic path's job
            wire._decode_fast(payload, width, dialect)  # raises _NotFast otherwise
            checked += 1
    assert checked >= 50
