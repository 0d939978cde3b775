"""benchmarks/bench_peers.py runs (``--tiny``), so it cannot rot: every row gets a value on
kvstream's side (in this interpreter, Dynamo left out), and with NVIDIA Dynamo
(ai-dynamo-runtime: ``.peers-venv``, or the interpreter ``KVSTREAM_PEER_PYTHON`` names; the
test skips without it) every Dynamo row gets the peer's value, both sides agree on every
match query (the benchmark stops otherwise) and the pure-Python fallback's table comes out.
No timing is asserted: the sizes are too small to mean anything."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_peers.py"

#: rows with Dynamo as the peer (match p50 and hash + match p99 have no goal, but a peer)
DYNAMO_ROWS = [
    f"ingest, {m} (M blocks/s)" for m in ("engine-keyed", "token-keyed", "Dynamo-keyed")
] + [
    "match p50 (us)",
    "match p99 (us)",
    "hash + match p50 (us)",
    "hash + match p99 (us)",
    "hash + match p50, Dynamo-keyed (us)",
    "memory, engine-keyed (MiB/M pairs)",
    "memory, token-keyed (MiB/M pairs)",
    "memory, Dynamo-keyed (MiB/M pairs)",
]
OTHER_ROWS = [
    "encode, uniform tokens (M blocks/s)",
    "decode to columns, zipf (M blocks/s)",
    "bytes, uniform tokens (KiB/batch)",
    "file -> index, demo stream (M blocks/s)",
    "file -> index, demo uncompressed (M blocks/s)",
    "replay, conversation trace (s CPU)",
]


def peer_python() -> str | None:
    """An interpreter that imports ai-dynamo-runtime, or None."""
    candidates = [
        sys.executable,
        os.environ.get("KVSTREAM_PEER_PYTHON", ""),
        str(ROOT / ".peers-venv" / "bin" / "python"),
    ]
    for py in filter(None, candidates):
        if not Path(py).exists():
            continue
        ok = subprocess.run(
            [py, "-c", "import dynamo.llm, kvstream"], check=False, capture_output=True
        )
        if ok.returncode == 0:
            return py
    return None


def run(python: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [python, str(SCRIPT), "--tiny", "--rounds=1", f"--json={out}", *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_every_row_runs_on_kvstreams_side(tmp_path: Path) -> None:
    """Every section in this interpreter, Dynamo left out (CI has no ai-dynamo-runtime)."""
    doc = run(sys.executable, tmp_path, "--no-peer")
    rows = {r["metric"]: r for r in doc["rows"]}
    for name in DYNAMO_ROWS:
        assert isinstance(rows[name]["kvstream"], float), name
        assert rows[name]["peer"] is None, name
    for name in OTHER_ROWS:
        assert math.isfinite(rows[name]["kvstream"]), name
        assert rows[name]["kvstream"] > 0, name
    assert rows["replay, conversation trace (s CPU)"]["goal"] == "<= 5 abs"
    assert rows["file -> index, demo stream (M blocks/s)"]["peer"] > 0


def test_dynamo_rows_and_the_pure_fallback(tmp_path: Path) -> None:
    """The index sections against Dynamo (the run stops if any match answer differs), and
    the same rows again with KVSTREAM_NO_NATIVE=1."""
    python = peer_python()
    if python is None:
        pytest.skip("ai-dynamo-runtime is not importable (scripts/test-peers installs it)")
    doc = run(python, tmp_path, "--pure", "--skip=codec,file,replay")
    assert doc["dynamo"] is True
    rows = {r["metric"]: r for r in doc["rows"]}
    for name in DYNAMO_ROWS:
        row = rows[name]
        assert math.isfinite(row["kvstream"]), name
        assert math.isfinite(row["peer"]), name
        assert row["peer"] > 0, name
    pure = {r["metric"]: r for r in doc["pure"]}
    assert set(pure) == set(rows)
    assert all(math.isfinite(r["slower"]) for r in pure.values())
