"""Shards in other processes: a match server next to each shard consumer, a client per shard.

A shard process runs its :class:`~kvstream.index.consumer.IndexConsumer` and, in the same
event loop, :class:`ShardServer`, which answers ``workers`` and ``match`` requests from the
index as it stands between two batches. A router process holds one :class:`RemoteShard` per
shard and a :class:`~kvstream.index.shards.ShardedIndex` over them: a match is sent to every
shard first and the replies are read afterwards, so a decision waits for the slowest shard,
not for the sum of them; each shard hashes the request itself, in parallel.

Protocol (TCP, one request at a time per connection, in order): every message is a 4-byte
big-endian length and a UTF-8 JSON object.

- ``{"op": "workers"}`` -> ``{"ok": true, "workers": [[instance_id, rank], ...]}``
- ``{"op": "match", "tokens": base64 of u32 little-endian ids, "workers": [[id, rank]...],
  "layer_group_id", "tier_weights", "hash_algo", "tokens_per_block", "request": {...}}`` ->
  ``{"ok": true, "num_tokens": n, "matches": [[id, rank, matched, weighted, request_blocks,
  tokens_per_block, hash_algo, trusted, note], ...], "workers": [...]}`` (the shard's
  workers ride along so the client's view of who is where stays current)
- an error -> ``{"ok": false, "error": class name, "message": text}``; the client raises
  HashConfigMismatchError or ConfigError for those, :class:`ShardUnavailableError` otherwise.

No authentication: listen on loopback or a private network only.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import struct
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from kvstream._types import TokenIds
from kvstream.errors import ConfigError
from kvstream.index.consumer import ConsumerReport, IndexConsumer
from kvstream.index.errors import HashConfigMismatchError
from kvstream.index.index import PrefixIndex
from kvstream.index.matching import HashRequest, MatchResult, WorkerMatch
from kvstream.index.shards import ShardUnavailableError
from kvstream.index.types import DEFAULT_TIER_WEIGHTS, WorkerKey

__all__ = ["RemoteShard", "ShardServer", "ShardUnavailableError", "serve_shard"]

_LEN: Final = struct.Struct(">I")
#: The largest message either side accepts (a 1M-token request is 5.4 MB of base64 JSON).
MAX_MESSAGE: Final = 64 << 20

_Worker = WorkerKey | tuple[str, int | None]


# ---------------------------------------------------------------------- encoding


def _mm_out(mm_keys: Sequence[Any] | None) -> list[Any] | None:
    if mm_keys is None:
        return None
    out: list[Any] = []
    for entry in mm_keys:
        keys = []
        for key in entry or ():
            if hasattr(key, "hash") and hasattr(key, "start_offset"):
                keys.append(["mm", bytes(key.hash).hex(), key.start_offset, key.uuid])
            elif isinstance(key, (tuple, list)) and len(key) == 2:
                ident, off = key
                if isinstance(ident, (bytes, bytearray)):
                    keys.append(["b", bytes(ident).hex(), off])
                else:
                    keys.append(["s", ident, off])
            else:
                raise ConfigError(f"cannot send multimodal key {key!r} to a remote shard")
        out.append(keys)
    return out


def _mm_in(data: list[Any] | None) -> tuple[Any, ...] | None:
    if data is None:
        return None
    from kvstream.events.model import MmKey

    out = []
    for entry in data:
        keys: list[Any] = []
        for kind, ident, off, *rest in entry:
            if kind == "mm":
                keys.append(MmKey(hash=bytes.fromhex(ident), start_offset=off, uuid=rest[0]))
            elif kind == "b":
                keys.append((bytes.fromhex(ident), off))
            else:
                keys.append((ident, off))
        out.append(tuple(keys))
    return tuple(out)


def _request_out(req: HashRequest | None) -> dict[str, Any] | None:
    if req is None:
        return None
    return {
        "lora_id": req.lora_id,
        "lora_name": req.lora_name,
        "cache_salt": req.cache_salt,
        "salt_id": req.salt_id,
        "drop_last_token": req.drop_last_token,
        "mm_keys": _mm_out(req.mm_keys),
    }


def _request_in(data: dict[str, Any] | None) -> HashRequest | None:
    if data is None:
        return None
    return HashRequest(
        lora_id=data["lora_id"],
        lora_name=data["lora_name"],
        cache_salt=data["cache_salt"],
        salt_id=data["salt_id"],
        drop_last_token=bool(data["drop_last_token"]),
        mm_keys=_mm_in(data["mm_keys"]),
    )


def _workers_out(workers: Sequence[_Worker]) -> list[list[Any]]:
    return [[w[0], w[1]] for w in workers]


def _workers_in(data: list[list[Any]]) -> list[WorkerKey]:
    return [WorkerKey(str(i), None if r is None else int(r)) for i, r in data]


def _match_out(m: WorkerMatch) -> list[Any]:
    w = m.worker
    return [
        w.instance_id,
        w.dp_rank,
        m.matched_blocks,
        m.weighted_blocks,
        m.request_blocks,
        m.tokens_per_block,
        m.hash_algo,
        m.trusted,
        m.note,
    ]


def _match_in(row: list[Any]) -> WorkerMatch:
    inst, rank, matched, weighted, blocks, tpb, algo, trusted, note = row
    return WorkerMatch(
        WorkerKey(inst, rank), matched, float(weighted), blocks, tpb, algo, bool(trusted), note
    )


def _frame(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return _LEN.pack(len(body)) + body


# ---------------------------------------------------------------------- server


class ShardServer:
    """Serves ``index`` (the shard consumer's, read between batches) on ``host:port`` (port
    0: a free one; :attr:`port` after :meth:`start`). Use ``async with`` or
    :meth:`start`/:meth:`aclose` in the consumer's event loop."""

    def __init__(self, index: PrefixIndex, host: str = "127.0.0.1", port: int = 0) -> None:
        self.index = index
        self.host = host
        self.port = port
        self.requests = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> ShardServer:
        """Listen; OSError when the address is taken."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def aclose(self) -> None:
        """Stop listening and close every connection."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for w in list(self._conns):
            w.close()  # the handler reads EOF and returns
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        await server.wait_closed()

    async def __aenter__(self) -> ShardServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self._conns.add(writer)
        try:
            while True:
                try:
                    head = await reader.readexactly(_LEN.size)
                    (n,) = _LEN.unpack(head)
                    if n > MAX_MESSAGE:
                        return
                    body = await reader.readexactly(n)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                writer.write(_frame(self.answer(body)))
                await writer.drain()
        except ConnectionError:
            return
        finally:
            self._conns.discard(writer)
            if task is not None:
                self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def answer(self, body: bytes) -> dict[str, Any]:
        """The reply to one request message (never raises)."""
        self.requests += 1
        try:
            req = json.loads(body)
            op = req.get("op")
            if op == "workers":
                return {"ok": True, "workers": _workers_out(self.index.workers())}
            if op != "match":
                raise ConfigError(f"unknown shard request {op!r}")
            raw = base64.b64decode(req["tokens"], validate=True)
            if len(raw) % 4:
                raise ConfigError("tokens must be u32 little-endian ids")
            res = self.index.match(
                TokenIds.from_bytes(raw),
                layer_group_id=int(req.get("layer_group_id", 0)),
                workers=_workers_in(req["workers"]),
                request=_request_in(req.get("request")),
                tier_weights=tuple(req.get("tier_weights", DEFAULT_TIER_WEIGHTS)),
                hash_algo=req.get("hash_algo"),
                tokens_per_block=req.get("tokens_per_block"),
            )
            return {
                "ok": True,
                "num_tokens": res.num_tokens,
                "matches": [_match_out(m) for m in res.matches],
                "workers": _workers_out(self.index.workers()),
            }
        except Exception as exc:  # every error goes back to the client, the server lives on
            return {"ok": False, "error": type(exc).__name__, "message": str(exc)}


