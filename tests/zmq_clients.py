"""Test-side ZMQ clients of a vLLM-format publisher: SUB, replay DEALER/REQ, free ports."""

from __future__ import annotations

import asyncio
import socket

import zmq
import zmq.asyncio

END_SEQ = b"\xff" * 8
TIMEOUT = 5.0


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports (the OS picks the base)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for i in range(n):
                t = socket.socket()
                held.append(t)
                t.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    raise RuntimeError("no run of free ports")


class Client:
    """The test's side: SUB, DEALER and REQ sockets, all closed at the end of the test."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sockets: list[zmq.asyncio.Socket] = []

    def socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        self.ctx.term()


async def subscribe(ctx: Client, endpoint: str, topic: bytes = b"") -> zmq.asyncio.Socket:
    """A SUB connected to ``endpoint`` whose subscription has reached the publisher."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    await asyncio.wait_for(monitor.recv_multipart(), TIMEOUT)
    sub.disable_monitor()
    monitor.close(linger=0)
    await asyncio.sleep(0.1)  # the subscription goes out right after the handshake
    return sub


async def recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    return list(await asyncio.wait_for(sock.recv_multipart(), TIMEOUT))


async def replay(
    ctx: Client, endpoint: str, start: int, *, delimiter: bool = False
) -> list[list[bytes]]:
    """Ask a replay ROUTER from ``start`` through a DEALER; every reply up to the end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    request = start.to_bytes(8, "big")
    await dealer.send_multipart([b"", request] if delimiter else [request])
    replies = []
    while True:
        frames = await recv(dealer)
        replies.append(frames)
        if frames[-2] == END_SEQ:
            return replies


def seqs(replies: list[list[bytes]]) -> list[int]:
    return [int.from_bytes(r[-2], "big") for r in replies[:-1]]
