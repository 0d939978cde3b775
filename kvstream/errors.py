"""The one error hierarchy of kvstream.

Every error kvstream raises on purpose derives from :class:`KVStreamError`, so callers can
catch the whole library with one ``except`` and the narrower classes when they care::

    KVStreamError
    ├── ConfigError                 bad configuration (flags, env, file, constructor args)
    ├── EventValidationError        an event/batch value breaks the model's rules  (ValueError)
    ├── HashingError                hashing failed
    │   └── UnknownHashAlgorithmError   a hash_algo name nobody registered          (KeyError)
    ├── CodecError                  encoding/decoding
    │   ├── EncodeError             a batch could not be encoded
    │   ├── DecodeError             bytes are not a valid encoding                 (ValueError)
    │   │   └── UnknownSchemaError  well-formed framing, but the schema is unknown
    │   └── SchemaCompatibilityError  schema versions that do not read each other
    ├── InteropError                a peer's format (TensorRT-LLM JSON, vLLM msgpack) is malformed
    ├── EmitterError                the event emitter was misused (unknown group, ...)
    └── SinkError                   a sink failed
        ├── RetriableSinkError      may succeed if retried (broker outage, timeout)
        └── PermanentSinkError      retrying cannot help (bad config, message too large)
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CodecError",
    "ConfigError",
    "DecodeError",
    "EmitterError",
    "EncodeError",
    "EventValidationError",
    "HashingError",
    "InteropError",
    "KVStreamError",
    "PermanentSinkError",
    "RetriableSinkError",
    "SchemaCompatibilityError",
    "SinkError",
    "UnknownHashAlgorithmError",
    "UnknownSchemaError",
    "did_you_mean",
]


class KVStreamError(Exception):
    """Base class of every error kvstream raises on purpose."""


class ConfigError(KVStreamError, ValueError):
    """Configuration is invalid; the message names the setting and what was wrong."""


class EventValidationError(KVStreamError, ValueError):
    """An event model value breaks a rule of the event model.

    ``errors`` holds one entry per problem, each ``{"loc": "events.0.data.blocks",
    "msg": ..., "input": ...}``; the message lists every field path and why.
    """

    def __init__(self, message: str, errors: Sequence[dict[str, Any]] = ()) -> None:
        super().__init__(message)
        self.errors: list[dict[str, Any]] = list(errors)

    @classmethod
    def from_pydantic(cls, model_name: str, exc: Any) -> EventValidationError:
        """Build from a ``pydantic.ValidationError``, naming each failing field path."""
        items: list[dict[str, Any]] = []
        lines: list[str] = []
        for err in exc.errors(include_url=False):
            loc = ".".join(str(p) for p in err.get("loc", ())) or "<root>"
            msg = str(err.get("msg", "invalid value"))
            items.append({"loc": loc, "msg": msg, "input": err.get("input")})
            lines.append(f"  {loc}: {msg}")
        head = f"invalid {model_name}: {len(items)} problem(s)"
        return cls(head + "\n" + "\n".join(lines), items)


class HashingError(KVStreamError):
    """Block hashing failed (bad parameters or inputs)."""


def did_you_mean(name: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to ``name`` (difflib), else ``""``."""
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class UnknownHashAlgorithmError(HashingError, KeyError):
    """A hash algorithm name is not registered. The message lists the known names."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        self.name = name
        self.known = sorted(known)
        super().__init__(
            f"unknown hash algorithm {name!r}{did_you_mean(name, self.known)}; "
            f"known algorithms: {', '.join(self.known)}"
        )

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class CodecError(KVStreamError):
    """Base class of encoding/decoding errors."""


class EncodeError(CodecError, ValueError):
    """A batch could not be encoded."""


class DecodeError(CodecError, ValueError):
    """Bytes are not a valid kvstream encoding. The message says what was wrong."""


class UnknownSchemaError(DecodeError):
    """The framing is valid but names a schema (fingerprint or id) nobody registered."""


class SchemaCompatibilityError(CodecError):
    """Two schema versions cannot read each other's data."""


class InteropError(KVStreamError, ValueError):
    """A peer engine's event payload (TensorRT-LLM JSON, vLLM msgpack) is malformed."""


class EmitterError(KVStreamError):
    """The event emitter was called in a way its contract forbids."""


class SinkError(KVStreamError):
    """A sink failed to export a batch."""


class RetriableSinkError(SinkError):
    """The export may succeed if retried (broker unavailable, timeout, connection reset)."""


class PermanentSinkError(SinkError):
    """Retrying cannot help (bad configuration, authorisation, record too large)."""
