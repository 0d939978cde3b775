"""What the golden-frame capture scripts (``capture_vllm.py``, ``capture_sglang.py``) share.

It records what a real engine publisher puts on the wire, from the outside: a SUB socket
connected to the publisher's PUB port keeps every live message's raw frames, and a DEALER asks
the publisher's replay ROUTER for everything from seq 0 and keeps the raw reply frames. Next to
each frame it writes the *expected* decoded content, converted from the producer's own event
objects (msgspec structs) before they were encoded, never from kvstream.

A capture is one JSON file (format ``kvstream-golden/1``, described in
``tests/data/golden/README.md``). It never imports kvstream and runs in the peer venv.
"""

from __future__ import annotations

import enum
import json
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import zmq

ROOT = Path(__file__).resolve().parents[2]
FORMAT = "kvstream-golden/1"
#: Batch timestamps are fixed (the engines use ``time.time()``) so captures are reproducible.
TS0 = 1767225600.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)
RECV_TIMEOUT_MS = 5000


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def to_expected(value: Any) -> Any:
    """JSON form of a producer's object: structs become dicts (``type`` = msgspec tag, every
    field, defaults included), enums their value, bytes ``{"$bytes": hex}``, tuples lists."""
    if isinstance(value, msgspec.Struct):
        out: dict[str, Any] = {}
        tag = type(value).__struct_config__.tag
        if tag is not None:
            out["type"] = tag
        for name in type(value).__struct_fields__:
            out[name] = to_expected(getattr(value, name))
        return out
    if isinstance(value, enum.Enum):
        return to_expected(value.value)
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        return [to_expected(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_expected(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"no golden form for {type(value).__name__}: {value!r}")


class Step:
    """One published batch: what the scenario did, and the producer's batch object."""

    def __init__(self, what: str, batch: Any) -> None:
        self.what = what
        self.batch = batch


class Capture:
    """Records one publisher's live frames and replay replies on loopback.

    ``pub_port``/``replay_port`` are the ports the publisher actually binds (after its DP-rank
    offset). ``topic`` is the subscription prefix (the publisher's configured topic).
    """

    def __init__(self, pub_port: int, replay_port: int | None, topic: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.monitor.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        self.sub.connect(f"tcp://127.0.0.1:{pub_port}")
        self.replay_port = replay_port

    def wait_until_subscribed(self) -> None:
        """Wait for the SUB's handshake; its subscription goes out right after it.

        PUB drops what it sends before the subscription reaches it: a capture whose seqs do not
        start at 0 is rejected by ``live_frames`` rather than kept.
        """
        self.monitor.recv_multipart()
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        time.sleep(0.2)

    def live_frames(self, count: int) -> list[list[bytes]]:
        frames = [self.sub.recv_multipart() for _ in range(count)]
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        if seqs != list(range(count)):
            raise RuntimeError(f"live capture lost frames: seqs {seqs}")
        return frames

    def replay_from(self, start: int) -> tuple[list[bytes], list[list[bytes]]]:
        """Ask the ROUTER for every batch from ``start``; the request as sent and the replies
        as the DEALER receives them (empty delimiter first), end marker included."""
        assert self.replay_port is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{self.replay_port}")
        request = [b"", start.to_bytes(8, "big")]
        dealer.send_multipart(request)
        replies: list[list[bytes]] = []
        while True:
            reply = dealer.recv_multipart()
            replies.append(reply)
            if END_SEQ in reply[1:3] and reply[-1] == b"":
                break
        dealer.close()
        return request, replies

    def close(self) -> None:
        self.sub.close(linger=0)


def record(
    *,
    name: str,
    producer: dict[str, Any],
    provenance: dict[str, Any],
    config: dict[str, Any],
    steps: Sequence[Step],
    publish: Callable[[Any], None],
    capture: Capture,
    topic: str,
    batch_fields: tuple[str, ...],
) -> dict[str, Any]:
    """Publish every step's batch, record the frames, and build the golden document.

    ``publish`` is the real publisher's ``publish``; the expectation of a batch is taken right
    after it (the publisher stamps its DP rank into the batch object before queueing it).
    """
    capture.wait_until_subscribed()
    expected: list[dict[str, Any]] = []
    for seq, step in enumerate(steps):
        publish(step.batch)
        batch = to_expected(step.batch)
        if isinstance(batch, list) or set(batch) != set(batch_fields):
            raise RuntimeError(f"unexpected batch fields {batch!r}")
        expected.append({"topic": topic, "seq": seq, "batch": batch})
    frames = capture.live_frames(len(steps))
    live = [
        {"what": step.what, "frames": [f.hex() for f in fr], "expected": exp}
        for step, fr, exp in zip(steps, frames, expected, strict=True)
    ]
    doc: dict[str, Any] = {
        "format": FORMAT,
        "name": name,
        "producer": producer,
        "provenance": provenance,
        "config": config,
        "live": live,
    }
    if capture.replay_port is not None:
        request, replies = capture.replay_from(0)
        doc["replay"] = {
            "request": [f.hex() for f in request],
            "replies": [[f.hex() for f in r] for r in replies],
            "expected_seqs": [_reply_seq(r) for r in replies],
        }
    return doc


def _reply_seq(reply: list[bytes]) -> int:
    # [b"", seq, payload] (<= vLLM 0.25, SGLang <= 0.5.19) or [b"", topic, seq, payload].
    seq = reply[1] if len(reply) == 3 else reply[2]
    return int.from_bytes(seq, "big", signed=True)


def write(doc: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / f"{doc['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
