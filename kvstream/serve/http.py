"""The HTTP API's routes over :class:`~kvstream.serve.service.IndexService`.

No framework: a route table, one msgspec decode per body, and errors turned into JSON bodies
``{"error": message, "type": kvstream error class}`` with the error's status. Every route but
``/health`` needs ``Authorization: Bearer TOKEN`` when the service has a token. Anything
unexpected while answering is logged and answered 500 with the same JSON shape; the service
goes on. The HTTP/1.1 connection work (parsing, keep-alive, the body limit's 413, TLS) is
:mod:`kvstream.serve.server`'s; :class:`Routes` takes a parsed request and gives the
response's status, body and header lines.

Routes (Dynamo 1.6.1's, then kvstream's):

=========================  ======  ==================================================
``/health``                GET     200, empty body: the process is alive
``/register``              POST    201 ``{"status": "ok"}``
``/unregister``            POST    200 ``{"status": "ok"}``
``/workers``               GET     registered instances, their listeners and state
``/query``                 POST    scores for token ids
``/query_by_hash``         POST    scores for Dynamo local hashes (or engine hashes)
``/dump``                  GET     every cached block, as Dynamo's events
``/metrics``               GET     Prometheus text
``/register_peer``         POST    201; ``/deregister_peer`` POST 200; ``/peers`` GET
``/ready``                 GET     200 ``{"ready": true}`` / 503 with what is awaited
``/route``                 POST    the router's decision with every worker's cost
``/snapshot``              GET     the service's state (peer recovery)
``/match``                 POST    per-worker matches (a sharded router's fan-out)
=========================  ======  ==================================================
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final

import msgspec

from kvstream.errors import KVStreamError
from kvstream.serve.errors import (
    MethodNotAllowedError,
    NotFoundError,
    ServiceError,
    UnauthorizedError,
    UnavailableError,
)
from kvstream.serve.match_api import match_handler
from kvstream.serve.requests import (
    PeerRequest,
    QueryByHashRequest,
    QueryRequest,
    RegisterRequest,
    UnregisterRequest,
    decode,
)

if TYPE_CHECKING:
    from kvstream.serve.service import IndexService

__all__ = ["Response", "Routes"]

log = logging.getLogger("kvstream.serve")

#: status, body, and the response's extra header lines (each ending in CRLF)
Response = tuple[int, bytes, bytes]
Handler = Callable[[bytes], Response]
AsyncHandler = Callable[[bytes], Awaitable[Response]]

_JSON: Final = b"content-type: application/json\r\n"
_TEXT: Final = b"content-type: text/plain; version=0.0.4\r\n"
_BINARY: Final = b"content-type: application/octet-stream\r\n"
_OK: Final = b'{"status":"ok"}'
_encode = msgspec.json.Encoder().encode


def error_response(exc: BaseException, allow: str | None = None) -> Response:
    """The JSON error response of ``exc``: a ServiceError's status, 422 for another kvstream
    error (bad input the handlers did not map), else 500."""
    if isinstance(exc, ServiceError):
        status = exc.status
    elif isinstance(exc, KVStreamError):
        status = 422
    else:
        status = 500
    message = str(exc) if status != 500 else f"internal error: {exc}"
    headers = _JSON if allow is None else _JSON + b"allow: " + allow.encode() + b"\r\n"
    return status, _encode({"error": message, "type": type(exc).__name__}), headers


class Routes:
    """The route table of ``svc`` (the module docstring lists it) and the per-request
    bookkeeping: authorization, the method check, errors as JSON, metrics."""

    def __init__(self, svc: IndexService) -> None:
        self.svc = svc
        self.metrics = svc.metrics
        self._token = None if svc.token is None else f"Bearer {svc.token}".encode()
        ok = self._ok
        self.routes: dict[str, tuple[str, Handler | None, AsyncHandler | None]] = {
            "/health": ("GET", lambda _: (200, b"", b""), None),
            "/register": ("POST", self._register, None),
            "/unregister": ("POST", None, self._unregister),
            "/workers": ("GET", lambda _: ok(svc.workers_json()), None),
            "/query": ("POST", self._query, None),
            "/query_by_hash": (
                "POST",
                lambda body: ok(svc.query_by_hash(decode(body, QueryByHashRequest))),
                None,
            ),
            "/dump": ("GET", lambda _: ok(svc.dump()), None),
            "/metrics": ("GET", lambda _: (200, self.metrics.render(), _TEXT), None),
            "/register_peer": ("POST", self._register_peer, None),
            "/deregister_peer": ("POST", self._deregister_peer, None),
            "/peers": ("GET", lambda _: ok(svc.peers()), None),
            "/ready": ("GET", self._ready, None),
            "/route": ("POST", lambda body: ok(svc.route(decode(body, QueryRequest))), None),
            "/snapshot": ("GET", self._snapshot, None),
            "/match": ("POST", match_handler(svc), None),
        }

    @staticmethod
    def _ok(body: Any, status: int = 200) -> Response:
        return status, _encode(body), _JSON

    def _query(self, body: bytes) -> Response:
        return 200, _encode(self.svc.query_body(body)), _JSON

    def _register(self, body: bytes) -> Response:
        self.svc.register(decode(body, RegisterRequest))
        return 201, _OK, _JSON

    async def _unregister(self, body: bytes) -> Response:
        await self.svc.unregister(decode(body, UnregisterRequest))
        return 200, _OK, _JSON

    def _register_peer(self, body: bytes) -> Response:
        self.svc.add_peer(decode(body, PeerRequest).url)
        return 201, _OK, _JSON

    def _deregister_peer(self, body: bytes) -> Response:
        self.svc.remove_peer(decode(body, PeerRequest).url)
        return 200, _OK, _JSON

    def _ready(self, _: bytes) -> Response:
        svc = self.svc
        is_ready, waiting = svc.ready()
        body = {"ready": is_ready, "waiting": waiting, "restored_from": svc.restored_from}
        return self._ok(body, 200 if is_ready else 503)

    def _snapshot(self, _: bytes) -> Response:
        if self.svc.ready()[1][:1] == ["restore"]:
            raise UnavailableError("the service is still restoring its state")
        return 200, self.svc.snapshot_bytes(), _BINARY

    def respond(
        self, method: str, path: str, authorization: bytes | None, body: bytes
    ) -> Response | Coroutine[Any, Any, Response]:
        """The response to one request: at once, or a coroutine for the few routes that
        wait (``/unregister``). ``HEAD`` is answered as ``GET`` (the server leaves the body
        out). Metrics are recorded when the response is known."""
        t0 = time.perf_counter()
        entry = self.routes.get(path)
        try:
            if entry is None:
                raise NotFoundError(f"no route {path}")
            want, handler, waiter = entry
            if method != want and not (method == "HEAD" and want == "GET"):
                return self._done(
                    path,
                    method,
                    t0,
                    error_response(
                        MethodNotAllowedError(f"{path} takes {want}, not {method}"), want
                    ),
                )
            if (
                self._token is not None
                and path != "/health"
                and (authorization is None or not hmac.compare_digest(authorization, self._token))
            ):
                raise UnauthorizedError("a valid 'Authorization: Bearer TOKEN' header is required")
            if waiter is not None:
                return self._wait(waiter, method, path, body, t0)
            assert handler is not None
            res = handler(body)
        except Exception as exc:
            res = self._failed(exc, method, path)
        return self._done(path if entry is not None else "other", method, t0, res)

    async def _wait(
        self, waiter: AsyncHandler, method: str, path: str, body: bytes, t0: float
    ) -> Response:
        try:
            res = await waiter(body)
        except Exception as exc:
            res = self._failed(exc, method, path)
        return self._done(path, method, t0, res)

    @staticmethod
    def _failed(exc: Exception, method: str, path: str) -> Response:
        if not isinstance(exc, KVStreamError):
            log.exception("%s %s failed", method, path)
        return error_response(exc)

    def _done(self, endpoint: str, method: str, t0: float, res: Response) -> Response:
        self.metrics.observe(endpoint, method, res[0], time.perf_counter() - t0)
        return res
