"""Peer test: the committed golden frames are what the real engine publishers produce.

``tests/data/golden`` holds frames captured from vLLM 0.33.0's and SGLang 0.5.23's real cache
managers and ``ZmqEventPublisher``s (and from the array-era publishers of vLLM 0.23.0 and SGLang
0.5.19), each frame with the content the producer's own event objects had before encoding
(issue 11 §1 "Golden frames"). This module checks that:

- ``scripts/peers/capture_vllm.py`` and ``capture_sglang.py`` rerun now write exactly the
  committed files (the goldens are reproducible from the real packages);
- every committed payload decodes to its committed expectation (the expectation is what the
  bytes say), and the replay replies carry the live frames' bytes;
- vLLM's own decoder reads the vLLM 0.33 payloads, and its real publisher (the
  ``vllm_publisher`` fixture), given the decoded batches, sends byte-identical frames.

Skipped without the peers; ``scripts/test-peers`` runs it. ``KVSTREAM_PEER_PYTHON`` runs the
capture scripts with another interpreter (a peer venv).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import golden  # scripts/peers, put on sys.path by conftest.py
import msgspec
import pytest

PEER_PYTHON = os.environ.get("KVSTREAM_PEER_PYTHON") or sys.executable
if sys.executable == PEER_PYTHON:
    pytest.importorskip("vllm.distributed.kv_events")

pytestmark = pytest.mark.peers

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "golden"
SCRIPTS = ["capture_vllm.py", "capture_sglang.py"]
CAPTURES = sorted(str(p.relative_to(GOLDEN).with_suffix("")) for p in GOLDEN.glob("*/*.json"))
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def load(name: str, base: Path = GOLDEN) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((base / f"{name}.json").read_text())
    return doc


def frames(hexes: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The capture scripts' output, run now into a temporary directory."""
    out = tmp_path_factory.mktemp("golden")
    for script in SCRIPTS:
        done = subprocess.run(
            [PEER_PYTHON, str(ROOT / "scripts" / "peers" / script), "--out", str(out)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, f"{script} failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_the_golden_set_is_complete() -> None:
    producers = {name.split("/")[0] for name in CAPTURES}
    assert producers == {"vllm-0.33.0", "vllm-0.23.0", "sglang-0.5.23", "sglang-0.5.19"}


def test_the_scripts_write_the_committed_captures_and_no_others(fresh: Path) -> None:
    written = sorted(str(p.relative_to(fresh).with_suffix("")) for p in fresh.glob("*/*.json"))
    assert written == CAPTURES


@pytest.mark.parametrize("name", CAPTURES)
def test_a_rerun_reproduces_the_committed_capture(fresh: Path, name: str) -> None:
    committed, now = load(name), load(name, fresh)
    assert [s["expected"] for s in now["live"]] == [s["expected"] for s in committed["live"]]
    assert [s["frames"] for s in now["live"]] == [s["frames"] for s in committed["live"]]
    assert now == committed


def _normalize_event(wire: Any, expected: dict[str, Any]) -> dict[str, Any]:
    """A decoded event (map, or positional array of the array era) as ``{field: value}`` over
    the expectation's fields; a field the wire leaves out is None (its default)."""
    if isinstance(wire, list):  # [tag, field1, field2, ...] in declaration order
        names = list(expected)
        assert len(wire) <= len(names), f"more slots than fields: {wire!r}"
        wire = dict(zip(names, wire, strict=False))
    assert isinstance(wire, dict), wire
    unknown = set(wire) - set(expected)
    assert not unknown, f"wire fields the producer's struct does not have: {unknown}"
    return {k: golden.to_expected(wire.get(k)) for k in expected}


@pytest.mark.parametrize("name", CAPTURES)
def test_every_payload_decodes_to_its_expectation(name: str) -> None:
    doc = load(name)
    rank_field = "data_parallel_rank" if name.startswith("vllm") else "attn_dp_rank"
    for step in doc["live"]:
        topic, seq, payload = frames(step["frames"])
        exp = step["expected"]
        assert topic == exp["topic"].encode()
        assert int.from_bytes(seq, "big") == exp["seq"]
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert (ts, rank) == (exp["batch"]["ts"], exp["batch"][rank_field])
        assert len(events) == len(exp["batch"]["events"])
        for wire, expected in zip(events, exp["batch"]["events"], strict=True):
            assert _normalize_event(wire, expected) == expected


@pytest.mark.parametrize("name", CAPTURES)
def test_replay_replies_carry_the_live_frames(name: str) -> None:
    doc = load(name)
    live = {s["expected"]["seq"]: frames(s["frames"]) for s in doc["live"]}
    replies = [frames(r) for r in doc["replay"]["replies"]]
    assert frames(doc["replay"]["request"]) == [b"", bytes(8)]
    assert doc["replay"]["expected_seqs"] == [*sorted(live), -1]
    two_frames = name.startswith(("vllm-0.23.0", "sglang-0.5.19"))
    for reply, seq in zip(replies, doc["replay"]["expected_seqs"], strict=True):
        assert reply[0] == b""  # the DEALER's empty delimiter
        if seq == -1:
            assert reply[1:] == ([END_SEQ, b""] if two_frames else [b"", END_SEQ, b""])
        else:
            topic, seq_bytes, payload = live[seq]
            assert reply[1:] == (
                [seq_bytes, payload] if two_frames else [topic, seq_bytes, payload]
            )


@pytest.mark.parametrize("name", [c for c in CAPTURES if c.startswith("vllm-0.33.0/")])
def test_vllm_decodes_its_payloads_to_the_expectation(vllm_kv: Any, name: str) -> None:
    decoder = msgspec.msgpack.Decoder(vllm_kv.KVEventBatch)
    for step in load(name)["live"]:
        batch = decoder.decode(frames(step["frames"])[2])
        assert golden.to_expected(batch) == step["expected"]["batch"]


@pytest.mark.parametrize(
    "name", ["vllm-0.33.0/sha256-int-dp0", "vllm-0.33.0/sha256_cbor-bytes-dp1"]
)
def test_vllm_publisher_resends_the_golden_frames_byte_for_byte(
    vllm_kv: Any, vllm_publisher: Callable[..., Any], free_port: Callable[[], int], name: str
) -> None:
    doc = load(name)
    rank, topic = doc["config"]["data_parallel_rank"], doc["config"]["topic"]
    decoder = msgspec.msgpack.Decoder(vllm_kv.KVEventBatch)
    batches = [decoder.decode(frames(s["frames"])[2]) for s in doc["live"]]
    port = free_port() - rank
    publisher = vllm_publisher(port, dp_rank=rank, topic=topic)
    capture = golden.Capture(port + rank, None, topic)
    try:
        capture.wait_until_subscribed()
        for batch in batches:
            publisher.publish(batch)
        received = capture.live_frames(len(batches))
    finally:
        capture.close()
    assert [[f.hex() for f in fr] for fr in received] == [s["frames"] for s in doc["live"]]
