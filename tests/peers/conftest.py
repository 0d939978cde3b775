"""Shared fixtures of the peer tests (issue 11 §9): kvstream against the real vLLM 0.33.0,
SGLang 0.5.23 and ai-dynamo-runtime 1.6.1, which ``scripts/test-peers`` installs in a side venv.

Without those packages (kvstream's own venv, CI) the directory's tests are not collected at all,
so ``scripts/test`` neither fails nor errors on them. ``KVSTREAM_PEER_PYTHON`` naming a peer
venv's interpreter collects them anyway: the tests that run the peers in a subprocess use it.

The capture helpers of ``scripts/peers`` (``golden``, ``peer_imports``) are importable here.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEER_SCRIPTS = ROOT / "scripts" / "peers"
GOLDEN = ROOT / "tests" / "data" / "golden"


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


PEERS_INSTALLED = _installed("vllm") and _installed("dynamo")
if not PEERS_INSTALLED and not os.environ.get("KVSTREAM_PEER_PYTHON"):
    collect_ignore_glob = ["test_*.py"]
if str(PEER_SCRIPTS) not in sys.path:
    sys.path.insert(0, str(PEER_SCRIPTS))


def free_tcp_port() -> int:
    """A loopback TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def free_port() -> Callable[[], int]:
    """``free_port()`` returns a free loopback TCP port."""
    return free_tcp_port


@pytest.fixture(scope="session")
def vllm_kv() -> Any:
    """vLLM 0.33's ``vllm.distributed.kv_events`` (KVEventBatch, BlockStored, publisher...)."""
    return pytest.importorskip("vllm.distributed.kv_events")


@pytest.fixture
def vllm_publisher(vllm_kv: Any) -> Iterator[Callable[..., Any]]:
    """Start vLLM's real ``ZmqEventPublisher``, as an engine does, and shut it down afterwards.

    ``start(port, replay_port=None, *, dp_rank=0, topic="", **config)`` builds it with
    ``EventPublisherFactory.create(KVEventsConfig(endpoint="tcp://*:port", ...), dp_rank)``, so
    it binds ``port + dp_rank`` (and ``replay_port + dp_rank``). Publish vLLM's own objects:
    ``pub.publish(vllm_kv.KVEventBatch(ts=..., events=[vllm_kv.BlockStored(...)]))``; the
    publisher stamps its DP rank into a batch whose ``data_parallel_rank`` is None.
    """
    from vllm.config.kv_events import KVEventsConfig

    started: list[Any] = []

    def start(
        port: int,
        replay_port: int | None = None,
        *,
        dp_rank: int = 0,
        topic: str = "",
        **config: Any,
    ) -> Any:
        cfg = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{port}",
            replay_endpoint=None if replay_port is None else f"tcp://*:{replay_port}",
            topic=topic,
            **config,
        )
        publisher = vllm_kv.EventPublisherFactory.create(cfg, data_parallel_rank=dp_rank)
        started.append(publisher)
        return publisher

    yield start
    for publisher in started:
        publisher.shutdown()


@pytest.fixture(scope="session")
def sglang_kv() -> Any:
    """SGLang 0.5.23's ``sglang.srt.disaggregation.kv_events`` (imported as
    ``scripts/peers/peer_imports.py`` explains)."""
    import peer_imports

    try:
        return peer_imports.load_sglang_kv_events()
    except ModuleNotFoundError as exc:
        pytest.skip(f"SGLang 0.5.23 not importable: {exc}")


@pytest.fixture
def sglang_publisher(sglang_kv: Any) -> Iterator[Callable[..., Any]]:
    """Start SGLang's real ``ZmqEventPublisher`` from a ``--kv-events-config`` JSON, as its
    scheduler does; ``start(port, replay_port=None, *, attn_dp_rank=0, topic="", **config)``
    binds ``port + attn_dp_rank``. Publish ``sglang_kv.KVEventBatch`` objects."""
    started: list[Any] = []

    def start(
        port: int,
        replay_port: int | None = None,
        *,
        attn_dp_rank: int = 0,
        topic: str = "",
        **config: Any,
    ) -> Any:
        cfg = {"publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": topic, **config}
        if replay_port is not None:
            cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
        publisher = sglang_kv.EventPublisherFactory.create(json.dumps(cfg), attn_dp_rank)
        started.append(publisher)
        return publisher

    yield start
    for publisher in started:
        publisher.shutdown()
        atexit.unregister(publisher.shutdown)  # SGLang's publisher registers it for exit too


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """``tests/data/golden``: the captured frames (format described in its README.md)."""
    return GOLDEN
