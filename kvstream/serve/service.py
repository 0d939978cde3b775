"""The index service: models, registrations, feeds, queries, snapshots, and its lifecycle.

::

    from kvstream.serve import IndexService, ServeConfig

    async with IndexService(ServeConfig(port=0, block_size=16)) as svc:
        print(svc.url)                    # http://127.0.0.1:PORT
        ...                               # routers call it (kvstream.serve.Client)

:meth:`IndexService.start` restores the last snapshot (``snapshot``) or, without one, pulls a
live peer's (``peers``), starts a feed per registration and per source, then serves HTTP
(:mod:`kvstream.serve.http`); :meth:`IndexService.aclose` stops serving, writes a last
snapshot and closes the feeds. Everything runs on one event loop: a query reads the indexes
between two applied batches, never during one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kvstream._types import hash_width
from kvstream.errors import ConfigError, HashingError, KVStreamError
from kvstream.hashing import get_hasher, split_blocks
from kvstream.index import HashRequest
from kvstream.index.errors import HashConfigMismatchError, SnapshotError
from kvstream.index.keys import KeyMode, keys_from_i64
from kvstream.index.snapshot import write_atomic
from kvstream.kafka_security import redact_url
from kvstream.serve.config import ServeConfig, SourceSpec, WorkerSpec, check_endpoint
from kvstream.serve.errors import (
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)
from kvstream.serve.feeds import EngineFeed, Feed, StreamFeed
from kvstream.serve.metrics import ServiceMetrics
from kvstream.serve.models import ModelIndex, ModelKey, Registration
from kvstream.serve.requests import (
    QueryByHashRequest,
    QueryRequest,
    QueryTokensRequest,
    RegisterRequest,
    UnregisterRequest,
    decode,
    read_query_tokens,
)
from kvstream.serve.snapshot import (
    ModelState,
    decode_service_snapshot,
    encode_service_snapshot,
    read_snapshot,
)

if TYPE_CHECKING:
    from kvstream.serve.server import HttpServer

__all__ = ["IndexService"]

log = logging.getLogger("kvstream.serve")

_U64: Final = 2**64
_PEER_TIMEOUT_S: Final = 10.0


class IndexService:
    """A KV index service (see the module docstring); ``config`` defaults to
    :class:`~kvstream.serve.config.ServeConfig`'s defaults."""

    def __init__(self, config: ServeConfig | None = None) -> None:
        self.config = config or ServeConfig()
        self.token = self.config.auth_token()
        self._models: dict[ModelKey, ModelIndex] = {}
        self._feeds: dict[str, Feed] = {}
        self._peers: list[str] = list(self.config.peers)
        #: where the state came from at start: "snapshot", "peer URL" or "" (empty start)
        self.restored_from = ""
        self._restoring = True
        self.metrics = ServiceMetrics(self)
        self.snapshots = 0
        self.last_snapshot_error = ""
        self._snap_task: asyncio.Task[None] | None = None
        self._server: HttpServer | None = None
        self.port: int | None = None
        self.started_at = time.monotonic()

    # ------------------------------------------------------------------ registry

    def models(self) -> list[ModelIndex]:
        """Every model index."""
        return list(self._models.values())

    def feeds(self) -> list[Feed]:
        """Every feed (registrations and sources)."""
        return list(self._feeds.values())

    def _key(self, model_name: str, routing_group: str | None) -> ModelKey:
        return ModelKey(model_name, routing_group or self.config.routing_group)

    def model(self, model_name: str, routing_group: str | None = None) -> ModelIndex:
        """The index of a model; NotFoundError (Dynamo's message) when it has none."""
        key = self._key(model_name, routing_group)
        m = self._models.get(key)
        if m is None:
            raise NotFoundError(
                f"no indexer for model={key.model_name} routing_group={key.routing_group}"
            )
        return m

    def _model_for(
        self, key: ModelKey, block_size: int, key_mode: KeyMode | None = None
    ) -> ModelIndex:
        """The model's index, created (``key_mode``, default dynamo) when new; ConflictError
        for another block size, or another key mode when ``key_mode`` is given."""
        m = self._models.get(key)
        if m is None:
            m = self._models[key] = ModelIndex(key, block_size, key_mode or KeyMode.DYNAMO)
        elif key_mode is not None and m.key_mode is not KeyMode.parse(key_mode):
            raise ConflictError(
                f"key_mode mismatch for model={key.model_name} "
                f"routing_group={key.routing_group}: existing={m.key_mode.value}, "
                f"requested={KeyMode.parse(key_mode).value}"
            )
        elif m.block_size != block_size:
            raise ConflictError(
                f"block_size mismatch for model={key.model_name} "
                f"routing_group={key.routing_group}: existing={m.block_size}, "
                f"requested={block_size}"
            )
        return m

    def register(self, req: RegisterRequest) -> None:
        """Follow one engine rank's publisher (Dynamo's ``POST /register``)."""
        if req.instance_id >= _U64:
            raise InvalidRequestError(f"instance_id {req.instance_id} is not a u64")
        block_size = req.block_size or self.config.block_size
        if block_size is None:
            raise InvalidRequestError(
                "block_size is required (the service was started without --block-size)"
            )
        try:
            check_endpoint(req.endpoint)
            if req.replay_endpoint is not None:
                check_endpoint(req.replay_endpoint, "replay_endpoint")
        except ConfigError as exc:
            raise InvalidRequestError(str(exc)) from None
        engine = req.engine or self.config.engine
        if engine not in ("vllm", "sglang"):
            raise InvalidRequestError(f"engine must be vllm or sglang, got {engine!r}")
        if req.hash_algo is not None:
            self._check_algo(req.hash_algo)
        key = self._key(req.model_name, req.routing_group)
        spec = WorkerSpec(req.instance_id, req.dp_rank, req.endpoint, req.replay_endpoint)
        for m in self._models.values():
            if (spec.instance_id, spec.dp_rank) in m.registrations:
                raise ConflictError(
                    f"instance {spec.instance_id} dp_rank {spec.dp_rank} already registered"
                )
        model = self._model_for(key, block_size)
        reg = Registration(spec, key, engine=engine, hash_algo=req.hash_algo)
        feed = EngineFeed(reg, model)
        try:
            feed.url()
        except ValueError as exc:
            if not model.registrations and not model.sources:
                del self._models[key]
            raise InvalidRequestError(str(exc)) from None
        model.registrations[(spec.instance_id, spec.dp_rank)] = reg
        self._start_feed(feed, None)

    def _start_feed(self, feed: Feed, resume: dict[str, Any] | None) -> None:
        self._feeds[feed.name] = feed
        feed.start(resume)

    async def unregister(self, req: UnregisterRequest) -> None:
        """Stop following an instance (every rank, or ``dp_rank``) and forget its blocks
        (Dynamo's ``POST /unregister``). A model left without workers or sources is
        removed, as Dynamo removes its indexer."""
        key = self._key(req.model_name, req.routing_group)
        m = self._models.get(key)
        regs = (
            []
            if m is None
            else [
                r
                for (inst, rank), r in m.registrations.items()
                if inst == req.instance_id and (req.dp_rank is None or rank == req.dp_rank)
            ]
        )
        if m is None or not regs:
            raise NotFoundError(f"instance {req.instance_id} not found")
        for r in regs:
            del m.registrations[(r.spec.instance_id, r.spec.dp_rank)]
            feed = self._feeds.pop(f"zmq:{r.spec.instance_id}:{r.spec.dp_rank}", None)
            if feed is not None:
                await feed.aclose()
        for w in m.workers_of(req.instance_id):
            if req.dp_rank is None or (w.dp_rank or 0) == req.dp_rank:
                m.index.forget(w)
        if not m.registrations and not m.sources:
            del self._models[key]

    def workers_json(self) -> list[dict[str, Any]]:
        """``GET /workers``: every registered instance (Dynamo's shape), plus, per rank,
        kvstream's ``note`` and every stream-fed worker with ``source`` set to its feed."""
        out: list[dict[str, Any]] = []
        for m in self._models.values():
            by_inst: dict[int, dict[str, Any]] = {}
            for (inst, rank), reg in sorted(m.registrations.items()):
                entry = by_inst.get(inst)
                if entry is None:
                    entry = by_inst[inst] = {
                        "instance_id": inst,
                        "source": "zmq",
                        "status": "active",
                        "model_name": m.key.model_name,
                        "routing_group": m.key.routing_group,
                        "block_size": m.block_size,
                        "endpoints": {},
                        "listeners": {},
                    }
                feed = self._feeds.get(f"zmq:{inst}:{rank}")
                status, note = feed.status() if isinstance(feed, EngineFeed) else ("failed", "")
                entry["endpoints"][str(rank)] = reg.spec.endpoint
                entry["listeners"][str(rank)] = {
                    "endpoint": reg.spec.endpoint,
                    "status": status,
                    "note": note,
                }
                if status != "active" and entry["status"] == "active":
                    entry["status"] = status
            out.extend(by_inst.values())
            registered = {str(i) for i in by_inst}
            for w in m.index.workers():
                if w.instance_id in registered:
                    continue
                info = m.index.info(w)
                out.append(
                    {
                        "instance_id": w.instance_id,
                        "dp_rank": 0 if w.dp_rank is None else w.dp_rank,
                        "source": "stream",
                        "status": "stale" if info.stale else "active",
                        "note": info.stale_reason or m.index.unmatchable(w),
                        "model_name": m.key.model_name,
                        "routing_group": m.key.routing_group,
                        "block_size": m.block_size,
                    }
                )
        return out

    # ------------------------------------------------------------------ queries

    def _check_algo(self, name: str) -> None:
        try:
            get_hasher(name)
        except HashingError as exc:
            raise InvalidRequestError(str(exc)) from None

    def _limit(self, n: int, what: str) -> None:
        if n > self.config.max_tokens:
            raise PayloadTooLargeError(
                f"{n} {what} is over the limit of {self.config.max_tokens} (--max-tokens)"
            )

    def query(self, req: QueryRequest) -> dict[str, Any]:
        """``POST /query``: scores of ``token_ids``, hashed with Dynamo's local hash, or
        with ``hash_algo`` (kvstream) and matched through the engine's hashes."""
        self._limit(len(req.token_ids), "token ids")
        m = self.model(req.model_name, req.routing_group)
        m.require_dynamo("/query")
        if req.hash_algo is not None:
            return self._query_engine_tokens(m, req)
        return self._query_dynamo(m, req, req.token_ids)

    def query_body(self, body: bytes) -> dict[str, Any]:
        """``POST /query`` from its JSON body: :meth:`query`'s answer and errors. Token ids
        written as a plain JSON array of u32 (what clients send) go from the JSON text to
        u32 bytes to keys without a Python int per id, read once (in C when built:
        :func:`~kvstream.serve.requests.read_query_tokens`); any other body is decoded as a
        :class:`QueryRequest`."""
        fast = read_query_tokens(body)
        if fast is not None and fast[0].hash_algo is None:
            req, raw = fast
            if len(raw) >> 2 > self.config.max_tokens:
                self._limit(len(raw) >> 2, "token ids")
            key = ModelKey(req.model_name, req.routing_group or self.config.routing_group)
            m = self._models.get(key)
            if m is None or m.index.key_mode is not KeyMode.DYNAMO or req.cache_salt is not None:
                m = self.model(req.model_name, req.routing_group)  # their errors
                m.require_dynamo("/query")
                return self._query_dynamo(m, req, raw)
            return m.query_keys(
                m.token_keys(raw, req.lora_name), include_stale=self.config.include_stale
            )
        return self.query(decode(body, QueryRequest))

    def _query_dynamo(
        self, m: ModelIndex, req: QueryRequest | QueryTokensRequest, tokens: list[int] | bytes
    ) -> dict[str, Any]:
        if req.cache_salt is not None:
            raise InvalidRequestError(
                "cache_salt needs hash_algo (Dynamo's local hashes carry no salt)"
            )
        keys = m.token_keys(tokens, req.lora_name)
        return m.query_keys(keys, include_stale=self.config.include_stale)

    def _engine_algo(self, m: ModelIndex, name: str) -> None:
        self._check_algo(name)
        algos = m.hash_algos()
        if name not in algos:
            raise ConflictError(
                f"no worker of model={m.key.model_name} publishes {name} hashes "
                f"(they publish: {', '.join(sorted(algos)) or 'nothing yet'})"
            )

    def _query_engine_tokens(self, m: ModelIndex, req: QueryRequest) -> dict[str, Any]:
        assert req.hash_algo is not None
        self._engine_algo(m, req.hash_algo)
        blocks = split_blocks(req.token_ids, m.block_size)
        if blocks and len(blocks[-1]) < m.block_size:
            blocks.pop()
        try:
            hashes = get_hasher(req.hash_algo).chain_bytes(
                blocks, lora_name=req.lora_name, cache_salt=req.cache_salt
            )
        except HashingError as exc:
            raise InvalidRequestError(
                f"cannot hash the request with {req.hash_algo}: {exc}"
            ) from None
        keys = m.keys_for_engine_hashes(hashes)
        return m.query_keys(keys, include_stale=self.config.include_stale)

    def query_by_hash(self, req: QueryByHashRequest) -> dict[str, Any]:
        """``POST /query_by_hash``: Dynamo local hashes (signed i64), or the engine's own
        block hashes with ``hash_algo``."""
        self._limit(len(req.block_hashes), "block hashes")
        m = self.model(req.model_name, req.routing_group)
        m.require_dynamo("/query_by_hash")
        if req.hash_algo is None:
            try:
                keys = keys_from_i64(req.block_hashes)
            except HashingError as exc:
                raise InvalidRequestError(str(exc)) from None
            # a lora_name is ignored, as Dynamo ignores it: the local hashes carry the LoRA
            return m.query_keys(keys, include_stale=self.config.include_stale)
        self._engine_algo(m, req.hash_algo)
        width = hash_width(req.hash_algo) or 8  # a registered name (checked above)
        hashes: list[bytes] = []
        for i, h in enumerate(req.block_hashes):
            try:
                if type(h) is int:
                    hashes.append((h % _U64 if h < 0 else h).to_bytes(width, "big"))
                elif isinstance(h, str):
                    raw = bytes.fromhex(h)
                    if len(raw) != width:
                        raise ValueError(f"{len(raw)} bytes, expected {width}")
                    hashes.append(raw)
                else:
                    raise ValueError("expected an int or a hex string")
            except (ValueError, OverflowError) as exc:
                raise InvalidRequestError(f"block_hashes[{i}]: {exc}") from None
        return m.query_keys(
            m.keys_for_engine_hashes(hashes), include_stale=self.config.include_stale
        )

    def route(self, req: QueryRequest) -> dict[str, Any]:
        """``POST /route`` (kvstream): the router's decision for ``token_ids`` among the
        model's workers, with every worker's cost."""
        self._limit(len(req.token_ids), "token ids")
        m = self.model(req.model_name, req.routing_group)
        if not m.index.workers():
            raise NotFoundError(f"model={m.key.model_name} has no workers yet")
        request = HashRequest(lora_name=req.lora_name, drop_last_token=False)
        try:
            decision = m.router.route(req.token_ids, request)
        except HashConfigMismatchError as exc:
            raise ConflictError(str(exc)) from None
        except (ConfigError, HashingError) as exc:
            raise InvalidRequestError(str(exc)) from None
        w = decision.worker
        return {
            "instance_id": w.instance_id,
            "dp_rank": 0 if w.dp_rank is None else w.dp_rank,
            "policy": decision.policy.value,
            "num_tokens": decision.num_tokens,
            "scores": [s.as_dict() for s in decision.scores],
        }

    def dump(self) -> dict[str, Any]:
        """``GET /dump``: every Dynamo-keyed model's cached blocks as Dynamo lists them
        (models indexed by other keys have no local hashes to list, and are left out)."""
        return {
            str(m.key): m.dump()
            for m in self._models.values()
            if m.index.key_mode is KeyMode.DYNAMO
        }

    def ready(self) -> tuple[bool, list[str]]:
        """``(ready, what is still awaited)``: the state restored, every feed caught up."""
        waiting = [f.name for f in self._feeds.values() if not f.caught_up]
        if self._restoring:
            waiting.insert(0, "restore")
        return not waiting, waiting

    # ------------------------------------------------------------------ peers

    def peers(self) -> list[str]:
        """The peers a restarted replica may recover from."""
        return list(self._peers)

    def add_peer(self, url: str) -> None:
        """Add a peer (``POST /register_peer``); InvalidRequestError for a non-HTTP URL."""
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise InvalidRequestError(f"peer url {url!r} must be http:// or https://")
        if url not in self._peers:
            self._peers.append(url)

    def remove_peer(self, url: str) -> None:
        """Remove a peer (``POST /deregister_peer``); NotFoundError when unknown."""
        url = url.rstrip("/")
        if url not in self._peers:
            raise NotFoundError(f"peer {url} not found")
        self._peers.remove(url)

    # ------------------------------------------------------------------ snapshots

    def _positions(self, m: ModelIndex) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in self._feeds.values():
            if f.model is m:
                ckpt = f.checkpoint()
                if ckpt is not None:
                    out[f.name] = ckpt
        return out

    def snapshot_bytes(self) -> bytes:
        """The whole state as snapshot bytes (``GET /snapshot``; :mod:`.snapshot`)."""
        return encode_service_snapshot([(m, self._positions(m)) for m in self._models.values()])

    async def save_snapshot(self) -> Path | None:
        """Write a snapshot to ``config.snapshot`` (None without one). The bytes are taken
        in one step, then written atomically off the loop; OSError on failure."""
        path = self.config.snapshot
        if path is None:
            return None
        data = self.snapshot_bytes()
        await asyncio.to_thread(write_atomic, path, data)
        self.snapshots += 1
        return path

    async def _snapshot_loop(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.save_snapshot()
                self.last_snapshot_error = ""
            except OSError as exc:
                self.last_snapshot_error = str(exc)
                log.error("snapshot to %s failed: %s", self.config.snapshot, exc)

    def _pull_peer(self, url: str) -> bytes:
        req = urllib.request.Request(f"{url}/snapshot")
        if self.token is not None:
            req.add_header("authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=_PEER_TIMEOUT_S) as resp:
            return bytes(resp.read())

    async def _restore(self) -> list[ModelState]:
        if self.config.snapshot is not None:
            states = read_snapshot(self.config.snapshot)
            if states is not None:
                self.restored_from = "snapshot"
                return states
        for url in self._peers:
            try:
                data = await asyncio.to_thread(self._pull_peer, url)
                states = decode_service_snapshot(data)
            except (OSError, urllib.error.URLError, SnapshotError) as exc:
                log.warning("peer %s: no state to recover from: %s", url, exc)
                continue
            self.restored_from = f"peer {url}"
            return states
        return []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Restore, start the feeds and the HTTP server (module docstring). ConfigError for
        a bad configuration, SnapshotError for an unreadable snapshot file, OSError when the
        port is taken."""
        self.started_at = time.monotonic()
        cfg = self.config
        sources: list[tuple[SourceSpec, ModelIndex]] = []
        for spec in cfg.sources:
            bs = spec.block_size or cfg.block_size
            if bs is None:
                raise ConfigError(
                    f"--source {redact_url(spec.url)}: give the model's block size "
                    "(--block-size, or block_size= in the source URL)"
                )
            key = ModelKey(spec.model_name, spec.routing_group)
            sources.append((spec, ModelIndex(key, bs, spec.key_mode)))
        await self._start_http()
        try:
            states = await self._restore()
            positions: dict[str, Any] = {}
            for st in states:
                self._models[st.model.key] = st.model
                positions.update(st.positions)
                for reg in st.model.registrations.values():
                    self._start_feed(
                        EngineFeed(reg, st.model),
                        positions.get(f"zmq:{reg.spec.instance_id}:{reg.spec.dp_rank}"),
                    )
            for spec, fresh in sources:
                try:
                    m = self._model_for(fresh.key, fresh.block_size, fresh.key_mode)
                except ConflictError as exc:
                    raise ConfigError(str(exc)) from None
                m.sources.add(spec.url)
                feed = StreamFeed(spec, m)
                self._start_feed(feed, positions.get(feed.name))
            for w in cfg.workers:
                if any(
                    (w.instance_id, w.dp_rank) in m.registrations for m in self._models.values()
                ):
                    continue
                self.register(
                    RegisterRequest(
                        instance_id=w.instance_id,
                        endpoint=w.endpoint,
                        model_name=cfg.model_name,
                        block_size=cfg.block_size,
                        dp_rank=w.dp_rank,
                        replay_endpoint=w.replay_endpoint,
                    )
                )
        except BaseException:
            await self.aclose(snapshot=False)
            raise
        self._restoring = False
        if cfg.snapshot is not None and cfg.snapshot_every_s is not None:
            self._snap_task = asyncio.create_task(self._snapshot_loop(cfg.snapshot_every_s))

    async def _start_http(self) -> None:
        from kvstream.serve.http import Routes
        from kvstream.serve.server import HttpServer, server_ssl_context

        cfg = self.config
        ctx = None
        if cfg.tls_cert is not None:
            assert cfg.tls_key is not None  # the configuration gives both or neither
            ctx = server_ssl_context(str(cfg.tls_cert), str(cfg.tls_key))
        server = HttpServer(Routes(self), max_body_bytes=cfg.max_body_bytes, ssl_context=ctx)
        try:
            await server.start(cfg.host, cfg.port)
        except OSError as exc:
            raise OSError(f"cannot serve on {cfg.host}:{cfg.port}: {exc}") from exc
        self._server = server
        self.port = server.port

    @property
    def url(self) -> str:
        """The service's base URL (after :meth:`start`)."""
        scheme = "https" if self.config.tls_cert is not None else "http"
        host = self.config.host
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{self.port}"

    async def aclose(self, *, snapshot: bool = True) -> None:
        """Stop serving, write a last snapshot (when configured and ``snapshot``), close
        every feed. Idempotent."""
        if self._snap_task is not None:
            self._snap_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._snap_task
            self._snap_task = None
        server, self._server = self._server, None
        if server is not None:
            await server.aclose()
        if snapshot and not self._restoring:
            try:
                await self.save_snapshot()
            except (OSError, KVStreamError) as exc:
                log.error("last snapshot failed: %s", exc)
        feeds = list(self._feeds.values())
        self._feeds.clear()
        for f in feeds:
            await f.aclose()

    async def __aenter__(self) -> IndexService:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
