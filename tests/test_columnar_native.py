"""The C record decoder (kvstream.codec._columns_native) against the reference it falls back to
(fastavro + ``record_columns``): identical columns, skipped events, errors and index state on
valid batches of every token encoding, mutated records, fuzzed and torn bytes, crafted
encodings and damaged container files."""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from test_codec_strategies import batches
from test_columnar import _leaves, _set

from kvstream.codec import AvroCodec, columnar, schema_registry, write_container
from kvstream.codec.binary import encode_long
from kvstream.codec.columnar import (
    ColumnarContainerReader,
    decode_columns_body,
    decode_columns_message,
    record_columns,
)
from kvstream.codec.decoder import read_record
from kvstream.codec.records import batch_to_record
from kvstream.codec.schemas import SchemaInfo
from kvstream.codec.tokens import TOKEN_ENCODINGS, decode_packed, encode_tokens
from kvstream.errors import DecodeError, EncodeError
from kvstream.events.columns import ColumnBatch
from kvstream.events.model import EventBatch
from kvstream.index import PrefixIndex

pytestmark = pytest.mark.skipif(not columnar.NATIVE, reason="_columns_native not built")

REGISTRY = schema_registry()
NATIVE_VERSIONS = (3, 4)
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def reference_only() -> Iterator[None]:
    """Decode with the reference path only (what KVSTREAM_NO_NATIVE=1 gives)."""
    saved = columnar._native
    columnar._native = None
    try:
        yield
    finally:
        columnar._native = saved


def typed(value: Any) -> Any:
    """``value`` with the type of every leaf, so that 1 != True and a list != a tuple."""
    if isinstance(value, list | tuple):
        return (type(value).__name__, [typed(v) for v in value])
    return (type(value).__name__, value)


def canon(cols: ColumnBatch) -> tuple[Any, ...]:
    return (
        typed(cols.instance_id),
        typed(cols.attention_dp_rank),
        typed(cols.incarnation),
        typed(cols.ts_ns),
        cols.schema_version,
        typed(cols.tokens),
        typed(cols.event_ids),
        typed(cols.kinds),
        typed(cols.hash_algos),
        typed(cols.group_ids),
        typed(cols.window_sizes),
        typed(cols.payloads),
        cols.has_blocks,
        typed(cols.token_layout),
    )


def outcome(fn: Any) -> tuple[Any, ...]:
    try:
        cols, skipped = fn()
    except DecodeError as exc:
        return ("error", type(exc), str(exc))
    try:
        batch: Any = cols.to_batch()
    except DecodeError as exc:
        batch = ("error", type(exc), str(exc))
    return ("ok", canon(cols), skipped, batch)


def native_outcome(body: bytes, writer: SchemaInfo) -> tuple[Any, ...]:
    def run() -> tuple[ColumnBatch, Any]:
        got = decode_columns_body(body, writer, writer)
        return got.columns, got.skipped

    return outcome(run)


def reference_outcome(body: bytes, writer: SchemaInfo) -> tuple[Any, ...]:
    return outcome(lambda: record_columns(read_record(body, writer, writer), writer.version))


def native_accepts(body: bytes, writer: SchemaInfo) -> bool:
    got = columnar._native_columns(body, 0, writer)
    return got is not None and got[2] == len(body)


def encoded_body(batch: EventBatch, version: int, encoding: str) -> bytes:
    """The schemaless body of ``batch`` (hypothesis: assume it fits ``version``)."""
    try:
        record = batch_to_record(batch, version, lossy=True, token_encoding=encoding)
    except EncodeError:
        assume(False)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, REGISTRY.get(version).parsed, record)
    return buf.getvalue()


def check_same(body: bytes, writer: SchemaInfo) -> str:
    """Assert the native path's outcome is the reference's; say what happened."""
    want = reference_outcome(body, writer)
    got = native_outcome(body, writer)
    assert got == want
    return f"{want[0]}, native {'accepts' if native_accepts(body, writer) else 'declines'}"


# ------------------------------------------------------------------------------ valid data


