"""The service's settings: one pydantic model, from flags, environment or a JSON file.

Precedence: flags over ``KVSTREAM_SERVE_*`` variables over the file (``--config``); list
settings (``workers``, ``sources``, ``peers``) given as flags replace the others' lists.
Environment values are JSON when they parse as JSON, else strings; ``KVSTREAM_SERVE_WORKERS``
and ``KVSTREAM_SERVE_PEERS`` also take the flags' comma-separated form.

Worker specs (``--workers``, Dynamo's syntax, plus an optional replay endpoint)::

    ID[:RANK]=tcp://HOST:PORT[;tcp://HOST:REPLAY_PORT], ...

Source URLs (``--source``) are what :func:`kvstream.index.open_source` reads (``kafka://``
URLs, file-sink directories), plus the options ``model_name=``, ``routing_group=``,
``block_size=`` (which index the source feeds) and ``key_mode=`` (how that index keys blocks:
``dynamo``, the default, which Dynamo's ``/query`` needs; ``engine`` or ``tokens``, answered by
``/match`` and ``/route``), removed before the source sees the URL. ``elastic=1`` with a
Kafka ``group_id=`` makes the service an elastic shard: the group assigns its partitions, a
partition it gains is read from its start, and the workers of one it loses leave its index.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvstream.errors import ConfigError
from kvstream.index.keys import KeyMode

__all__ = [
    "DEFAULT_GROUP",
    "DEFAULT_MODEL",
    "ServeConfig",
    "SourceSpec",
    "WorkerSpec",
    "parse_source",
    "parse_workers",
]

DEFAULT_MODEL = "default"
DEFAULT_GROUP = "default"
_U64 = 2**64 - 1
_ENV_PREFIX = "KVSTREAM_SERVE_"
_SOURCE_OPTIONS = ("model_name", "routing_group", "block_size", "key_mode", "elastic")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One engine rank's ZMQ publisher: what ``POST /register`` and ``--workers`` name."""

    instance_id: int
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """A stream source feeding one model's index (see the module docstring)."""

    url: str
    model_name: str = DEFAULT_MODEL
    routing_group: str = DEFAULT_GROUP
    block_size: int | None = None
    #: how the model's index keys blocks (:class:`kvstream.index.KeyMode`)
    key_mode: KeyMode = KeyMode.DYNAMO
    #: a Kafka consumer-group member whose index follows its assigned partitions
    elastic: bool = False


def check_endpoint(text: str, what: str = "endpoint") -> str:
    """``text`` when it is a ``tcp://HOST:PORT`` address; ConfigError otherwise."""
    parts = urlsplit(text)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None or not 0 < port < 65536:
        raise ConfigError(f"{what} {text!r} is not tcp://HOST:PORT")
    return text


def parse_workers(text: str) -> list[WorkerSpec]:
    """Parse ``--workers`` (module docstring); ConfigError naming the bad entry."""
    out: list[WorkerSpec] = []
    seen: set[tuple[int, int]] = set()
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        who, sep, where = entry.partition("=")
        if not sep:
            raise ConfigError(f"--workers entry {entry!r}: expected ID[:RANK]=tcp://HOST:PORT")
        ident, _, rank_text = who.strip().partition(":")
        try:
            instance = int(ident)
            rank = int(rank_text) if rank_text else 0
        except ValueError:
            raise ConfigError(
                f"--workers entry {entry!r}: the instance id and rank must be integers"
            ) from None
        if not 0 <= instance <= _U64 or not 0 <= rank < 2**32:
            raise ConfigError(f"--workers entry {entry!r}: id or rank out of range")
        endpoint, _, replay = where.strip().partition(";")
        check_endpoint(endpoint, f"--workers entry {entry!r}: endpoint")
        if replay:
            check_endpoint(replay, f"--workers entry {entry!r}: replay endpoint")
        if (instance, rank) in seen:
            raise ConfigError(f"--workers: instance {instance} rank {rank} is listed twice")
        seen.add((instance, rank))
        out.append(WorkerSpec(instance, rank, endpoint, replay or None))
    return out


