"""HTTP/1.1 for the index service: an :class:`asyncio.Protocol` over httptools' parser.

httptools (llhttp, the parser uvicorn runs on) does the parsing; this module does the rest
of what the service needs and nothing more:

- keep-alive, pipelining (responses in request order, reading paused while many wait),
  HTTP/1.0 and ``Connection: close`` honoured;
- request bodies by ``Content-Length`` or chunked; a body over ``max_body_bytes`` gets 413
  without being kept: at once when the client waits for ``100 Continue`` (then the
  connection closes), else after the rest is read and dropped; ``Expect: 100-continue``
  answered when the body is welcome;
- a malformed request (bad request line, bad header, bad chunk, an unknown method) gets a
  400 JSON error and the connection closes; request heads over 64 KiB get 431;
- each response built once and written with one ``transport.write`` (prebuilt status lines
  and headers, a ``date`` refreshed once a second);
- TLS by an :class:`ssl.SSLContext` on ``loop.create_server``;
- idle keep-alive connections closed after ``keep_alive_s``;
- :meth:`HttpServer.aclose`: stop accepting, let every request already read be answered,
  close idle connections, then close the rest (after ``grace_s``, cut).

Routing, authorization, errors and metrics are :class:`~kvstream.serve.http.Routes`'.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import logging
import ssl
import time
import urllib.parse
from http import HTTPStatus
from typing import Any, Final

import httptools

from kvstream.serve.errors import BadRequestError, PayloadTooLargeError, ServiceError
from kvstream.serve.http import Response, Routes, error_response

__all__ = ["HttpServer"]

log = logging.getLogger("kvstream.serve")

_MAX_HEAD: Final = 64 * 1024
_MAX_QUEUED: Final = 32  # pipelined requests read ahead before reading pauses
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_STATUS: Final = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
_CLOSE: Final = b"connection: close\r\n"
_METHODS: Final = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS")}
#: how long a closing connection drops what the client still sends before it is cut
_LINGER_S: Final = 2.0


class _HeadTooLargeError(ServiceError):
    """The request line and headers are over 64 KiB."""

    status = 431


class _Clock:
    """The ``date`` header line, refreshed once a second while a server runs."""

    line = b""

    @classmethod
    def tick(cls) -> None:
        cls.line = b"date: " + email.utils.formatdate(usegmt=True).encode() + b"\r\n"


_Clock.tick()


class _Request:
    __slots__ = ("auth", "body", "error", "keep_alive", "method", "path")

    def __init__(self) -> None:
        self.method = ""
        self.path = ""
        self.auth: bytes | None = None
        self.body: list[bytes] = []
        self.error: ServiceError | None = None
        self.keep_alive = True


class _Connection(asyncio.Protocol):
    """One client connection (the module docstring says what it does)."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.routes = server.routes
        self.paths = server.paths
        self.limit = server.max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[_Request] = collections.deque()
        self.req: _Request | None = None  # the request being read
        self.url = b""
        self.head = 0  # bytes of request line and headers so far
        self.size = 0  # body bytes so far
        self.expect = False
        self.too_big: ServiceError | None = None  # the declared length is over the limit
        self.dropping = False  # the body being read is dropped (the answer is 413)
        self.busy = False  # a response that waits is being produced
        self.closing = False  # close once the queued responses are written
        self.paused = False
        self.last_active = time.monotonic()
        self.linger: asyncio.TimerHandle | None = None  # the half-closed wait (_shut)
        self.refused = False  # a request was refused: the client may still be sending

    # ------------------------------------------------------------- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment] # uvloop's is no asyncio.Transport
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.linger is not None:
            self.linger.cancel()
        self.server.connections.discard(self)
        self.queue.clear()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.closing and self.req is None:
            return  # nothing more is read once the connection is closing
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # no protocol switch here: the request is answered, then the connection closes
            self._close_after_queue()
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            err: ServiceError = (
                cause
                if isinstance(cause, ServiceError)
                else BadRequestError(f"malformed HTTP request: {exc}")
            )
            self._fail(err)

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.paused:
            self.transport.resume_reading()

    # ------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self.req = _Request()
        self.url = b""
        self.head = 0
        self.size = 0
        self.expect = False
        self.too_big = None
        self.dropping = False

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.head += len(url)
        if self.head > _MAX_HEAD:
            self._head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        n = len(name)
        self.head += n + len(value)
        if self.head > _MAX_HEAD:
            self._head_too_large()
        if n == 13 and name.lower() == b"authorization":
            assert self.req is not None
            self.req.auth = value
        elif n == 6 and name.lower() == b"expect" and value.lower() == b"100-continue":
            self.expect = True
        elif n == 14 and name.lower() == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                return  # the parser refuses it
            if declared > self.limit:
                self.too_big = PayloadTooLargeError(
                    f"a {declared}-byte body is over the limit of {self.limit} bytes"
                )

    @staticmethod
    def _head_too_large() -> None:
        raise _HeadTooLargeError(f"the request line and headers are over {_MAX_HEAD} bytes")

    def on_headers_complete(self) -> None:
        req = self.req
        assert req is not None
        method = self.parser.get_method()
        req.method = _METHODS.get(method) or method.decode("ascii", "replace")
        path = self.paths.get(self.url)  # a route's own path, as clients send it
        if path is None:
            url = self.url.partition(b"?")[0]
            if url[:1] != b"/":  # the absolute form (a proxy's)
                url = httptools.parse_url(self.url).path or b"/"
            path = url.decode("latin-1")
            if "%" in path:
                path = urllib.parse.unquote(path, "latin-1")
        req.path = path
        req.keep_alive = self.parser.should_keep_alive()
        if self.too_big is not None:
            self._reject(self.too_big)
        elif self.expect and self.transport is not None:
            self.transport.write(_CONTINUE)

    def on_body(self, chunk: bytes) -> None:
        req = self.req
        if req is None or self.dropping:
            return
        self.size += len(chunk)
        if self.size > self.limit:
            self._reject(PayloadTooLargeError(f"the body is over the limit of {self.limit} bytes"))
            return
        req.body.append(chunk)

    def on_message_complete(self) -> None:
        req = self.req
        if req is None:  # answered already (a 413 to a client that waited to send)
            return
        self.req = None
        self.queue.append(req)
        if len(self.queue) > _MAX_QUEUED and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._run()

    # ------------------------------------------------------------- answering

    def _reject(self, err: ServiceError) -> None:
        """Answer the request being read with ``err`` and keep none of its body: a client
        waiting for 100 Continue is answered now and the connection closes; otherwise the
        rest of the body is read, dropped, and the request answered in its turn."""
        req = self.req
        assert req is not None
        req.error = err
        req.body = []
        self.dropping = True
        if self.expect:
            req.keep_alive = False
            self.req = None
            self.queue.append(req)
            self.refused = True
            self._close_after_queue()
            self._run()

    def _fail(self, err: ServiceError) -> None:
        """A request that cannot be parsed: answered after the queued ones, then close."""
        req = self.req or _Request()
        self.req = None
        req.error = err
        req.body = []
        req.keep_alive = False
        req.method = req.method or "?"
        req.path = req.path or "?"
        self.queue.append(req)
        self.refused = True
        self._close_after_queue()
        self._run()

    def _close_after_queue(self) -> None:
        self.closing = True
        if self.transport is not None and not self.queue and not self.busy:
            self._shut()

    def _shut(self) -> None:
        """Close after the last response. After a refused request (malformed, or a body
        refused at once) half-close and drop what the client still sends until it closes
        too (or ``_LINGER_S`` passes): closing at once with unread bytes from the client (a
        pipelined request behind a malformed one) makes the kernel send a reset, which can
        destroy the error response before the client reads it."""
        transport = self.transport
        if transport is None:
            return
        if self.refused and self.linger is None and transport.can_write_eof():
            transport.write_eof()
            self.linger = asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
        else:
            transport.close()

    def _run(self) -> None:
        """Answer queued requests in order until one has to wait."""
        queue = self.queue
        while queue and not self.busy:
            req = queue.popleft()
            if req.error is not None:
                self._write(req, self._answer_error(req))
                continue
            body = req.body[0] if len(req.body) == 1 else b"".join(req.body)
            res = self.routes.respond(req.method, req.path, req.auth, body)
            if type(res) is tuple:
                self._write(req, res)
            else:
                self.busy = True
                task = asyncio.get_running_loop().create_task(self._await(req, res))
                self.server.tasks.add(task)
                task.add_done_callback(self.server.tasks.discard)
        if not queue and self.paused and self.transport is not None and not self.closing:
            self.paused = False
            self.transport.resume_reading()

    def _answer_error(self, req: _Request) -> Response:
        assert req.error is not None
        res = error_response(req.error)
        endpoint = req.path if req.path in self.routes.routes else "other"
        self.routes.metrics.observe(endpoint, req.method, res[0], 0.0)
        return res

    async def _await(self, req: _Request, pending: Any) -> None:
        res: Response = await pending
        self.busy = False
        self._write(req, res)
        self._run()

    def _write(self, req: _Request, res: Response) -> None:
        transport = self.transport
        if transport is None:
            return
        status, payload, headers = res
        close = not req.keep_alive or (self.closing and not self.queue)
        line = _STATUS.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status
        transport.write(
            b"%s%s%scontent-length: %d\r\n%s\r\n%s"
            % (
                line,
                _Clock.line,
                headers,
                len(payload),
                _CLOSE if close else b"",
                b"" if req.method == "HEAD" else payload,
            )
        )
        if close:
            self.closing = True
            if self.req is None:
                self._shut()
            # else: a rejected body is still arriving; closed when it is read

    def idle(self) -> bool:
        """Nothing read, nothing to answer."""
        return self.req is None and not self.queue and not self.busy