@PROPS
@given(batch=batches(), encoding=st.sampled_from(TOKEN_ENCODINGS), version=st.sampled_from((3, 4)))
def test_valid_batches_decode_natively_and_alike(
    batch: EventBatch, encoding: str, version: int
) -> None:
    writer = REGISTRY.get(version)
    body = encoded_body(batch, version, encoding)
    assert native_accepts(body, writer), "the C decoder declined a valid record"
    assert check_same(body, writer) == "ok, native accepts"


@PROPS
@given(batch=batches())
def test_messages_of_every_version_match_the_reference(batch: EventBatch) -> None:
    for version in (1, 2, 3, 4):
        try:
            data = AvroCodec(version, lossy=True).encode(batch)
        except EncodeError:
            continue
        got = decode_columns_message(data, REGISTRY)
        with reference_only():
            want = decode_columns_message(data, REGISTRY)
        assert canon(got.columns) == canon(want.columns)
        assert got.skipped == want.skipped
        assert got.batch == want.batch


def test_the_native_path_is_taken_for_shipped_v3_and_v4_only() -> None:
    for version in (1, 2, 3, 4):
        assert columnar._native_ok(REGISTRY.get(version)) == (version in NATIVE_VERSIONS)


# ------------------------------------------------------------------------------ mutated data

_INTS = [-1, 0, 1, 3, 7, 8, 100, 101, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, -(2**63)]
_STRS = [
    "",
    "x",
    "x" * 65,
    "x" * 257,
    "x" * 1025,
    "UNKNOWN",
    "STORED",
    "STORED_PACKED",
    "NONE",
    "VARINT",
    "ZSTD",
    "BIT_PLANES",
    "SLIDING_WINDOW",
    "\u00e9" * 40,
]
_BYTES = [
    b"",
    b"\x01" * 7,
    b"\x01" * 8,
    b"\x01" * 16,
    b"\x01" * 32,
    b"\x01" * 33,
    b"\x01" * 65,
    b"\x80",
    b"\xff\xff",
    b"\x00\x00\x00",
]


@PROPS
@given(
    batch=batches(max_events=4),
    encoding=st.sampled_from(TOKEN_ENCODINGS),
    version=st.sampled_from((3, 4)),
    data=st.data(),
)
def test_mutated_records_give_the_same_result_or_error(
    batch: EventBatch, encoding: str, version: int, data: st.DataObject
) -> None:
    """Fields set to boundary values (out of range, wrong width or length, other kinds and
    encodings): the same columns, or the same DecodeError, as the reference."""
    writer = REGISTRY.get(version)
    try:
        record = batch_to_record(batch, version, lossy=True, token_encoding=encoding)
    except EncodeError:
        assume(False)
    for _ in range(data.draw(st.integers(1, 3))):
        path, old = data.draw(st.sampled_from(_leaves(record)))
        assume(path)
        if isinstance(old, bool) or old is None:
            value: Any = data.draw(st.sampled_from([None, 0, 1, "x", b"\x01" * 8]))
        elif isinstance(old, int):
            value = data.draw(st.sampled_from(_INTS))
        elif isinstance(old, str):
            value = data.draw(st.sampled_from(_STRS))
        elif isinstance(old, bytes):
            value = data.draw(st.sampled_from([*_BYTES, old[:-1], old + b"\x00", old[::-1]]))
        elif isinstance(old, list):
            value = data.draw(st.sampled_from([[], old[:-1], old + old[-1:]])) if old else []
        else:
            value = old
        _set(record, path, value)
    buf = io.BytesIO()
    try:
        fastavro.schemaless_writer(buf, writer.parsed, record)
    except Exception:  # the mutation does not fit the schema's types: nothing to decode
        assume(False)
    event(check_same(buf.getvalue(), writer))


def _mutate(body: bytearray, rng: random.Random) -> bytearray:
    op = rng.randrange(6)
    pos = rng.randrange(len(body) + 1)
    if op == 0 and body:
        body[pos % len(body)] ^= 1 << rng.randrange(8)
    elif op == 1 and body:
        body[pos % len(body)] = rng.choice((0x00, 0x01, 0x02, 0x7F, 0x80, 0xFE, 0xFF))
    elif op == 2:
        del body[pos:]
    elif op == 3:
        body[pos:pos] = bytes(rng.choice((b"\x00", b"\x01", b"\xff" * 11, b"\x80" * 10)))
    elif op == 4:
        del body[pos : pos + rng.randrange(1, 9)]
    else:
        body[pos:pos] = b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01"  # a huge varint
    return body


