"""The index's result records (kvstream.index.record): the C base that owns its values
(``_match_native.Record``) behaves as its pure-Python twin ``_PyRecord`` does, and both as the
frozen dataclasses they replace (construction, defaults, errors, equality, hashing, repr,
pickling, immutability); the router's and the index's result classes are records."""

from __future__ import annotations

import copy
import gc
import pickle
from dataclasses import FrozenInstanceError
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstream.index import record as record_module
from kvstream.index.matching import MatchResult, WorkerMatch
from kvstream.index.record import Record, _PyField, _PyRecord
from kvstream.index.router import RouteDecision, RoutingPolicy, WorkerScore
from kvstream.index.types import WorkerKey

NAMES = ("worker", "blocks", "weight", "note")
DEFAULTS = (0.5, "")


def _twin(base: type, field: type) -> type:
    # What Record.__init_subclass__ declares, over a chosen base (C or Python).
    ns: dict[str, Any] = {
        "__slots__": (),
        "__record_fields__": NAMES,
        "__record_defaults__": DEFAULTS,
        "__match_args__": NAMES,
        **{n: field(i, n) for i, n in enumerate(NAMES)},
    }
    return type("Hit", (base,), ns)


BASES: dict[str, type] = {"python": _twin(_PyRecord, _PyField)}
if record_module._native is not None:
    BASES["native"] = _twin(record_module._native.Record, record_module._native.Field)
needs_native = pytest.mark.skipif("native" not in BASES, reason="the C extension is not built")

_atom = st.one_of(st.none(), st.integers(), st.floats(allow_nan=False), st.text(max_size=4))
_value = st.one_of(_atom, st.tuples(_atom, _atom), st.lists(_atom, max_size=2))
_args = st.lists(_value, min_size=0, max_size=6)


def _outcome(cls: type, args: list[Any], kwargs: dict[str, Any]) -> Any:
    try:
        r = cls(*args, **kwargs)
    except TypeError:
        return TypeError
    values = tuple(getattr(r, n) for n in NAMES)
    same = cls(*values)
    made, again = r.__reduce__()
    return (values, r == same, r != same, repr(r), made is cls, made(*again) == r)


@given(args=_args, kw=st.dictionaries(st.sampled_from([*NAMES, "other"]), _value, max_size=3))
def test_native_record_behaves_as_the_python_twin(args: list[Any], kw: dict[str, Any]) -> None:
    """Any positional and keyword arguments: the same values or the same TypeError (too
    many, unknown, repeated, missing), equality, repr and pickle round trip."""
    got = {name: _outcome(cls, args, kw) for name, cls in BASES.items()}
    assert len(set(map(repr, got.values()))) == 1, got


@given(a=_args, b=_args)
def test_equality_and_hash_as_a_frozen_dataclass(a: list[Any], b: list[Any]) -> None:
    """Equal when the values are, hash of the values' tuple (hashable values only)."""
    for cls in BASES.values():
        if len(a) < 2 or len(a) > 4 or len(b) < 2 or len(b) > 4:
            continue
        x, y = cls(*a), cls(*b)
        vx = tuple(getattr(x, n) for n in NAMES)
        vy = tuple(getattr(y, n) for n in NAMES)
        assert (x == y) is (vx == vy)
        assert (x != y) is (vx != vy)
        try:
            h = hash(vx)
        except TypeError:
            with pytest.raises(TypeError):
                hash(x)
        else:
            assert hash(x) == h


