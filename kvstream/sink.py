"""The Sink interface, sink URLs and the registry that finds sinks by name (layer L2).

A sink decides *where* batches go (memory, files, Kafka); the pipeline
(:mod:`kvstream.pipeline`) decides *when* and how often to call it, as the OpenTelemetry SDK
splits a span processor from its exporter. A sink is driven by one pipeline task at a time:

* :meth:`Sink.start` (optional) opens connections; the pipeline calls it before the first export.
* :meth:`Sink.export` delivers batches in order and answers with an :class:`ExportResult`
  (success, retriable failure or permanent failure, with a reason). The pipeline retries
  retriable failures with backoff and never calls ``export`` concurrently on one sink.
* :meth:`Sink.force_flush` makes everything exported so far durable (fsync, broker acks).
* :meth:`Sink.shutdown` flushes and releases resources; afterwards ``export`` fails permanently.
* :meth:`Sink.abandon` / :meth:`Sink.resolve` (optional): when the pipeline gives up an
  export, the sink stops delivering it and says what arrived anyway, so lost markers cover
  exactly the ids that are missing.

Sinks are found by the scheme of a URL (``memory``, ``file:///var/kv?rotate_bytes=1e8``,
``kafka://host:9092/topic?partitions=8``): built-ins first, then the ``kvstream.sinks``
entry-point group, which is read lazily, so a third-party package adds a sink with::

    [project.entry-points."kvstream.sinks"]
    s3 = "mypkg.s3sink:S3Sink"      # a Sink subclass (or callable) with from_url(SinkURL)
"""

from __future__ import annotations

import abc
import enum
import importlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from types import TracebackType
from typing import ClassVar, Final, Protocol, cast, runtime_checkable
from urllib.parse import parse_qsl, unquote, urlsplit

from kvstream.errors import ConfigError, PermanentSinkError, RetriableSinkError, SinkError
from kvstream.events.model import EventBatch
from kvstream.kafka_security import redact_url

__all__ = [
    "ENTRY_POINT_GROUP",
    "Abandoned",
    "ExportResult",
    "ExportStatus",
    "ReadableSink",
    "Sink",
    "SinkFactory",
    "SinkURL",
    "available_sinks",
    "create_sink",
    "get_sink_factory",
    "parse_sink_url",
    "parse_size",
    "register_sink",
]

#: The entry-point group third-party packages use to add sinks.
ENTRY_POINT_GROUP: Final = "kvstream.sinks"


class ExportStatus(enum.Enum):
    """How an export ended."""

    SUCCESS = "success"
    #: Nothing or only part was delivered; exporting the same batches again may succeed.
    RETRIABLE = "retriable"
    #: Retrying cannot help (bad configuration, record too large, sink shut down).
    PERMANENT = "permanent"


@dataclass(frozen=True, slots=True)
class ExportResult:
    """The outcome of :meth:`Sink.export`; ``reason`` says what went wrong (empty on success)."""

    status: ExportStatus
    reason: str = ""
    error: BaseException | None = field(default=None, compare=False)

    @property
    def ok(self) -> bool:
        """True on success."""
        return self.status is ExportStatus.SUCCESS

    @property
    def retriable(self) -> bool:
        """True when exporting the same batches again may succeed."""
        return self.status is ExportStatus.RETRIABLE

    @classmethod
    def success(cls) -> ExportResult:
        """Everything was delivered."""
        return _SUCCESS

    @classmethod
    def retry(cls, reason: str, error: BaseException | None = None) -> ExportResult:
        """A failure worth retrying."""
        return cls(ExportStatus.RETRIABLE, reason, error)

    @classmethod
    def permanent(cls, reason: str, error: BaseException | None = None) -> ExportResult:
        """A failure retrying cannot fix."""
        return cls(ExportStatus.PERMANENT, reason, error)

    @classmethod
    def from_exception(cls, exc: BaseException) -> ExportResult:
        """Classify an exception a sink raised instead of returning a result.

        :class:`RetriableSinkError`, :class:`TimeoutError` and :class:`ConnectionError` are
        retriable; :class:`PermanentSinkError` and anything else (a bug) are permanent.
        """
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if isinstance(exc, RetriableSinkError | TimeoutError | ConnectionError):
            return cls.retry(reason, exc)
        return cls.permanent(reason, exc)

    def raise_for_status(self) -> None:
        """Raise the matching :class:`SinkError` subclass unless this is a success."""
        if self.status is ExportStatus.RETRIABLE:
            raise RetriableSinkError(self.reason) from self.error
        if self.status is ExportStatus.PERMANENT:
            raise PermanentSinkError(self.reason) from self.error