@PROPS
@given(
    batch=batches(max_events=4),
    encoding=st.sampled_from(TOKEN_ENCODINGS),
    version=st.sampled_from((3, 4)),
    seed=st.integers(0, 2**32),
    mutations=st.integers(1, 4),
)
def test_fuzzed_and_torn_bytes_give_the_same_result_or_error(
    batch: EventBatch, encoding: str, version: int, seed: int, mutations: int
) -> None:
    """Flipped, overwritten, inserted and deleted bytes, truncations: never a crash or an
    over-read, and exactly the reference's result or error."""
    writer = REGISTRY.get(version)
    body = bytearray(encoded_body(batch, version, encoding))
    rng = random.Random(seed)
    for _ in range(mutations):
        body = _mutate(body, rng)
    event(check_same(bytes(body), writer))


def _message_outcome(data: bytes) -> tuple[Any, ...]:
    def run() -> tuple[ColumnBatch, Any]:
        got = decode_columns_message(data, REGISTRY)
        return got.columns, (got.writer_version, got.skipped)

    return outcome(run)


@PROPS
@given(
    batch=batches(max_events=3),
    version=st.sampled_from((1, 3, 4)),
    seed=st.integers(0, 2**32),
    mutations=st.integers(0, 3),
)
def test_fuzzed_single_object_messages_match_the_reference(
    batch: EventBatch, version: int, seed: int, mutations: int
) -> None:
    """Whole messages (header included) read in place by the C decoder: the reference's
    result or error, for every writer version and damaged headers."""
    try:
        data = bytearray(AvroCodec(version, lossy=True).encode(batch))
    except EncodeError:
        assume(False)
    rng = random.Random(seed)
    for _ in range(mutations):
        data = _mutate(data, rng)
    got = _message_outcome(bytes(data))
    with reference_only():
        want = _message_outcome(bytes(data))
    assert got == want
    event(str(want[0]))


# ------------------------------------------------------------------------------ crafted bytes


def _body(version: int, events: bytes, n_events: int, tokens: bytes | None = None) -> bytes:
    src = (
        encode_long(1) + b"w" + encode_long(0) + encode_long(0)
    )  # instance "w", no rank, incarnation 0
    if tokens is None:
        tokens = encode_long(0) + encode_long(0) + encode_long(0) + encode_long(0)
        if version >= 4:
            tokens += encode_long(1) + encode_long(1) + encode_long(0) + encode_long(0)
    arr = (encode_long(n_events) + events + encode_long(0)) if n_events else encode_long(0)
    return src + encode_long(5) + tokens + arr


def _cleared(eid: int = 1, kind: bytes | None = None, union: bytes = b"") -> bytes:
    """A CLEARED event: every payload null (or the branch given for the first one)."""
    return (
        encode_long(eid)
        + (kind if kind is not None else encode_long(5))
        + encode_long(1)
        + encode_long(12)
        + b"v1_block_key"
        + encode_long(0)
        + (union or encode_long(0))
        + encode_long(0) * 4
    )


