"""TokenIdsView (a block of a packed chain sharing the chain's bytes) is indistinguishable from
the plain TokenIds of the same ids: equality both ways, hash, repr, ints, slicing, ``raw``,
JSON, pickling and copying (which give the plain TokenIds), and the events built with views
encode and decode as those built with plain copies."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstream._types import TokenIds, TokenIdsView
from kvstream.codec import AvroCodec
from kvstream.events.model import EventBatch, KVCacheEvent, SourceId, Stored, StoredBlock

_RAW = TokenIds.__dict__["_raw"]


def _cut_yet(view: TokenIdsView) -> bool:
    try:
        _RAW.__get__(view, TokenIds)
    except AttributeError:
        return False
    return True


runs = st.integers(1, 6).flatmap(
    lambda k: st.tuples(
        st.lists(st.integers(0, 2**32 - 1), min_size=k, max_size=k * 5).map(
            lambda ids: ids[: len(ids) // k * k]
        ),
        st.just(k),
    )
)


@given(runs)
def test_a_view_is_the_plain_block(run: tuple[list[int], int]) -> None:
    ids, k = run
    packed = TokenIds(ids)
    views = TokenIdsView.of_run(packed.raw, k)
    step = len(ids) // k
    assert len(views) == k
    for i, view in enumerate(views):
        want = TokenIds(ids[i * step : (i + 1) * step])
        assert len(view) == step
        assert not _cut_yet(view)  # len reads nothing
        assert view == want
        assert want == view
        assert view == list(want)
        assert list(view) == list(want)
        assert hash(view) == hash(want)
        assert repr(view) == repr(want)
        assert view.raw == want.raw
        assert view.tolist() == want.tolist()
        assert view[1:] == want[1:]
        assert view[0] == want[0] if step else True
        assert view + want == want + want
        for clone in (pickle.loads(pickle.dumps(view)), copy.copy(view), copy.deepcopy(view)):
            assert type(clone) is TokenIds
            assert clone == want


def test_bytes_are_cut_once_on_first_read() -> None:
    (a, b) = TokenIdsView.of_run(TokenIds(range(8)).raw, 2)
    assert not _cut_yet(b)
    raw = b.raw
    assert raw == TokenIds([4, 5, 6, 7]).raw
    assert _cut_yet(b)
    assert b.raw is raw
    assert not _cut_yet(a)
    assert not hasattr(b, "_run")  # the run is released once the block is cut
    assert len(b) == 4
    assert len(a) == 4
    assert a == TokenIds(range(4))


@pytest.mark.parametrize(("packed", "k"), [(b"\0" * 12, 2), (b"\0" * 8, 0), ("abcd", 1)])
def test_of_run_rejects_what_is_not_equal_blocks(packed: bytes, k: int) -> None:
    with pytest.raises(ValueError, match="equal blocks"):
        TokenIdsView.of_run(packed, k)


def test_events_with_views_validate_dump_and_encode_as_plain_ones() -> None:
    hashes = [i.to_bytes(8, "big") for i in range(1, 4)]
    views = TokenIdsView.of_run(TokenIds(range(12)).raw, 3)
    plain = [TokenIds(range(i * 4, i * 4 + 4)) for i in range(3)]

    def batch(tokens: list[TokenIds]) -> EventBatch:
        blocks = tuple(
            StoredBlock(block_hash=h, token_ids=t) for h, t in zip(hashes, tokens, strict=True)
        )
        event = KVCacheEvent(
            event_id=0,
            hash_algo="v1_block_key",
            layer_group_id=0,
            window_size=64,
            data=Stored(parent_hash=None, blocks=blocks),
        )
        return EventBatch(source=SourceId(instance_id="w"), ts_ns=1, events=(event,))

    with_views, with_plain = batch(list(views)), batch(plain)
    assert with_views == with_plain
    assert with_views.model_dump_json() == with_plain.model_dump_json()
    assert with_views.model_dump() == with_plain.model_dump()
    assert pickle.loads(pickle.dumps(with_views)) == with_plain
    codec = AvroCodec()
    encoded = codec.encode(with_views)
    assert encoded == codec.encode(with_plain)
    assert codec.decode(encoded) == with_plain
