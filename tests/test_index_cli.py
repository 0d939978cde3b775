"""``kvstream index`` and ``kvstream replay`` through typer's CliRunner (small traces)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from index_support import Producer, tokens
from typer.testing import CliRunner

from kvstream.cli import index_cmd, replay_cmd
from kvstream.codec import write_container
from kvstream.workloads import trace_path
from kvstream.workloads.base import DataNotFoundError


def _trace_available() -> bool:
    try:
        return trace_path("conversation").is_file()
    except DataNotFoundError:
        return False


# The Mooncake traces live in shared/data beside the checkout (CI has them); skip elsewhere.
needs_trace = pytest.mark.skipif(not _trace_available(), reason="shared/data is not present")

app = typer.Typer()
app.command("index")(index_cmd.index)
app.command("replay")(replay_cmd.replay)
runner = CliRunner()


def small_trace(tmp_path: Path, rows: int = 300) -> Path:
    import gzip

    lines = gzip.decompress(trace_path("conversation").read_bytes()).decode().splitlines()[:rows]
    path = tmp_path / "small_trace.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_json(*args: str) -> dict:  # type: ignore[type-arg]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)  # type: ignore[no-any-return]


@needs_trace
def test_replay_reports_hits_balance_and_accuracy(tmp_path: Path) -> None:
    trace = small_trace(tmp_path)
    kv = run_json("replay", str(trace), "--workers", "4", "--capacity-blocks", "800")
    rr = run_json("replay", str(trace), "-w", "4", "-c", "800", "--router", "round-robin")
    assert kv["requests"] + kv["unservable"] == rr["requests"] + rr["unservable"] == 300
    assert kv["prediction_accuracy"] == 1.0
    assert kv["hit_ratio"] > rr["hit_ratio"] > 0
    assert kv["hit_ratio"] <= kv["ceiling_ratio"]
    assert len(kv["workers"]) == 4
    assert sum(w["requests"] for w in kv["workers"]) == kv["requests"]
    assert kv["imbalance"] < 2.0
    assert kv["index"]["stale_workers"] == 0
    assert kv["ttft_s"]["p90"] >= kv["ttft_s"]["p50"] >= 0


@needs_trace
def test_replay_by_trace_name_with_limit_and_text_output() -> None:
    res = runner.invoke(app, ["replay", "conversation", "-n", "120", "-w", "2", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "prefix hit ratio" in res.stdout
    assert "index predicted the reuse" in res.stdout
    assert "worker-1/-" in res.stdout
    rnd = run_json("replay", "synthetic", "-n", "80", "--router", "random", "--seed", "3")
    assert rnd["options"]["router"] == "random"
    assert rnd["requests"] == 80


def test_replay_bad_arguments_exit_2(tmp_path: Path) -> None:
    res = runner.invoke(app, ["replay", "conversation", "-n", "5", "--router", "fastest"])
    assert res.exit_code == 2
    assert "unknown router" in res.output
    res = runner.invoke(app, ["replay", str(tmp_path / "nope.jsonl")])
    assert res.exit_code == 2


def write_stream(directory: Path) -> tuple[list[int], list[int]]:
    """Two workers: a holds 3 blocks of prompt ``t``, b holds 1; returns (t, other)."""
    directory.mkdir()
    t = tokens(17)
    batches = []
    for name, n in (("a", 3), ("b", 1)):
        p = Producer(name)
        batches += [p.batch(p.created(), p.stored(p.chain(t)[:n]))]
    write_container(directory / "kvstream-1.avro", batches)
    return t, tokens(17, seed=4)


def test_index_answers_queries(tmp_path: Path) -> None:
    t, other = write_stream(tmp_path / "d")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text(json.dumps({"tokens": other}) + "\n" + json.dumps(t) + "\n")
    out = run_json(
        "index", str(tmp_path / "d"), "--query", " ".join(map(str, t)), "--queries", str(qfile)
    )
    assert out["batches"] == 2
    assert [w["worker"] for w in out["workers"]] == ["a/-", "b/-"]
    first, second, third = (q["matches"] for q in out["queries"])
    assert [m["matched_blocks"] for m in first] == [3, 1]
    assert [m["matched_blocks"] for m in second] == [0, 0]
    assert third == first
    res = runner.invoke(app, ["index", str(tmp_path / "d"), "-q", ",".join(map(str, t))])
    assert res.exit_code == 0, res.output
    assert "Query 1: 17 tokens" in res.stdout


def test_index_snapshot_then_resume(tmp_path: Path) -> None:
    t, _ = write_stream(tmp_path / "d")
    snap = tmp_path / "idx.snap"
    first = run_json(
        "index", str(tmp_path / "d"), "--snapshot", str(snap), "-q", " ".join(map(str, t))
    )
    assert first["batches"] == 2
    assert first["snapshots"] == 1
    assert snap.exists()
    again = run_json(
        "index", str(tmp_path / "d"), "--snapshot", str(snap), "-q", " ".join(map(str, t))
    )
    assert again["batches"] == 0  # resumed after what the snapshot covers
    assert again["queries"] == first["queries"]


def test_index_errors(tmp_path: Path) -> None:
    t, _ = write_stream(tmp_path / "d")
    res = runner.invoke(
        app, ["index", str(tmp_path / "d"), "-q", "1 2 3", "--hash-algo", "v2_sha256"]
    )
    assert res.exit_code == 2
    assert "blake3_64" in res.output
    res = runner.invoke(app, ["index", str(tmp_path / "d"), "-q", "1 x 3"])
    assert res.exit_code == 2
    bad = tmp_path / "bad.snap"
    bad.write_bytes(b"garbage")
    res = runner.invoke(app, ["index", str(tmp_path / "d"), "--snapshot", str(bad)])
    assert res.exit_code == 2
    res = runner.invoke(app, ["index", str(tmp_path / "missing")])
    assert res.exit_code == 2  # a missing input is a usage error, as in `events dump`
    assert "no such file" in res.output
    del t


@pytest.mark.kafka
@needs_trace
def test_replay_through_kafka(kafka: object) -> None:
    topic = kafka.topic("replay")  # type: ignore[attr-defined]
    url = f"kafka://{kafka.bootstrap}/{topic}"  # type: ignore[attr-defined]
    out = run_json("replay", "conversation", "-n", "60", "-w", "3", "--sink", url)
    assert out["requests"] == 60
    assert out["prediction_accuracy"] == 1.0
    assert out["malformed"] == 0
    res = run_json("index", url, "-q", "1 2 3")
    assert len(res["workers"]) == 3
    assert res["index"]["stale_workers"] == 0


@needs_trace
def test_consumer_side_needs_no_torch_and_no_kafka_client() -> None:
    import subprocess
    import sys

    code = (
        "import sys, asyncio\n"
        "import kvstream.index, kvstream.cli.index_cmd, kvstream.cli.replay_cmd\n"
        "from kvstream.cli.replay_run import ReplayOptions, run_replay\n"
        "asyncio.run(run_replay(ReplayOptions(limit=20, workers=2)))\n"
        "bad = [m for m in ('torch', 'aiokafka') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1]
    )
