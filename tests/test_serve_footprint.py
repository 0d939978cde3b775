"""What ``kvstream serve`` loads: a service following engines over ZMQ and answering Dynamo's
queries imports no numpy, no codec (fastavro), no pipeline and no prometheus-client (they
cost it ~20 MiB of RSS against Dynamo's whole service); those load when a feature needs them
(a Kafka or file source, an engine hash algorithm, the first ``/metrics`` scrape).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from serve_support import Engine, local_path, signed

from kvstream.serve import Client

#: Modules a service that only follows engines must not load (the ``kvstream.codec`` package
#: itself loads: the index's C loop ``_columns_native`` lives in it).
NOT_NEEDED = (
    "numpy",
    "fastavro",
    "kvstream.codec.codec",
    "kvstream.codec.decoder",
    "kvstream.pipeline",
    "prometheus_client",
)

_RUN = """
import atexit, json, sys
out, argv = sys.argv[1], sys.argv[2:]
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["kvstream", *argv]
from kvstream.cli.main import main
main()
"""


def _serve(tmp_path: Path, *argv: str) -> tuple[subprocess.Popen[str], Path, str]:
    """``kvstream serve ARGV`` in a subprocess that writes its loaded modules at exit."""
    modules = tmp_path / "modules.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", _RUN, str(modules), "serve", "--port", "0", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    url = json.loads(proc.stdout.readline())["listening"]
    return proc, modules, url


def _stop(proc: subprocess.Popen[str], modules: Path) -> set[str]:
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    loaded: list[str] = json.loads(modules.read_text())
    return set(loaded)


def test_following_an_engine_and_answering_loads_no_numpy_codec_pipeline_or_prometheus(
    tmp_path: Path,
) -> None:
    e = Engine(4)
    proc, modules, url = _serve(
        tmp_path,
        "--block-size",
        "4",
        "--workers",
        f"7=tcp://127.0.0.1:{e.port};tcp://127.0.0.1:{e.replay_port}",
    )
    try:
        prompt, branch = list(range(1, 13)), [1, 2, 3, 4, 99, 98, 97, 96]
        e.store(prompt)
        e.store(branch)
        e.evict_leaves(1)  # the prompt's last block
        deadline = time.monotonic() + 20
        with Client(url) as c:
            while [c.query(p)["scores"] for p in (prompt, branch)] != [{"7": {"0": 8}}] * 2:
                assert time.monotonic() < deadline, "the engine's events never arrived"
                time.sleep(0.05)
            by_hash = c.query_by_hash([signed(h) for h in local_path(prompt, 4)])
            assert by_hash["scores"] == {"7": {"0": 8}}
            assert c.route(prompt)["instance_id"] == "7"
            assert c.dump()
            assert c.workers()[0]["status"] == "active"
            assert "ready" in c.ready()
        loaded = _stop(proc, modules)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        e.close()
    assert "kvstream.serve.server" in loaded  # the probe saw the service's own modules
    assert [m for m in NOT_NEEDED if m in loaded] == []


def test_a_metrics_scrape_loads_prometheus_client_then(tmp_path: Path) -> None:
    proc, modules, url = _serve(tmp_path, "--block-size", "4")
    try:
        with Client(url) as c:
            c.health()
            text = c.metrics()
        loaded = _stop(proc, modules)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "prometheus_client" in loaded
    assert 'kvstream_serve_request_duration_seconds_bucket{endpoint="/health",le="0.00025"}' in text
    assert "process_resident_memory_bytes" in text


def test_latency_bucket_labels_are_prometheus_clients() -> None:
    from prometheus_client.utils import floatToGoString

    from kvstream.serve.metrics import LATENCY_BUCKETS, LE_LABELS

    want = [floatToGoString(b) for b in (*LATENCY_BUCKETS, float("inf"))]  # type: ignore[no-untyped-call]
    assert list(LE_LABELS) == want
