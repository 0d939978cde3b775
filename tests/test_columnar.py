"""The columnar decoder (kvstream.codec.columnar) against the model decoder: the same batches,
the same skipped events, the same rejections, for valid records, mutated ones and damaged
container files."""

from __future__ import annotations

import io
from typing import Any

import fastavro
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from test_codec_strategies import batches

from kvstream.codec import AvroCodec, read_container, schema_registry, write_container
from kvstream.codec.columnar import (
    ColumnarContainerReader,
    decode_columns_body,
    decode_columns_message,
    record_columns,
)
from kvstream.codec.decoder import decode_body
from kvstream.codec.downgrade import WRITABLE_VERSIONS
from kvstream.codec.records import batch_to_record
from kvstream.errors import DecodeError, EncodeError
from kvstream.events.columns import STORED, ColumnBatch
from kvstream.events.model import EventBatch
from kvstream.index import PrefixIndex

REGISTRY = schema_registry()
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same_columns(a: ColumnBatch, b: ColumnBatch) -> None:
    """Every column equal (stored payloads compared without the model blocks)."""
    assert (a.instance_id, a.attention_dp_rank, a.incarnation, a.ts_ns) == (
        b.instance_id,
        b.attention_dp_rank,
        b.incarnation,
        b.ts_ns,
    )
    assert a.event_ids == b.event_ids
    assert a.kinds == b.kinds
    assert a.hash_algos == b.hash_algos
    assert a.group_ids == b.group_ids
    assert a.window_sizes == b.window_sizes
    for k, pa, pb in zip(a.kinds, a.payloads, b.payloads, strict=True):
        if k == STORED:
            assert pa[:4] == pb[:4]
        else:
            assert pa == pb


@PROPS
@given(batch=batches())
def test_columns_of_every_version_equal_the_model(batch: EventBatch) -> None:
    for version in WRITABLE_VERSIONS:
        try:
            data = AvroCodec(version, lossy=True).encode(batch)
        except EncodeError:
            continue
        want = AvroCodec().decode_result(data)
        got = decode_columns_message(data, REGISTRY)
        assert got.writer_version == want.writer_version == version
        assert got.skipped == want.skipped
        assert got.batch == want.batch
        same_columns(got.columns, ColumnBatch.from_batch(want.batch))
        raw = b"".join(
            b.token_ids.raw
            for ev in want.batch.events
            if ev.data.type == "stored"
            for b in ev.data.blocks  # type: ignore[union-attr]
        )
        assert got.columns.tokens == raw


def test_confluent_framing_and_unknown_schemas() -> None:
    from test_codec_strategies import ALGOS  # noqa: F401 - the strategies' module is shared

    batch = EventBatch.model_validate({"source": {"instance_id": "w"}, "ts_ns": 1, "events": []})
    codec = AvroCodec()
    data = codec.encode_confluent(batch, 7)
    assert decode_columns_message(data, REGISTRY, schema_ids={7: codec.schema_version}).batch == (
        codec.decode_confluent(data, {7: codec.schema_version})
    )
    assert decode_columns_message(data, REGISTRY, header_version=codec.schema_version).batch
    with pytest.raises(DecodeError, match="no mapping"):
        decode_columns_message(data, REGISTRY)
    with pytest.raises(DecodeError):
        decode_columns_message(b"\xc3\x01" + b"\x00" * 8, REGISTRY)


# ------------------------------------------------------------------------ mutated records

_INTS = [-1, 0, 1, 3, 100, 101, 2**31 - 1, 2**31, -(2**31), 2**63 - 1, -(2**63)]
_STRS = ["", "x", "x" * 65, "x" * 257, "x" * 1025, "UNKNOWN", "STORED", "LOST", "FULL_ATTENTION"]
_BYTES = [b"", b"\x01" * 7, b"\x01" * 8, b"\x01" * 16, b"\x01" * 32, b"\x01" * 33, b"\x01" * 65]