@pytest.mark.parametrize("version", NATIVE_VERSIONS)
@pytest.mark.parametrize(
    "body_of",
    [
        lambda v: _body(v, _cleared(), 1),  # valid
        lambda v: _body(
            v, _cleared(kind=encode_long(-1)), 1
        ),  # negative enum index: fastavro wraps
        lambda v: _body(v, _cleared(kind=encode_long(-8)), 1),
        lambda v: _body(v, _cleared(kind=encode_long(8)), 1),  # past the symbols
        lambda v: _body(v, _cleared(kind=encode_long(0)), 1),  # UNKNOWN: skipped
        lambda v: _body(v, _cleared(union=encode_long(-1)), 1),  # negative union branch
        lambda v: _body(v, _cleared(union=encode_long(2)), 1),
        lambda v: _body(v, _cleared(eid=-5), 1),
        lambda v: _body(v, b"\xff" * 10 + b"\x01" + _cleared()[1:], 1),  # 11-byte varint
        lambda v: _body(v, b"\xff" * 9 + b"\x7f" + _cleared()[1:], 1),  # 10th byte > 1
        lambda v: _body(v, b"\xfe" + b"\xff" * 8 + b"\x01" + _cleared()[1:], 1),  # max long
        lambda v: _body(v, _cleared(), 1)[:-1],  # torn
        lambda v: _body(v, _cleared(), 1) + b"\x00",  # trailing byte
        lambda v: (
            _body(v, _cleared() + _cleared(2), -2)[:-1] + encode_long(0)
        ),  # negative block count
        lambda v: _body(v, _cleared(), 2**62),  # absurd item count
        lambda v: encode_long(-3) + b"w" + _body(v, b"", 0)[2:],  # negative string length
        lambda v: encode_long(2**40) + b"w" + _body(v, b"", 0)[2:],  # string past the end
        lambda v: encode_long(2) + b"\xc3\x28" + _body(v, b"", 0)[2:],  # invalid UTF-8
        lambda v: encode_long(1) + b"\xed" + _body(v, b"", 0)[2:],
        lambda v: _body(
            v,
            b"",
            0,
            encode_long(1)
            + encode_long(0)
            + encode_long(2)
            + b"\x01\x00"
            + encode_long(0)
            + (
                encode_long(1) + encode_long(1) + encode_long(0) + encode_long(0) if v >= 4 else b""
            ),
        ),  # 1 unused id
        lambda v: _body(
            v,
            b"",
            0,
            encode_long(2**62)
            + encode_long(0)
            + encode_long(0)
            + encode_long(0)
            + (
                encode_long(1) + encode_long(1) + encode_long(0) + encode_long(0) if v >= 4 else b""
            ),
        ),
    ],
)
def test_crafted_encodings_match_the_reference(version: int, body_of: Any) -> None:
    check_same(body_of(version), REGISTRY.get(version))


def test_crafted_packed_tokens_match_the_reference() -> None:
    writer = REGISTRY.get(4)
    plain = encode_long(0) * 2 + encode_long(0) * 2  # count, high_bits, low16, high_planes: empty
    for enc, comp, count, data in [
        (3, 1, 2, b"\x01\x02"),  # VARINT, no stored events use them: unused ids
        (3, 1, 1, b"\x80\x00"),  # redundant trailing zero group
        (3, 1, 1, b"\xff\xff\xff\xff\x10"),  # over 32 bits
        (3, 1, 1, b"\xff\xff\xff\xff\x8f\x01"),  # over 5 bytes
        (4, 1, 2, b"\x01"),  # too few
        (2, 1, 9, b"\x00" * 18 + b"\x00\x02"),  # bit planes, padding bit set
        (2, 1, 9, b"\x00" * 18 + b"\x00" * 34),  # 17 planes
        (0, 1, 0, b""),  # UNKNOWN encoding
        (3, 0, 0, b""),  # UNKNOWN compression
        (3, 2, 4, b"not zstd"),
        (1, 2, 0, b""),  # NONE with a compression set
        (3, 1, -1, b""),
    ]:
        tokens = (
            plain
            + encode_long(enc)
            + encode_long(comp)
            + encode_long(count)
            + encode_long(len(data))
            + data
        )
        check_same(_body(4, b"", 0, tokens), writer)


_CODES = {"BIT_PLANES": 2, "VARINT": 3, "DELTA_VARINT": 4}


@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 300), max_size=40),
    encoding=st.sampled_from(("planes", "varint", "delta_varint")),
    edits=st.lists(
        st.tuples(st.integers(0, 10**4), st.sampled_from(b"\x00\x01\x0f\x10\x7f\x80\x8f\xff")),
        max_size=3,
    ),
    cut=st.integers(0, 3),
    count_delta=st.sampled_from((0, 0, 0, -1, 1)),
)
def test_packed_ids_match_tokens_decode_packed(
    ids: list[int], encoding: str, edits: list[tuple[int, int]], cut: int, count_delta: int
) -> None:
    """The C token decoder accepts exactly what tokens.decode_packed accepts, with the same
    ids: canonical varints, bit planes with clean padding, the exact count."""
    raw = b"".join(i.to_bytes(4, "little") for i in ids)
    enc = encode_tokens(raw, encoding)
    name = enc.encoding if enc.is_packed else "BIT_PLANES"
    data = bytearray(enc.packed if enc.is_packed else enc.planes.low16 + enc.planes.high_planes)
    for pos, byte in edits:
        if data:
            data[pos % len(data)] = byte
    if cut and data:
        del data[-cut:]
    count = enc.count + count_delta
    try:
        want: Any = decode_packed(name, "NONE", count, bytes(data))
    except DecodeError:
        want = None
    assert columnar._native.packed_ids(_CODES[name], bytes(data), count) == want
    event("valid" if want is not None else "invalid")


