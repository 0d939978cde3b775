"""Parity of the native block table (``kvstream._native._index.GroupTable``) with its
pure-Python twin (:class:`kvstream.index.table.GroupTable`): random operation sequences on
both, everything observable compared after each step."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstream.events.model import StoredBlock
from kvstream.index.domain import MaskMap
from kvstream.index.stats import SourceStats
from kvstream.index.table import GroupTable, native_table_type

NativeTable = native_table_type()
pytestmark = pytest.mark.skipif(NativeTable is None, reason="native index not built")

# a small hash space so that stores, removes and parents collide often; two widths
HASHES = [bytes([i]) * 8 for i in range(12)] + [bytes([i]) * 32 for i in range(40, 44)]
hashes_st = st.sampled_from(HASHES)
level_st = st.integers(0, 5)


def _masks_of(m: MaskMap) -> dict[bytes, int]:
    return m.as_dict()


class TableParity(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        bit = 1 << 3
        self.py = GroupTable(bit)
        self.nat: Any = NativeTable(bit)  # type: ignore[misc]
        self.py_masks: MaskMap | None = MaskMap()
        self.nat_masks: MaskMap | None = MaskMap()
        self.py.attach(self.py_masks)
        self.nat.attach(self.nat_masks)
        self.py_st = SourceStats()
        self.nat_st = SourceStats()

    @rule(
        parent=st.one_of(st.none(), hashes_st),
        hs=st.lists(hashes_st, min_size=0, max_size=6),
        level=st.one_of(level_st, st.lists(level_st, min_size=6, max_size=6)),
    )
    def store_hashes(self, parent: bytes | None, hs: list[bytes], level: Any) -> None:
        lv = level if isinstance(level, int) else level[: len(hs)]
        self.py.store_hashes(parent, list(hs), lv, self.py_st)
        self.nat.store_hashes(parent, list(hs), lv, self.nat_st)

    @rule(
        parent=st.one_of(st.none(), hashes_st),
        hs=st.lists(hashes_st, min_size=1, max_size=4),
        level=level_st,
    )
    def store_blocks(self, parent: bytes | None, hs: list[bytes], level: int) -> None:
        blocks = [StoredBlock(block_hash=h, token_ids=[1], cache_level=level) for h in hs]
        self.py.store(parent, blocks, self.py_st)
        self.nat.store(parent, blocks, self.nat_st)

    @rule(hs=st.lists(hashes_st, min_size=1, max_size=5), level=st.one_of(st.none(), level_st))
    def remove(self, hs: list[bytes], level: int | None) -> None:
        self.py.remove(list(hs), level, self.py_st)
        self.nat.remove(list(hs), level, self.nat_st)

    @rule(h=hashes_st, old=level_st, new=level_st)
    def update(self, h: bytes, old: int, new: int) -> None:
        self.py.update(h, old, new, self.py_st)
        self.nat.update(h, old, new, self.nat_st)

    @rule()
    def clear(self) -> None:
        self.py.clear()
        self.nat.clear()
        self.py_masks = self.nat_masks = None

    @rule()
    def detach(self) -> None:
        self.py.detach()
        self.nat.detach()
        self.py_masks = self.nat_masks = None

    @precondition(lambda self: self.py_masks is None)
    @rule()
    def attach(self) -> None:
        self.py_masks = MaskMap()
        self.nat_masks = MaskMap()
        self.py.attach(self.py_masks)
        self.nat.attach(self.nat_masks)

    @rule()
    def round_trip(self) -> None:
        dump = self.nat.dump_nodes()
        self.nat.load_nodes(list(zip(*dump, strict=True)))
        pdump = self.py.dump_nodes()
        self.py.load_nodes(list(zip(*pdump, strict=True)))

    @rule()
    def cross_load(self) -> None:
        # the Python twin's dump loads into the native type and the other way round
        self.nat.load_nodes(list(zip(*self.py.dump_nodes(), strict=True)))

    @rule(
        hs=st.lists(hashes_st, min_size=0, max_size=8),
        weights=st.sampled_from([(1.0,), (1.0, 0.5, 0.25, 0.1)]),
    )
    def queries(self, hs: list[bytes], weights: tuple[float, ...]) -> None:
        d = self.py.walk(hs)
        assert self.nat.walk(hs) == d
        for depth in (d, len(hs)):
            assert self.nat.weighted(hs, depth, weights) == pytest.approx(
                self.py.weighted(hs, depth, weights)
            )
            assert self.nat.tier_depths(hs, depth) == self.py.tier_depths(hs, depth)

    @invariant()
    def same(self) -> None:
        py, nat = self.py, self.nat
        assert nat.nodes() == py.nodes()
        assert len(nat) == len(py)
        assert (nat.present, nat.lower, nat.ghosts, nat.rooted_count) == (
            py.present,
            py.lower,
            py.ghosts,
            py.rooted_count,
        )
        assert sorted(nat.mirrored()) == sorted(py.mirrored())
        for h in HASHES:
            assert nat.tiers_of(h) == py.tiers_of(h)
            assert nat.is_rooted(h) == py.is_rooted(h)
            assert (h in nat) == (h in py)
            assert nat.knows(h) == py.knows(h)
        assert self.nat_st == self.py_st
        if self.py_masks is not None:
            assert self.nat_masks is not None
            assert _masks_of(self.nat_masks) == _masks_of(self.py_masks)
        ph, pp, pr = py.dump_nodes()
        nh, np_, nr = nat.dump_nodes()
        assert _dump_set(nh, np_, nr) == _dump_set(ph, pp, pr)
        nat.check()
        py.check()


def _dump_set(hs: list[bytes], ps: list[int], rs: list[int]) -> set[tuple[bytes, Any, int]]:
    return {(h, hs[p] if p >= 0 else p, r) for h, p, r in zip(hs, ps, rs, strict=True)}


TableParity.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTableParity = TableParity.TestCase


def test_native_table_errors() -> None:
    t: Any = NativeTable(1)  # type: ignore[misc]
    s = SourceStats()
    with pytest.raises(TypeError):
        t.store_hashes(None, ["not bytes"], 0, s)
    with pytest.raises(ValueError, match="at most 255 bytes"):
        t.store_hashes(None, [b"x" * 256], 0, s)
    with pytest.raises(ValueError, match="duplicate block hashes"):
        t.load_nodes([(b"a", -1, 1), (b"a", -1, 1)])
    with pytest.raises(ValueError, match="outside the table"):
        t.load_nodes([(b"a", 5, 1)])
    with pytest.raises(ValueError, match="one cache level per block"):
        t.store_hashes(None, [b"a", b"b"], [0], s)
