"""kvstream.index.sources.trtllm: TensorRT-LLM JSON files and stdin as an event source."""

from __future__ import annotations

import asyncio
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvstream.engines.trtllm import from_trtllm_events
from kvstream.errors import ConfigError
from kvstream.events.model import EventBatch, Stored
from kvstream.index import SourceError
from kvstream.index.sources import FileSource, open_source
from kvstream.index.sources.trtllm import TrtllmSource, _utf8_complete, is_trtllm_spec

SHAPES = Path(__file__).parent / "data" / "trtllm" / "shapes"


def shape(name: str) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = json.loads((SHAPES / f"{name}.json").read_text())
    return events


def key(batches: list[EventBatch]) -> list[tuple[Any, ...]]:
    """Batches without their timestamps."""
    return [(b.source, b.events) for b in batches]


def expected(*reads: list[dict[str, Any]], instance_id: str, **options: Any) -> list[Any]:
    from kvstream.engines.trtllm import TrtllmEventReader

    reader = TrtllmEventReader(instance_id=instance_id, **options)
    return key([b for events in reads for b in reader.read(events, ts_ns=0)])


async def drain(source: TrtllmSource) -> list[EventBatch]:
    async with source:
        return [item.batch async for item in source]


def stored(block_hash: int, **envelope: Any) -> dict[str, Any]:
    return {
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [{"block_hash": block_hash, "tokens": [{"token_id": 1}, {"token_id": 2}]}],
        },
        **envelope,
    }


# --------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------


async def test_a_file_holding_one_json_array(tmp_path: Path) -> None:
    events = shape("v1_ser_ed53795b_created_stored_removed")
    path = tmp_path / "worker-0.json"
    path.write_text(json.dumps(events, indent=2))
    source = TrtllmSource(path, tokens_per_block=32)
    got = await drain(source)
    assert key(got) == expected(events, instance_id="worker-0", tokens_per_block=32)
    assert got[0].source.instance_id == "worker-0"  # from the file name
    assert source.stats.batches == 1
    assert source.stats.malformed == 0


async def test_json_lines_of_events_and_of_arrays(tmp_path: Path) -> None:
    a = shape("dynamo_adapter_minimal_tokens")
    b = shape("openengine_no_event_id_no_window")
    path = tmp_path / "drains.jsonl"
    # one event per line, then one POST drain (array) per line, then two concatenated arrays
    text = "\n".join(json.dumps(e) for e in a) + "\n" + json.dumps(b) + "\n"
    text += json.dumps([stored(7, attention_dp_rank=0)]) + json.dumps([stored(8)])
    path.write_text(text)
    got = await drain(TrtllmSource(path, instance_id="w"))
    reads = [[e] for e in a] + [b, [stored(7, attention_dp_rank=0)], [stored(8)]]
    assert key(got) == expected(*reads, instance_id="w")


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".ndjson", ".JSON"])
def test_open_source_routes_trtllm_json(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"events{suffix}"
    source = open_source(path, tokens_per_block=8)
    assert isinstance(source, TrtllmSource)
    assert source.reader.numbering_state() == {"last_ids": [], "max_window": None}


def test_open_source_keeps_file_sink_files_and_directories(tmp_path: Path) -> None:
    assert isinstance(open_source(tmp_path), FileSource)
    sink_file = tmp_path / "kvstream-20250101T000000.000000Z-12-0.jsonl"
    assert isinstance(open_source(sink_file), FileSource)
    assert isinstance(open_source(tmp_path / "kvstream-1.avro"), FileSource)
    looks_like_json = tmp_path / "dir.json"
    looks_like_json.mkdir()
    assert isinstance(open_source(looks_like_json), FileSource)
    assert not is_trtllm_spec("kafka://h:1/t")
    assert is_trtllm_spec("-")
    assert is_trtllm_spec("trtllm:-")
    assert is_trtllm_spec(f"file://{tmp_path}/x.ndjson")


async def test_url_options(tmp_path: Path) -> None:
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps(shape("trtllm_grpc_bridge_minimal")) + "\n")
    url = f"trtllm+file://{path}?instance_id=trt-7&incarnation=2&tokens_per_block=16"
    url += "&default_window_size=512"
    source = open_source(url)
    assert isinstance(source, TrtllmSource)
    (batch,) = await drain(source)
    assert (batch.source.instance_id, batch.source.incarnation) == ("trt-7", 2)
    assert {e.window_size for e in batch.events} == {512}
    # a keyword argument wins over the query
    source = open_source(f"trtllm+file://{path}?instance=q", instance_id="kw")
    (batch,) = await drain(source)
    assert batch.source.instance_id == "kw"
    with pytest.raises(SourceError, match="unknown option 'colour'"):
        open_source(f"trtllm+file://{path}?colour=red")
    with pytest.raises(SourceError, match="not a number"):
        open_source(f"trtllm+file://{path}?tokens_per_block=many")
    with pytest.raises(SourceError, match="no path"):
        open_source("trtllm+file://?instance=x")
    with pytest.raises(ConfigError, match="tokens_per_block"):
        open_source(f"trtllm+file://{path}?tokens_per_block=0")


