"""The C column encoder (``_tokens_native.encode_columns``) against its Python twin.

Every event kind, every schema version and token encoding, ``lossy`` on and off: the bytes
``encode_columns_body`` writes with the C encoder equal the Python twin's
(``column_encoder._encode_columns_py``) and the model path's, and so do the errors. The C
encoder must write every valid publisher column batch itself (never silently hand it to
Python): it declines (returns None, so the Python path decides) only where the Python path
raises, or for columns that break the columns' contract.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline_helpers import small_cache_manager, small_chats
from test_codec_strategies import batches, v1_batches

from kvstream.codec import column_encoder
from kvstream.codec.column_encoder import encode_columns_body
from kvstream.codec.encoder import encode_batch_body
from kvstream.codec.tokens import TOKEN_ENCODINGS
from kvstream.errors import EncodeError
from kvstream.events.columns import ColumnBatch, publish_columns
from kvstream.events.model import EventBatch

pytestmark = pytest.mark.skipif(
    column_encoder._NATIVE_ENCODE is None,
    reason="the C column encoder is not built (or KVSTREAM_NO_NATIVE)",
)

#: (version, token encoding) pairs encode_columns_body accepts.
SETTINGS = [(v, "planes") for v in (1, 2, 3)] + [(4, enc) for enc in TOKEN_ENCODINGS]
_PREFIX = b"\xc3\x01" + bytes(range(8))


class _python_only:
    def __enter__(self) -> None:
        self.saved = column_encoder._NATIVE_ENCODE
        column_encoder._NATIVE_ENCODE = None

    def __exit__(self, *exc: object) -> None:
        column_encoder._NATIVE_ENCODE = self.saved


def _outcome(fn: Any, arg: Any, version: int, lossy: bool, enc: str) -> tuple[str, Any]:
    try:
        return "bytes", fn(arg, version, lossy=lossy, prefix=_PREFIX, token_encoding=enc)
    except EncodeError as exc:
        return "error", str(exc)


def _check(cols: ColumnBatch, version: int, lossy: bool, enc: str, model: Any = None) -> None:
    """Same bytes or the same error with and without C (and as the model path, given the
    model); valid columns are written in C."""
    native = _outcome(encode_columns_body, cols, version, lossy, enc)
    with _python_only():
        python = _outcome(encode_columns_body, cols, version, lossy, enc)
    assert native == python
    if model is not None:
        assert _outcome(encode_batch_body, model, version, lossy, enc) == python
    direct_enc = enc if version >= 4 else "planes"
    assert column_encoder._NATIVE_ENCODE is not None
    direct = column_encoder._NATIVE_ENCODE(_PREFIX, cols, version, direct_enc, lossy)
    if python[0] == "bytes":
        assert direct == python[1], "the C encoder declined valid columns"
    else:
        assert direct is None, "the C encoder wrote what the Python path refuses"


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
    _check(publish_columns(batch), version, lossy, enc, batch)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=v1_batches(max_events=8), lossy=st.booleans())
def test_v1_batches_write_the_python_bytes(batch: EventBatch, lossy: bool) -> None:
    _check(publish_columns(batch), 1, lossy, "planes", batch)


def _cache_manager_batches() -> Iterator[tuple[ColumnBatch, EventBatch]]:
    """The columns of a metadata-only cache manager's deferred batches (the emitter's hand-off,
    ``DeferredBatch.columns``) and their models."""
    mgr = small_cache_manager("e", 1, incarnation=3)
    for req in small_chats(4, 5):
        mgr.add_request(req.request_id, req.prompt)
        mgr.append_tokens(req.request_id, req.output)
        mgr.free_request(req.request_id)
        deferred = mgr.flush_events_deferred()
        if deferred is not None:
            cols = deferred.columns()
            yield cols, deferred.materialize()


def test_cache_manager_deferred_columns_write_the_python_bytes() -> None:
    seen = 0
    for cols, model in _cache_manager_batches():
        seen += 1
        for version, enc in ((4, "auto"), (4, "planes"), (4, "varint"), (3, "planes")):
            _check(cols, version, False, enc, model)
        _check(cols, 1, True, "planes", model)
    assert seen


def _sample_columns() -> tuple[ColumnBatch, int]:
    """Publisher columns of a sample batch holding every kind, and a stored event's index."""
    from kvstream.codec.samples import sample_batches

    batch = max(sample_batches(), key=lambda b: len({ev.data.type for ev in b.events}))
    cols = publish_columns(batch)
    cols._batch = None  # the columns alone, as a bridge hands them over
    return cols, cols.kinds.index(1)


def _odd(change: Any) -> ColumnBatch:
    cols, i = _sample_columns()
    change(cols, i)
    return cols


def _set(cols: ColumnBatch, name: str, value: Any) -> None:
    setattr(cols, name, value)


_ODD = [
    lambda c, i: c.kinds.__setitem__(i, 9),  # an unknown kind code
    lambda c, i: c.kinds.__setitem__(i, True),  # bool is not a kind code
    lambda c, i: c.event_ids.__setitem__(i, 2**64),  # does not fit a long
    lambda c, i: c.event_ids.__setitem__(i, "3"),
    lambda c, i: c.window_sizes.pop(),  # columns of different lengths
    lambda c, i: c.hash_algos.__setitem__(i, "\udc80"),  # not UTF-8 encodable
    lambda c, i: c.payloads.__setitem__(i, c.payloads[i] + (None,)),  # a fifth item
    lambda c, i: c.payloads.__setitem__(i, (None, [bytearray(8)], 0, 16)),
    lambda c, i: c.stored_extra.__setitem__(0, ([], None)),  # no block sizes
    lambda c, i: c.stored_extra.__setitem__(0, ([16, -1], None)),
    lambda c, i: c.stored_extra.clear(),  # fewer extras than stored events
    lambda c, i: _set(c, "instance_id", b"w"),
    lambda c, i: _set(c, "ts_ns", -(2**70)),
    lambda c, i: _set(c, "event_ids", tuple(c.event_ids)),  # a tuple is read as well
    lambda c, i: _set(c, "kinds", iter(c.kinds)),  # not a list: the Python path decides
]


@pytest.mark.parametrize("change", range(len(_ODD)))
@pytest.mark.parametrize("setting", [(4, "auto"), (2, "planes"), (1, "planes")])
@pytest.mark.parametrize("lossy", [False, True])
def test_odd_columns_get_the_python_result(
    change: int, setting: tuple[int, str], lossy: bool
) -> None:
    version, enc = setting
    native = _outcome(encode_columns_body, _odd(_ODD[change]), version, lossy, enc)
    with _python_only():
        python = _outcome(encode_columns_body, _odd(_ODD[change]), version, lossy, enc)
    assert native == python


def test_the_attribute_helper_error_is_the_python_paths() -> None:
    cols, i = _sample_columns()
    assert cols.stored_extra is not None
    sizes, _ = cols.stored_extra[0]
    n = len(cols.payloads[i][1])
    bad_attrs = ((0,) * n, (0,) * n, (None,) * n, (None,) * n, (None,) * n, (None,) * n, ((),) * n)
    cols.stored_extra[0] = (sizes, bad_attrs)  # seven columns, not eight
    with pytest.raises(EncodeError):
        encode_columns_body(cols, 4)
    with _python_only(), pytest.raises(EncodeError):
        encode_columns_body(cols, 4)