@pytest.mark.parametrize(
    ("code", "data", "count"),
    [
        (3, b"\x80\x80\x80\x80\x00", 1),  # redundant zero group in the 5th byte
        (3, b"\x80\x00", 1),
        (3, b"\xff\xff\xff\xff\x0f", 1),  # 2**32 - 1
        (3, b"\xff\xff\xff\xff\x10", 1),  # 2**32
        (3, b"\xff\xff\xff\xff\x8f\x01", 1),  # six bytes
        (4, b"\x01\x02", 2),
        (4, b"\x01\x02", 3),
        (4, b"\x01\x02\x03", 2),
        (3, b"", 0),
        (3, b"\x00", 0),
        (2, b"\x01\x00" * 9 + b"\x00\x01", 9),  # bit planes, last id's high bit
        (2, b"\x01\x00" * 9 + b"\x00\x02", 9),  # a padding bit
        (2, b"\x01\x00" * 9 + b"\x00", 9),  # half a plane
        (2, b"", 0),
        (2, b"\x00", 0),
    ],
)
def test_packed_ids_edge_cases(code: int, data: bytes, count: int) -> None:
    name = {2: "BIT_PLANES", 3: "VARINT", 4: "DELTA_VARINT"}[code]
    try:
        want: Any = decode_packed(name, "NONE", count, data)
    except DecodeError:
        want = None
    assert columnar._native.packed_ids(code, data, count) == want


def test_bit_planes_are_unpacked_on_first_access_and_only_from_bytes() -> None:
    batch = EventBatch.model_validate(
        {
            "source": {"instance_id": "w"},
            "ts_ns": 1,
            "events": [
                {
                    "event_id": 0,
                    "window_size": 1,
                    "data": {
                        "type": "stored",
                        "parent_hash": None,
                        "blocks": [{"block_hash": b"\x01" * 8, "token_ids": [1, 70000, 3]}],
                    },
                }
            ],
        }
    )
    data = AvroCodec(token_encoding="planes").encode(batch)
    want = b"".join(i.to_bytes(4, "little") for i in (1, 70000, 3))
    lazy = decode_columns_message(data, REGISTRY).columns
    assert (lazy._tokens, lazy._planes is None) == (None, False)
    assert lazy.tokens == want
    assert (lazy._tokens, lazy._planes) == (want, None)
    eager = decode_columns_message(bytearray(data), REGISTRY).columns  # framing copies: bytes
    assert eager.tokens == want
    body = bytearray(data[10:])
    got = columnar._native_columns(memoryview(body), 0, REGISTRY.get(4))  # mutable: unpacked now
    assert got is not None
    assert got[0]._tokens == want
    body[:] = bytes(len(body))  # the record is kept as a copy for to_batch
    assert got[0].to_batch() == batch
    planes_ids = columnar._native.planes_ids
    with pytest.raises(ValueError, match="outside"):
        planes_ids(b"\x00" * 6, 3, 1, 1, 6)
    with pytest.raises(ValueError, match="outside"):
        planes_ids(b"\x00" * 6, -1, 0, 0, 0)
    with pytest.raises(ValueError, match="invalid"):
        planes_ids(b"\x00" * 6 + b"\xf0", 3, 1, 0, 6)
    assert planes_ids(b"\x01\x00" * 3 + b"\x02", 3, 1, 0, 6) == b"".join(
        i.to_bytes(4, "little") for i in (1, 65537, 1)
    )


# ------------------------------------------------------------------------------ stored fields