@pytest.mark.parametrize("name", list(BASES))
def test_frozen_fields_and_other_classes(name: str) -> None:
    cls = BASES[name]
    r = cls(WorkerKey("w", 0), 3)
    assert (r.worker, r.blocks, r.weight, r.note) == (WorkerKey("w", 0), 3, 0.5, "")
    with pytest.raises(FrozenInstanceError, match="cannot assign to field 'blocks'"):
        r.blocks = 4
    with pytest.raises(FrozenInstanceError, match="cannot delete field 'note'"):
        del r.note
    with pytest.raises(AttributeError):
        r.other = 1
    other = _twin(BASES[name].__base__, type(cls.__dict__["worker"]))
    assert r != other(WorkerKey("w", 0), 3)  # another class: never equal
    assert r.__eq__(0) is NotImplemented
    assert copy.copy(r) == r
    assert copy.deepcopy(r) == r
    assert (
        repr(r)
        == "Hit(worker=WorkerKey(instance_id='w', dp_rank=0), blocks=3, weight=0.5, note='')"
    )
    match r:
        case cls(w, b):
            assert (w, b) == (WorkerKey("w", 0), 3)


@needs_native
def test_native_records_of_atoms_are_left_to_reference_counting() -> None:
    """As CPython does for tuples of atoms: a record whose values cannot lead back to it is
    not tracked by the cyclic GC; one holding a list (or a tuple with one) is, and a cycle
    through it is collected."""
    cls = BASES["native"]
    assert not gc.is_tracked(cls(WorkerKey("w", 0), 3, 1.5, "x"))
    assert not gc.is_tracked(cls(("a", 1), None))
    held: list[Any] = []
    r = cls(held, 1)
    assert gc.is_tracked(r)
    assert gc.is_tracked(cls(("a", held), 1))
    held.append(r)  # a cycle through the record
    del r, held
    gc.collect()


@needs_native
def test_native_record_rejects_classes_without_fields() -> None:
    base = record_module._native.Record
    with pytest.raises((TypeError, AttributeError)):
        base()
    bad = type("Bad", (base,), {"__slots__": (), "__record_fields__": ("a",)})
    with pytest.raises(AttributeError):
        bad(1)  # no __record_defaults__
    with pytest.raises(TypeError):
        type(
            "Worse", (base,), {"__slots__": (), "__record_fields__": "a", "__record_defaults__": ()}
        )(1)
    with pytest.raises(TypeError):
        record_module._native.Field(0, "x").__get__(object(), object)


def test_record_subclasses_are_checked() -> None:
    """A record class derives from Record alone, declares ``__slots__ = ()``, has fields, and
    no field without a default follows one with."""
    with pytest.raises(TypeError, match="__slots__"):

        class NoSlots(Record):
            a: int

    with pytest.raises(TypeError, match="without a default"):

        class Order(Record):
            __slots__ = ()
            a: int = 0
            b: int

    with pytest.raises(TypeError, match="at least one field"):

        class Empty(Record):
            __slots__ = ()

    class Ok(Record):
        __slots__ = ()
        a: int
        b: str = "x"

    with pytest.raises(TypeError, match="alone"):

        class Sub(Ok):
            __slots__ = ()

    assert Ok(1) == Ok(a=1, b="x")
    assert Ok.__match_args__ == ("a", "b")
    assert not hasattr(Ok(1), "__dict__")


def test_result_classes_are_records() -> None:
    """WorkerMatch, MatchResult, WorkerScore and RouteDecision: records with the fields,
    defaults and methods of the dataclasses they were."""
    key = WorkerKey("w", 1)
    m = WorkerMatch(key, 3, 2.5, 10, 16, "blake3_64", True)
    assert isinstance(m, Record)
    assert m.note == ""
    assert m.matched_tokens == 48
    assert m == WorkerMatch(key, 3, 2.5, 10, 16, "blake3_64", True, "")
    s = WorkerScore(m, 1, 2, 3.5, 7.25)
    assert s.pending_prefill_blocks == 0.0
    assert s.worker == key
    assert s.as_dict()["cost"] == 7.25
    d = RouteDecision(key, RoutingPolicy.KV, 100)
    assert d.scores == ()
    assert d.affinity_weight is None
    assert d.chosen is None
    r = MatchResult((m,), 100)
    assert r.best() == m
    assert len(r) == 1
    assert list(r) == [m]
    for obj in (m, s, d, r):
        assert pickle.loads(pickle.dumps(obj)) == obj
        with pytest.raises(FrozenInstanceError):
            obj.__setattr__(type(obj).__record_fields__[0], None)
