"""The C ``MaskMap`` domains keep when the extension is built: the Python
:class:`~kvstream.index.domain.MaskMap`'s contract (same reads after any adds, discards and
widenings, through rebuilds and reused slots), and the C depth search over it gives the
reference search's pairs (tests skip when the extension is not built)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from native_parts import native_part

from kvstream.index import domain as domain_module
from kvstream.index.domain import MaskMap, prefix_depths
from kvstream.index.types import DomainKey

native = native_part("kvstream.index._table_native")
#: the C maps: the extension's, and the index core's (keys inline) when built
C_MAPS = [native.MaskMap] + ([domain_module._INDEX_MASKS] if domain_module._INDEX_MASKS else [])
c_maps = pytest.mark.parametrize("cmap", C_MAPS, ids=lambda t: t.__module__)


def _prefix(c: Any, hashes: list[bytes], raw: bytes | None) -> Any:
    if type(c) is native.MaskMap:
        return native.prefix_depths(c, hashes, raw)
    return c.prefix_depths(hashes, raw)


def _slots(c: Any, hashes: list[bytes], raw: bytes | None) -> Any:
    if type(c) is native.MaskMap:
        return native.slot_depths(c, hashes, raw)
    return c.slot_depths(hashes, raw)


#: few distinct keys, so adds and discards hit the same ones (tombstones, reuse): up to 12
#: bytes (compared in the slot up to 8, by content beyond), some sharing their first 8 bytes
_key = st.sampled_from(
    [bytes([i]) * (1 + i % 12) for i in range(40)] + [bytes(8) + bytes([i]) for i in range(4)]
)
_op = st.tuples(st.sampled_from(("add", "discard", "reserve")), _key, st.integers(0, 140))


def _copy(key: bytes) -> bytes:
    """An equal key that is another object (decoded batches never share hash objects)."""
    return bytes(bytearray(key))


@c_maps
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=200), probe=st.lists(_key, max_size=10))
def test_c_mask_map_reads_as_the_python_one(
    cmap: Any, ops: list[tuple[str, bytes, int]], probe: list[bytes]
) -> None:
    """After the same operations both maps hold the same keys and masks, the same width,
    and answer get/contains/len the same, for keys as other objects of equal value."""
    c, ref = cmap(), MaskMap()
    for op, key, slot in ops:
        if op == "reserve":
            c.reserve(slot)
            ref.reserve(slot)
            continue
        at = slot % (8 * ref.width)  # a reserved slot
        getattr(c, op)(_copy(key), at)
        getattr(ref, op)(key, at)
        assert len(c) == len(ref)
    assert c.width == ref.width
    assert c.as_dict() == ref.as_dict()
    for key in probe:
        k = _copy(key)
        assert c.get(k) == ref.get(key)
        assert c.get(k, -1) == ref.get(key, -1)
        assert (k in c) == (key in ref)


@c_maps
def test_c_mask_map_survives_growth_and_churn(cmap: Any) -> None:
    """Thousands of keys added and dropped in waves (rebuilds, tombstones reused), and a
    widening in between, keep every bit."""
    c, ref = cmap(), MaskMap()
    keys = [i.to_bytes(8, "little") for i in range(5000)]
    for wave in range(4):
        if wave == 2:
            c.reserve(100)
            ref.reserve(100)
        slot = 100 if wave >= 2 else wave
        for k in keys[wave * 500 :]:
            c.add(k, slot)
            ref.add(k, slot)
        for k in keys[wave * 700 : wave * 700 + 2000]:
            c.discard(k, slot)
            ref.discard(k, slot)
        assert len(c) == len(ref)
    assert c.as_dict() == ref.as_dict()
    assert not gc.is_tracked(c)


@c_maps
def test_c_mask_map_rejects_what_the_index_never_passes(cmap: Any) -> None:
    """Keys are bytes and slots reserved: anything else raises, and the map is unchanged."""
    c = cmap()
    c.add(b"k", 3)
    with pytest.raises(TypeError):
        c.add("k", 1)
    with pytest.raises(ValueError, match="reserved"):
        c.add(b"k", 64)
    with pytest.raises(ValueError, match="reserved"):
        c.add(b"k", -1)
    assert c.get(b"k") == 1 << 3
    assert c.get("k") == 0
    assert "k" not in c
    c.discard(b"absent", 3)
    c.discard(b"k", 200)  # beyond the width: nothing held there
    assert c.as_dict() == {b"k": 1 << 3}
    with pytest.raises(TypeError):
        cmap(1)
    assert repr(c).startswith("<MaskMap keys=1 width=8")


@c_maps
@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(_op, max_size=80),
    hashes=st.lists(_key, max_size=20),
    allowed=st.integers(0, 1 << 141),
)
def test_c_search_over_the_c_mask_map_equals_the_reference(
    cmap: Any, ops: list[tuple[str, bytes, int]], hashes: list[bytes], allowed: int
) -> None:
    """prefix_depths/slot_depths over the C map give the reference search's pairs over the
    same masks as a dict, for any masks (shrinking along the chain or not)."""
    c = cmap()
    for op, key, slot in ops:
        c.reserve(slot)
        if op != "reserve":
            getattr(c, op)(key, slot)
    want = c.as_dict()
    hashes = [_copy(h) for h in hashes]
    for a in (None, allowed):
        want_pairs = prefix_depths(hashes, want, a)
        raw = None if a is None else (a & ((1 << 8 * c.width) - 1))
        raw_b = None if raw is None else raw.to_bytes(c.width, "little")
        assert _prefix(c, hashes, raw_b) == want_pairs
        assert prefix_depths(hashes, c, a) == want_pairs  # the Python search reads it too
        per_slot: dict[int, int] = {}
        for mask, d in want_pairs:
            for s in range(mask.bit_length()):
                if mask >> s & 1 and d > per_slot.get(s, 0):
                    per_slot[s] = d
        assert _slots(c, hashes, raw_b) == sorted(per_slot.items())


def test_domains_keep_the_c_mask_map() -> None:
    """A domain's masks are the C map when the extension is built (and not switched off)."""
    if domain_module._native is None:
        pytest.skip("KVSTREAM_NO_NATIVE: domains keep the Python MaskMap")
    assert domain_module._MASK_MAP is native.MaskMap
    want = domain_module._INDEX_MASKS or native.MaskMap  # the index core's when built
    assert type(domain_module.HashDomain(DomainKey("sha256", 16, 0)).masks) is want