async def test_stdin(tmp_path: Path) -> None:
    events = shape("openengine_lora_id_zero_then_reset")
    data = json.dumps(events).encode() + b"\n" + json.dumps([stored(3)]).encode()
    source = open_source("-", stdin=io.BytesIO(data))
    assert isinstance(source, TrtllmSource)
    got = await drain(source)
    assert key(got) == expected(events, [stored(3)], instance_id="stdin")
    source = open_source("trtllm:-?instance_id=pipe", stdin=io.BytesIO(b"[]"))
    assert await drain(source) == []
    assert source.ended
    with pytest.raises(SourceError, match="stdin cannot be resumed"):
        TrtllmSource("-", resume_from=source.checkpoint())


async def test_stdin_waits_for_a_slow_writer() -> None:
    read_fd, write_fd = os.pipe()
    with open(read_fd, "rb", buffering=0) as pipe:
        source = TrtllmSource("-", instance_id="p", stdin=pipe)
        assert await source.read(0.05) is None  # nothing written yet: a timeout, not the end
        assert not source.ended
        os.write(write_fd, json.dumps([stored(1)]).encode()[:10])
        assert await source.read(0.05) is None  # half a value
        os.write(write_fd, json.dumps([stored(1)]).encode()[10:] + b"\n")
        item = await source.read(1)
        assert item is not None
        assert item.batch.source.instance_id == "p"
        os.close(write_fd)
        assert await source.read(1) is None
        assert source.ended


# --------------------------------------------------------------------------------------------
# Malformed input never ends the source
# --------------------------------------------------------------------------------------------


