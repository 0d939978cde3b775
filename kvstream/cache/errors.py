"""Errors of the KV-cache manager, all :class:`~kvstream.errors.KVStreamError` subclasses.

::

    KVStreamError
    └── CacheError                  the cache manager refused an operation
        ├── CacheFullError          a request does not fit even after evicting every free block
        ├── UnknownRequestError     no request has that id                          (KeyError)
        ├── RequestError            invalid request arguments                       (ValueError)
        │   └── DuplicateRequestError   a request with that id is already running
        ├── KVAccessError           a K/V read or write outside what the request may touch
        └── CacheInvariantError     internal consistency check failed (a bug in kvstream)

Every operation that raises one of these leaves the manager exactly as it was.
"""

from __future__ import annotations

from kvstream.errors import KVStreamError

__all__ = [
    "CacheError",
    "CacheFullError",
    "CacheInvariantError",
    "DuplicateRequestError",
    "KVAccessError",
    "RequestError",
    "UnknownRequestError",
]


class CacheError(KVStreamError):
    """Base class of the cache manager's errors."""


class CacheFullError(CacheError):
    """A request needs more blocks of a layer group than the pool can give.

    ``layer_group_id``, ``needed`` (blocks the operation takes from the free pool) and
    ``available`` (free blocks, evictable cached ones included) say which pool was short.
    """

    def __init__(self, request_id: str, layer_group_id: int, needed: int, available: int) -> None:
        self.request_id = request_id
        self.layer_group_id = layer_group_id
        self.needed = needed
        self.available = available
        super().__init__(
            f"request {request_id!r} needs {needed} free blocks of layer group "
            f"{layer_group_id} but only {available} are free or evictable; "
            "nothing was changed"
        )


class UnknownRequestError(CacheError, KeyError):
    """No running request has this id."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"unknown request {request_id!r}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class RequestError(CacheError, ValueError):
    """A request's arguments are invalid (empty prompt, bad priority or multimodal item)."""


class DuplicateRequestError(RequestError):
    """A request with this id is already running."""


class KVAccessError(CacheError, ValueError):
    """A K/V read or write names a bad layer, a bad token range or badly shaped tensors,
    writes into the reused (read-only) prefix, reads tokens a sliding window released, or
    needs tensors in metadata-only mode."""


class CacheInvariantError(CacheError):
    """An internal consistency check failed. This is a bug in kvstream; please report it."""
