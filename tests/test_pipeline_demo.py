"""``kvstream demo``: the cache on a workload, streamed to sinks, read back and checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from conftest_kafka import KafkaEnv
from kvstream.sinks.file import list_files, read_dir
from typer.testing import CliRunner

from kvstream.cli.demo_cmd import demo

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command("demo")(demo)


@app.callback()
def _root() -> None:
    """(a group, so the command is invoked by name as under ``kvstream``)"""


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["demo", *args])
    return result.exit_code, result.stdout, result.stderr


def test_default_file_sink_round_trip_as_json(tmp_path: Path) -> None:
    code, out, err = run("--out", str(tmp_path / "kv"), "-n", "12", "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["ok"] is True
    assert summary["requests"] == 12
    assert summary["events"] == sum(summary["events_by_kind"].values()) > 0
    assert summary["events_by_kind"]["created"] == 2 * 2  # 2 ranks x 2 layer groups
    assert 0 <= summary["prefix_hit_rate"] <= 1
    (sink,) = summary["sinks"]
    assert sink["ok"]
    assert sink["events"] == summary["events"]
    assert sink["files"] == 1
    assert sum(len(b.events) for b in read_dir(tmp_path / "kv")) == summary["events"]
    assert summary["pipeline"]["undelivered_events"] == 0


def test_several_sinks_and_a_human_summary(tmp_path: Path) -> None:
    code, out, err = run(
        "--sink", "memory", "--sink", f"file://{tmp_path}/j?format=jsonl", "-n", "6", "--ranks", "1"
    )
    assert code == 0, err
    for text in ("prefix hit rate", "stored", "removed", "identical", "memory"):
        assert text in out
    assert list_files(tmp_path / "j")[0].suffix == ".jsonl"


def test_a_host_tier_turns_evictions_into_tier_moves(tmp_path: Path) -> None:
    def summary(*extra: str) -> dict[str, object]:
        args = ["--out", str(tmp_path / "x"), "-n", "150", "--gpu-blocks", "64", "--json"]
        code, out, err = run(*args, "--ranks", "1", *extra)
        assert code == 0, err
        return json.loads(out)  # type: ignore[no-any-return]

    plain, tiered = summary(), summary("--host-tier", "2")
    assert plain["ok"]
    assert tiered["ok"]
    plain_kinds = plain["events_by_kind"]
    tiered_kinds = tiered["events_by_kind"]
    assert isinstance(plain_kinds, dict)
    assert isinstance(tiered_kinds, dict)
    assert "updated" not in plain_kinds
    assert tiered_kinds["updated"] > 0
    assert tiered["prefix_hit_rate"] > plain["prefix_hit_rate"]  # type: ignore[operator]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sink", "nosuch://x"], "unknown sink"),
        (["--trace", "nope"], "unknown trace"),
        (["--sink", "memory?max_batches=zz"], "max_batches"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(args: list[str], message: str) -> None:
    code, _, err = run(*args, "-n", "2")
    assert code == 2
    assert message in err


def test_an_unreachable_kafka_sink_exits_1() -> None:
    from kafka_broker import free_port

    code, _, err = run("--sink", f"kafka://127.0.0.1:{free_port()}/t", "-n", "2", "--json")
    assert code == 1
    assert "cannot connect" in err


@pytest.mark.kafka
def test_demo_into_kafka(kafka: KafkaEnv) -> None:
    topic = kafka.topic("demo")
    url = f"kafka://{kafka.bootstrap}/{topic}?partitions=2"
    code, out, err = run("--sink", url, "-n", "8", "--json")
    assert code == 0, err
    (sink,) = json.loads(out)["sinks"]
    assert sink["ok"]
    assert sink["events"] > 0


def test_mooncake_demo_is_sized_to_the_trace_and_states_its_ceiling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KVSTREAM_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # the trace ships in the package
    code, out, err = run("--trace", "mooncake-conversation", "-n", "150", "-s", "memory", "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["ok"] is True
    assert s["requests"] == 150
    assert s["rejected_requests"] == 0
    ceiling = s["ceiling_hit_rate"]
    assert 0 < ceiling < 1
    # room for every distinct block of the rows: the hit rate is what the trace offers
    assert 0.9 * ceiling <= s["prefix_hit_rate"] <= ceiling
    code, out, err = run("--trace", "mooncake-conversation", "-n", "150", "-s", "memory")
    assert code == 0, err
    assert "unlimited cache" in out
    small = json.loads(
        run("--trace", "mooncake-conversation", "-n", "150", "-s", "memory",
            "--gpu-blocks", "512", "--json")[1]
    )  # fmt: skip
    assert small["evictions"] > s["evictions"]  # a cache too small for the trace
    assert small["ceiling_hit_rate"] == ceiling
