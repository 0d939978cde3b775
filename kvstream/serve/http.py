"""The HTTP API: a bare ASGI application over :class:`~kvstream.serve.service.IndexService`.

No framework: a route table, one msgspec decode per body, and errors turned into JSON bodies
``{"error": message, "type": kvstream error class}`` with the error's status. Every route but
``/health`` needs ``Authorization: Bearer TOKEN`` when the service has a token. A body over
``max_body_bytes`` gets 413 before it is read whole. Anything unexpected while answering is
logged and answered 500 with the same JSON shape; the service goes on.

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

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from kvstream.errors import KVStreamError
from kvstream.serve.errors import (
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
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

__all__ = ["create_app"]

log = logging.getLogger("kvstream.serve")

_JSON: Final = [(b"content-type", b"application/json")]
_OK: Final = b'{"status":"ok"}'
_encode = msgspec.json.Encoder().encode

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Handler = Callable[[bytes], Awaitable[tuple[int, bytes, list[tuple[bytes, bytes]]]]]


def create_app(svc: IndexService) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The ASGI application of ``svc``."""
    limit = svc.config.max_body_bytes
    token = None if svc.token is None else f"Bearer {svc.token}".encode()
    metrics = svc.metrics

    def ok(body: Any, status: int = 200) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return status, _encode(body), _JSON

    async def health(_: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return 200, b"", []

    async def register(body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        svc.register(decode(body, RegisterRequest))
        return 201, _OK, _JSON

    async def unregister(body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        await svc.unregister(decode(body, UnregisterRequest))
        return 200, _OK, _JSON

    async def workers(_: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return ok(svc.workers_json())

    async def query(body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return ok(svc.query_body(body))

    async def query_by_hash(body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return ok(svc.query_by_hash(decode(body, QueryByHashRequest)))

    async def dump(_: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return ok(svc.dump())

    async def prometheus(_: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return 200, metrics.render(), [(b"content-type", b"text/plain; version=0.0.4")]

    async def register_peer(body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        svc.add_peer(decode(body, PeerRequest).url)
        return 201, _OK, _JSON

    async def deregister_peer(body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        svc.remove_peer(decode(body, PeerRequest).url)
        return 200, _OK, _JSON

    async def peers(_: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return ok(svc.peers())

    async def ready(_: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        is_ready, waiting = svc.ready()
        body = {"ready": is_ready, "waiting": waiting, "restored_from": svc.restored_from}
        return ok(body, 200 if is_ready else 503)

    async def route(body: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        return ok(svc.route(decode(body, QueryRequest)))

    async def snapshot(_: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        if svc.ready()[1][:1] == ["restore"]:
            raise UnavailableError("the service is still restoring its state")
        return 200, svc.snapshot_bytes(), [(b"content-type", b"application/octet-stream")]

    routes: dict[str, tuple[str, Handler]] = {
        "/health": ("GET", health),
        "/register": ("POST", register),
        "/unregister": ("POST", unregister),
        "/workers": ("GET", workers),
        "/query": ("POST", query),
        "/query_by_hash": ("POST", query_by_hash),
        "/dump": ("GET", dump),
        "/metrics": ("GET", prometheus),
        "/register_peer": ("POST", register_peer),
        "/deregister_peer": ("POST", deregister_peer),
        "/peers": ("GET", peers),
        "/ready": ("GET", ready),
        "/route": ("POST", route),
        "/snapshot": ("GET", snapshot),
        "/match": ("POST", match_handler(svc)),
    }

    async def read_body(scope: Scope, receive: Receive) -> bytes:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > limit:
                    raise PayloadTooLargeError(
                        f"a {declared}-byte body is over the limit of {limit} bytes"
                    )
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            chunk = msg.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLargeError(f"the body is over the limit of {limit} bytes")
                chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def authorized(scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return bool(value == token)
        return False

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        t0 = time.perf_counter()
        path = scope["path"]
        method = scope["method"]
        entry = routes.get(path)
        endpoint = path if entry is not None else "other"
        headers: list[tuple[bytes, bytes]] = _JSON
        try:
            if entry is None:
                raise NotFoundError(f"no route {path}")
            want, handler = entry
            if method != want and not (method == "HEAD" and want == "GET"):
                raise MethodNotAllowedError(f"{path} takes {want}, not {method}")
            if token is not None and path != "/health" and not authorized(scope):
                raise UnauthorizedError("a valid 'Authorization: Bearer TOKEN' header is required")
            body = await read_body(scope, receive) if want == "POST" else b""
            status, payload, headers = await handler(body)
        except ServiceError as exc:
            status = exc.status
            payload = _encode({"error": str(exc), "type": type(exc).__name__})
            if status == 405:
                headers = [*_JSON, (b"allow", routes[path][0].encode())]
        except KVStreamError as exc:  # a library error the handlers did not map: bad input
            status = 422
            payload = _encode({"error": str(exc), "type": type(exc).__name__})
        except Exception as exc:
            log.exception("%s %s failed", method, path)
            status = 500
            payload = _encode({"error": f"internal error: {exc}", "type": type(exc).__name__})
        # a known length: no chunked encoding for the client to undo
        headers = [*headers, (b"content-length", b"%d" % len(payload))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": b"" if method == "HEAD" else payload})
        metrics.observe(endpoint, method, status, time.perf_counter() - t0)

    return app
