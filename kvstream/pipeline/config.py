"""Pipeline settings: one pydantic model, settable from flags, environment or a file.

``PipelineConfig`` holds the pipeline-wide bounds and a :class:`SinkPolicy` per sink (the
``defaults`` applied to every sink, overridden per sink name in ``sinks``)::

    PipelineConfig(
        handoff_timeout_s=0.005,
        defaults=SinkPolicy(overflow="drop_oldest", linger_s=0.01),
        sinks={"kafka": {"overflow": "block", "block_timeout_s": 0.002}},
    )

:meth:`PipelineConfig.from_env` reads ``KVSTREAM_PIPELINE_*`` variables (``__`` separates
nesting: ``KVSTREAM_PIPELINE_DEFAULTS__LINGER_S=0.05``).
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from typing_extensions import Self

from kvstream.errors import ConfigError

__all__ = ["OverflowPolicy", "PipelineConfig", "RetryPolicy", "SinkPolicy"]

_Seconds = Annotated[float, Field(ge=0.0, le=86_400.0)]
_PositiveSeconds = Annotated[float, Field(gt=0.0, le=86_400.0)]


class OverflowPolicy(str, enum.Enum):
    """What a full sink queue does with a new batch."""

    #: Wait for room up to ``block_timeout_s`` (and the hand-off bound), then drop the new batch.
    BLOCK = "block"
    #: Evict the oldest queued batch to make room (the emitter's own rule).
    DROP_OLDEST = "drop_oldest"
    #: Reject the new batch.
    DROP_NEWEST = "drop_newest"


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class RetryPolicy(_Model):
    """Exponential backoff with jitter under an overall deadline per export chunk.

    Attempt n (from 0) waits ``min(max_backoff_s, initial_backoff_s * multiplier**n)``,
    scaled by a random factor in ``[1 - jitter, 1]``, before attempt n + 1. A chunk is
    dropped (reason ``retry_exhausted``) once ``deadline_s`` has passed since its first
    attempt; ``deadline_s=None`` retries until the pipeline closes.
    """

    initial_backoff_s: _PositiveSeconds = 0.05
    max_backoff_s: _PositiveSeconds = 2.0
    multiplier: Annotated[float, Field(ge=1.0, le=100.0)] = 2.0
    jitter: Annotated[float, Field(ge=0.0, le=1.0)] = 0.2
    deadline_s: _PositiveSeconds | None = 30.0
    #: Each export attempt is cancelled (and counted as retriable) after this long.
    attempt_timeout_s: _PositiveSeconds = 10.0
    #: Each attempt to read sends in doubt back (:meth:`~kvstream.sink.Sink.resolve`, after a
    #: chunk was given up) is cancelled after this long; attempts go on with backoff until
    #: one succeeds or the pipeline closes (then the sends are reported ``unknown``).
    resolve_timeout_s: _PositiveSeconds = 15.0

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("max_backoff_s must be >= initial_backoff_s")
        return self


class SinkPolicy(_Model):
    """Queueing, batching, overflow and retry settings of one sink."""

    #: Queue bound in batches and in events; whichever is reached first makes it full.
    #: A single batch larger than ``max_queue_events`` is still accepted into an empty queue.
    max_queue_batches: Annotated[int, Field(ge=1)] = 8192
    max_queue_events: Annotated[int, Field(ge=1)] = 1_000_000
    #: One export call takes at most this many batches / events (at least one batch).
    max_export_batches: Annotated[int, Field(ge=1)] = 512
    max_export_events: Annotated[int, Field(ge=1)] = 65_536
    #: How long to wait for a fuller chunk once the first batch is there (0: export at once).
    linger_s: _Seconds = 0.005
    overflow: OverflowPolicy = OverflowPolicy.DROP_OLDEST
    #: ``block`` only: the longest a submit waits for room in this sink's queue.
    block_timeout_s: _Seconds = 0.01
    retry: RetryPolicy = RetryPolicy()


class PipelineConfig(_Model):
    """Settings of a :class:`kvstream.pipeline.Pipeline`."""

    #: Label value of the ``pipeline`` label on every metric.
    name: Annotated[str, Field(min_length=1, max_length=64)] = "kvstream"
    #: Upper bound on one ``submit()`` call from the engine thread, all sinks together.
    handoff_timeout_s: _Seconds = 0.05
    #: ``aclose()`` drains, flushes and shuts sinks down within this many seconds.
    close_timeout_s: _PositiveSeconds = 10.0
    #: Part of ``close_timeout_s`` reserved for flushing and shutting the sinks down.
    shutdown_grace_s: _PositiveSeconds = 1.0
    #: ``flush()`` gives up after this many seconds unless told otherwise.
    flush_timeout_s: _PositiveSeconds = 30.0
    defaults: SinkPolicy = SinkPolicy()
    #: Per-sink overrides, by sink name: fields given here replace ``defaults``' values.
    sinks: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _valid_overrides(self) -> Self:
        for name in self.sinks:
            self.policy_for(name)
        return self

    def policy_for(self, sink_name: str) -> SinkPolicy:
        """The effective policy of ``sink_name`` (defaults + its overrides)."""
        override = self.sinks.get(sink_name)
        if not override:
            return self.defaults
        merged = self.defaults.model_dump()
        for key, value in override.items():
            if key == "retry" and isinstance(value, Mapping):
                merged["retry"] = {**merged["retry"], **value}
            else:
                merged[key] = value
        return SinkPolicy.model_validate(merged)

    @classmethod
    def load(cls, data: Mapping[str, Any] | None = None, **overrides: Any) -> PipelineConfig:
        """Validate a mapping (e.g. parsed from a file) plus keyword overrides.

        Raises :class:`ConfigError` naming each bad setting.
        """
        merged = {**(data or {}), **overrides}
        try:
            return cls.model_validate(merged)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            raise ConfigError(f"invalid pipeline config: {problems}") from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PipelineConfig:
        """Load a JSON file (the keys of this model)."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read pipeline config {os.fspath(path)!r}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"pipeline config {os.fspath(path)!r} must be a JSON object")
        return cls.load(data)

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, prefix: str = "KVSTREAM_PIPELINE_"
    ) -> PipelineConfig:
        """Build from environment variables; ``__`` nests (``DEFAULTS__RETRY__DEADLINE_S``).

        Values are parsed as JSON when they are valid JSON (numbers, ``null``, objects),
        else taken as strings.
        """
        env = os.environ if environ is None else environ
        data: dict[str, Any] = {}
        for key, raw in env.items():
            if not key.startswith(prefix):
                continue
            path = key[len(prefix) :].lower().split("__")
            node = data
            for part in path[:-1]:
                child = node.setdefault(part, {})
                if not isinstance(child, dict):
                    raise ConfigError(f"{key}: {part} is both a value and a section")
                node = child
            try:
                value: Any = json.loads(raw)
            except ValueError:
                value = raw
            node[path[-1]] = value
        return cls.load(data)
