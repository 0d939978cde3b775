"""The C batch body encoder (``_tokens_native.encode_body``) against its Python twin.

Every event kind, every schema version and token encoding, ``lossy`` on and off: the bytes
``encode_batch_body`` writes with the C encoder equal the Python path's, and so do the errors.
The C encoder must write every valid batch itself (never silently hand it to Python), read
the cache manager's token views without cutting them, and decline (return None, so the
Python path decides) whatever the models would not hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline_helpers import cache_batches
from test_codec_strategies import batches, v1_batches

from kvstream._types import TokenIds, TokenIdsView
from kvstream.codec import AvroCodec, encoder
from kvstream.codec.downgrade import events_for_version
from kvstream.codec.encoder import encode_batch_body
from kvstream.codec.tokens import TOKEN_ENCODINGS
from kvstream.errors import EncodeError
from kvstream.events.model import (
    EventBatch,
    KVCacheEvent,
    Removed,
    SourceId,
    Stored,
    StoredBlock,
)

pytestmark = pytest.mark.skipif(
    encoder._NATIVE_ENCODE is None, reason="the C encoder is not built (or KVSTREAM_NO_NATIVE)"
)

#: (version, token encoding) pairs encode_batch_body accepts.
SETTINGS = [(v, "planes") for v in (1, 2, 3)] + [(4, enc) for enc in TOKEN_ENCODINGS]
_PREFIX = b"\xc3\x01" + bytes(range(8))


def _python_only() -> Any:
    class _Off:
        def __enter__(self) -> None:
            self.saved = encoder._NATIVE_ENCODE
            encoder._NATIVE_ENCODE = None

        def __exit__(self, *exc: object) -> None:
            encoder._NATIVE_ENCODE = self.saved

    return _Off()


def _outcome(batch: EventBatch, version: int, lossy: bool, enc: str) -> tuple[str, Any]:
    try:
        return "bytes", encode_batch_body(
            batch, version, lossy=lossy, prefix=_PREFIX, token_encoding=enc
        )
    except EncodeError as exc:
        return "error", str(exc)


def _check(batch: EventBatch, version: int, lossy: bool, enc: str) -> None:
    """Same bytes or the same error with and without C; valid batches are written in C."""
    native = _outcome(batch, version, lossy, enc)
    with _python_only():
        python = _outcome(batch, version, lossy, enc)
    assert native == python
    if python[0] == "bytes":
        events = events_for_version(batch, version, lossy=lossy)
        assert encoder._NATIVE_ENCODE is not None
        direct = encoder._NATIVE_ENCODE(_PREFIX, batch, events, version, enc)
        assert direct == python[1], "the C encoder declined a valid batch"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    batch=batches(max_events=8),
    setting=st.sampled_from(SETTINGS),
    lossy=st.booleans(),
)
def test_every_kind_and_version_writes_the_python_bytes(
    batch: EventBatch, setting: tuple[int, str], lossy: bool
) -> None:
    version, enc = setting
    _check(batch, version, lossy, enc)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=v1_batches(max_events=8))
def test_v1_batches_write_the_python_bytes(batch: EventBatch) -> None:
    _check(batch, 1, False, "planes")


def _views(n_blocks: int, per_block: int, first: int = 0) -> tuple[TokenIdsView, ...]:
    packed = TokenIds(range(first, first + n_blocks * per_block)).raw
    return TokenIdsView.of_run(packed, n_blocks)


def _stored_event(event_id: int, tokens: Iterator[TokenIds] | tuple[TokenIds, ...]) -> Any:
    blocks = tuple(
        StoredBlock(block_hash=bytes([event_id, i]) * 4, token_ids=t) for i, t in enumerate(tokens)
    )
    return KVCacheEvent(
        event_id=event_id,
        hash_algo="v2_sha256_64",
        window_size=4096,
        data=Stored(parent_hash=None, blocks=blocks),
    )


class _MyTokens(TokenIds):
    """A TokenIds subclass that is not a view: read through ``raw``."""

    __slots__ = ()


def _view_batch() -> tuple[EventBatch, tuple[TokenIdsView, ...]]:
    unread = _views(4, 16)
    cut = _views(3, 16, first=1000)
    _ = cut[1].raw  # this one has cut its own bytes (its run now raises)
    mixed = (cut[0], TokenIds(range(5)), cut[1], _MyTokens(range(7)), cut[2])
    batch = EventBatch(
        source=SourceId(instance_id="w", attention_dp_rank=None),
        ts_ns=1,
        events=(_stored_event(0, unread), _stored_event(1, mixed)),
    )
    return batch, unread


def test_chain_views_are_read_without_cutting_them() -> None:
    batch, unread = _view_batch()
    body = encode_batch_body(batch, 4)
    for i, view in enumerate(unread):  # the C encoder read them through run/run_index
        assert view.run[1] == 64
        assert view.run_index == i
    with _python_only():
        assert encode_batch_body(_view_batch()[0], 4) == body
    for version, enc in SETTINGS:
        _check(_view_batch()[0], version, False, enc)
    assert AvroCodec().decode(AvroCodec().encode(batch)) == batch


def test_cache_manager_batches_write_the_python_bytes() -> None:
    got = cache_batches("engine-0", 1, conversations=4, seed=3)
    assert got
    assert any(
        isinstance(b, TokenIdsView)
        for batch in got
        for ev in batch.events
        if isinstance(ev.data, Stored)
        for b in (blk.token_ids for blk in ev.data.blocks)
    )
    for batch in got:
        for version, enc in ((4, "auto"), (4, "planes"), (3, "planes"), (1, "planes")):
            _check(batch, version, True, enc)


def _construct(**fields: Any) -> Any:
    """A batch built without validation (model_construct), so it can hold what models reject."""
    event_fields: dict[str, Any] = {
        "event_id": 3,
        "hash_algo": "v1_block_key",
        "layer_group_id": 0,
        "window_size": 64,
        "data": Removed(block_hashes=(b"\x01" * 8,)),
    }
    event_fields.update(fields)
    event = KVCacheEvent.model_construct(**event_fields)
    return EventBatch.model_construct(
        source=SourceId(instance_id="w"), ts_ns=5, schema_version=4, events=(event,)
    )


_ODD = [
    {"event_id": "3"},  # not an int
    {"event_id": 2**64},  # does not fit a long
    {"event_id": True},  # bool is not a model int
    {"window_size": 2.5},
    {"hash_algo": "\udc80"},  # not UTF-8 encodable
    {"hash_algo": None},
    {"data": object()},  # not an event payload
    {"data": Removed.model_construct(block_hashes=[b"\x01" * 8])},  # a list, not a tuple
    {"data": Removed.model_construct(block_hashes=(bytearray(8),))},
    {"data": Stored.model_construct(parent_hash=None, blocks=())},
    {
        "data": Stored.model_construct(
            parent_hash=None,
            blocks=(StoredBlock.model_construct(block_hash=b"\x01" * 8, token_ids=[1, 2]),),
        )
    },
    {
        "data": Stored.model_construct(
            parent_hash=None,
            blocks=(
                StoredBlock.model_construct(
                    block_hash=b"\x01" * 8, token_ids=TokenIds([1]), extra_keys=(1.5,)
                ),
            ),
        )
    },
]


@pytest.mark.parametrize("fields", _ODD)
def test_what_models_would_reject_gets_the_python_outcome(fields: dict[str, Any]) -> None:
    batch = _construct(**fields)
    for version, enc in ((4, "auto"), (2, "planes")):
        native = _outcome(batch, version, True, enc)
        with _python_only():
            assert native == _outcome(batch, version, True, enc)


def test_declines_instead_of_guessing() -> None:
    assert encoder._NATIVE_ENCODE is not None
    batch = _construct(event_id="3")
    events = batch.events
    assert encoder._NATIVE_ENCODE(b"", batch, events, 4, "auto") is None
    assert encoder._NATIVE_ENCODE(b"", batch, events, 9, "auto") is None  # unknown version
    with pytest.raises(EncodeError, match="cannot encode batch"):
        encode_batch_body(batch, 4)


def test_an_error_of_the_attribute_helper_is_the_python_one() -> None:
    bad = StoredBlock.model_construct(
        block_hash=b"\x01" * 8, token_ids=TokenIds([1]), extra_keys=(1.5,)
    )
    batch = _construct(data=Stored.model_construct(parent_hash=None, blocks=(bad,)))
    with pytest.raises(EncodeError, match=r"extra key item 1\.5 is not a str, int or bytes"):
        encode_batch_body(batch, 4)
    with _python_only(), pytest.raises(EncodeError, match=r"extra key item 1\.5"):
        encode_batch_body(batch, 4)
