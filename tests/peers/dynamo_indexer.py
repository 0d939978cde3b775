"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo 1.6.1) as a
subprocess on a loopback port, and its ``/dump`` flattened to comparable blocks; used by
``test_peer_serve.py`` and ``benchmarks/bench_serve.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

__all__ = ["Dynamo", "flatten"]


class Dynamo:
    """``python -m dynamo.indexer`` on a loopback port."""

    def __init__(
        self,
        port: int,
        log: Path,
        block_size: int,
        extra: tuple[str, ...] = (),
        cmd_prefix: tuple[str, ...] = (),
    ) -> None:
        """Start it with ``--block-size`` and ``extra`` arguments (``cmd_prefix``: e.g.
        ``taskset -c 1``), and wait for ``/health``."""
        self.port = port
        self._log = log.open("wb")
        self.log_path = log
        self.proc = subprocess.Popen(
            [
                *cmd_prefix,
                sys.executable,
                "-m",
                "dynamo.indexer",
                "--port",
                str(port),
                "--block-size",
                str(block_size),
                *extra,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(log.read_text(errors="replace")[-2000:]) from None
                time.sleep(0.1)

    def call(self, path: str, body: Any = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def flatten(dump: dict[str, Any]) -> set[tuple[Any, ...]]:
    """Every block of a ``/dump`` as (worker, rank, tier, parent, block hash, tokens hash)."""
    out = set()
    for entry in dump.values():
        for ev in entry["events"]:
            stored = ev["event"]["data"]["stored"]
            parent = stored["parent_hash"]
            for b in stored["blocks"]:
                out.add(
                    (
                        int(ev["worker_id"]),
                        ev["event"]["dp_rank"],
                        ev["storage_tier"],
                        parent,
                        b["block_hash"],
                        b["tokens_hash"],
                    )
                )
                parent = b["block_hash"]
    return out
