"""kvstream's engine decoders on frames captured from the real publishers (tests/data/golden).

Each capture holds the raw frames vLLM 0.33 / 0.23 and SGLang 0.5.23 / 0.5.19 sent, and what
the producer's own objects said before encoding (scripts/peers/capture_*.py wrote both). The
decoders must read every frame into exactly that, the sources must recover every batch through
the recorded replay replies, and nothing may come out as lost. No peer package is needed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import zmq
from engine_publisher import TestEnginePublisher, free_ports

from kvstream._types import hash_width
from kvstream.engines.endpoint import DIALECTS
from kvstream.engines.stream import EngineStream
from kvstream.engines.vllm import MEDIUM_LEVELS, WireEvent, decode_payload
from kvstream.events.model import UNBOUNDED_WINDOW, EventBatch, Lost, Stored
from kvstream.index.sources import open_source

GOLDEN = Path(__file__).parent / "data" / "golden"
CAPTURES = sorted(GOLDEN.glob("*/*.json"))


def _algo(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    if doc["producer"]["package"] == "sglang":
        return "sglang_sha256_64"
    base = {"sha256": "vllm_sha256", "sha256_cbor": "vllm_sha256_cbor"}[
        cfg["prefix_caching_hash_algo"]
    ]
    return f"{base}_64" if cfg["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] else base


def _dialect(doc: dict[str, Any]) -> Any:
    return DIALECTS[doc["producer"]["package"]]


def _value(v: Any) -> Any:
    """The capture's JSON convention back to Python values: {"$bytes": hex} -> bytes."""
    if isinstance(v, dict) and set(v) == {"$bytes"}:
        return bytes.fromhex(v["$bytes"])
    if isinstance(v, list):
        return tuple(_value(x) for x in v)
    return v


def _hash(v: Any, width: int) -> bytes:
    v = _value(v)
    if isinstance(v, bytes):
        return v
    return (v % 2**64).to_bytes(8, "big") if width == 8 else v


def _named(ev: Any, positions: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(ev, dict):
        return ev
    names = ("type", "block_hashes", "medium") if ev[0] == "BlockRemoved" else positions
    return dict(zip(names, ev, strict=False))


def _check(got: WireEvent, want: dict[str, Any], width: int, where: str) -> None:
    kind = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}
    assert got.kind == kind[want["type"]], (where, got.error)
    if got.kind == "cleared":
        return
    assert got.block_hashes == tuple(_hash(h, width) for h in want["block_hashes"]), where
    assert got.group == (want.get("group_idx") or 0), where
    medium = want.get("medium")
    assert got.cache_level == (None if medium is None else MEDIUM_LEVELS[medium]), where
    if got.kind == "removed":
        return
    parent = want["parent_block_hash"]
    assert got.parent_hash == (None if parent is None else _hash(parent, width)), where
    tokens = [t[0] if isinstance(t, list) else t for t in want["token_ids"]]  # bigram heads
    flat = [t for block in got.block_tokens for t in block]
    assert flat == tokens, where
    size = want["block_size"]
    assert all(len(b) == size for b in got.block_tokens[:-1]), where
    assert got.lora_id == want.get("lora_id"), where
    assert got.lora_name == want.get("lora_name"), where
    salt = want.get("cache_salt") or (want.get("metadata") or {}).get("cache_salt")
    assert got.cache_salt == salt, where
    extra = want.get("extra_keys")
    if extra is None:
        assert got.extra_keys is None, where
    else:
        assert got.extra_keys == tuple(None if e is None else _value(e) for e in extra), where
    assert got.sliding_window == want.get("kv_cache_spec_sliding_window"), where


