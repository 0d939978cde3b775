"""The vLLM export against frames vLLM 0.33.0 itself published (tests/data/golden/vllm-0.33.0).

Each captured payload is decoded by kvstream's vLLM reader, turned into kvstream batches and
exported again: what comes out must be what vLLM sent, ``extra_keys`` verbatim included
(vLLM's block pool sends ``[None, None]`` for two key-less blocks, never an omitted field).
Two kinds of frame cannot come back byte for byte, for documented reasons
(docs/engines.md, "kvstream fields with no vLLM slot" and the removal rule): ``session_id``
has no kvstream field, and consecutive one-hash ``BlockRemoved`` events are coalesced into one
``removed`` event on the way in. Their ``extra_keys`` must still match.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvstream.engines.stream import EngineStream
from kvstream.engines.vllm import decode_payload
from kvstream.engines.vllm_export import VllmExporter
from kvstream.events.model import AttentionKind, Created, EventBatch, KVCacheEvent

GOLDEN = Path(__file__).parent / "data" / "golden" / "vllm-0.33.0"
CAPTURES = sorted(GOLDEN.glob("*.json"))


def _algo(name: str) -> tuple[str, int]:
    base = "vllm_sha256_cbor" if name.startswith("sha256_cbor") else "vllm_sha256"
    return (base + "_64", 8) if "-int-" in name else (base, 32)


def _reproducible(events: list[dict[str, Any]]) -> bool:
    removed_runs = any(
        a["type"] == b["type"] == "BlockRemoved" for a, b in itertools.pairwise(events)
    )
    return not removed_runs and not any("session_id" in e for e in events)


@pytest.mark.parametrize("capture", CAPTURES, ids=lambda p: p.stem)
def test_export_gives_back_vllm_033_frames(capture: Path) -> None:
    doc = json.loads(capture.read_text())
    algo, width = _algo(capture.stem)
    rank = doc["config"]["data_parallel_rank"]
    stream = EngineStream("golden", rank, algo, clock_ns=lambda: 1)
    exporter = VllmExporter(hash_format="int" if width == 8 else "bytes")
    # the capture's group 1 is a sliding window of 8 (config.kv_cache_groups); vLLM's events
    # say so in every BlockStored, kvstream in the group's created event
    swa = Created(
        num_blocks_per_cache_level=[doc["config"]["num_gpu_blocks"]],
        tokens_per_block=doc["config"]["block_size"],
        attention_kind=AttentionKind.SLIDING_WINDOW,
    )
    created = KVCacheEvent(event_id=0, hash_algo=algo, layer_group_id=1, window_size=8, data=swa)
    assert (
        exporter.encode(EventBatch(source=stream.source, ts_ns=0, events=[created])).payload is None
    )
    exact = 0
    for frame in doc["live"]:
        sent = bytes.fromhex(frame["frames"][2])
        batch = stream.convert(decode_payload(sent, width=width))
        again = exporter.encode(batch, dp_rank=rank).payload
        assert again is not None
        theirs = msgspec.msgpack.decode(sent)[1]
        ours = msgspec.msgpack.decode(again)[1]
        stored_keys = [e["extra_keys"] for e in theirs if e["type"] == "BlockStored"]
        assert [e["extra_keys"] for e in ours if e["type"] == "BlockStored"] == stored_keys
        if _reproducible(theirs):
            assert again == sent, frame["what"]
            exact += 1
    assert exact >= len(doc["live"]) - 2  # every frame but the two documented ones
