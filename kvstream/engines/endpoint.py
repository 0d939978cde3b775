"""``vllm://`` and ``sglang://`` URLs: where an engine publishes and how to follow it.

::

    vllm://HOST:PORT?replay=RPORT&dp_size=N&hash_algo=NAME&instance=NAME&from=0|latest
    sglang://HOST:PORT?...                 (same options)

=============== ==========================================================================
option          meaning
=============== ==========================================================================
``replay``      the engine's replay ROUTER port (``replay_endpoint``); rank r uses RPORT+r.
                Without it a gap cannot be recovered and becomes a ``lost`` marker.
``dp_size``     data-parallel ranks; rank r publishes on PORT+r (default 1)
``hash_algo``   the algorithm the engine hashes blocks with, published in every event
                (default: ``vllm_sha256_64`` for vLLM — its default ``sha256`` in int mode —,
                ``sglang_sha256_64`` for SGLang). A name kvstream does not know is an error
                naming the closest known one, unless ``allow_unknown_algo=true`` is given
                too: then it is published as given (a newer engine's algorithm, which
                kvstream cannot hash requests with)
``instance``    the kvstream ``instance_id`` of this engine (default ``ENGINE@HOST:PORT``)
``from``        ``0``: replay everything the engine still buffers before following it
                (default); ``latest``: only what is published from now on (what came
                before is reported as one ``lost`` marker, so consumers know)
``topic``       the engine's topic (``KVEventsConfig.topic``; default ``""``: all)
``bind``        ``true``: kvstream binds the SUB socket and engines connect to it (the
                "router binds" deployment); default: kvstream connects to the engine
``hwm``         receive high-water mark of each SUB socket (default 100000)
``replay_timeout`` seconds to wait for each replay reply (default 2)
=============== ==========================================================================

Bad URLs raise :class:`~kvstream.errors.ConfigError` naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qsl, urlsplit

from kvstream.engines.sglang import SGLANG
from kvstream.engines.vllm import VLLM, Dialect
from kvstream.errors import ConfigError

__all__ = ["DIALECTS", "EngineEndpoint", "parse_engine_url"]

#: URL scheme -> wire dialect.
DIALECTS: Final[dict[str, Dialect]] = {"vllm": VLLM, "sglang": SGLANG}
_OPTIONS: Final = (
    "replay",
    "dp_size",
    "hash_algo",
    "allow_unknown_algo",
    "instance",
    "from",
    "topic",
    "bind",
    "hwm",
    "replay_timeout",
)
_MAX_PORT: Final = 65535


@dataclass(frozen=True, slots=True)
class EngineEndpoint:
    """A parsed engine URL (module docstring). ``start`` is ``"0"`` or ``"latest"``."""

    dialect: Dialect
    host: str
    port: int
    replay_port: int | None = None
    dp_size: int = 1
    hash_algo: str = ""
    instance_id: str = ""
    start: str = "0"
    topic: str = ""
    bind: bool = False
    hwm: int = 100_000
    replay_timeout_s: float = 2.0

    def pub_address(self, rank: int) -> str:
        """The ZMQ address rank ``rank`` publishes on (kvstream's side of it when binding)."""
        return f"tcp://{self.host}:{self.port + rank}"

    def replay_address(self, rank: int) -> str | None:
        """The replay ROUTER address of rank ``rank`` (None: the engine has no replay)."""
        if self.replay_port is None:
            return None
        return f"tcp://{self.host}:{self.replay_port + rank}"

    def describe(self) -> str:
        """A short label for logs: ``vllm://127.0.0.1:5557 (2 ranks)``."""
        ranks = f" ({self.dp_size} ranks)" if self.dp_size > 1 else ""
        return f"{self.dialect.name}://{self.host}:{self.port}{ranks}"


def _int(params: dict[str, str], key: str, default: int, lo: int, hi: int, *, url: str) -> int:
    raw = params.get(key)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{url}: {key}={raw!r} is not an integer") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{url}: {key}={value} is outside {lo}..{hi}")
    return value


def parse_engine_url(url: str) -> EngineEndpoint:
    """Parse ``vllm://`` / ``sglang://`` URLs (module docstring); ConfigError when invalid."""
    parts = urlsplit(url)
    dialect = DIALECTS.get(parts.scheme.lower())
    if dialect is None:
        raise ConfigError(f"{url}: not an engine URL (use {' or '.join(DIALECTS)}://HOST:PORT)")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise ConfigError(f"{url}: {exc}") from None
    if not host or port is None:
        raise ConfigError(f"{url}: needs HOST:PORT, e.g. {parts.scheme}://127.0.0.1:5557")
    if port < 1:
        raise ConfigError(f"{url}: port must be 1..{_MAX_PORT}")
    params: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _OPTIONS:
            raise ConfigError(f"{url}: unknown option {key!r} (known: {', '.join(_OPTIONS)})")
        params[key] = value
    dp_size = _int(params, "dp_size", 1, 1, 1024, url=url)
    if port + dp_size - 1 > _MAX_PORT:
        raise ConfigError(f"{url}: ports {port}..{port + dp_size - 1} exceed {_MAX_PORT}")
    replay = None
    if "replay" in params:
        replay = _int(params, "replay", 0, 1, _MAX_PORT - dp_size + 1, url=url)
        if port <= replay < port + dp_size or replay <= port < replay + dp_size:
            raise ConfigError(f"{url}: replay ports overlap the publisher ports")
    start = params.get("from", "0")
    if start not in ("0", "latest"):
        raise ConfigError(f"{url}: from={start!r}; use from=0 or from=latest")
    bind_raw = params.get("bind", "false").lower()
    if bind_raw not in ("true", "false", "1", "0"):
        raise ConfigError(f"{url}: bind={bind_raw!r}; use true or false")
    try:
        timeout = float(params.get("replay_timeout", "2"))
    except ValueError:
        raise ConfigError(f"{url}: replay_timeout is not a number") from None
    if not 0 < timeout <= 3600:
        raise ConfigError(f"{url}: replay_timeout must be in (0, 3600] seconds")
    allow_raw = params.get("allow_unknown_algo", "false").lower()
    if allow_raw not in ("true", "false", "1", "0"):
        raise ConfigError(f"{url}: allow_unknown_algo={allow_raw!r}; use true or false")
    from kvstream.hashing.registry import check_hash_algo

    hash_algo = check_hash_algo(
        params.get("hash_algo") or dialect.default_hash_algo,
        allow_unknown=allow_raw in ("true", "1"),
        where=f"{url}: hash_algo",
        hint="; add allow_unknown_algo=true to publish a name kvstream does not know as given",
    )
    instance = params.get("instance") or f"{dialect.name}@{host}:{port}"
    if len(instance) > 256:
        raise ConfigError(f"{url}: instance names are at most 256 characters")
    return EngineEndpoint(
        dialect=dialect,
        host=host,
        port=port,
        replay_port=replay,
        dp_size=dp_size,
        hash_algo=hash_algo,
        instance_id=instance,
        start=start,
        topic=params.get("topic", ""),
        bind=bind_raw in ("true", "1"),
        hwm=_int(params, "hwm", 100_000, 0, 2**31 - 1, url=url),
        replay_timeout_s=timeout,
    )
