"""Errors of the KV-cache manager, all :class:`~kvstream.errors.KVStreamError` subclasses.

::

    KVStreamError
    └── CacheError                  the cache manager refused an operation
        ├── CacheFullError          a request does not fit even after evicting every free block
        ├── UnknownRequestError     no request has that id                          (KeyError)
        ├── RequestError            invalid request arguments                       (ValueError)
        │   └── DuplicateRequestError   a request with that id is already running
        ├── KVAccessError           a K/V read or write outside what the request may touch
        ├── TransferError           a KV transfer does not fit the receiving manager or request
        ├── StoreError              the disk block store could not do an operation   (OSError)
        │   ├── StoreFullError      no space left (ENOSPC, EDQUOT, EFBIG): nothing was written
        │   └── BlockFileError      a block file is corrupt, truncated or not the block asked for
        ├── BlockKeyError           a bad disk-store key           (TypeError, ValueError)
        ├── BlockBufferError        a block buffer not C-contiguous, or not writable   (TypeError)
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
    "BlockBufferError",
    "BlockFileError",
    "BlockKeyError",
    "RequestError",
    "StoreError",
    "StoreFullError",
    "TransferError",
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


class TransferError(CacheError, ValueError):
    """A KV transfer cannot be imported: its layout or hash configuration differs from the
    receiver's, it does not cover the blocks the receiver asked for, its block hashes do not
    match the tokens, or its tensors are malformed. The receiver is left as it was."""


class StoreError(CacheError, OSError):
    """The disk block store could not read, write or scan its directory (``path`` names the
    file or directory when known)."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        self.path = path
        super().__init__(message)

    def __str__(self) -> str:  # OSError would format (errno, strerror)
        return str(self.args[0])


class StoreFullError(StoreError):
    """A block file could not be written for lack of space (ENOSPC, EDQUOT, EFBIG); no
    partial file was left visible."""


class BlockFileError(StoreError):
    """A block file is corrupt: bad magic or version, truncated, a checksum mismatch, or a
    header naming another block or namespace. The store treats it as a miss and removes it."""


class BlockKeyError(CacheError, TypeError, ValueError):
    """A disk-store block key is not ``(namespace: 16 bytes, block_hash: 8 or 32 bytes)`` of
    type ``bytes``, or :meth:`~kvstream.cache.DiskStore.unpin` names a block that is not
    pinned. (Also a TypeError and a ValueError, what these raised before.)"""


class BlockBufferError(CacheError, TypeError):
    """A block payload buffer is not C-contiguous, or an output buffer is read-only."""


class CacheInvariantError(CacheError):
    """An internal consistency check failed. This is a bug in kvstream; please report it."""
