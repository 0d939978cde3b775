"""A vLLM-protocol engine publisher for tests: PUB bind + ROUTER replay on real sockets.

It reproduces what vLLM's ``ZmqEventPublisher`` (0.33) does on the wire — three frames
``[topic, seq, payload]``, seq from 0, a bounded replay buffer answered
``[id, "", topic, seq, payload]`` per batch then the ``-1`` end marker — plus the knobs a
test needs to play a misbehaving engine: skip frames (a gap as a slow subscriber sees it),
the pre-0.26 two-frame replay reply, garbage frames, a restart. Payload bytes are whatever
the test passes (real captured vLLM payloads in the interop tests).
"""

from __future__ import annotations

import socket
import threading
from collections import deque

import msgspec
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored_payload(i: int, rank: int | None = 0, *, lora: int | None = None) -> bytes:
    """A vLLM engine batch payload, number ``i``: one 4-token ``BlockStored`` whose hash is
    ``i + 1`` under parent ``i`` (none for the first), of DP ``rank`` and LoRA id ``lora``."""
    ev = {
        "type": "BlockStored",
        "block_hashes": [i + 1],
        "parent_block_hash": i or None,
        "token_ids": [i, i + 1, i + 2, i + 3],
        "block_size": 4,
        "lora_id": lora,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgspec.msgpack.encode([float(i), [ev], rank])


def free_ports(n: int) -> list[int]:
    """``n`` consecutive free TCP ports on 127.0.0.1 (base + rank layout)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65000:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind(("127.0.0.1", base + i))
            return [base + i for i in range(n)]
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise RuntimeError("no free consecutive ports")


class TestEnginePublisher:
    """One rank of an engine. ``replay_port`` None: no replay socket."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        port: int,
        replay_port: int | None = None,
        *,
        topic: bytes = b"",
        buffer_steps: int = 10_000,
        legacy_replay: bool = False,
    ) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.legacy_replay = legacy_replay
        self.replay_requests: list[int] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_port is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.router.bind(f"tcp://127.0.0.1:{replay_port}")
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    def publish(self, payload: bytes, *, send: bool = True) -> int:
        """Publish one batch (``send=False``: buffer it for replay only, as if the PUB had
        dropped it for this subscriber). Returns its seq."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Send arbitrary frames (garbage tests)."""
        self.pub.send_multipart(frames)

    def restart(self) -> None:
        """The engine process restarted: seq from 0, an empty replay buffer."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self.router.poll(50):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            self.replay_requests.append(start)
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for seq, payload in items:
                if self.legacy_replay:
                    self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
                else:
                    self.router.send_multipart(
                        [client, b"", self.topic, seq.to_bytes(8, "big"), payload]
                    )
            if self.legacy_replay:
                self.router.send_multipart([client, b"", END_SEQ, b""])
            else:
                self.router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
            self.router.close(0)
        self.pub.close(0)
        self.ctx.term()