def parse_source(url: str) -> SourceSpec:
    """Split a ``--source`` URL into the source's own URL and the index it feeds."""
    parts = urlsplit(url)
    if not parts.query:
        return SourceSpec(url)
    mine: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        (mine.__setitem__(key, value) if key in _SOURCE_OPTIONS else rest.append((key, value)))
    block_size = None
    if "block_size" in mine:
        try:
            block_size = int(mine["block_size"])
        except ValueError:
            raise ConfigError(
                f"{url}: block_size={mine['block_size']!r} is not an integer"
            ) from None
        if block_size < 1:
            raise ConfigError(f"{url}: block_size must be >= 1")
    try:
        key_mode = KeyMode.parse(mine.get("key_mode") or KeyMode.DYNAMO)
    except ConfigError as exc:
        raise ConfigError(f"{url}: {exc}") from None
    elastic = mine.get("elastic", "0").lower() in ("1", "true", "yes")
    if elastic and not any(k == "group_id" and v for k, v in rest):
        raise ConfigError(f"{url}: elastic=1 needs a Kafka group_id=")
    own = urlunsplit(parts._replace(query=urlencode(rest)))
    return SourceSpec(
        own,
        mine.get("model_name") or DEFAULT_MODEL,
        mine.get("routing_group") or DEFAULT_GROUP,
        block_size,
        key_mode,
        elastic,
    )


class ServeConfig(BaseModel):
    """Everything ``kvstream serve`` is configured with (see ``kvstream serve --help``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8090
    #: block size of the workers given by ``workers`` and of registrations that name none
    block_size: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    model_name: str = DEFAULT_MODEL
    routing_group: str = DEFAULT_GROUP
    #: wire dialect of registered engines: ``vllm`` or ``sglang``
    engine: str = "vllm"
    workers: tuple[WorkerSpec, ...] = ()
    sources: tuple[SourceSpec, ...] = ()
    snapshot: Path | None = None
    snapshot_every_s: Annotated[float, Field(gt=0, le=86_400)] | None = 60.0
    peers: tuple[str, ...] = ()
    auth_token_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    #: bytes a request body may have (413 above)
    max_body_bytes: Annotated[int, Field(ge=1024)] = 16 << 20
    #: token ids (or block hashes) a query may carry (413 above)
    max_tokens: Annotated[int, Field(ge=1)] = 1 << 20
    #: report stale workers' matches too (default: they are left out of scores)
    include_stale: bool = False
    #: seconds without an event after which a ZMQ-fed worker is reported stale-suspect
    idle_after_s: Annotated[float, Field(gt=0)] = 300.0

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(parse_workers(v))
        if isinstance(v, Sequence):
            return tuple(
                w
                if isinstance(w, WorkerSpec)
                else parse_workers(w)[0]
                if isinstance(w, str)
                else WorkerSpec(**w)
                for w in v
            )
        return v

    @field_validator("sources", mode="before")
    @classmethod
    def _sources(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, Sequence):
            return tuple(
                s
                if isinstance(s, SourceSpec)
                else parse_source(s)
                if isinstance(s, str)
                else SourceSpec(**s)
                for s in v
            )
        return v

    @field_validator("peers", mode="before")
    @classmethod
    def _peers(cls, v: Any) -> Any:
        if isinstance(v, str):
            return tuple(p.strip().rstrip("/") for p in v.split(",") if p.strip())
        return v

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v not in ("vllm", "sglang"):
            raise ValueError(f"engine must be vllm or sglang, got {v!r}")
        return v

    @classmethod
    def load(
        cls,
        file: str | os.PathLike[str] | None = None,
        environ: Mapping[str, str] | None = None,
        **flags: Any,
    ) -> ServeConfig:
        """Merge a JSON ``file``, ``KVSTREAM_SERVE_*`` variables and ``flags`` (None values
        are unset flags); ConfigError naming every bad setting."""
        data: dict[str, Any] = {}
        if file is not None:
            try:
                loaded = json.loads(Path(file).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ConfigError(f"cannot read serve config {os.fspath(file)!r}: {exc}") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"serve config {os.fspath(file)!r} must be a JSON object")
            data.update(loaded)
        env = os.environ if environ is None else environ
        for key, raw in env.items():
            if key.startswith(_ENV_PREFIX):
                name = key[len(_ENV_PREFIX) :].lower()
                try:
                    data[name] = json.loads(raw)
                except ValueError:
                    data[name] = raw
        data.update({k: v for k, v in flags.items() if v is not None})
        try:
            cfg = cls.model_validate(data)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            raise ConfigError(f"invalid serve config: {problems}") from None
        except ConfigError as exc:
            raise ConfigError(f"invalid serve config: {exc}") from None
        if cfg.workers and cfg.block_size is None:
            raise ConfigError("--workers needs --block-size (the workers' KV block size)")
        if (cfg.tls_cert is None) != (cfg.tls_key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        return cfg

    def auth_token(self) -> str | None:
        """The bearer token from ``auth_token_file`` (stripped), None without one;
        ConfigError when the file cannot be read or is empty."""
        if self.auth_token_file is None:
            return None
        try:
            token = self.auth_token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --auth-token-file: {exc}") from None
        if not token:
            raise ConfigError(f"--auth-token-file {self.auth_token_file} is empty")
        return token