_SUCCESS: Final = ExportResult(ExportStatus.SUCCESS)


@dataclass(frozen=True, slots=True)
class Abandoned:
    """What :meth:`Sink.abandon` knows of the batches it gave up: ``delivered`` did arrive;
    ``in_doubt`` may have arrived (sent, never acknowledged; ask :meth:`Sink.resolve`);
    every other batch of the export did not arrive and never will."""

    delivered: Sequence[EventBatch] = ()
    in_doubt: Sequence[EventBatch] = ()


class Sink(abc.ABC):
    """Where batches go. Subclasses implement :meth:`export`; the rest has safe defaults.

    Contract (what the pipeline relies on):

    * ``export`` is never called concurrently on one sink, and batches arrive in the order
      they must be delivered; a sink keeps that order per source.
    * ``export`` returns a result rather than raising; raising a :class:`SinkError` (or
      anything else, treated as permanent) is tolerated. After a retriable result the same
      batches may be exported again: at-least-once, consumers dedupe by event id.
    * ``export`` is cancellation-safe: the pipeline cancels an attempt that exceeds its
      timeout and may export the same batches again.
    * ``force_flush``/``shutdown`` honour ``timeout_s`` (None: no limit) and never raise for
      a sink-side failure: ``force_flush`` returns False, ``shutdown`` gives up and releases.
      Both are safe to cancel: a cancelled ``shutdown`` releases at once, it never goes on
      waiting for the destination.
    * When the pipeline gives up the batches of the last export (retry deadline, permanent
      failure, close's deadline) it calls ``abandon()``: from then on none of them may be
      delivered except those it reports ``in_doubt``; the pipeline asks ``resolve`` about
      those before declaring them lost (or reports them as ``unknown``).
    """

    #: The URL scheme this sink registers under (``memory``, ``file``, ``kafka``).
    scheme: ClassVar[str] = ""
    #: True when ``export`` also takes :class:`~kvstream.events.columns.ColumnBatch` objects
    #: (it encodes them without their models; what it reads of them: ``source``, ``ts_ns``,
    #: ``hash_algos``); the pipeline materialises them for every other sink.
    accepts_columns: ClassVar[bool] = False
    #: True when ``export`` also takes :class:`~kvstream.events.deferred.DeferredBatch`
    #: objects as they are (with ``accepts_columns``): the sink turns each into its columns
    #: itself (``batch.columns()``, thread-safe), e.g. in the thread that encodes it; the
    #: pipeline turns them into columns on its loop for every other column sink.
    accepts_deferred: ClassVar[bool] = False

    def __init__(self, *, name: str | None = None) -> None:
        self._name = name or self.scheme or type(self).__name__.lower()

    @property
    def name(self) -> str:
        """A short label for metrics and reports (defaults to the scheme)."""
        return self._name

    async def start(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Open connections/files. Called once by the pipeline before the first export."""

    @abc.abstractmethod
    async def export(self, batches: Sequence[EventBatch]) -> ExportResult:
        """Deliver ``batches`` in order; see the class docstring for the contract."""

    async def force_flush(self, timeout_s: float | None = None) -> bool:
        """Make everything exported so far durable; True when done within ``timeout_s``."""
        return True

    async def shutdown(self, timeout_s: float | None = None) -> None:  # noqa: B027
        """Flush and release resources; idempotent. Later exports fail permanently."""

    def abandon(self) -> Abandoned:
        """Stop delivering the batches of the last export (the pipeline gave them up) and say
        which arrived (see :class:`Abandoned`). Synchronous and never raises. The default,
        for sinks that keep nothing in flight after ``export`` returns: nothing arrived."""
        return Abandoned()

    async def resolve(self, batches: Sequence[EventBatch]) -> list[bool]:
        """For batches ``abandon`` reported in doubt: which did arrive (per batch). Raises
        :class:`RetriableSinkError` while it cannot tell yet, :class:`PermanentSinkError`
        when it never can (they stay in doubt)."""
        raise PermanentSinkError(f"{type(self).__name__} cannot resolve batches in doubt")

    async def __aenter__(self) -> Sink:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()

    @classmethod
    def from_url(cls, url: SinkURL) -> Sink:
        """Build the sink a URL describes; raises :class:`ConfigError` for bad parameters."""
        raise ConfigError(f"sink {cls.__name__} cannot be built from a URL ({url.raw!r})")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


@runtime_checkable
class ReadableSink(Protocol):
    """A sink that can return what it wrote (memory, file and Kafka sinks do).

    ``position()`` marks the sink's current end; ``read_back(since)`` returns the batches
    written after that mark (everything with None), in order per source.
    """

    async def position(self) -> object:
        """An opaque mark of what the sink holds now."""
        ...

    async def read_back(self, since: object = None) -> list[EventBatch]:
        """The batches written after ``since`` (a :meth:`position` mark), decoded."""
        ...


# --------------------------------------------------------------------------------------- URLs


@dataclass(frozen=True, slots=True)
class SinkURL:
    """A parsed sink URL: ``scheme://netloc/path?key=value&...``.

    ``memory`` (no ``://``) parses as scheme ``memory``. Query keys are case-sensitive; a key
    given twice keeps its last value. Typed access: :meth:`get_int`, :meth:`get_float`,
    :meth:`get_bool`; :meth:`check_keys` rejects parameters a sink does not know.
    """

    raw: str
    scheme: str
    netloc: str = ""
    path: str = ""
    params: Mapping[str, str] = field(default_factory=dict)

    @property
    def hosts(self) -> list[str]:
        """``host:port`` entries of a comma-separated netloc (Kafka bootstrap servers);
        ConfigError for a port that is not a number in 1..65535 (caught here, not at
        connect time)."""
        hosts = [h for h in self.netloc.split(",") if h]
        for h in hosts:
            if h.endswith("]") or ":" not in h:  # no port: the client's default
                continue
            port = h.rpartition(":")[2]
            if not (port.isdigit() and 1 <= int(port) <= 65535):
                raise ConfigError(f"port {port!r} of {h!r} in {self.raw!r} is not in 1..65535")
        return hosts

    def get(self, key: str, default: str | None = None) -> str | None:
        """The raw parameter value, or ``default``."""
        return self.params.get(key, default)

    def get_int(self, key: str, default: int | None = None) -> int | None:
        """An integer parameter; accepts ``1e8`` and ``64MiB``-style sizes too."""
        raw = self.params.get(key)
        if raw is None:
            return default
        return parse_size(raw, what=f"{key} in {self.raw!r}")

    def get_float(self, key: str, default: float | None = None) -> float | None:
        """A float parameter."""
        raw = self.params.get(key)
        if raw is None:
            return default
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{key} must be a number in {self.raw!r}, got {raw!r}") from None

    def get_bool(self, key: str, default: bool = False) -> bool:
        """A boolean parameter: 1/true/yes/on or 0/false/no/off."""
        raw = self.params.get(key)
        if raw is None:
            return default
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on", ""):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key} must be true or false in {self.raw!r}, got {raw!r}")

    def check_keys(self, known: Sequence[str]) -> None:
        """Raise :class:`ConfigError` naming every unknown parameter and the known ones."""
        unknown = sorted(set(self.params) - set(known))
        if unknown:
            raise ConfigError(
                f"unknown parameter(s) {', '.join(unknown)} for a {self.scheme} sink "
                f"({self.raw!r}); known: {', '.join(sorted(known))}"
            )


_SIZE_UNITS: Final = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
}


def parse_size(text: str, *, what: str = "value") -> int:
    """``"1000"``, ``"1e6"``, ``"64MiB"``, ``"10mb"`` -> int; raises :class:`ConfigError`."""
    s = text.strip().lower()
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    num, unit = s[:i].strip(), s[i:]
    if unit not in _SIZE_UNITS or not num:
        raise ConfigError(f"{what}: expected an integer or size like 64MiB, got {text!r}")
    try:
        value = float(num) if any(c in num for c in ".e") else int(num)
    except ValueError:
        raise ConfigError(f"{what}: expected an integer or size like 64MiB, got {text!r}") from None
    result = value * _SIZE_UNITS[unit]
    if result != int(result):
        raise ConfigError(f"{what}: {text!r} is not a whole number")
    return int(result)


def parse_sink_url(url: str) -> SinkURL:
    """Parse a sink URL. ``memory``/``memory://`` (+query), ``file:///abs/dir?...``,
    ``kafka://h1:9092,h2:9092/topic?...``. Raises :class:`ConfigError` when malformed.

    ``raw`` (what error messages quote) is the URL with its secrets masked
    (:func:`kvstream.kafka_security.redact_url`); ``params`` hold the real values."""
    shown = redact_url(url)
    text = url.strip()
    if not text:
        raise ConfigError("empty sink URL")
    if "://" not in text:
        name, _, query = text.partition("?")
        if not name.isidentifier():
            raise ConfigError(
                f"sink {shown!r} is neither a sink name (memory) nor a URL (scheme://...)"
            )
        return SinkURL(raw=shown, scheme=name.lower(), params=_query(query, shown))
    parts = urlsplit(text)
    if not parts.scheme:
        raise ConfigError(f"sink URL {shown!r} has no scheme")
    return SinkURL(
        raw=shown,
        scheme=parts.scheme.lower(),
        netloc=unquote(parts.netloc),
        path=unquote(parts.path),
        params=_query(parts.query, shown),
    )


def _query(query: str, url: str) -> dict[str, str]:
    try:
        return dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError as exc:
        raise ConfigError(f"malformed query string in sink URL {url!r}: {exc}") from None


# ----------------------------------------------------------------------------------- registry

#: Something that builds a sink from a URL: a Sink subclass (its ``from_url``) or a callable.
SinkFactory = Callable[[SinkURL], Sink]

#: Built-in sinks, imported only when asked for (aiokafka stays unimported without kafka).
_BUILTINS: Final[dict[str, str]] = {
    "memory": "kvstream.sinks.memory:MemorySink",
    "file": "kvstream.sinks.file:FileSink",
    "kafka": "kvstream.sinks.kafka:KafkaSink",
    "vllm": "kvstream.sinks.vllm:VllmSink",
}
_registered: dict[str, SinkFactory] = {}
_entry_points: dict[str, metadata.EntryPoint] = {}
_entry_points_loaded = threading.Event()
_lock = threading.Lock()


def register_sink(scheme: str, factory: SinkFactory | type[Sink]) -> None:
    """Register (or replace) a sink for ``scheme`` in this process."""
    with _lock:
        _registered[scheme.lower()] = _as_factory(factory)


def _as_factory(obj: object) -> SinkFactory:
    if isinstance(obj, type) and issubclass(obj, Sink):
        return obj.from_url
    from_url = getattr(obj, "from_url", None)
    if callable(from_url):
        return cast(SinkFactory, from_url)
    if callable(obj):
        return cast(SinkFactory, obj)
    raise ConfigError(f"{obj!r} is not a Sink subclass or a factory callable")


def _load_entry_points() -> dict[str, metadata.EntryPoint]:
    with _lock:
        if not _entry_points_loaded.is_set():
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                _entry_points.setdefault(ep.name.lower(), ep)
            _entry_points_loaded.set()
        return _entry_points


def _load_target(target: str) -> object:
    module_name, _, attr = target.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def available_sinks() -> list[str]:
    """Every scheme a sink can be created for (built-ins, registered, entry points)."""
    return sorted(set(_BUILTINS) | set(_registered) | set(_load_entry_points()))


def get_sink_factory(scheme: str) -> SinkFactory:
    """The factory for ``scheme``: registered first, then built-ins, then entry points.

    Raises :class:`ConfigError` listing the known schemes when there is none, and
    :class:`SinkError` when a sink's module fails to import (e.g. aiokafka missing).
    """
    key = scheme.lower()
    with _lock:
        factory = _registered.get(key)
    if factory is not None:
        return factory
    target: object
    try:
        if key in _BUILTINS:
            target = _load_target(_BUILTINS[key])
        else:
            ep = _load_entry_points().get(key)
            if ep is None:
                raise ConfigError(
                    f"unknown sink {scheme!r}; available: {', '.join(available_sinks())}"
                )
            target = ep.load()
    except ImportError as exc:
        raise SinkError(
            f"the {scheme!r} sink could not be loaded ({exc}); is its extra installed? "
            f"(pip install 'kvstream[{key}]')"
        ) from exc
    factory = _as_factory(target)
    with _lock:
        _registered.setdefault(key, factory)
    return factory


def create_sink(url: str | SinkURL) -> Sink:
    """Build a sink from a URL or name, e.g. ``create_sink("file:///tmp/kv?format=jsonl")``."""
    parsed = url if isinstance(url, SinkURL) else parse_sink_url(url)
    return get_sink_factory(parsed.scheme)(parsed)
