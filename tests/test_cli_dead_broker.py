"""What a user sees when the Kafka broker is down (issue 24 item 14), and the log filter.

Before: a dozen identical aiokafka lines per run, ``KafkaConnectionError: KafkaConnectionError``
in the error, and a human summary that never said why the sink got nothing. Now library logs
go through the CLI's handler (repeats collapsed, with a count), every exception name is
printed once, the summary names the sink's last error, and no secret of the URL shows.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kafka_broker import free_port

from kvstream.cli.logs import CliLogHandler, RepeatFilter

KVSTREAM = [sys.executable, "-m", "kvstream.cli.main"]
SECRET = "dead-broker-secret-never-printed"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTREAM_KAFKA_")}
    return subprocess.run(
        [*KVSTREAM, *args],
        capture_output=True,
        text=True,
        timeout=240,
        env={**env, "COLUMNS": "300"},
        check=False,
    )


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("demo")
    done = run_cli("demo", "-o", str(out), "--requests", "12", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def dead_sink() -> str:
    # a loopback port nobody listens on: every connection is refused at once
    return (
        f"kafka://127.0.0.1:{free_port()}/x?security_protocol=SASL_PLAINTEXT"
        f"&sasl_mechanism=SCRAM-SHA-256&sasl_username=kv&sasl_password={SECRET}"
    )


def test_bridge_to_a_dead_broker_says_why_once(demo_dir: Path) -> None:
    done = run_cli("bridge", str(demo_dir), "--sink", dead_sink())
    assert done.returncode == 1
    out, err = done.stdout, done.stderr
    assert SECRET not in out + err
    assert "Traceback" not in err
    unable = [line for line in err.splitlines() if "Unable connect to" in line]
    # the first one, then how many more there were (aiokafka retried ~10 times)
    assert 1 <= len(unable) <= 2, err
    assert unable[0].startswith("error: aiokafka: ")
    if len(unable) == 2:
        assert "(repeated " in unable[1]
    assert "KafkaConnectionError: KafkaConnectionError" not in " ".join((out + err).split())
    # the human summary says why the sink got nothing
    summary = " ".join(out.split())
    assert "sink kafka: 0 events delivered" in summary
    assert "last error:" in summary
    assert "Unable to bootstrap" in summary


def test_bridge_json_to_a_dead_broker_keeps_secrets(demo_dir: Path) -> None:
    done = run_cli("bridge", str(demo_dir), "--sink", dead_sink(), "--json")
    assert done.returncode == 1
    assert SECRET not in done.stdout + done.stderr
    result = json.loads(done.stdout)
    assert "sasl_password=***" in result["sinks"][0]
    error = result["close"]["sinks"]["kafka"]["last_error"]
    assert error.count("KafkaConnectionError") == 1, error


def test_demo_to_a_dead_broker_names_each_error_once() -> None:
    done = run_cli("demo", "--sink", dead_sink(), "--requests", "4")
    assert done.returncode == 1
    err = " ".join(done.stderr.split())
    assert SECRET not in done.stdout + done.stderr
    assert "Traceback" not in err
    assert "KafkaConnectionError: KafkaConnectionError" not in err
    assert "KafkaConnectionError: Unable to bootstrap" in err


def _record(msg: str, name: str = "aiokafka.conn", level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_repeat_filter_collapses_and_counts() -> None:
    now = [0.0]
    f = RepeatFilter(window_s=60.0, clock=lambda: now[0])
    assert f.filter(_record("down"))
    assert not any(f.filter(_record("down")) for _ in range(11))
    assert f.filter(_record("another"))  # other messages are not held back
    assert f.filter(_record("down", name="kvstream.pipeline"))  # nor other loggers' copies
    (summary,) = f.pending()
    assert summary.getMessage() == "down (repeated 11 more times)"
    assert f.pending() == []  # counted once
    assert not f.filter(_record("down"))
    now[0] = 61.0  # the window ended: shown again, with the count since
    again = _record("down")
    assert f.filter(again)
    assert again.getMessage() == "down (repeated 1 more time before)"


def test_handler_lines_and_exit_summary(capsys: pytest.CaptureFixture[str]) -> None:
    handler = CliLogHandler()
    for _ in range(3):
        handler.handle(_record("Unable connect"))
    try:
        raise ConnectionRefusedError("refused")
    except ConnectionRefusedError:
        record = _record("sink failed", name="kvstream.pipeline.worker")
        handler.handle(_record(f"source:kafka://h:1/t?sasl_password={SECRET}&x=1: down"))
        record.exc_info = sys.exc_info()
    handler.handle(record)
    handler.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "error: aiokafka: Unable connect",
        "error: aiokafka: source:kafka://h:1/t?sasl_password=***&x=1: down",
        "error: kvstream: sink failed (ConnectionRefusedError: refused)",
        "error: aiokafka: Unable connect (repeated 2 more times)",
    ]


def test_shard_to_a_dead_broker_keeps_secrets() -> None:
    done = run_cli("shard", dead_sink(), "--shard", "0/1", "--no-follow", "--block-size", "16")
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "Unable to bootstrap" in done.stderr
