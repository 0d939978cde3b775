"""Index shards behind index services: a router's :class:`RemoteShard` per service.

Each shard is a ``kvstream serve`` (or ``kvstream shard``) process holding part of the
fleet's workers, e.g. shard K/N of a Kafka topic (``--source
"kafka://HOST:PORT/TOPIC?shard=K/N&key_mode=engine"``). A router holds one
:class:`RemoteShard` per service and a :class:`~kvstream.index.shards.ShardedIndex` over
them (:func:`~kvstream.index.shards.sharded_router` adds a Router)::

    from kvstream.index.shards import ShardedIndex, sharded_router
    from kvstream.serve.shards import RemoteShard

    shards = ShardedIndex([RemoteShard("http://10.0.0.5:8090"), RemoteShard("http://10.0.0.6:8090")])
    decision = sharded_router(shards).route(prompt_tokens)

Matches go over the service's ``POST /match`` (:mod:`kvstream.serve.match_api`). A match is
sent to every shard first and the answers are read afterwards
(:meth:`RemoteShard.submit_match`), so a decision waits for the slowest shard, not for the
sum of them; each shard hashes the request itself, in parallel.
"""

from __future__ import annotations

import http.client
import json
import ssl
import sys
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Final
from urllib.parse import urlsplit

import msgspec

from kvstream._types import TokenIds
from kvstream.errors import ConfigError
from kvstream.index.errors import HashConfigMismatchError
from kvstream.index.matching import HashRequest, MatchResult
from kvstream.index.shards import ShardUnavailableError
from kvstream.index.types import DEFAULT_TIER_WEIGHTS, WorkerKey
from kvstream.serve.config import DEFAULT_MODEL
from kvstream.serve.match_api import MatchAnswer, MatchRequest, request_to_wire, result_from_wire

__all__ = ["RemoteShard", "ShardUnavailableError"]

_Worker = WorkerKey | tuple[str, int | None]
_encode = msgspec.json.Encoder().encode
_decode_answer: Final = msgspec.json.Decoder(MatchAnswer)
#: connection errors after which a request on a reused keep-alive connection is sent again
_STALE: Final = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


def _token_bytes(tokens: Any) -> bytes:
    """u32 little-endian ids (what ``/match`` takes as ``tokens``)."""
    if isinstance(tokens, TokenIds):
        return tokens.raw
    try:
        arr = array("I", tokens)
    except OverflowError:
        raise ConfigError("token ids must be unsigned 32-bit integers") from None
    if sys.byteorder == "big":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


