"""``kvstream bridge`` as a user runs it: a real process, real sockets, a real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest_kafka import KafkaEnv
from engine_publisher import TestEnginePublisher, free_ports
from kvstream.sinks.file import read_dir
from test_engine_source import payload

from kvstream.events.model import EventBatch, Lost, Stored
from kvstream.index.sources import open_source

KVSTREAM = [sys.executable, "-m", "kvstream.cli.main"]


def _bridge(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [*KVSTREAM, "bridge", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _stored_hashes(batches: list[EventBatch]) -> dict[int | None, list[int]]:
    out: dict[int | None, list[int]] = {}
    for b in batches:
        for e in b.events:
            if isinstance(e.data, Stored):
                out.setdefault(b.source.attention_dp_rank, []).extend(
                    int.from_bytes(x.block_hash, "big") for x in e.data.blocks
                )
    return out


def test_bridge_vllm_to_files_recovers_everything(tmp_path: Path) -> None:
    ports = free_ports(4)
    ranks = [TestEnginePublisher(ports[r], ports[2 + r]) for r in range(2)]
    try:
        for r, pub in enumerate(ranks):
            for i in range(3):  # published before the bridge started
                pub.publish(payload(100 * r + i, r))
        url = f"vllm://127.0.0.1:{ports[0]}?replay={ports[2]}&dp_size=2"
        proc = _bridge(url, "--sink", "file", "--out", str(tmp_path), "--idle-exit", "3", "--json")
        time.sleep(2.0)  # interpreter start + subscribe
        for r, pub in enumerate(ranks):
            for i in range(3, 6):
                pub.publish(payload(100 * r + i, r))
        out, err = proc.communicate(timeout=60)
    finally:
        for pub in ranks:
            pub.close()
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["ok"]
    assert summary["lost_ids"] == 0
    assert summary["stop_reason"].startswith("idle")
    batches = list(read_dir(tmp_path))
    assert _stored_hashes(batches) == {0: [1, 2, 3, 4, 5, 6], 1: [101, 102, 103, 104, 105, 106]}
    for rank in (0, 1):
        ids = [e.event_id for b in batches if b.source.attention_dp_rank == rank for e in b.events]
        assert ids == list(range(6))
    assert not any(isinstance(e.data, Lost) for b in batches for e in b.events)


def test_sigterm_flushes_and_exits_0(tmp_path: Path) -> None:
    ports = free_ports(2)
    pub = TestEnginePublisher(ports[0], ports[1])
    try:
        pub.publish(payload(0))
        proc = _bridge(f"vllm://127.0.0.1:{ports[0]}?replay={ports[1]}", "-o", str(tmp_path), "-q")
        time.sleep(2.0)
        pub.publish(payload(1))
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        pub.close()
    assert proc.returncode == 0, err
    assert "stopped by signal" in out
    assert _stored_hashes(list(read_dir(tmp_path))) == {0: [1, 2]}


def test_an_engine_that_never_starts_is_reported(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    proc = _bridge(f"vllm://127.0.0.1:{port}", "-o", str(tmp_path), "--idle-exit", "7", "--json")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(out)["batches"] == 0


def test_progress_line_says_what_it_waits_for(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    proc = _bridge(f"vllm://127.0.0.1:{port}", "-o", str(tmp_path), "--idle-exit", "6.5")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert f"waiting for the engine to publish on tcp://127.0.0.1:{port}" in err
    assert "stopped: idle for 6.5 s" in out


@pytest.mark.parametrize(
    "args",
    [
        ["vllm://127.0.0.1"],
        ["vllm://127.0.0.1:5557?from=never"],
        ["vllm://127.0.0.1:5557", "--sink", "nosuch://x"],
        ["vllm://127.0.0.1:5557", "--overflow", "sometimes"],
    ],
)
def test_bad_arguments_exit_2(args: list[str]) -> None:
    proc = subprocess.run(
        [*KVSTREAM, "bridge", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert "error" in proc.stderr


@pytest.mark.kafka
async def test_bridge_vllm_to_kafka_and_back(kafka: KafkaEnv, tmp_path: Path) -> None:
    ports = free_ports(2)
    topic = kafka.topic("bridge")
    pub = TestEnginePublisher(ports[0], ports[1])
    try:
        for i in range(4):
            pub.publish(payload(i))
        sink = f"kafka://{kafka.bootstrap}/{topic}?create_topic=true"
        proc = _bridge(
            f"vllm://127.0.0.1:{ports[0]}?replay={ports[1]}",
            "-s",
            sink,
            "--idle-exit",
            "3",
            "--json",
        )
        time.sleep(2.0)
        pub.publish(payload(4))
        _, err = proc.communicate(timeout=90)
    finally:
        pub.close()
    assert proc.returncode == 0, err
    # "Kafka -> a router" is the second command: read the topic back as a consumer would
    got: list[EventBatch] = []
    async with open_source(f"kafka://{kafka.bootstrap}/{topic}") as src:
        while (item := await src.read(10)) is not None:
            got.append(item.batch)
    assert _stored_hashes(got) == {0: [1, 2, 3, 4, 5]}


TRTLLM_EVENTS = [
    {
        "event_id": 0,
        "data": {"type": "created", "num_blocks_per_cache_level": [4096, 0]},
        "window_size": 4096,
    },
    {
        "event_id": 1,
        "data": {
            "type": "stored",
            "parent_hash": None,
            "blocks": [
                {
                    "type": "stored_block",
                    "block_hash": 924206229973855,
                    "tokens": [
                        {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                        for t in (1, 2, 3, 4)
                    ],
                    "cache_level": 0,
                    "priority": 35,
                    "mm_keys": [],
                }
            ],
        },
        "window_size": 4096,
    },
    {
        "event_id": 2,
        "data": {"type": "removed", "block_hashes": [924206229973855]},
        "window_size": 4096,
    },
]


@pytest.mark.parametrize("via_stdin", [False, True], ids=["file", "stdin"])
def test_bridge_trtllm_json_to_files(tmp_path: Path, via_stdin: bool) -> None:
    lines = "".join(json.dumps([e]) + "\n" for e in TRTLLM_EVENTS) + "not json\n"
    src = tmp_path / "events.jsonl"
    src.write_text(lines)
    out = tmp_path / "out"
    args = [*KVSTREAM, "bridge", "-" if via_stdin else str(src), "-o", str(out), "--json"]
    proc = subprocess.run(
        [*args, "--tokens-per-block", "4"],
        input=lines if via_stdin else None,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["stop_reason"] == "source ended"
    assert summary["source_stats"]["malformed"] == 1  # the bad line, counted, not fatal
    batches = list(read_dir(out))
    assert [e.event_id for b in batches for e in b.events] == [0, 1, 2]
    assert _stored_hashes(batches) == {None: [924206229973855]}


def test_prometheus_metrics_while_bridging(tmp_path: Path) -> None:
    import urllib.request

    ports = free_ports(3)
    pub = TestEnginePublisher(ports[0], ports[1])
    try:
        pub.publish(payload(0))
        url = f"vllm://127.0.0.1:{ports[0]}?replay={ports[1]}&instance=m0"
        proc = _bridge(url, "-o", str(tmp_path), "-q", "--metrics-port", str(ports[2]))
        text = ""
        for _ in range(60):
            time.sleep(0.5)
            pub.publish(payload(1))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ports[2]}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            if 'kvstream_bridge_batches_total{source="vllm://127.0.0.1' in text:
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        pub.close()
    assert proc.returncode == 0, err
    assert "kvstream_bridge_blocks_total" in text
    assert "kvstream_pipeline_events_out_total" in text  # the pipeline's own metrics