async def serve_shard(
    consumer: IndexConsumer,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    stop: asyncio.Event | None = None,
    on_listen: Callable[[ShardServer], None] | None = None,
    snapshot_every_batches: int | None = None,
    snapshot_every_s: float | None = None,
) -> ConsumerReport:
    """Run a shard process's loop: ``consumer`` reads its source (until it ends or ``stop``
    is set, snapshotting as :meth:`IndexConsumer.run` does) while a :class:`ShardServer`
    answers matches from its index; ``on_listen`` is called once the server listens."""
    async with ShardServer(consumer.index, host, port) as server:
        if on_listen is not None:
            on_listen(server)
        async with consumer.source:
            return await consumer.run(
                stop=stop,
                snapshot_every_batches=snapshot_every_batches,
                snapshot_every_s=snapshot_every_s,
            )


# ---------------------------------------------------------------------- client


class RemoteShard:
    """A shard served by a :class:`ShardServer` at ``host:port``, for a
    :class:`~kvstream.index.shards.ShardedIndex` (blocking sockets: call it from one thread).

    :meth:`workers` answers from the view the last reply brought, asking the shard when it
    is older than ``refresh_s``. ``timeout_s`` bounds every request; a shard that does not
    answer raises :class:`ShardUnavailableError` (and is reconnected on the next call).
    """

    def __init__(
        self, host: str, port: int, *, timeout_s: float = 2.0, refresh_s: float = 1.0
    ) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self._sock: socket.socket | None = None
        self._workers: list[WorkerKey] = []
        self._seen = float("-inf")

    def __repr__(self) -> str:
        return f"RemoteShard({self.host}:{self.port})"

    def close(self) -> None:
        """Close the connection (the next call reconnects)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> RemoteShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, obj: dict[str, Any]) -> socket.socket:
        try:
            if self._sock is None:
                self._sock = socket.create_connection((self.host, self.port), self.timeout_s)
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.settimeout(self.timeout_s)
            self._sock.sendall(_frame(obj))
        except OSError as exc:
            self.close()
            raise ShardUnavailableError(f"shard {self.host}:{self.port}: {exc}") from exc
        return self._sock

    def _recv(self, sock: socket.socket) -> dict[str, Any]:
        try:
            (n,) = _LEN.unpack(self._read(sock, _LEN.size))
            if n > MAX_MESSAGE:
                raise ShardUnavailableError(f"shard {self.host}:{self.port}: reply too large")
            reply = json.loads(self._read(sock, n))
            if not isinstance(reply, dict):
                raise ValueError(f"a reply is a JSON object, got {type(reply).__name__}")
        except (OSError, ValueError) as exc:
            self.close()
            raise ShardUnavailableError(f"shard {self.host}:{self.port}: {exc}") from exc
        if not reply.get("ok"):
            err, msg = reply.get("error"), f"shard {self.host}:{self.port}: {reply.get('message')}"
            if err == "HashConfigMismatchError":
                raise HashConfigMismatchError(msg)
            if err in ("ConfigError", "HashingError", "UnknownHashAlgorithmError"):
                raise ConfigError(msg)
            raise ShardUnavailableError(f"{msg} ({err})")
        if "workers" in reply:
            try:
                self._workers = _workers_in(reply["workers"])
            except (TypeError, ValueError) as exc:
                self.close()
                raise ShardUnavailableError(
                    f"shard {self.host}:{self.port}: malformed reply ({exc!r})"
                ) from exc
            self._seen = time.monotonic()
        return reply

    def _read(self, sock: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("connection closed")
            buf += chunk
        return bytes(buf)

    def workers(self) -> list[WorkerKey]:
        """The shard's workers (as of at most ``refresh_s`` ago)."""
        if time.monotonic() - self._seen > self.refresh_s:
            self._recv(self._send({"op": "workers"}))
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
        """Send a match request now; the returned function waits for its result."""
        cands = self.workers() if workers is None else workers
        sock = self._send(
            {
                "op": "match",
                "tokens": base64.b64encode(TokenIds(tokens).raw).decode(),
                "workers": _workers_out(cands),
                "layer_group_id": layer_group_id,
                "tier_weights": list(tier_weights),
                "hash_algo": hash_algo,
                "tokens_per_block": tokens_per_block,
                "request": _request_out(request),
            }
        )

        def result() -> MatchResult:
            reply = self._recv(sock)
            try:
                matches = tuple(_match_in(m) for m in reply["matches"])
                return MatchResult(matches, int(reply["num_tokens"]))
            except (KeyError, TypeError, ValueError) as exc:
                self.close()
                raise ShardUnavailableError(
                    f"shard {self.host}:{self.port}: malformed reply ({exc!r})"
                ) from exc

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
        """As :meth:`PrefixIndex.match`, answered by the remote shard."""
        return self.submit_match(
            tokens,
            layer_group_id=layer_group_id,
            workers=workers,
            request=request,
            tier_weights=tier_weights,
            hash_algo=hash_algo,
            tokens_per_block=tokens_per_block,
        )()