@pytest.mark.parametrize("path", CAPTURES, ids=[f"{p.parent.name}/{p.stem}" for p in CAPTURES])
def test_every_captured_frame_decodes_to_what_the_engine_sent(path: Path) -> None:
    doc = json.loads(path.read_text())
    algo = _algo(doc)
    width = hash_width(algo)
    assert width is not None
    dialect = _dialect(doc)
    stream = EngineStream("golden", 0, algo)
    events = 0
    for step in doc["live"]:
        _topic, seq_b, payload = (bytes.fromhex(f) for f in step["frames"])
        expected = step["expected"]
        assert int.from_bytes(seq_b, "big") == expected["seq"]
        wire = decode_payload(payload, width=width, dialect=dialect)
        want = expected["batch"]["events"]
        assert len(wire.events) == len(want)
        for i, (got, ev) in enumerate(zip(wire.events, want, strict=True)):
            _check(got, _named(ev, dialect.stored_positions), width, f"{step['what']} #{i}")
        batch = stream.convert(wire)
        assert not any(isinstance(e.data, Lost) for e in batch.events), step["what"]
        assert [e.event_id for e in batch.events] == list(range(events, events + len(batch.events)))
        events += len(batch.events)
    assert events > 0


@pytest.mark.parametrize("path", CAPTURES, ids=[f"{p.parent.name}/{p.stem}" for p in CAPTURES])
def test_windows_and_groups_of_hybrid_models(path: Path) -> None:
    doc = json.loads(path.read_text())
    algo = _algo(doc)
    stream = EngineStream("golden", 0, algo)
    dialect = _dialect(doc)
    windows: dict[int, set[int]] = {}
    for step in doc["live"]:
        payload = bytes.fromhex(step["frames"][2])
        batch = stream.convert(decode_payload(payload, width=stream.width, dialect=dialect))
        for e in batch.events:
            windows.setdefault(e.layer_group_id, set()).add(e.window_size)
    if doc["producer"]["package"] == "vllm":
        assert windows == {0: {UNBOUNDED_WINDOW}, 1: {8}}  # full attention + an 8-token window
    else:
        assert windows == {0: {UNBOUNDED_WINDOW}}


class _RecordedRouter(TestEnginePublisher):
    """Replays a capture: its live frames on the PUB, its recorded replay replies verbatim."""

    def __init__(self, port: int, replay_port: int, doc: dict[str, Any]) -> None:
        super().__init__(port, None)
        self.replies = [[bytes.fromhex(f) for f in r] for r in doc["replay"]["replies"]]
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        import threading

        self._thread = threading.Thread(target=self._serve_recorded, daemon=True)
        self._thread.start()

    def _serve_recorded(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            client, *_ = self.router.recv_multipart()
            for reply in self.replies:  # exactly what the real ROUTER sent this DEALER
                self.router.send_multipart([client, *reply])


@pytest.mark.parametrize("path", CAPTURES, ids=[f"{p.parent.name}/{p.stem}" for p in CAPTURES])
async def test_the_recorded_replay_recovers_every_batch(path: Path) -> None:
    doc = json.loads(path.read_text())
    algo = _algo(doc)
    width = hash_width(algo)
    assert width is not None
    pub_port, replay_port = free_ports(2)
    engine = _RecordedRouter(pub_port, replay_port, doc)
    live = [[bytes.fromhex(f) for f in step["frames"]] for step in doc["live"]]
    scheme = doc["producer"]["package"]
    topic = live[0][0].decode()
    url = f"{scheme}://127.0.0.1:{pub_port}?replay={replay_port}&hash_algo={algo}&topic={topic}"
    got: list[EventBatch] = []
    try:
        async with open_source(url) as src:
            await asyncio.sleep(0.3)
            engine.send_raw(live[-1])  # it was in the replay too: delivered once, not twice
            while len(got) < len(live):
                item = await src.read(10)
                assert item is not None, f"{len(got)} of {len(live)} batches"
                got.append(item.batch)
            assert await src.read(0.5) is None
    finally:
        engine.close()
    assert not any(isinstance(e.data, Lost) for b in got for e in b.events)
    assert src.subscriber.stats[0].replayed == len(live)  # asked for at start-up (from=0)
    stored = [
        int.from_bytes(blk.block_hash, "big") if width == 8 else blk.block_hash
        for b in got
        for e in b.events
        if isinstance(e.data, Stored)
        for blk in e.data.blocks
    ]
    want = [
        _hash(h, width) if width != 8 else int.from_bytes(_hash(h, width), "big")
        for step in doc["live"]
        for ev in step["expected"]["batch"]["events"]
        for h in (_named(ev, _dialect(doc).stored_positions).get("block_hashes") or [])
        if _named(ev, _dialect(doc).stored_positions)["type"] == "BlockStored"
    ]
    assert stored == want