async def test_bad_lines_and_bad_events_are_counted_with_file_and_line(tmp_path: Path) -> None:
    good = json.dumps([stored(1)])
    lines = [
        good,  # 1
        "garbage",  # 2
        '{"event_id": 1, "data": {"type": "stored"',  # 3: cut short, the next line is fine
        good,  # 4
        "42",  # 5: JSON, but not events
        json.dumps([stored(2), {"data": {"type": "evicted"}}, stored(3)]),  # 6: one bad event
        good,  # 7
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    source = TrtllmSource(path, instance_id="w")
    got = await drain(source)
    assert [[e.event_id for e in b.events] for b in got] == [[0], [1], [2, 3], [4]]
    assert source.stats.malformed == 4
    where = [m.where for m in source.recent_malformed]
    assert where == [f"{path}:2", f"{path}:3", f"{path}:5", f"{path}:6"]
    errors = [m.error for m in source.recent_malformed]
    assert errors[0].startswith("not JSON: Expecting value")
    assert "expected an event object or a list of them, got int" in errors[2]
    assert "event[1].data.type: unknown event type 'evicted'" in errors[3]


async def test_a_truncated_tail_is_malformed_once_the_file_is_done(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps([stored(1)]) + "\n" + json.dumps([stored(2)])[:-3])
    source = TrtllmSource(path)
    assert len(await drain(source)) == 1
    assert [m.where for m in source.recent_malformed] == [f"{path}:2"]


def test_missing_file_is_a_source_error(tmp_path: Path) -> None:
    source = TrtllmSource(tmp_path / "nope.jsonl")
    with pytest.raises(SourceError, match="no such file"):
        asyncio.run(source.read(1))


# --------------------------------------------------------------------------------------------
# Following a growing file
# --------------------------------------------------------------------------------------------


async def test_follows_a_file_while_it_is_written(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    source = TrtllmSource(path, instance_id="w", follow=True, poll_interval_s=0.01)
    assert await source.read(0.05) is None  # not there yet: wait, no error
    first = json.dumps([stored(1)]) + "\n"
    second = json.dumps(shape("openengine_lora_id_zero_then_reset"))
    with path.open("w") as f:
        f.write(first + second[:40])  # a line still being written
        f.flush()
        item = await source.read(1)
        assert item is not None
        assert [e.event_id for e in item.batch.events] == [0]
        assert await source.read(0.05) is None  # the half line is not judged yet
        assert source.stats.malformed == 0
        f.write(second[40:] + "\n")
        f.flush()
        item = await source.read(1)
    assert item is not None
    assert [e.event_id for e in item.batch.events] == [1, 2]
    assert source.stats.malformed == 0
    await source.aclose()


async def test_idle_timeout_ends_a_followed_file(tmp_path: Path) -> None:
    path = tmp_path / "idle.jsonl"
    path.write_text(json.dumps([stored(1)]) + "\n" + '{"half": ')
    source = TrtllmSource(path, follow=True, poll_interval_s=0.01, idle_timeout_s=0.05)
    got = await drain(source)
    assert len(got) == 1
    assert source.ended
    assert source.stats.malformed == 1  # the half value will never be finished


# --------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------


def two_rank_reads() -> list[list[dict[str, Any]]]:
    """Values whose events carry no ids (numbered by the reader) and span two ranks."""
    return [
        [stored(1, attention_dp_rank=0), stored(2, attention_dp_rank=1)],
        [
            stored(3, attention_dp_rank=1),
            {
                "data": {
                    "type": "stored",
                    "cache_salt": "é",
                    "blocks": [
                        {"block_hash": 4, "tokens": [{"token_id": 9}], "cache_salt": "tenant-ü"}
                    ],
                }
            },
        ],
        [stored(5, attention_dp_rank=0), stored(6)],
    ]


@pytest.mark.parametrize("stop_after", [1, 2, 3, 4, 5])
async def test_resume_from_any_checkpoint(tmp_path: Path, stop_after: int) -> None:
    reads = two_rank_reads()
    path = tmp_path / "ckpt.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in reads) + "\n")
    full = expected(*reads, instance_id="w")
    assert len(full) == 6
    first = TrtllmSource(path, instance_id="w")
    head = []
    async with first:
        for _ in range(stop_after):
            item = await first.read(1)
            assert item is not None
            head.append(item.batch)
        checkpoint = json.loads(json.dumps(first.checkpoint()))
    assert checkpoint["kind"] == "trtllm"
    rest = await drain(TrtllmSource(path, instance_id="w", resume_from=checkpoint))
    assert key(head) + key(rest) == full


async def test_checkpoint_moves_past_values_that_give_no_batch(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("[]\nnot json\n")
    source = TrtllmSource(path)
    assert await drain(source) == []
    checkpoint = source.checkpoint()
    assert (checkpoint["line"], checkpoint["offset"]) == (3, path.stat().st_size)
    again = TrtllmSource(path, resume_from=checkpoint)
    assert await drain(again) == []
    assert again.stats.malformed == 0


def test_bad_checkpoints() -> None:
    with pytest.raises(SourceError, match="not a TensorRT-LLM source checkpoint"):
        TrtllmSource("x.jsonl", resume_from={"kind": "file"})
    with pytest.raises(SourceError, match="bad TensorRT-LLM source checkpoint"):
        TrtllmSource("x.jsonl", resume_from={"kind": "trtllm", "offset": 0})
    with pytest.raises(SourceError, match="bad TensorRT-LLM source checkpoint"):
        TrtllmSource(
            "x.jsonl",
            resume_from={"kind": "trtllm", "offset": 0, "line": 1, "skip": 0, "numbering": {}},
        )


# --------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------


def test_utf8_complete_holds_back_a_cut_sequence() -> None:
    text = "aé€😀".encode()
    for cut in range(len(text) + 1):
        keep = _utf8_complete(text[:cut])
        assert text[:keep].decode() == text[:cut].decode("utf-8", "ignore")
    assert _utf8_complete(b"\xff\xfe") == 2  # not UTF-8 at all: nothing to wait for


async def test_invalid_utf8_is_malformed_and_offsets_stay_exact(tmp_path: Path) -> None:
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b"\xff\xfe garbage\n" + json.dumps([stored(1)]).encode() + b"\n")
    source = TrtllmSource(path)
    got = await drain(source)
    assert len(got) == 1
    assert [m.where for m in source.recent_malformed] == [f"{path}:1"]
    assert source.checkpoint()["offset"] == path.stat().st_size - 1


async def test_values_spanning_many_reads(tmp_path: Path) -> None:
    reads = [[stored(i, event_id=i)] for i in range(2000)]
    path = tmp_path / "big.json"
    path.write_text("\n".join(json.dumps(r) for r in reads))
    got = await drain(TrtllmSource(path, instance_id="w"))
    assert [b.events[0].event_id for b in got] == list(range(2000))
    assert isinstance(got[-1].events[0].data, Stored)
    assert key(got) == key(
        [b for r in reads for b in from_trtllm_events(r, instance_id="w", ts_ns=0)]
    )