class RemoteShard:
    """A shard served by an index service at ``url`` (``http://HOST:PORT``, or https), for a
    :class:`~kvstream.index.shards.ShardedIndex`: its ``model_name`` (and ``routing_group``)
    index. One keep-alive connection, blocking: call it from one thread.

    :meth:`workers` answers from the list the last answer brought, asking the service when
    it is older than ``refresh_s``. ``timeout_s`` bounds every request. A service that cannot
    be reached, does not answer in time, answers garbage or any error but those below raises
    :class:`ShardUnavailableError` (the connection is re-opened on the next call); a 409
    raises :class:`~kvstream.index.errors.HashConfigMismatchError`, and a request it refuses
    (400/422) or a wrong token (401) ConfigError, as an in-process index would.
    """

    def __init__(
        self,
        url: str,
        *,
        model_name: str = DEFAULT_MODEL,
        routing_group: str | None = None,
        token: str | None = None,
        timeout_s: float = 2.0,
        refresh_s: float = 1.0,
        ca_file: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"shard URL {url!r} must be http://HOST:PORT or https://...")
        try:
            self._port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:
            raise ConfigError(f"shard URL {url!r}: {exc}") from None
        self.url = url.rstrip("/")
        self._host = parts.hostname
        self._ctx = ssl.create_default_context(cafile=ca_file) if parts.scheme == "https" else None
        self.model_name = model_name
        self.routing_group = routing_group
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self._headers = {"content-type": "application/json"}
        if token is not None:
            self._headers["authorization"] = f"Bearer {token}"
        self._conn: http.client.HTTPConnection | None = None
        self._workers: list[WorkerKey] = []
        self._seen = float("-inf")

    def __repr__(self) -> str:
        return f"RemoteShard({self.url}, model_name={self.model_name!r})"

    def close(self) -> None:
        """Close the connection (the next call opens a new one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def __enter__(self) -> RemoteShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _unavailable(self, what: object) -> ShardUnavailableError:
        self.close()
        return ShardUnavailableError(f"shard {self.url}: {what}")

    def _send(self, body: bytes) -> tuple[http.client.HTTPConnection, bool]:
        """Send ``POST /match``; the connection and whether it was open before."""
        reused = self._conn is not None
        for attempt in (0, 1):
            if self._conn is None:
                if self._ctx is not None:
                    self._conn = http.client.HTTPSConnection(
                        self._host, self._port, timeout=self.timeout_s, context=self._ctx
                    )
                else:
                    self._conn = http.client.HTTPConnection(
                        self._host, self._port, timeout=self.timeout_s
                    )
            conn = self._conn
            try:
                conn.request("POST", "/match", body=body, headers=self._headers)
                return conn, reused and not attempt
            except (*_STALE, http.client.ImproperConnectionState) as exc:
                # the service closed the idle connection, or an answer was left unread:
                # once more, on a fresh connection
                if attempt or not reused:
                    raise self._unavailable(exc) from exc
                self.close()
            except OSError as exc:
                raise self._unavailable(exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _receive(self, conn: http.client.HTTPConnection, body: bytes, reused: bool) -> MatchAnswer:
        try:
            try:
                resp = conn.getresponse()
            except _STALE:
                if not reused:
                    raise
                self.close()  # closed while idle, after our send: send it again, fresh
                conn, _ = self._send(body)
                resp = conn.getresponse()
            status, data = resp.status, resp.read()
            if resp.getheader("connection", "").lower() == "close":
                self.close()
        except ShardUnavailableError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise self._unavailable(exc) from exc
        if status != 200:
            raise self._error(status, data)
        try:
            answer = _decode_answer.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise self._unavailable(f"malformed answer ({exc})") from exc
        self._workers = [WorkerKey(i, r) for i, r in answer.workers]
        self._seen = time.monotonic()
        return answer

    def _error(self, status: int, data: bytes) -> Exception:
        message = data.decode("utf-8", "replace")
        try:
            obj = json.loads(data)
            if isinstance(obj, dict) and "error" in obj:
                message = f"{obj['error']} ({obj.get('type')})"
        except ValueError:
            pass
        text = f"shard {self.url}: HTTP {status}: {message}"
        if status == 409:
            return HashConfigMismatchError(text)
        if status in (400, 401, 422):
            return ConfigError(text)
        return ShardUnavailableError(text)

    # ------------------------------------------------------------------ the shard API

    def workers(self) -> list[WorkerKey]:
        """The shard's workers (as of at most ``refresh_s`` ago)."""
        if time.monotonic() - self._seen > self.refresh_s:
            body = _encode(
                MatchRequest(
                    tokens=b"",
                    model_name=self.model_name,
                    routing_group=self.routing_group,
                    workers=[],
                )
            )
            conn, reused = self._send(body)
            self._receive(conn, body, reused)
        return list(self._workers)

    def submit_match(
        self,
        tokens: Any,
        *,
        layer_group_id: int = 0,
        workers: Sequence[_Worker] | None = None,
        request: HashRequest | None = None,
        tier_weights: Sequence[float] = DEFAULT_TIER_WEIGHTS,
        hash_algo: str | None = None,
        tokens_per_block: int | None = None,
    ) -> Callable[[], MatchResult]:
        """Send a match request now; the returned function waits for its result (call it
        before the next request to this shard)."""
        cands = self.workers() if workers is None else workers
        body = _encode(
            MatchRequest(
                tokens=_token_bytes(tokens),
                model_name=self.model_name,
                routing_group=self.routing_group,
                workers=[(w[0], w[1]) for w in cands],
                layer_group_id=layer_group_id,
                tier_weights=list(tier_weights),
                hash_algo=hash_algo,
                tokens_per_block=tokens_per_block,
                request=request_to_wire(request),
            )
        )
        conn, reused = self._send(body)

        def result() -> MatchResult:
            return result_from_wire(self._receive(conn, body, reused))

        return result

    def match(
        self,
        tokens: Any,
        *,
        layer_group_id: int = 0,
        workers: Sequence[_Worker] | None = None,
        request: HashRequest | None = None,
        tier_weights: Sequence[float] = DEFAULT_TIER_WEIGHTS,
        hash_algo: str | None = None,
        tokens_per_block: int | None = None,
    ) -> MatchResult:
        """As :meth:`~kvstream.index.PrefixIndex.match`, answered by the shard's service."""
        return self.submit_match(
            tokens,
            layer_group_id=layer_group_id,
            workers=workers,
            request=request,
            tier_weights=tier_weights,
            hash_algo=hash_algo,
            tokens_per_block=tokens_per_block,
        )()
