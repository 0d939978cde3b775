"""The C ``Column`` a GroupTable keeps its integer columns in: it behaves as the list it
replaces for every operation the table uses, and the table's hashes list is left out of the
cyclic GC's walks (tests skip when the extension is not built)."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream.index import table as table_module
from kvstream.index.table import GroupTable

native = native_part("kvstream.index._table_native")
Column = native.Column

I64 = st.integers(-(1 << 63), (1 << 63) - 1)
U64 = st.integers(0, (1 << 64) - 1)

_ops = st.one_of(
    st.tuples(st.just("append"), st.integers()),
    st.tuples(st.just("pop"), st.just(0)),
    st.tuples(st.just("set"), st.integers()),
    st.tuples(st.just("get"), st.integers()),
    st.tuples(st.just("extend"), st.lists(st.integers(), max_size=5)),
)


def _fits(v: object, unsigned: bool) -> bool:
    lo, hi = (0, (1 << 64) - 1) if unsigned else (-(1 << 63), (1 << 63) - 1)
    if isinstance(v, list):
        return all(lo <= x <= hi for x in v)
    assert isinstance(v, int)
    return lo <= v <= hi


@settings(max_examples=300, deadline=None)
@given(
    unsigned=st.booleans(),
    start=st.lists(I64, max_size=8),
    ops=st.lists(st.tuples(_ops, st.integers(-12, 12)), max_size=40),
)
def test_column_behaves_as_a_list(
    unsigned: bool, start: list[int], ops: list[tuple[tuple[str, object], int]]
) -> None:
    """Every operation gives the list's result, or the list's error (IndexError), or
    OverflowError for a value outside the column's 64-bit range (the list left as it was)."""
    start = [x % (1 << 64) for x in start] if unsigned else start
    col = Column(start, unsigned=unsigned)
    ref = list(start)
    for (op, arg), i in ops:
        if op == "append":
            if _fits(arg, unsigned):
                col.append(arg)
                ref.append(arg)  # type: ignore[arg-type]
            else:
                with pytest.raises(OverflowError):
                    col.append(arg)
        elif op == "extend":
            if _fits(arg, unsigned):
                col.extend(arg)
                ref.extend(arg)  # type: ignore[arg-type]
            else:
                with pytest.raises(OverflowError):
                    col.extend(arg)
        elif op == "pop":
            if ref:
                assert col.pop() == ref.pop()
            else:
                with pytest.raises(IndexError):
                    col.pop()
        elif op == "get":
            if -len(ref) <= i < len(ref):
                assert col[i] == ref[i]
            else:
                with pytest.raises(IndexError):
                    col[i]
        elif op == "set":
            if not -len(ref) <= i < len(ref):
                with pytest.raises(IndexError):
                    col[i] = 0
            elif _fits(arg, unsigned):
                col[i] = arg
                ref[i] = arg  # type: ignore[call-overload]
            else:
                with pytest.raises(OverflowError):
                    col[i] = arg
        assert len(col) == len(ref)
        assert bool(col) == bool(ref)
        assert col.tolist() == ref == list(col)
        assert col == ref


@given(unsigned=st.booleans(), values=st.lists(U64, max_size=20))
def test_column_copies_and_pickles(unsigned: bool, values: list[int]) -> None:
    """copy, deepcopy and pickle give an equal column of the same kind."""
    values = values if unsigned else [x - (1 << 63) for x in values]
    col = Column(values, unsigned=unsigned)
    for other in (copy.copy(col), copy.deepcopy(col), pickle.loads(pickle.dumps(col))):
        assert type(other) is Column
        assert other == col
        assert other.tolist() == values
        assert repr(other) == repr(col)
        if values:  # an independent copy
            other[0] = 0
            assert col[0] == values[0]


def test_column_rejects_what_a_table_never_stores() -> None:
    """Non-ints, deletion, and values outside the range raise; nothing is changed."""
    col = Column([1, 2])
    with pytest.raises(TypeError):
        col.append(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        del col[0]
    with pytest.raises(OverflowError):
        Column([-1], unsigned=True)
    with pytest.raises(OverflowError):
        col.append(1 << 63)
    assert col.tolist() == [1, 2]
    assert not gc.is_tracked(col)


def test_table_columns_stay_out_of_the_gc() -> None:
    """A table's columns and hashes are not walked by the cyclic GC, after stores, a clear
    and a reload."""
    if table_module._COLUMNS is None:
        pytest.skip("KVSTREAM_NO_NATIVE: the tables keep lists")
    assert table_module._COLUMNS is native
    t = GroupTable(1)
    st_ = table_module.SourceStats()
    t.store_hashes(None, [bytes([i]) * 8 for i in range(10)], 0, st_)
    for _ in range(2):
        for col in (t.parent, t.refs, t.kid, t.free):
            assert type(col) is Column
        assert not gc.is_tracked(t.hashes)
        t.load_nodes([(b"a" * 8, table_module.ROOT, 1), (b"b" * 8, 0, 1)])
    t.check()
    t.clear()
    assert not gc.is_tracked(t.hashes)
    assert type(t.refs) is Column


def test_untrack_atoms_leaves_containers_to_the_gc() -> None:
    """A list holding anything but bytes and ints stays tracked."""
    kept = native.untrack_atoms([b"x", 1, [2]])
    assert gc.is_tracked(kept)
    assert not gc.is_tracked(native.untrack_atoms([b"x", 1]))
    with pytest.raises(TypeError):
        native.untrack_atoms((b"x",))
