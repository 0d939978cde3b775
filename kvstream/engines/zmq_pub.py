"""Publish payloads the way vLLM's ``ZmqEventPublisher`` does: PUB frames plus a replay ROUTER.

One :class:`ZmqPublisher` per data-parallel rank (:class:`PublisherGroup` binds rank r at
``PORT + r`` and its replay ROUTER at ``REPLAY + r``, like vLLM's ``offset_endpoint_port``):

- every payload goes out as three frames ``[topic, seq (8 bytes big-endian), payload]``;
  ``seq`` counts from 0 per publisher (per process, in vLLM) and +1 per payload;
- the last ``buffer_steps`` ``(seq, payload)`` pairs are kept for replay. A client sends the
  start seq as 8 bytes big-endian from a REQ (the ROUTER sees ``[id, "", start]``) or a
  DEALER (``[id, start]``, or ``[id, "", start]`` when it adds the delimiter itself). The
  answer mirrors the request's envelope: one ``[topic, seq, payload]`` message (vLLM >= 0.26)
  per buffered payload with ``seq >= start``, in order, then the end marker
  ``["", ffffffffffffffff, ""]``. Malformed requests are counted and ignored;
- :meth:`ZmqPublisher.restart` is what an engine restart looks like to a subscriber: ``seq``
  starts again at 0 and the replay buffer is emptied.

Sending never blocks the event loop: PUB drops a slow subscriber's messages at ``hwm`` (as in
vLLM; there is no acknowledgement), so :meth:`ZmqPublisher.publish` is a synchronous,
non-blocking send. Replay requests are served by one asyncio task per rank on pyzmq's asyncio
API, concurrently with publishing and yielding to the loop every few hundred messages; the
ROUTER's send high-water mark is ``2 * (buffer_steps + 1)`` so a full replay plus its marker
fits (vLLM 0.33 does the same).

Socket errors surface as kvstream errors: binding an address in use raises :class:`OSError`
(``EADDRINUSE``; it may free up), any other bind failure :class:`~kvstream.errors.ConfigError`;
publishing on a closed publisher raises :class:`ConnectionError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections import deque
from typing import Any, Final

import zmq
import zmq.asyncio

from kvstream.errors import ConfigError

__all__ = ["END_SEQ", "PublisherGroup", "ZmqPublisher", "tcp_endpoint"]

log = logging.getLogger("kvstream.engines.zmq")

#: The replay end marker's seq: -1 as 8 bytes big-endian.
END_SEQ: Final = b"\xff" * 8
#: Replay messages sent between two yields to the event loop.
_REPLAY_CHUNK: Final = 256


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://host:port`` (IPv6 hosts bracketed; ``*`` and ``0.0.0.0`` bind every interface)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


class ZmqPublisher:
    """One rank's PUB socket and replay ROUTER (module docstring).

    ``context`` is shared by a :class:`PublisherGroup`; without one the publisher makes and
    terminates its own. :meth:`start` binds (from inside a running event loop),
    :meth:`close` releases; both are idempotent.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        _check_sizes(buffer_steps, hwm)
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self._own_context = context is None
        self._ctx = context
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._generation = 0  # +1 per restart: a replay in progress stops at a restart
        self._closed = False
        #: Payloads published, replay requests served, malformed replay requests.
        self.published = 0
        self.replays = 0
        self.bad_requests = 0

    @property
    def next_seq(self) -> int:
        """The seq the next payload gets."""
        return self._seq

    @property
    def buffered(self) -> list[int]:
        """The seqs a replay can still return, oldest first."""
        return [seq for seq, _ in self._buffer]

    @property
    def started(self) -> bool:
        """True between :meth:`start` and :meth:`close`."""
        return self._pub is not None

    async def start(self) -> None:
        """Bind the PUB socket and the replay ROUTER and start serving replays."""
        if self._closed:
            raise ConnectionError("the publisher is closed")
        if self._pub is not None:
            return
        ctx = self._ctx
        if ctx is None:
            ctx = self._ctx = zmq.asyncio.Context()
        # a plain socket on the same context: PUB sends are synchronous and never block
        pub: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        router: zmq.asyncio.Socket | None = None
        try:
            _bind(pub, self.endpoint)
            if self.replay_endpoint is not None:
                router = ctx.socket(zmq.ROUTER)
                router.setsockopt(zmq.SNDHWM, 2 * (self.buffer_steps + 1))
                router.setsockopt(zmq.LINGER, 0)
                _bind(router, self.replay_endpoint)
        except BaseException:
            pub.close(linger=0)
            if router is not None:
                router.close(linger=0)
            raise
        self._pub, self._router = pub, router
        if router is not None:
            self._task = asyncio.get_running_loop().create_task(
                self._serve(router), name=f"kvstream-replay {self.replay_endpoint}"
            )

    def publish(self, payload: bytes) -> int:
        """Send ``payload`` as ``[topic, seq, payload]``, keep it for replay; returns its seq."""
        pub = self._pub
        if pub is None:
            raise ConnectionError("the publisher is closed" if self._closed else "not started")
        seq = self._seq
        try:
            pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise ConnectionError(f"publishing on {self.endpoint} failed: {exc}") from exc
        self._seq = seq + 1
        self._buffer.append((seq, payload))
        self.published += 1
        return seq

    def restart(self) -> None:
        """Start over as a restarted engine does: seq 0 next, an empty replay buffer."""
        self._seq = 0
        self._buffer.clear()
        self._generation += 1

    async def close(self, linger_s: float = 0.0) -> None:
        """Stop serving replays and close the sockets; the PUB socket may spend up to
        ``linger_s`` sending what it still queues. Terminates the context if it owns it."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        pub, self._pub = self._pub, None
        router, self._router = self._router, None
        if router is not None:
            router.close(linger=0)
        if pub is not None:
            pub.close(linger=max(int(linger_s * 1000), 0))
        if self._own_context and self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            await terminate_context(ctx, linger_s)

    # ----------------------------------------------------------------------------- replay

    async def _serve(self, router: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await router.recv_multipart()
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("replay socket %s: %s", self.replay_endpoint, exc)
                await asyncio.sleep(0.01)
                continue
            request = _parse_request(frames)
            if request is None:
                self.bad_requests += 1
                log.warning(
                    "replay socket %s: ignoring a malformed request (%d frames: %s)",
                    self.replay_endpoint,
                    len(frames),
                    [len(f) for f in frames],
                )
                continue
            envelope, start = request
            try:
                await self._replay(router, envelope, start)
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("replay to a client of %s failed: %s", self.replay_endpoint, exc)

    async def _replay(self, router: zmq.asyncio.Socket, envelope: list[bytes], start: int) -> None:
        self.replays += 1
        generation = self._generation
        todo = [item for item in self._buffer if item[0] >= start]
        for i, (seq, payload) in enumerate(todo):
            if i and i % _REPLAY_CHUNK == 0:
                await asyncio.sleep(0)
                if self._generation != generation:
                    break  # the source restarted: the rest belongs to the old process
            # ROUTER never blocks: at its high-water mark it drops, as vLLM's does
            await router.send_multipart([*envelope, self.topic, seq.to_bytes(8, "big"), payload])
        await router.send_multipart([*envelope, b"", END_SEQ, b""])


def _check_sizes(buffer_steps: int, hwm: int) -> None:
    if buffer_steps < 1:
        raise ConfigError(f"buffer_steps must be >= 1, got {buffer_steps}")
    if hwm < 0:
        raise ConfigError(f"hwm must be >= 0 (0: no limit), got {hwm}")


def _parse_request(frames: list[bytes]) -> tuple[list[bytes], int] | None:
    """``([id], start)`` for ``[id, start]``, ``([id, ""], start)`` for ``[id, "", start]``."""
    if len(frames) == 2:
        envelope, start = frames[:1], frames[1]
    elif len(frames) == 3 and frames[1] == b"":
        envelope, start = frames[:2], frames[2]
    else:
        return None
    if len(start) != 8:
        return None
    return envelope, int.from_bytes(start, "big")


def _bind(sock: zmq.Socket[Any], endpoint: str) -> None:
    if "[" in endpoint:
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise OSError(errno.EADDRINUSE, f"cannot bind {endpoint}: address in use") from exc
        raise ConfigError(f"cannot bind {endpoint}: {exc}") from exc


async def terminate_context(ctx: zmq.Context[Any], timeout_s: float) -> None:
    """Terminate ``ctx`` (its sockets closed, with bounded linger) off the event loop."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.to_thread(ctx.term), max(timeout_s, 0.0) + 1.0)