def _leaves(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    out: list[tuple[tuple[Any, ...], Any]] = []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _leaves(v, (*path, k))
    elif isinstance(node, list):
        out.append((path, node))
        for i, v in enumerate(node):
            out += _leaves(v, (*path, i))
    else:
        out.append((path, node))
    return out


def _set(node: Any, path: tuple[Any, ...], value: Any) -> None:
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value


@PROPS
@given(batch=batches(max_events=4), data=st.data())
def test_mutated_records_are_rejected_alike(batch: EventBatch, data: st.DataObject) -> None:
    """A record with a field set to a boundary value (out of range, wrong width, wrong
    length, wrong kind): both decoders reject it, or both return the same batch."""
    version = max(WRITABLE_VERSIONS)
    schema = REGISTRY.get(version)
    record = batch_to_record(batch, version)
    for _ in range(data.draw(st.integers(1, 2))):
        leaves = _leaves(record)
        path, old = data.draw(st.sampled_from(leaves))
        assume(path)
        if isinstance(old, bool) or old is None:
            value: Any = data.draw(st.sampled_from([None, 0, 1, "x", b"\x01" * 8]))
        elif isinstance(old, int):
            value = data.draw(st.sampled_from(_INTS))
        elif isinstance(old, str):
            value = data.draw(st.sampled_from(_STRS))
        elif isinstance(old, bytes):
            value = data.draw(st.sampled_from(_BYTES))
        elif isinstance(old, list):
            value = data.draw(st.sampled_from([[], old[:-1], old + old[-1:]])) if old else []
        else:
            value = old
        _set(record, path, value)
    buf = io.BytesIO()
    try:
        fastavro.schemaless_writer(buf, schema.parsed, record)
    except Exception:  # the mutation does not fit the schema's types: nothing to decode
        assume(False)
    body = buf.getvalue()
    try:
        want: Any = decode_body(body, schema, REGISTRY.current)
    except DecodeError as exc:
        want = exc
    try:
        got: Any = decode_columns_body(body, schema, REGISTRY.current)
    except DecodeError as exc:
        got = exc
    if isinstance(want, DecodeError):
        event("rejected")
        assert isinstance(got, DecodeError), f"columns accepted what the model rejects: {want}"
        return
    event("accepted")
    assert not isinstance(got, DecodeError), f"columns rejected a valid record: {got}"
    assert got.batch == want.batch
    assert got.skipped == want.skipped
    same_columns(got.columns, ColumnBatch.from_batch(want.batch))


def test_record_not_of_the_reader_schema() -> None:
    with pytest.raises(DecodeError, match="shape"):
        record_columns(
            {"tokens": {"count": 0, "high_bits": 0, "low16": b"", "high_planes": b""}}, 3
        )


# ------------------------------------------------------------------ damaged container files


def _apply_all(items: list[Any]) -> dict[str, Any]:
    idx = PrefixIndex()
    for b in items:
        idx.apply(b)
    idx.check()
    return idx.canonical_state()


@PROPS
@given(
    stream=st.lists(batches(max_events=4), min_size=1, max_size=5),
    cut=st.one_of(st.none(), st.integers(0, 10**6)),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), max_size=2),
)
def test_damaged_containers_give_the_same_index(
    stream: list[EventBatch], cut: int | None, flips: list[tuple[int, int]]
) -> None:
    """Torn and bit-flipped container files: the columnar and the model reader stop at the
    same block, skip the same events, and build identical indexes."""
    buf = io.BytesIO()
    write_container(buf, stream, sync_interval=1)  # one block per batch
    data = bytearray(buf.getvalue())
    for pos, bit in flips:
        data[pos % len(data)] ^= 1 << bit
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    try:
        model = read_container(io.BytesIO(bytes(data)), tolerate_torn_tail=True)
        want = list(model)
    except DecodeError:  # a damaged header: both refuse the file
        with pytest.raises(DecodeError):
            list(ColumnarContainerReader(io.BytesIO(bytes(data)), tolerate_torn_tail=True))
        return
    cols = ColumnarContainerReader(io.BytesIO(bytes(data)), tolerate_torn_tail=True)
    got = list(cols)
    assert [c.to_batch() for c in got] == want
    assert (cols.valid_end, cols.ignored_bytes, cols.blocks_read) == (
        model.valid_end,
        model.ignored_bytes,
        model.blocks_read,
    )
    assert (cols.torn_reason is None) == (model.torn_reason is None)
    assert cols.skipped == model.skipped
    assert _apply_all(got) == _apply_all(want)


def test_a_negative_mm_key_block_index_is_rejected_by_both_decoders() -> None:
    """Found by test_mutated_records_are_rejected_alike: block_index -1 passed the "non-
    decreasing from -1" check, and the model decoder then gave the key to the last block
    (Python's negative index) where another key overwrote it: a key silently dropped."""
    from kvstream.events.model import KVCacheEvent, MmKey, SourceId, Stored, StoredBlock

    key = (MmKey(hash=b"\0" * 32, start_offset=0),)
    blocks = tuple(StoredBlock(block_hash=b"\0" * 8, token_ids=t, mm_keys=key) for t in ([1], [2]))
    batch = EventBatch(
        source=SourceId(instance_id="0", incarnation=0),
        ts_ns=0,
        events=(
            KVCacheEvent(
                event_id=0,
                hash_algo="v1_block_key",
                layer_group_id=0,
                window_size=1,
                data=Stored(parent_hash=None, blocks=blocks),
            ),
        ),
    )
    version = max(WRITABLE_VERSIONS)
    schema = REGISTRY.get(version)
    record = batch_to_record(batch, version)
    record["events"][0]["stored"]["mm_keys"][0]["block_index"] = -1
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, schema.parsed, record)
    for decode in (decode_body, decode_columns_body):
        with pytest.raises(DecodeError, match="block_index -1"):
            decode(buf.getvalue(), schema, REGISTRY.current)