_STORED_VALUES: dict[str, list[Any]] = {
    "parent_hash": [None, b"\x01" * 7, b"\x01" * 8, b"\x01" * 32, b""],
    "block_count": [0, 1, 2, 3, -1],
    "block_size": [-1, 0, 1, 2, 3],
    "last_block_size": [-1, 0, 1, 2, 3],
    "block_sizes": [None, [], [1], [2, 2], [1, -1], [0, 4], [2**62, 2**62]],
    "cache_level": [-1, 0, 3, 2**31],
    "cache_levels": [None, [], [0], [0, 0], [0, 1], [0, -1], [0, 2**31]],
    "priority": [-1, 0, 100, 101],
    "priorities": [None, [], [35], [35, 35], [0, 101], [-1, 5]],
    "lora_ids": [None, [], [None], [1, None], [None, None, None]],
    "lora_names": [None, [], ["a"], ["a", None]],
    "cache_salts": [None, [], ["s"], [None, "s"]],
    "mm_keys": [
        [],
        [{"block_index": -1, "hash": b"\x00" * 32, "start_offset": 0, "uuid": None}],
        [{"block_index": 0, "hash": b"\x00" * 32, "start_offset": -1, "uuid": "u"}],
        [{"block_index": 1, "hash": b"\x00" * 32, "start_offset": 2**31 - 1, "uuid": None}],
        [
            {"block_index": 1, "hash": b"\x00" * 32, "start_offset": 0, "uuid": None},
            {"block_index": 0, "hash": b"\x00" * 32, "start_offset": 0, "uuid": None},
        ],
    ],
    "token_extra_ids": [
        [],
        [{"block_index": 0, "ids": b"\x00" * 8}],
        [{"block_index": 1, "ids": b"\x00" * 4}],
        [{"block_index": 0, "ids": b""}, {"block_index": 0, "ids": b""}],
        [{"block_index": 2, "ids": b""}],
    ],
    "extra_keys": [
        [],
        [{"block_index": 0, "keys": ["a", 1, {"value": b"b"}, ["x", -2]]}],
        [{"block_index": 1, "keys": []}, {"block_index": 1, "keys": []}],
        [{"block_index": -1, "keys": []}],
    ],
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=st.integers(1, 3),
    tokens=st.integers(1, 3),
    algo_width=st.sampled_from(
        [("v1_block_key", 8), ("v2_sha256", 32), ("new", 8), ("new", 16), ("new", 32)]
    ),
    encoding=st.sampled_from(("v3", "planes", "varint", "delta_varint", "planes+zstd")),
    changes=st.lists(
        st.sampled_from(sorted(_STORED_VALUES)).flatmap(
            lambda k: st.tuples(st.just(k), st.sampled_from(_STORED_VALUES[k]))
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_stored_payload_rules_match_the_reference(
    blocks: int,
    tokens: int,
    algo_width: tuple[str, int],
    encoding: str,
    changes: list[tuple[str, Any]],
) -> None:
    """One stored event whose fields take boundary values: block layouts, per-block columns,
    parent widths, hash widths per algorithm, sparse arrays, against the reference."""
    algo, width = algo_width
    version, encoding = (3, "planes") if encoding == "v3" else (4, encoding)
    batch = EventBatch.model_validate(
        {
            "source": {"instance_id": "w"},
            "ts_ns": 1,
            "events": [
                {
                    "event_id": 0,
                    "window_size": 1 << 40,
                    "hash_algo": algo,
                    "data": {
                        "type": "stored",
                        "parent_hash": None,
                        "blocks": [
                            {"block_hash": bytes([i + 1]) * width, "token_ids": [i] * tokens}
                            for i in range(blocks)
                        ],
                    },
                }
            ],
        },
    )
    writer = REGISTRY.get(version)
    record = batch_to_record(batch, version, token_encoding=encoding)
    stored = record["events"][0]["stored"]
    for key, value in changes:
        stored[key] = value
    buf = io.BytesIO()
    try:
        fastavro.schemaless_writer(buf, writer.parsed, record)
    except Exception:  # the value does not fit the schema's types
        assume(False)
    event(check_same(buf.getvalue(), writer))


_DIFF = [
    None,
    {"old_value": 0, "new_value": 1},
    {"old_value": -1, "new_value": 1},
    {"old_value": 0, "new_value": 101},
    {"old_value": 2**31, "new_value": 0},
]
#: (path below the record, values) of the fields of the other kinds, the events and the source
_FIELDS: list[tuple[tuple[Any, ...], list[Any]]] = [
    (("source", "instance_id"), ["", "x" * 256, "x" * 257, "\u00e9" * 256]),
    (("source", "attention_dp_rank"), [None, -1, 0, 2**31 - 1, 2**31]),
    (("source", "incarnation"), [-1, 0, 2**63 - 1]),
    (("ts_ns",), [-1, 0, 2**63 - 1]),
    (("events", 0, "created", "num_blocks_per_cache_level"), [[], [0], [-1], [1, 2**63 - 1]]),
    (("events", 0, "created", "tokens_per_block"), [-1, 0, 1, 2**31 - 1, 2**31]),
    (("events", 0, "created", "attention_kind"), ["UNKNOWN", "FULL_ATTENTION", "SLIDING_WINDOW"]),
    (("events", 1, "removed", "block_count"), [-1, 0, 1, 2, 3]),
    (("events", 1, "removed", "block_hashes"), [b"", b"\x01" * 8, b"\x01" * 16, b"\x01" * 65]),
    (("events", 1, "removed", "cache_level"), [None, -1, 0, 2**31]),
    (("events", 2, "updated", "block_hash"), [b"", b"\x01" * 8, b"\x01" * 32, b"\x01" * 65]),
    (("events", 2, "updated", "cache_level"), _DIFF),
    (("events", 2, "updated", "priority"), _DIFF),
    (("events", 3, "lost", "first_event_id"), [-1, 0, 2**63 - 1]),
    (("events", 3, "lost", "count"), [-1, 0, 1]),
    (("events", 3, "lost", "reason"), ["", "x" * 1024, "x" * 1025, "\u00e9" * 1024]),
    (("events", 4, "event_id"), [-1, 0, 2**63 - 1]),
    (("events", 4, "window_size"), [-1, 0, 1]),
    (("events", 4, "hash_algo"), ["", "x" * 64, "x" * 65, "v2_sha256", "new"]),
    (("events", 4, "layer_group_id"), [-1, 0, 2**31]),
    (("events", 4, "kind"), ["UNKNOWN", "CREATED", "STORED", "REMOVED", "LOST", "STORED_PACKED"]),
    (("events", 1, "kind"), ["UNKNOWN", "CREATED", "UPDATED", "CLEARED"]),
    (("events", 3, "removed"), [None, {"block_count": 1, "block_hashes": b"\x01" * 8}]),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    version=st.sampled_from((3, 4)),
    changes=st.lists(
        st.sampled_from(range(len(_FIELDS))).flatmap(
            lambda i: st.tuples(st.just(_FIELDS[i][0]), st.sampled_from(_FIELDS[i][1]))
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_event_and_source_rules_match_the_reference(
    version: int, changes: list[tuple[tuple[Any, ...], Any]]
) -> None:
    """A batch of created, removed, updated, lost and cleared events whose fields take
    boundary values, against the reference."""
    h = b"\x02" * 8
    batch = EventBatch.model_validate(
        {
            "source": {"instance_id": "w", "attention_dp_rank": 1, "incarnation": 2},
            "ts_ns": 3,
            "events": [
                {
                    "event_id": 0,
                    "window_size": 1,
                    "data": {
                        "type": "created",
                        "num_blocks_per_cache_level": [4, 2],
                        "tokens_per_block": 16,
                    },
                },
                {
                    "event_id": 1,
                    "window_size": 1,
                    "data": {"type": "removed", "block_hashes": [h, h]},
                },
                {
                    "event_id": 2,
                    "window_size": 1,
                    "data": {
                        "type": "updated",
                        "block_hash": h,
                        "cache_level": {"old_value": 0, "new_value": 1},
                    },
                },
                {
                    "event_id": 3,
                    "window_size": 1,
                    "data": {"type": "lost", "first_event_id": 9, "count": 2},
                },
                {"event_id": 4, "window_size": 1, "data": {"type": "cleared"}},
            ],
        }
    )
    writer = REGISTRY.get(version)
    record = batch_to_record(batch, version)
    for path, value in changes:
        _set(record, path, value)
    buf = io.BytesIO()
    try:
        fastavro.schemaless_writer(buf, writer.parsed, record)
    except Exception:  # the value does not fit the schema's types (STORED_PACKED in v3)
        assume(False)
    event(check_same(buf.getvalue(), writer))


# ------------------------------------------------------------------------------ containers


def _state(items: list[Any]) -> dict[str, Any]:
    idx = PrefixIndex()
    idx.apply_many(items)
    idx.check()
    return idx.canonical_state()


def _read_all(data: bytes) -> tuple[Any, ...]:
    try:
        reader = ColumnarContainerReader(io.BytesIO(data), tolerate_torn_tail=True)
        got: list[ColumnBatch] = [*reader]
    except DecodeError as exc:
        return ("error", str(exc))
    return (
        [canon(c) for c in got],
        reader.skipped,
        (reader.valid_end, reader.ignored_bytes, reader.blocks_read, reader.torn_reason),
        _state(got),
    )


@PROPS
@given(
    stream=st.lists(batches(max_events=4), min_size=1, max_size=5),
    version=st.sampled_from((3, 4)),
    sync_interval=st.sampled_from((1, 3, 100)),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), max_size=2),
)
def test_damaged_containers_give_the_same_columns_and_index(
    stream: list[EventBatch],
    version: int,
    sync_interval: int,
    cut: int | None,
    flips: list[tuple[int, int]],
) -> None:
    """Torn and bit-flipped container files with one or many records per block: the native
    and the reference reader stop at the same block, give identical columns and skipped
    events, and build identical indexes with apply_many."""
    buf = io.BytesIO()
    try:
        write_container(
            buf, stream, schema_version=version, lossy=True, sync_interval=sync_interval
        )
    except EncodeError:
        assume(False)
    data = bytearray(buf.getvalue())
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    got = _read_all(bytes(data))
    with reference_only():
        want = _read_all(bytes(data))
    assert got == want


def test_a_record_the_native_decoder_declines_is_read_by_the_reference_in_a_block() -> None:
    """One block, three records, the middle one with an instance id that is not UTF-8: the
    C decoder declines it, the reference reads it from the right offset and rejects it."""
    stream = [
        EventBatch.model_validate({"source": {"instance_id": f"w{i}"}, "ts_ns": i, "events": []})
        for i in range(3)
    ]
    buf = io.BytesIO()
    write_container(buf, stream, sync_interval=100, codec="null")
    got = [c.instance_id for c in ColumnarContainerReader(io.BytesIO(buf.getvalue()))]
    assert got == ["w0", "w1", "w2"]
    bad = buf.getvalue().replace(b"\x04w1", b"\x04w\xff")
    with pytest.raises(DecodeError, match="record 1 of the block"):
        list(ColumnarContainerReader(io.BytesIO(bad)))


# ------------------------------------------------------------------------------ switches


def test_no_native_env_leaves_the_reference_only() -> None:
    code = "import kvstream.codec.columnar as c; print(c.NATIVE)"
    env = {**os.environ, "KVSTREAM_NO_NATIVE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


_DEV_FUZZ = """
import io, random, fastavro
from test_codec_strategies import batches
from test_columnar_native import REGISTRY, _mutate, check_same
from hypothesis import given, settings, strategies as st, HealthCheck
from kvstream.codec.records import batch_to_record

@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(batch=batches(max_events=4), seed=st.integers(0, 2**32))
def fuzz(batch, seed):
    w = REGISTRY.get(4)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, w.parsed, batch_to_record(batch, 4))
    rng = random.Random(seed)
    for _ in range(200):
        body = bytearray(buf.getvalue())
        for _ in range(rng.randrange(1, 4)):
            body = _mutate(body, rng)
        check_same(bytes(body), w)

fuzz()
print("ok")
"""


def test_fuzz_under_python_dev_mode() -> None:
    """The debug allocator and dev-mode checks see no over-read or refcount error."""
    tests = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-X", "dev", "-c", _DEV_FUZZ],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        cwd=tests,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