class HttpServer:
    """Serves ``routes`` on ``host:port`` (see the module docstring)."""

    def __init__(
        self,
        routes: Routes,
        *,
        max_body_bytes: int,
        ssl_context: ssl.SSLContext | None = None,
        keep_alive_s: float = 60.0,
    ) -> None:
        self.routes = routes
        #: each route's path as request bytes -> the path (the common URL, decoded once)
        self.paths: dict[bytes, str] = {p.encode("latin-1"): p for p in routes.routes}
        self.max_body_bytes = max_body_bytes
        self.ssl_context = ssl_context
        self.keep_alive_s = keep_alive_s
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        """Listen; OSError when the address cannot be bound."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, ssl=self.ssl_context, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._tick()

    def _tick(self) -> None:
        _Clock.tick()
        now = time.monotonic()
        for c in list(self.connections):
            if c.idle() and now - c.last_active > self.keep_alive_s and c.transport is not None:
                c.transport.close()
        self._timer = asyncio.get_running_loop().call_later(1.0, self._tick)

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Stop accepting, answer every request already read, close idle connections; what
        is still open after ``grace_s`` is cut."""
        if self._server is None:
            return
        self._server.close()
        self._server = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for c in list(self.connections):
            c._close_after_queue()
        deadline = time.monotonic() + grace_s
        while self.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abort()
        for t in list(self.tasks):
            t.cancel()
        await asyncio.sleep(0)


def server_ssl_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS server context for a certificate chain and its key (OSError / ssl.SSLError when
    they do not load)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx
