"""A client of the index service (kvstream's, or Dynamo's standalone indexer: same API).

::

    from kvstream.serve import Client

    with Client("http://127.0.0.1:8090") as c:
        c.register(1, "tcp://127.0.0.1:5557", block_size=16)
        scores = c.query([1, 2, 3, ...])["scores"]      # {"1": {"0": 32}}

One keep-alive connection (``http.client``, no dependency), not thread-safe: one client per
thread. An error response raises the :mod:`kvstream.serve.errors` class it names (or the one
its status maps to); a service that cannot be reached raises
:class:`~kvstream.serve.errors.UnavailableError`. The connection is re-opened once when a
request finds it closed (a server restart, an idle timeout).
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvstream.errors import ConfigError
from kvstream.serve.errors import ServiceError, UnavailableError, error_for_status

__all__ = ["Client"]


class Client:
    """Calls one service at ``url`` (``http://`` or ``https://``); ``token``: the bearer
    token; ``ca_file``: the CA to verify an https service with (default: the system's);
    ``timeout_s`` per request."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout_s: float = 10.0,
        ca_file: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"service URL {url!r} must be http://HOST:PORT or https://...")
        self.url = url.rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        try:
            self._port = parts.port or (443 if self._https else 80)
        except ValueError as exc:
            raise ConfigError(f"service URL {url!r}: {exc}") from None
        self._timeout = timeout_s
        self._ctx = ssl.create_default_context(cafile=ca_file) if self._https else None
        self._headers = {"content-type": "application/json"}
        if token is not None:
            self._headers["authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._https:
                self._conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self._timeout, context=self._ctx
                )
            else:
                self._conn = http.client.HTTPConnection(
                    self._host, self._port, timeout=self._timeout
                )
        return self._conn

    def request_raw(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """One request; ``(status, body)`` whatever the status. UnavailableError when the
        service cannot be reached."""
        for attempt in (0, 1):
            conn = self._connect()
            try:
                conn.request(method, path, body=body, headers=self._headers)
                resp = conn.getresponse()
                data = resp.read()
                if resp.getheader("connection", "").lower() == "close":
                    self.close()
                return resp.status, data
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise UnavailableError(f"{self.url}: the connection was closed") from None
            except OSError as exc:
                self.close()
                raise UnavailableError(f"{self.url} cannot be reached: {exc}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def call(self, method: str, path: str, payload: Any = None) -> Any:
        """A JSON request; the decoded JSON answer (None for an empty body). A 4xx/5xx
        raises its :class:`~kvstream.serve.errors.ServiceError`."""
        body = None if payload is None else json.dumps(payload).encode()
        status, data = self.request_raw(method, path, body)
        if status >= 400:
            raise self._error(status, data)
        return json.loads(data) if data else None

    @staticmethod
    def _error(status: int, data: bytes) -> ServiceError:
        message = data.decode("utf-8", "replace")
        type_name = None
        try:
            obj = json.loads(data)
            if isinstance(obj, dict):
                message = str(obj.get("error", message))
                type_name = obj.get("type")
        except ValueError:
            pass
        return error_for_status(status, type_name)(f"HTTP {status}: {message}")

    # ------------------------------------------------------------------ the API

    def health(self) -> bool:
        """True when the service answers ``/health`` with 200."""
        try:
            return self.request_raw("GET", "/health")[0] == 200
        except UnavailableError:
            return False

    def ready(self) -> dict[str, Any]:
        """``/ready``'s answer (``{"ready": bool, "waiting": [...]}``), whatever its status."""
        status, data = self.request_raw("GET", "/ready")
        if status not in (200, 503):
            raise self._error(status, data)
        out: dict[str, Any] = json.loads(data)
        return out

    def register(
        self,
        instance_id: int,
        endpoint: str,
        *,
        model_name: str = "default",
        block_size: int | None = None,
        dp_rank: int = 0,
        replay_endpoint: str | None = None,
        **extra: Any,
    ) -> None:
        """Register an engine rank's ZMQ publisher (``extra``: ``engine``, ``hash_algo``,
        ``routing_group``)."""
        body: dict[str, Any] = {
            "instance_id": instance_id,
            "endpoint": endpoint,
            "model_name": model_name,
            "dp_rank": dp_rank,
            **extra,
        }
        if block_size is not None:
            body["block_size"] = block_size
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self.call("POST", "/register", body)

    def unregister(
        self, instance_id: int, *, model_name: str = "default", dp_rank: int | None = None
    ) -> None:
        """Stop following an instance (every rank, or ``dp_rank``)."""
        body: dict[str, Any] = {"instance_id": instance_id, "model_name": model_name}
        if dp_rank is not None:
            body["dp_rank"] = dp_rank
        self.call("POST", "/unregister", body)

    def workers(self) -> list[dict[str, Any]]:
        """``/workers``."""
        out: list[dict[str, Any]] = self.call("GET", "/workers")
        return out

    def query(
        self, token_ids: Sequence[int], *, model_name: str = "default", **extra: Any
    ) -> dict[str, Any]:
        """``/query``: ``{"scores", "frequencies", "instances"}`` (``extra``: ``lora_name``,
        ``routing_group``, ``hash_algo``, ``cache_salt``)."""
        body = {"token_ids": list(token_ids), "model_name": model_name, **extra}
        out: dict[str, Any] = self.call("POST", "/query", body)
        return out

    def query_by_hash(
        self, block_hashes: Sequence[int | str], *, model_name: str = "default", **extra: Any
    ) -> dict[str, Any]:
        """``/query_by_hash`` with Dynamo local hashes (signed i64), or engine hashes with
        ``hash_algo=``."""
        body = {"block_hashes": list(block_hashes), "model_name": model_name, **extra}
        out: dict[str, Any] = self.call("POST", "/query_by_hash", body)
        return out

    def route(
        self, token_ids: Sequence[int], *, model_name: str = "default", **extra: Any
    ) -> dict[str, Any]:
        """``/route`` (kvstream): the chosen worker and every worker's cost."""
        body = {"token_ids": list(token_ids), "model_name": model_name, **extra}
        out: dict[str, Any] = self.call("POST", "/route", body)
        return out

    def dump(self) -> dict[str, Any]:
        """``/dump``."""
        out: dict[str, Any] = self.call("GET", "/dump")
        return out

    def snapshot(self) -> bytes:
        """``/snapshot``: the service's state as snapshot bytes."""
        status, data = self.request_raw("GET", "/snapshot")
        if status >= 400:
            raise self._error(status, data)
        return data

    def metrics(self) -> str:
        """``/metrics`` text."""
        status, data = self.request_raw("GET", "/metrics")
        if status >= 400:
            raise self._error(status, data)
        return data.decode()

    def close(self) -> None:
        """Close the connection (the next request opens a new one)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
