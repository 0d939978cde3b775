"""Errors of the index, the router, snapshots and consumers."""

from __future__ import annotations

from kvstream.errors import ConfigError, KVStreamError

__all__ = [
    "HashConfigMismatchError",
    "PrefixIndexError",
    "SnapshotError",
    "SourceError",
]


class PrefixIndexError(KVStreamError):
    """Base class of the errors :mod:`kvstream.index` raises on purpose."""


class HashConfigMismatchError(PrefixIndexError, ConfigError):
    """A router was configured with a hash algorithm or block size that a worker does not
    advertise (it would hash requests differently from the worker and never match)."""


class SnapshotError(PrefixIndexError):
    """A snapshot file is missing, truncated, corrupt or of an unknown format version."""


class SourceError(PrefixIndexError):
    """An event source cannot be opened or configured (bad URL, missing directory)."""
