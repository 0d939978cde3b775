"""benchmarks/bench_pipeline_kafka.py at a tiny size, so it cannot rot: every row runs
against a real tansu broker and reads its topic back (the benchmark fails on a lost id)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kafka_broker import BrokerUnavailable, tansu_binary

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.kafka]


def test_bench_pipeline_kafka_runs_and_reads_every_id_back() -> None:
    try:
        tansu_binary()
    except BrokerUnavailable as exc:
        pytest.skip(f"no Kafka broker for tests: {exc}")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_pipeline_kafka.py"),
            "--workers",
            "3",
            "--batches-per-worker",
            "4",
            "--rounds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "every id read back" in out.stdout
    assert "pipeline / the better raw aiokafka row" in out.stdout
