"""The columnar publish path (``kvstream.codec.column_encoder``) against the model path: for any
valid batch, every schema version, token encoding and ``lossy`` setting, the columns of the
batch encode to exactly the bytes the model encoder writes, or both raise EncodeError; the
columns build the same validated model back; values the model refuses are refused by the
columns' model too."""

from __future__ import annotations

import io
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_strategies import batches, v1_batches

from kvstream.codec import AvroCodec, ContainerWriter, read_container
from kvstream.codec.column_encoder import encode_columns_body
from kvstream.codec.encoder import ENCODED_VERSIONS, encode_batch_body
from kvstream.codec.tokens import TOKEN_ENCODINGS
from kvstream.errors import DecodeError, EncodeError, EventValidationError
from kvstream.events.columns import STORED, ColumnBatch, model_of_columns, publish_columns
from kvstream.events.model import EventBatch

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _both(batch: EventBatch, version: int, lossy: bool, encoding: str) -> tuple[Any, Any]:
    def run(fn: Any, arg: Any) -> Any:
        try:
            return fn(arg, version, lossy=lossy, prefix=b"P", token_encoding=encoding)
        except EncodeError as exc:
            return ("EncodeError", str(exc))

    return run(encode_batch_body, batch), run(encode_columns_body, publish_columns(batch))


@PROPS
@given(
    batch=st.one_of(batches(), v1_batches()),
    version=st.sampled_from(ENCODED_VERSIONS),
    lossy=st.booleans(),
    encoding=st.sampled_from(TOKEN_ENCODINGS),
)
def test_columns_encode_byte_identical_to_the_model(
    batch: EventBatch, version: int, lossy: bool, encoding: str
) -> None:
    want, got = _both(batch, version, lossy, encoding)
    assert got == want


@PROPS
@given(batch=batches())
def test_columns_build_the_same_model(batch: EventBatch) -> None:
    cols = publish_columns(batch)
    assert cols.to_batch() is batch
    assert model_of_columns(cols) == batch
    assert len(cols.tokens) == 4 * sum(
        len(b.token_ids) for ev in batch.events if ev.data.type == "stored" for b in ev.data.blocks
    )


@PROPS
@given(batch=batches())
def test_codec_encodes_columns_as_the_model(batch: EventBatch) -> None:
    codec = AvroCodec()
    assert codec.encode(publish_columns(batch)) == codec.encode(batch)
    assert codec.encode_confluent(publish_columns(batch), 7) == codec.encode_confluent(batch, 7)
    # columns a consumer built (with the model's blocks) go through their model
    assert codec.encode(ColumnBatch.from_batch(batch)) == codec.encode(batch)


def test_every_kind_and_version_is_exercised() -> None:
    from kvstream.codec.samples import sample_batches

    for batch in sample_batches():
        for version in ENCODED_VERSIONS:
            want, got = _both(batch, version, True, "auto")
            assert got == want


def _stored_columns(batch: EventBatch) -> ColumnBatch:
    cols = publish_columns(batch)
    cols._batch = None  # the columns alone, as a bridge hands them over
    return cols


def test_values_the_model_refuses_are_refused_from_columns() -> None:
    from kvstream.codec.samples import sample_batches

    batch = next(b for b in sample_batches() if any(ev.data.type == "stored" for ev in b.events))
    i = next(i for i, ev in enumerate(batch.events) if ev.data.type == "stored")
    cols = _stored_columns(batch)
    assert cols.kinds[i] == STORED
    parent, hashes, level, first = cols.payloads[i]
    cols.payloads[i] = (parent, [h + b"\x00" for h in hashes], level, first)  # wrong width
    with pytest.raises(EventValidationError):
        cols.to_batch()
    cols = _stored_columns(batch)
    cols.tokens = cols.tokens[:-4]  # a token id short
    with pytest.raises((EventValidationError, DecodeError)):
        cols.to_batch()
    cols = _stored_columns(batch)
    cols.stored_extra = None
    with pytest.raises(DecodeError):
        cols.to_batch()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch_list=st.lists(batches(), min_size=1, max_size=4),
    version=st.sampled_from(ENCODED_VERSIONS),
)
def test_container_blocks_from_columns_equal_the_model(
    batch_list: list[EventBatch], version: int
) -> None:
    from kvstream.codec.container import ContainerEncoder
    from kvstream.codec.schemas import schema_registry

    enc = ContainerEncoder(schema_registry().get(version), "null", b"s" * 16, lossy=True)
    want = enc.block(batch_list)
    assert enc.block([publish_columns(b) for b in batch_list]) == want
    written = io.BytesIO()
    with ContainerWriter(written, schema_version=version, lossy=True) as w:
        w.write_many(publish_columns(b) for b in batch_list)
    assert [*read_container(io.BytesIO(written.getvalue()))] == [_v(b, version) for b in batch_list]


def _v(batch: EventBatch, version: int) -> EventBatch:
    """What reading ``batch`` back from a file of schema ``version`` gives."""
    codec = AvroCodec(version, lossy=True)
    return codec.decode(codec.encode(batch))
