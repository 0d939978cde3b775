"""The vllm:// sink accounts for every batch it does not publish (issue 24, item 1).

Real loopback sockets, the real pipeline and, at the end, ``kvstream bridge`` as a user runs
it. A refused batch (a rank outside ``dp_size``, a rank that cannot be bound, a second
instance) is lost, and the close report counts exactly its events; batches of the
instance and ranks a user selected out of a shared stream are published, the others skipped
on purpose (not a loss).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvstream.sinks.vllm import VllmSink
from pipeline_helpers import batches_for, source
from zmq_clients import Client, free_ports, replay, seqs

from kvstream.events.model import EventBatch
from kvstream.pipeline import CloseReport, Pipeline, PipelineConfig
from kvstream.sink import ExportStatus, create_sink

KVSTREAM = [sys.executable, "-m", "kvstream.cli.main"]


@pytest.fixture
async def ctx() -> AsyncIterator[Client]:
    client = Client()
    yield client
    client.close()


def _interleave(*streams: list[EventBatch]) -> list[EventBatch]:
    out: list[EventBatch] = []
    for i in range(max(len(s) for s in streams)):
        out.extend(s[i] for s in streams if i < len(s))
    return out


async def _run(sink: VllmSink, batches: list[EventBatch]) -> CloseReport:
    # small chunks: most exports mix published and refused batches
    config = PipelineConfig.load(defaults={"linger_s": 0, "max_export_batches": 3})
    pipe = Pipeline([sink], config)
    await pipe.start()
    for b in batches:
        assert pipe.submit(b)
    return await pipe.aclose(20)


def _published_hashes(replies: list[list[bytes]]) -> list[int]:
    return [
        h
        for r in replies[:-1]
        for e in msgspec.msgpack.decode(r[-1])[1]
        for h in e.get("block_hashes", [])
    ]


async def test_a_refused_rank_is_exactly_what_the_report_calls_undelivered(ctx: Client) -> None:
    base = free_ports(4)
    sink = VllmSink("127.0.0.1", base, replay_port=base + 2, dp_size=1)
    rank0 = batches_for(source("w0", 0), 60, 4, stored=True)
    rank1 = batches_for(source("w0", 1), 45, 3, stored=True)
    report = await _run(sink, _interleave(rank0, rank1))
    r = report.sinks["vllm"]
    assert r.events_out == 60
    assert r.undelivered_events == 45
    assert r.dropped == {"permanent_error": 45}
    assert r.lost_pending_ids == 45  # their markers are refused too: nothing covers the ids
    assert not r.ok
    assert not report.ok
    assert not report.timed_out  # refusals are permanent: close does not wait out markers
    assert "rank 1 of 'w0' is outside dp_size=1" in (r.last_error or "")
    assert sink.rejected_events["rank_out_of_range"] >= 45
    assert sink.published_events == 60


async def test_dp_size_auto_takes_the_ranks_from_the_stream(ctx: Client) -> None:
    base = free_ports(6)
    sink = VllmSink("127.0.0.1", base, replay_port=base + 3)  # dp_size=auto
    streams = [batches_for(source("w0", r), 20, 4, stored=True) for r in range(3)]
    report = await _run(sink, _interleave(*streams))
    assert report.ok, report.as_dict()
    assert sink.details()["ranks_bound"] == 3


async def test_dp_size_auto_publishes_every_rank_with_replay(ctx: Client) -> None:
    base = free_ports(6)
    sink = VllmSink("127.0.0.1", base, replay_port=base + 3)
    await sink.start()
    try:
        streams = [batches_for(source("w0", r), 8, 4, stored=True) for r in range(3)]
        assert (await sink.export(_interleave(*streams))).ok
        assert sink.dp_size == 3
        for rank in range(3):
            replies = await replay(ctx, str(sink.replay_endpoint(rank)), 0)
            assert seqs(replies) == [0, 1]
            assert _published_hashes(replies) == list(range(8))
    finally:
        await sink.shutdown(1.0)


async def test_a_rank_whose_ports_collide_is_refused_and_counted(ctx: Client) -> None:
    base = free_ports(3)
    # rank 1 would publish on base+1: rank 0's replay port
    sink = VllmSink("127.0.0.1", base, replay_port=base + 1)
    rank0 = batches_for(source("w0", 0), 12, 4, stored=True)
    rank1 = batches_for(source("w0", 1), 9, 3, stored=True)
    report = await _run(sink, _interleave(rank0, rank1))
    r = report.sinks["vllm"]
    assert (r.events_out, r.undelivered_events) == (12, 9)
    assert "overlap" in (r.last_error or "")
    assert sink.details()["rejected_batches"] == {
        "rank_unbindable": sink.rejected["rank_unbindable"]
    }


async def test_a_second_instance_is_lost_unless_one_is_selected(ctx: Client) -> None:
    a = batches_for(source("a", 0), 20, 4, stored=True)
    b = batches_for(source("b", 0), 12, 4, stored=True)
    base = free_ports(2)
    unselected = VllmSink("127.0.0.1", base, replay_port=base + 1)
    report = await _run(unselected, _interleave(a, b))
    r = report.sinks["vllm"]
    assert (r.events_out, r.undelivered_events) == (20, 12)
    assert "select one with instance=ID" in (r.last_error or "")

    base = free_ports(2)
    selected = create_sink(f"vllm://127.0.0.1:{base}?replay={base + 1}&instance=b")
    assert isinstance(selected, VllmSink)
    report = await _run(selected, _interleave(a, b))
    assert report.ok, report.as_dict()
    assert selected.published_events == 12
    assert selected.skipped_events == {"unselected_instance": 20}


async def test_ranks_selects_ranks_and_publishes_them_on_their_own_ports(ctx: Client) -> None:
    base = free_ports(4)
    sink = create_sink(f"vllm://127.0.0.1:{base}?replay={base + 2}&ranks=1")
    assert isinstance(sink, VllmSink)
    await sink.start()
    try:
        r0 = batches_for(source("w0", 0), 8, 4, stored=True)
        r1 = batches_for(source("w0", 1), 8, 4, stored=True)
        result = await sink.export(_interleave(r0, r1))
        assert result.ok
        assert sink.skipped == {"unselected_rank": 2}
        assert sink.replay_endpoint(1) == f"tcp://127.0.0.1:{base + 3}"
        replies = await replay(ctx, str(sink.replay_endpoint(1)), 0)
        assert _published_hashes(replies) == list(range(8))
        assert seqs(await replay(ctx, str(sink.replay_endpoint(0)), 0)) == []
    finally:
        await sink.shutdown(1.0)


async def test_abandon_names_exactly_the_batches_that_went_out() -> None:
    base = free_ports(2)
    sink = VllmSink("127.0.0.1", base, replay_port=base + 1, dp_size=1)
    await sink.start()
    try:
        mixed = _interleave(
            batches_for(source("w0", 0), 400, 2, stored=True),
            batches_for(source("w0", 1), 400, 2, stored=True),
        )
        result = await sink.export(mixed)
        assert result.status is ExportStatus.PERMANENT
        assert result.reason == (
            "batches not published: rank_out_of_range: rank 1 of 'w0' is outside dp_size=1 "
            "(dp_size=auto takes the ranks from the stream)"
        )
        assert sink.rejected == {"rank_out_of_range": 200}
        assert sink.rejected_events == {"rank_out_of_range": 400}
        delivered = sink.abandon().delivered
        assert list(delivered) == [b for b in mixed if b.source.attention_dp_rank == 0]
    finally:
        await sink.shutdown(1.0)


def _write_two_rank_dir(tmp_path: Path) -> tuple[Path, dict[int, int]]:
    import asyncio

    out = tmp_path / "stream"
    events = {0: 40, 1: 30}
    batches = _interleave(
        *(batches_for(source("w0", r), n, 5, stored=True) for r, n in events.items())
    )

    async def write() -> None:
        sink = create_sink(f"file://{out}")
        await sink.start()
        assert (await sink.export(batches)).ok
        await sink.shutdown()

    asyncio.run(write())
    return out, events


@pytest.mark.parametrize(
    ("query", "ok", "undelivered"),
    [("dp_size=1", False, 30), ("", True, 0), ("ranks=0", True, 0)],
    ids=["fixed-dp-size", "auto", "selected-rank"],
)
def test_bridge_exits_non_zero_and_reports_exactly_what_the_sink_refused(
    tmp_path: Path, query: str, ok: bool, undelivered: int
) -> None:
    directory, events = _write_two_rank_dir(tmp_path)
    base = free_ports(4)
    url = f"vllm://127.0.0.1:{base}?replay={base + 2}" + (f"&{query}" if query else "")
    proc = subprocess.run(
        [*KVSTREAM, "bridge", str(directory), "--sink", url, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    doc: dict[str, Any] = json.loads(proc.stdout)
    assert proc.returncode == (0 if ok else 1), proc.stderr
    assert doc["ok"] is ok
    rep = doc["close"]["sinks"]["vllm"]
    assert rep["undelivered_events"] == undelivered
    assert rep["events_out"] == sum(events.values()) - undelivered
    details = doc["sink_details"]["vllm"]
    if query == "dp_size=1":
        assert details["rejected_events"]["rank_out_of_range"] >= 30
        assert "outside dp_size=1" in rep["last_error"]
    if query == "ranks=0":
        assert details["skipped_events"] == {"unselected_rank": 30}
        assert details["published_batches"] == 8
