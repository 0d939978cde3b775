"""A fault-injecting TCP proxy for outage tests: cut, reset, delay or stall connections.

It runs its own asyncio loop in a background thread, so one proxy serves every test whatever
event loop the test uses. Control methods are thread-safe and return once applied::

    proxy = FaultProxy("127.0.0.1", broker_port).start()
    proxy.cut()        # close every connection and refuse new ones (broker "down")
    proxy.reset()      # RST every connection, keep accepting (a network blip)
    proxy.delay(0.2)   # add latency to every chunk, both directions
    proxy.stall()      # keep connections open but forward nothing (a hung broker)
    proxy.restore()    # back to normal
    proxy.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["FaultProxy"]


class _Conn:
    def __init__(
        self,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.client = client
        self.upstream = upstream
        self.tasks: list[asyncio.Task[None]] = []

    def writers(self) -> tuple[asyncio.StreamWriter, asyncio.StreamWriter]:
        return self.client[1], self.upstream[1]


def _rst(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """Forwards 127.0.0.1:``port`` to ``upstream_host:upstream_port`` with injectable faults."""

    def __init__(self, upstream_host: str, upstream_port: int, listen_port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listen_port = listen_port
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[_Conn] = set()
        self._cut = False
        self._delay = 0.0
        self._flowing: asyncio.Event | None = None
        self.accepted = 0
        self.bytes_forwarded = 0

    # ----------------------------------------------------------------------------- control

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=10)

    def start(self) -> FaultProxy:
        self._thread.start()
        self._call(self._start())
        return self

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self._listen_port)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Close every connection (FIN) and refuse new ones until :meth:`restore`."""
        self._call(self._apply(cut=True, close="fin"))

    def reset(self) -> None:
        """Reset (RST) every connection; new connections are accepted."""
        self._call(self._apply(close="rst"))

    def delay(self, seconds: float) -> None:
        """Add ``seconds`` of latency to every forwarded chunk."""
        self._call(self._apply(delay=seconds))

    def stall(self) -> None:
        """Keep connections open but forward nothing until :meth:`restore`."""
        self._call(self._apply(stall=True))

    def restore(self) -> None:
        """Forward normally again."""
        self._call(self._apply(cut=False, delay=0.0, stall=False))

    def set_upstream(self, host: str, port: int) -> None:
        """Point new connections at another upstream."""
        self.upstream = (host, port)

    async def _apply(
        self,
        *,
        cut: bool | None = None,
        close: str | None = None,
        delay: float | None = None,
        stall: bool | None = None,
    ) -> None:
        if cut is not None:
            self._cut = cut
        if delay is not None:
            self._delay = delay
        assert self._flowing is not None
        if stall is True:
            self._flowing.clear()
        elif stall is False:
            self._flowing.set()
        if close is not None:
            for conn in list(self._conns):
                self._drop(conn, rst=close == "rst")

    def _drop(self, conn: _Conn, *, rst: bool) -> None:
        self._conns.discard(conn)
        for w in conn.writers():
            if rst:
                _rst(w)
            else:
                w.close()
        for t in conn.tasks:
            t.cancel()

    def close(self) -> None:
        """Stop the proxy and its thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            self._drop(conn, rst=False)
        tasks = [t for c in list(self._conns) for t in c.tasks]
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    # ----------------------------------------------------------------------------- serving

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._cut:
            writer.close()
            return
        try:
            upstream = await asyncio.open_connection(*self.upstream)
        except OSError:
            _rst(writer)
            return
        conn = _Conn((reader, writer), upstream)
        self._conns.add(conn)
        conn.tasks = [
            asyncio.ensure_future(self._pump(conn, reader, upstream[1])),
            asyncio.ensure_future(self._pump(conn, upstream[0], writer)),
        ]
        await asyncio.gather(*conn.tasks, return_exceptions=True)
        if conn in self._conns:
            self._drop(conn, rst=False)

    async def _pump(
        self, conn: _Conn, src: asyncio.StreamReader, dst: asyncio.StreamWriter
    ) -> None:
        assert self._flowing is not None
        try:
            while True:
                data = await src.read(65536)
                if not data:
                    break
                await self._flowing.wait()
                if self._delay:
                    await asyncio.sleep(self._delay)
                dst.write(data)
                await dst.drain()
                self.bytes_forwarded += len(data)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            if conn in self._conns:
                self._drop(conn, rst=False)
