"""kvstream.engines.vllm / .sglang / .stream: every encoding the engines used, decoded."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.engines.sglang import SGLANG
from kvstream.engines.stream import EngineStream
from kvstream.engines.vllm import STORED_POSITIONS, VLLM, decode_payload
from kvstream.errors import InteropError
from kvstream.events.model import UNBOUNDED_WINDOW, Cleared, Lost, Removed, Stored

# peers.md §1.2 test vectors: one BlockStored (hash V3a), array era and map era, and a
# BlockRemoved + AllBlocksCleared batch.
ARRAY_ERA = bytes.fromhex(
    "93cb0000000000000000919cab426c6f636b53746f72656491cf84b146b151d55111c0940102030404c0a347"
    "5055c0c000ae66756c6c5f617474656e74696f6ec000"
)
MAP_ERA = bytes.fromhex(
    "93cb0000000000000000918aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391cf"
    "84b146b151d55111b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa62"
    "6c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0a96772"
    "6f75705f69647800b26b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e00"
)
REMOVED_CLEARED = bytes.fromhex(
    "93cb00000000000000009284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391"
    "cf84b146b151d55111a66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f"
    "636b73436c656172656400"
)
V3A = 9561501211280363793


def _payload(events: list[object], rank: int | None = 0, ts: float = 1.5) -> bytes:
    return msgspec.msgpack.encode([ts, events, rank])


def _stored(**kw: object) -> dict[str, object]:
    ev: dict[str, object] = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    ev.update(kw)
    return ev


@pytest.mark.parametrize("payload", [ARRAY_ERA, MAP_ERA], ids=["array", "map"])
def test_reference_vectors_decode_the_same(payload: bytes) -> None:
    wire = decode_payload(payload, width=8)
    assert wire.ts == 0.0
    assert wire.dp_rank == 0
    (ev,) = wire.events
    assert ev.kind == "stored"
    assert ev.block_hashes == (V3A.to_bytes(8, "big"),)
    assert ev.parent_hash is None
    assert [list(b) for b in ev.block_tokens] == [[1, 2, 3, 4]]
    assert ev.cache_level == 0
    assert ev.group == 0
    assert ev.spec_kind == "full_attention"


def test_removed_and_cleared_vector() -> None:
    wire = decode_payload(REMOVED_CLEARED, width=8)
    assert [e.kind for e in wire.events] == ["removed", "cleared"]
    assert wire.events[0].block_hashes == (V3A.to_bytes(8, "big"),)


@pytest.mark.parametrize("slots", range(5, 17))
def test_positional_arrays_of_every_length(slots: int) -> None:
    values = {
        "type": "BlockStored",
        "block_hashes": [7, 8],
        "parent_block_hash": 6,
        "token_ids": [1, 2, 3, 4, 5, 6],
        "block_size": 3,
        "lora_id": 9,
        "medium": "CPU",
        "lora_name": "ad",
        "extra_keys": [["ad"], ["ad", ["img", -2]]],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 128,
        "locality": "LOCAL",
        "ownership": "t2",
        "session_id": "s",
        "lookahead_token_ids": None,
    }
    event = [values[name] for name in STORED_POSITIONS[:slots]]
    (ev,) = decode_payload(_payload([event]), width=8).events
    assert ev.kind == "stored", ev.error
    assert ev.block_hashes == ((7).to_bytes(8, "big"), (8).to_bytes(8, "big"))
    assert ev.parent_hash == (6).to_bytes(8, "big")
    assert [list(b) for b in ev.block_tokens] == [[1, 2, 3], [4, 5, 6]]
    assert ev.lora_id == (9 if slots > 5 else None)
    assert ev.cache_level == (1 if slots > 6 else None)
    assert ev.lora_name == ("ad" if slots > 7 else None)
    assert ev.extra_keys == ((("ad",), ("ad", ("img", -2))) if slots > 8 else None)
    assert ev.group == (1 if slots > 9 else 0)
    assert ev.sliding_window == (128 if slots > 11 else None)


def test_unknown_trailing_slots_and_map_keys_are_ignored() -> None:
    arr = ["BlockRemoved", [5], "GPU", 0, None, None, "future", {"x": 1}]
    mp = _stored(future_field={"nested": [1]}, another=3)
    events = decode_payload(_payload([arr, mp]), width=8).events
    assert [e.kind for e in events] == ["removed", "stored"]


def test_sglang_signed_hashes_and_cache_salt() -> None:
    # peers.md §2 vector: page [1..4] hashes to -3488128144981237669 (signed int64).
    ev = {
        "type": "BlockStored",
        "block_hashes": [-3488128144981237669, 5674439469042975057],
        "parent_block_hash": None,
        "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "block_size": 4,
        "lora_id": None,
        "medium": "CPU_PINNED",
        "cache_salt": "tenant",
        "session_id": "s1",
    }
    (out,) = decode_payload(_payload([ev]), width=8, dialect=SGLANG).events
    assert out.block_hashes[0] == (-3488128144981237669 + 2**64).to_bytes(8, "big")
    assert out.cache_salt == "tenant"
    assert out.cache_level == 1


def test_sglang_bigram_pages() -> None:
    pairs = [[1, 2], [2, 3], [3, 4], [4, 5]]
    ev = _stored(block_hashes=[11], token_ids=pairs, block_size=4)
    (out,) = decode_payload(_payload([ev]), width=8, dialect=SGLANG).events
    assert [list(b) for b in out.block_tokens] == [[1, 2, 3, 4]]
    (bad,) = decode_payload(_payload([ev]), width=8, dialect=VLLM).events
    assert bad.kind == "malformed"  # vLLM never sends pairs


def test_bytes_hashes() -> None:
    digest = bytes(range(32))
    ev = _stored(block_hashes=[digest], token_ids=[1, 2], block_size=2, parent_block_hash=digest)
    (wide,) = decode_payload(_payload([ev]), width=32).events
    assert wide.block_hashes == (digest,)
    (narrow,) = decode_payload(_payload([ev]), width=8).events
    assert narrow.block_hashes == (digest[-8:],)  # what vLLM's int mode publishes
    assert narrow.parent_hash == digest[-8:]


def test_partial_last_block_and_placeholders() -> None:
    ev = _stored(block_hashes=[1, 2], token_ids=[1, 2, 3, 4, 5], block_size=4)
    (out,) = decode_payload(_payload([ev]), width=8).events
    assert [list(b) for b in out.block_tokens] == [[1, 2, 3, 4], [5]]
    placeholder = _stored(block_hashes=[1, 2], token_ids=[], block_size=0, medium="CPU")
    (out,) = decode_payload(_payload([placeholder]), width=8).events
    assert [list(b) for b in out.block_tokens] == [[], []]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"block_hashes": "x"}, "list of hashes"),
        ({"block_hashes": [1.5]}, "int or bytes"),
        ({"block_hashes": [b"\x01" * 12, 3]}, "12-byte hash"),
        ({"block_hashes": []}, "no block hashes"),
        ({"token_ids": [1, 2, 3]}, "do not split"),
        ({"token_ids": [1, -2, 3, 4, 5, 6, 7, 8]}, "token id"),
        ({"medium": "TAPE"}, "unknown medium"),
        ({"group_idx": "a"}, "group_idx"),
        ({"extra_keys": [None]}, "one entry per block"),
        ({"extra_keys": [[1.5], None]}, "unsupported extra key"),
        ({"lora_name": 3}, "lora_name"),
        ({"block_size": -1}, "block_size"),
    ],
)
def test_a_malformed_event_costs_only_itself(change: dict[str, object], reason: str) -> None:
    events = decode_payload(_payload([_stored(), _stored(**change), {"type": "Nope"}]), width=8)
    kinds = [e.kind for e in events.events]
    assert kinds == ["stored", "malformed", "malformed"]
    assert reason in events.events[1].error
    assert "unknown event type" in events.events[2].error


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode({"a": 1}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode(["x", [], 0]),
        msgspec.msgpack.encode([1.0, {}, 0]),
        msgspec.msgpack.encode([1.0, [], -1]),
    ],
)
def test_payloads_that_are_not_batches(payload: bytes) -> None:
    with pytest.raises(InteropError):
        decode_payload(payload, width=8)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes(data: bytes) -> None:
    with contextlib.suppress(InteropError):
        decode_payload(data, width=8)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzz_mutated_valid_payloads(data: st.DataObject) -> None:
    base = bytearray(MAP_ERA)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(base) - 1))
        base[i] = data.draw(st.integers(0, 255))
    try:
        wire = decode_payload(bytes(base), width=8)
    except InteropError:
        return
    stream = EngineStream("w", 0, "vllm_sha256_cbor_64")
    batch = stream.convert(wire)  # never raises: bad events become lost markers
    assert [e.event_id for e in batch.events][:1] in ([], [0]) or isinstance(
        batch.events[0].data, Lost
    )


# ---------------------------------------------------------------------------------- stream


def _stream() -> EngineStream:
    ticks = iter(range(100, 10_000))
    return EngineStream("vllm@h:1", 1, "vllm_sha256_cbor_64", clock_ns=lambda: next(ticks))


def test_stream_ids_windows_and_groups() -> None:
    s = _stream()
    swa = _stored(group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64)
    b = s.convert(decode_payload(_payload([_stored(), swa]), width=8))
    assert b.source.instance_id == "vllm@h:1"
    assert b.source.attention_dp_rank == 1
    assert b.ts_ns == 1_500_000_000
    assert [e.event_id for e in b.events] == [0, 1]
    assert [(e.layer_group_id, e.window_size) for e in b.events] == [(0, UNBOUNDED_WINDOW), (1, 64)]
    assert all(e.hash_algo == "vllm_sha256_cbor_64" for e in b.events)
    removed = {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "group_idx": 1}
    b2 = s.convert(decode_payload(_payload([removed, {"type": "AllBlocksCleared"}]), width=8))
    assert [e.event_id for e in b2.events] == [2, 3, 4]
    assert isinstance(b2.events[0].data, Removed)
    assert b2.events[0].window_size == 64  # remembered from the group's stores
    assert [type(e.data) for e in b2.events[1:]] == [Cleared, Cleared]
    assert [e.layer_group_id for e in b2.events[1:]] == [0, 1]


def test_stream_keeps_lora_salt_and_extra_keys() -> None:
    s = _stream()
    ev = _stored(lora_id=3, lora_name="ad", extra_keys=[["ad", "salt"], ["ad", ["mm", -1]]])
    (e,) = s.convert(decode_payload(_payload([ev]), width=8)).events
    assert isinstance(e.data, Stored)
    b0, b1 = e.data.blocks
    assert (b0.lora_id, b0.lora_name) == (3, "ad")
    assert b0.extra_keys == ("ad", "salt")
    assert b1.extra_keys == ("ad", ("mm", -1))


def test_stream_lost_markers_and_restart() -> None:
    s = _stream()
    s.convert(decode_payload(_payload([_stored()]), width=8))  # id 0
    lost = s.lost(3, "gap").events[0]
    assert isinstance(lost.data, Lost)
    assert (lost.data.first_event_id, lost.data.count, lost.event_id) == (1, 3, 3)
    bad = s.convert(decode_payload(_payload([_stored(medium="TAPE"), _stored()]), width=8))
    assert isinstance(bad.events[0].data, Lost)
    assert "unknown medium" in bad.events[0].data.reason
    assert [e.event_id for e in bad.events] == [4, 5]
    assert s.malformed_events == 1
    old = s.source.incarnation
    s.restart()
    assert s.source.incarnation > old
    assert s.convert(decode_payload(_payload([_stored()]), width=8)).events[0].event_id == 0


def test_int_hashes_on_a_256_bit_stream_become_lost_markers() -> None:
    s = EngineStream("w", 0, "v2_sha256")  # 32-byte algorithm: int hashes cannot be right
    b = s.convert(decode_payload(_payload([_stored()]), width=s.width))
    (e,) = b.events
    assert isinstance(e.data, Lost)
    assert e.event_id == 0


@settings(max_examples=150, deadline=None)
@given(
    n_blocks=st.integers(1, 5),
    block_size=st.integers(1, 8),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=40, max_size=40),
    lora=st.one_of(st.none(), st.text(min_size=1, max_size=5)),
    level=st.sampled_from(["GPU", "CPU", "DISK", "EXTERNAL", None]),
    extra=st.booleans(),
)
def test_trusted_blocks_equal_validated_ones(  # noqa: PLR0917 - hypothesis arguments
    n_blocks: int,
    block_size: int,
    tokens: list[int],
    lora: str | None,
    level: str | None,
    extra: bool,
) -> None:
    toks = tokens[: n_blocks * block_size]
    ev = _stored(
        block_hashes=list(range(1, n_blocks + 1)),
        token_ids=toks,
        block_size=block_size,
        lora_name=lora,
        medium=level,
        extra_keys=[[lora or "x", ["mm", -i]] for i in range(n_blocks)] if extra else None,
    )
    (e,) = _stream().convert(decode_payload(_payload([ev]), width=8)).events
    assert isinstance(e.data, Stored)
    for i, block in enumerate(e.data.blocks):
        again = type(block).model_validate(block.model_dump())
        assert again == block
        assert repr(again) == repr(block)
        assert list(block.token_ids) == toks[i * block_size : (i + 1) * block_size]
