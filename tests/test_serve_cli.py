"""``kvstream serve`` and ``kvstream query`` as processes: start, answer, SIGTERM writes a last
snapshot and exits 0, and the exit codes of bad configurations and refused queries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from serve_support import Engine

from kvstream.serve import Client

KVSTREAM = [sys.executable, "-m", "kvstream.cli.main"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVSTREAM, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_serve_answers_and_a_sigterm_writes_the_last_snapshot(tmp_path: Path) -> None:
    snap = tmp_path / "s.snap"
    e = Engine(4)
    workers = f"7=tcp://127.0.0.1:{e.port};tcp://127.0.0.1:{e.replay_port}"
    proc = subprocess.Popen(
        [
            *KVSTREAM,
            "serve",
            "--port",
            "0",
            "--block-size",
            "4",
            "--workers",
            workers,
            "--snapshot",
            str(snap),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        url = first["listening"]
        assert first["models"] == ["default:default"]
        prompt = list(range(1, 13))
        e.store(prompt)
        deadline = time.monotonic() + 20
        with Client(url) as c:
            while not c.query(prompt)["scores"]:
                assert time.monotonic() < deadline, "the engine's blocks never arrived"
                time.sleep(0.05)
        q = run("query", url, "--tokens", " ".join(map(str, prompt)))
        assert q.returncode == 0, q.stderr
        assert "7" in q.stdout
        assert "12" in q.stdout
        q = run("query", url, "--tokens", "1 2 3", "--model-name", "nope")
        assert q.returncode == 2
        assert "no indexer for model=nope" in q.stderr
        q = run("query", url, "--tokens", "1 x 3")
        assert q.returncode == 2
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        e.close()
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"stopped": True, "snapshots": 1}
    assert snap.stat().st_size > 0


def test_bad_configurations_exit_2_with_one_line(tmp_path: Path) -> None:
    for args, why in [
        (["--workers", "1=tcp://127.0.0.1:5557"], "--workers needs --block-size"),
        (["--workers", "bogus", "--block-size", "4"], "expected ID"),
        (["--tls-cert", str(tmp_path / "c.pem")], "both --tls-cert and --tls-key"),
        (["--auth-token-file", str(tmp_path / "missing")], "cannot read --auth-token-file"),
        (["--source", "kafka://127.0.0.1:9092/t"], "give the model's block size"),
    ]:
        r = run("serve", "--port", "0", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert why in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
    bad = tmp_path / "bad.snap"
    bad.write_bytes(b"not a snapshot at all, clearly")
    r = run("serve", "--port", "0", "--snapshot", str(bad))
    assert r.returncode == 2
    assert "snapshot" in r.stderr
    assert "Traceback" not in r.stderr


def test_query_without_a_service_exits_1() -> None:
    env = {**os.environ}
    r = subprocess.run(
        [*KVSTREAM, "query", "http://127.0.0.1:9", "--tokens", "1 2"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert r.returncode == 1
    assert "cannot be reached" in r.stderr