class PublisherGroup:
    """The publishers of one engine's data-parallel ranks, sharing one ZMQ context.

    Rank r publishes on ``tcp://HOST:PORT+r`` and serves replays on ``tcp://HOST:REPLAY+r``
    (no replay socket when ``replay_port`` is None).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        replay_port: int | None = None,
        dp_size: int = 1,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        if dp_size < 1:
            raise ConfigError(f"dp_size must be >= 1, got {dp_size}")
        _check_sizes(buffer_steps, hwm)
        self.host = host
        self.port = port
        self.replay_port = replay_port
        self.dp_size = dp_size
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self._ctx: zmq.asyncio.Context | None = None
        self.ranks: list[ZmqPublisher] = []

    def endpoint(self, rank: int) -> str:
        """Rank ``rank``'s PUB address."""
        return tcp_endpoint(self.host, self.port + rank)

    def replay_endpoint(self, rank: int) -> str | None:
        """Rank ``rank``'s replay ROUTER address (None without replay)."""
        if self.replay_port is None:
            return None
        return tcp_endpoint(self.host, self.replay_port + rank)

    async def start(self) -> None:
        """Bind every rank's sockets; on failure nothing stays bound."""
        if self.ranks:
            return
        ctx = self._ctx = zmq.asyncio.Context()
        try:
            self.ranks = await self._bind(ctx, 0, self.dp_size)
        except BaseException:
            self._ctx = None
            await terminate_context(ctx, 0.0)
            raise

    async def grow(self, dp_size: int) -> None:
        """Bind ranks ``len(ranks)..dp_size-1`` too (a stream showed more ranks than were
        bound); on failure the ranks bound before stay and the new ones are released.
        Raises as :meth:`start` does; ConnectionError when not started."""
        ctx = self._ctx
        if ctx is None or not self.ranks:
            raise ConnectionError("the publisher group is not started")
        if dp_size <= len(self.ranks):
            return
        self.ranks = self.ranks + await self._bind(ctx, len(self.ranks), dp_size)
        self.dp_size = dp_size

    async def _bind(self, ctx: zmq.asyncio.Context, first: int, end: int) -> list[ZmqPublisher]:
        ranks: list[ZmqPublisher] = []
        try:
            for rank in range(first, end):
                pub = ZmqPublisher(
                    self.endpoint(rank),
                    self.replay_endpoint(rank),
                    topic=self.topic,
                    buffer_steps=self.buffer_steps,
                    hwm=self.hwm,
                    context=ctx,
                )
                await pub.start()
                ranks.append(pub)
        except BaseException:
            for pub in ranks:
                await pub.close()
            raise
        return ranks

    async def close(self, linger_s: float = 0.0) -> None:
        """Close every rank (PUB linger ``linger_s``) and terminate the context."""
        ranks, self.ranks = self.ranks, []
        for pub in ranks:
            await pub.close(linger_s)
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            await terminate_context(ctx, linger_s)
