"""``ColumnBatch.from_batch`` builds the columns of a batch of only ``stored`` and
``removed`` events in C (``model_columns`` of the codec extension, what
``PrefixIndex.apply`` does for every batch an emitter hands the index); the Python loop is the
reference: both give the same slots, payload objects included, and any other batch is left
to the Python loop."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec_strategies import batches, events

from kvstream.events import columns as columnar
from kvstream.events.columns import REMOVED, STORED, ColumnBatch
from kvstream.events.model import EventBatch, KVCacheEvent, Removed, SourceId, Stored

pytestmark = pytest.mark.skipif(
    columnar.native_model_columns() is None, reason="the C extension is not built"
)


def _slots(c: ColumnBatch) -> dict[str, Any]:
    return {n: getattr(c, n) for n in ColumnBatch.__slots__}


def _python(batch: EventBatch, monkeypatch: pytest.MonkeyPatch) -> ColumnBatch:
    with monkeypatch.context() as m:
        m.setattr(columnar, "_model_columns", None)
        return ColumnBatch.from_batch(batch)


def _batch(evs: list[KVCacheEvent]) -> EventBatch:
    return EventBatch(source=SourceId(instance_id="w", incarnation=3), ts_ns=5, events=tuple(evs))


def _same(got: ColumnBatch, want: ColumnBatch) -> None:
    assert _slots(got) == _slots(want)
    for kind, a, b in zip(got.kinds, got.payloads, want.payloads, strict=True):
        if kind == STORED:  # the model's own parent hash and blocks, as the reference keeps
            assert a[0] is b[0]
            assert a[4] is b[4]


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(evs=st.lists(events(kinds=("stored", "removed")), max_size=6))
def test_stored_and_removed_batches_equal_the_python_loop(
    evs: list[KVCacheEvent], monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = _batch(evs)
    calls: list[Any] = []
    real = columnar._model_columns

    def spy(*args: Any) -> Any:
        out = real(*args)
        calls.append(out)
        return out

    monkeypatch.setattr(columnar, "_model_columns", spy)
    got = ColumnBatch.from_batch(batch)
    assert calls  # the C loop built it
    assert calls[0] is not None
    _same(got, _python(batch, monkeypatch))
    assert got.to_batch() is batch


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(batch=batches())
def test_any_batch_equals_the_python_loop(
    batch: EventBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    kinds = {type(e.data) for e in batch.events}
    built = columnar._model_columns(batch.events, Stored, Removed, STORED, REMOVED)
    # declined exactly when some event is neither stored nor removed
    assert (built is None) == bool(kinds - {Stored, Removed})
    _same(ColumnBatch.from_batch(batch), _python(batch, monkeypatch))


def test_errors_propagate() -> None:
    class Boom:
        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(name)

    with pytest.raises(RuntimeError, match="data"):
        columnar._model_columns((Boom(),), Stored, Removed, STORED, REMOVED)
    with pytest.raises(TypeError):
        columnar._model_columns([], Stored, Removed, STORED, REMOVED)  # events must be a tuple


def test_class_attributes_take_precedence_over_the_instance_dict() -> None:
    """Fields are read from an instance's dict only for types with no class attribute of
    that name (pydantic models): a descriptor elsewhere wins, as attribute lookup has it."""
    removed = Removed(block_hashes=(b"\x01" * 8,), cache_level=None)

    class Event:
        event_id = property(lambda self: 7)

        def __init__(self) -> None:
            self.__dict__.update(
                event_id=99, hash_algo="blake3_64", layer_group_id=0, window_size=1, data=removed
            )

    cols = columnar._model_columns((Event(),), Stored, Removed, STORED, REMOVED)
    assert cols is not None
    assert cols[0] == [7]  # the property's, not the dict's 99
    assert cols[5] == [([b"\x01" * 8], None)]
