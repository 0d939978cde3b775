"""A directory of KV block files that any number of processes share (the disk tier).

::

    with DiskStore("/var/cache/kv", capacity_bytes=64 << 30) as store:
        store.put(namespace, block_hash, payload)        # True if this call created it
        store.get_into(namespace, block_hash, out)       # True on a verified hit

A block is keyed by ``(namespace, block_hash)``: a 16-byte namespace (e.g. a digest of the
model and KV layout) and an 8- or 32-byte block hash. Its file is
``<root>/<namespace hex>/<first 2 hash hex digits>/<hash hex>.kvb`` in the format of
:mod:`kvstream.cache.block_file`. Names are hex only, so no key can name a path outside the
root.

Writers never expose a partial file: a block is written to a temporary file in the target's
directory and hard-linked to its final name; the first writer wins, later ones find the file
and skip. A file that fails validation on read is removed and reported as a miss, so a
second process pointing at the same directory reuses every block bit-identically or not at
all.

Each process keeps its own LRU of the files it knows (those it found on open or on a
rescan, and those it wrote or read) and evicts from it to stay under ``capacity_bytes``.
Hits refresh a file's mtime, and a rescan orders files by mtime, so the processes converge
on one LRU order. A ``DiskStore`` object is not thread-safe: use one per thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import socket
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Final

from kvstream.cache.block_file import (
    HASH_LENGTHS,
    HEADER_SIZE,
    NAMESPACE_SIZE,
    byte_view,
    check_key,
    encode_header,
    parse_header,
    payload_hasher,
    verify_checksum,
)
from kvstream.cache.errors import (
    BlockBufferError,
    BlockFileError,
    BlockKeyError,
    StoreError,
    StoreFullError,
)
from kvstream.errors import ConfigError

if TYPE_CHECKING:
    from typing_extensions import Self

    from kvstream.cache.block_file import BufferLike

__all__ = ["STALE_TEMP_AGE_S", "DiskStore", "DiskStoreStats"]

log = logging.getLogger("kvstream.cache.disk_store")

STALE_TEMP_AGE_S: Final = 3600.0
"""A temporary file older than this is removed on a scan whoever left it."""

_SUFFIX: Final = ".kvb"
_TEMP_PREFIX: Final = ".tmp."
_FULL_ERRNOS: Final = frozenset(
    e for e in (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", None)) if e is not None
)
_HEX: Final = re.compile(r"[0-9a-f]+")
# Reads are hashed piece by piece while each piece is still in the CPU cache: hashing the
# whole payload after reading it costs a second pass over memory (~10% of the read time).
_CHUNK: Final = 256 << 10
#: A hit refreshes the file's mtime (its LRU age for other processes) when older than this.
_TOUCH_AFTER_S: Final = 10.0

Key = tuple[bytes, bytes]


@dataclass(frozen=True, slots=True)
class DiskStoreStats:
    """Counters of one :class:`DiskStore` object (this process's view).

    ``files`` / ``used_bytes``: block files known to this object and their total size
    (headers included). ``misses`` counts every ``get_into`` that returned False, ``corrupt``
    those among them that found an invalid file (and removed it). ``write_skipped``: puts
    that found the file already there or lost the race to another writer. ``bytes_written``
    and ``bytes_read`` are file bytes (header + payload) of successful puts and hits.
    """

    files: int
    used_bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    corrupt: int
    writes: int
    write_skipped: int
    evictions: int
    write_errors: int
    bytes_written: int
    bytes_read: int


class DiskStore:
    """Block files under ``root``, at most ``capacity_bytes`` of them as this process sees it.

    Opening creates ``root`` (:class:`~kvstream.cache.errors.StoreError` if it cannot, or it
    is not a directory), scans the block files already there into the LRU, oldest mtime
    first, and removes temporary files that crashed writers left behind (this host's with a
    dead pid, anyone's older than :data:`STALE_TEMP_AGE_S`).

    ``fsync=True`` makes every put durable (file and directory entries) before it returns.
    ``anonymous_temp`` writes files unnamed until published (Linux ``O_TMPFILE``, where the
    file system supports it), so a writer that dies mid-write leaves nothing behind; else
    (or with False) temporary names are used and cleaned up by later opens.
    ``put`` rescans the directory when ``rescan_interval_s`` (measured with ``clock``) has
    passed since the last scan, so files written by other processes count toward capacity.
    Keys are ``(namespace, block_hash)`` bytes: BlockKeyError (a KVStreamError that is also
    a TypeError and a ValueError) for other types, a namespace that is not 16 bytes or a
    hash that is not 8 or 32; BlockBufferError for a payload buffer that is not
    C-contiguous or an output buffer that is read-only; ConfigError for bad arguments.
    After :meth:`close` every method but :meth:`stats` raises ``StoreError``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        fsync: bool = False,
        rescan_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        anonymous_temp: bool = True,
    ) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if rescan_interval_s < 0:
            raise ConfigError(f"rescan_interval_s must be >= 0, got {rescan_interval_s}")
        self.root = os.path.abspath(os.fspath(root))
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.rescan_interval_s = rescan_interval_s
        self._clock = clock
        self._host = _hostname()
        self._lru: OrderedDict[Key, int] = OrderedDict()  # key -> file size, oldest first
        self._used = 0
        self._pins: Counter[Key] = Counter()
        self._evicted: list[Key] = []
        self._last_scan = 0.0
        self._closed = False
        self._hits = self._misses = self._corrupt = 0
        self._writes = self._write_skipped = self._evictions = self._write_errors = 0
        self._bytes_written = self._bytes_read = 0
        #: Write unnamed temporary files (O_TMPFILE) while the file system allows it.
        #: (Publishing one needs /proc/self/fd to link it through.)
        self._anonymous_temp = anonymous_temp and bool(_O_TMPFILE) and os.path.isdir(_PROC_FD)
        try:
            os.makedirs(self.root, exist_ok=True)
            self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise StoreError(f"cannot open store root {self.root}: {e}", path=self.root) from e
        self._close_fd = weakref.finalize(self, os.close, self._root_fd)
        self.rescan()

    # -- queries ---------------------------------------------------------------------------

    def path(self, namespace: bytes, block_hash: bytes) -> str:
        """The file that holds (or would hold) this block; always under ``root``."""
        check_key(namespace, block_hash)
        hx = block_hash.hex()
        return f"{self.root}{os.sep}{namespace.hex()}{os.sep}{hx[:2]}{os.sep}{hx}{_SUFFIX}"

    def contains(self, namespace: bytes, block_hash: bytes) -> bool:
        """Whether the block's file exists now (whichever process wrote it). Not validated:
        a corrupt file is found out, and removed, by :meth:`get_into`."""
        self._check_open()
        try:
            os.stat(self.path(namespace, block_hash))
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StoreError(f"cannot stat block file: {e}", path=e.filename) from e
        return True

    def stats(self) -> DiskStoreStats:
        """A snapshot of the counters (also after :meth:`close`)."""
        return DiskStoreStats(
            files=len(self._lru),
            used_bytes=self._used,
            capacity_bytes=self.capacity_bytes,
            hits=self._hits,
            misses=self._misses,
            corrupt=self._corrupt,
            writes=self._writes,
            write_skipped=self._write_skipped,
            evictions=self._evictions,
            write_errors=self._write_errors,
            bytes_written=self._bytes_written,
            bytes_read=self._bytes_read,
        )

    def take_evicted(self) -> list[tuple[bytes, bytes]]:
        """The keys this object evicted to make room since the last call, oldest first, and
        forget them (also after :meth:`close`). Whoever announces removals (the cache's disk
        tier) calls this after each :meth:`put`; the list grows until it is taken."""
        evicted, self._evicted = self._evicted, []
        return evicted

    # -- writing ---------------------------------------------------------------------------

    def put(self, namespace: bytes, block_hash: bytes, payload: BufferLike) -> bool:
        """Store ``payload`` (any C-contiguous buffer, written without a copy) as this block.

        Returns True if this call created the file, False if it already existed or another
        writer created it first (the first writer wins; nothing is overwritten). Evicts
        least-recently-used unpinned files first to keep the store within capacity.

        Raises :class:`~kvstream.cache.errors.StoreFullError` when the file cannot fit (larger
        than the capacity, or pinned files leave no room: nothing is evicted then) or the
        disk is full (ENOSPC, EDQUOT, EFBIG), and ``StoreError`` for other I/O errors. On
        any error no file is visible under the block's name and no temporary file remains.
        """
        self._check_open()
        final = self.path(namespace, block_hash)
        key = (namespace, block_hash)
        view = byte_view(payload)
        size = HEADER_SIZE + view.nbytes
        if size > self.capacity_bytes:
            raise StoreFullError(
                f"a {size}-byte block file exceeds the store's capacity of "
                f"{self.capacity_bytes} bytes",
                path=final,
            )
        if self._clock() - self._last_scan >= self.rescan_interval_s:
            self.rescan()
        if self._track_existing(key, final):
            self._write_skipped += 1
            return False
        self._make_room(size, final)
        created = self._write_new(final, namespace, block_hash, view)
        if created:
            self._writes += 1
            self._bytes_written += size
            self._track(key, size)
        else:
            self._write_skipped += 1
            self._track_existing(key, final)
        return created

    def _write_new(
        self, final: str, namespace: bytes, block_hash: bytes, payload: memoryview
    ) -> bool:
        # The file is written unnamed (O_TMPFILE, Linux) or under a temporary name, then
        # hard-linked to its final name: readers never see a partial file, the first writer
        # wins, and an unnamed file vanishes by itself if this process dies mid-write.
        directory = os.path.dirname(final)
        tmp: str | None = None
        fd = -1
        try:
            try:
                fd, tmp = self._open_temp(directory)
            except FileNotFoundError:  # the block's first file in this directory
                self._make_dirs(directory)
                fd, tmp = self._open_temp(directory)
            # The header comes last (its checksum covers the payload), hashed piece by piece
            # right after each piece is written, while it is still in the CPU cache.
            _write_all(fd, memoryview(bytes(HEADER_SIZE)))
            hasher = payload_hasher()
            for start in range(0, payload.nbytes, _CHUNK):
                piece = payload[start : start + _CHUNK]
                _write_all(fd, piece)
                hasher.update(piece)
            header = encode_header(
                namespace=namespace,
                block_hash=block_hash,
                payload=payload,
                checksum=hasher.digest(),
            )
            if os.pwrite(fd, header, 0) != HEADER_SIZE:
                raise OSError(errno.EIO, "short header write")
            if self.fsync:
                os.fsync(fd)
            try:
                if tmp is None:
                    # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names an O_TMPFILE file;
                    # the directory fd only forces linkat (the paths are absolute).
                    os.link(
                        f"{_PROC_FD}/{fd}",
                        final,
                        dst_dir_fd=self._root_fd,
                        follow_symlinks=True,
                    )
                else:
                    os.link(tmp, final)
            except FileExistsError:
                return False
            if self.fsync:
                _fsync_dir(directory)
            return True
        except OSError as e:
            self._write_errors += 1
            cls = StoreFullError if e.errno in _FULL_ERRNOS else StoreError
            raise cls(f"cannot write block file {final}: {e}", path=final) from e
        finally:
            if fd >= 0:
                os.close(fd)
            if tmp is not None:
                _unlink(tmp)

    def _open_temp(self, directory: str) -> tuple[int, str | None]:
        # (fd, temporary name or None for an unnamed file)
        if self._anonymous_temp:
            try:
                fd = os.open(directory, _O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o644)
            except OSError as e:
                if e.errno not in _NO_TMPFILE_ERRNOS:
                    raise
                self._anonymous_temp = False  # this file system cannot: named temp files
            else:
                return fd, None
        tmp = os.path.join(directory, _temp_name(self._host))
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        return os.open(tmp, flags, 0o644), tmp

    def _make_dirs(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        if self.fsync:  # make the new directories' own entries durable too
            parent = os.path.dirname(directory)
            _fsync_dir(parent)
            _fsync_dir(os.path.dirname(parent))

    def _make_room(self, size: int, final: str) -> None:
        over = self._used + size - self.capacity_bytes
        if over <= 0:
            return
        victims: list[Key] = []
        freed = 0
        for key, file_size in self._lru.items():
            if freed >= over:
                break
            if key not in self._pins:
                victims.append(key)
                freed += file_size
        if freed < over:
            raise StoreFullError(
                f"no room for a {size}-byte block file: {self._used} of "
                f"{self.capacity_bytes} bytes used and only {freed} evictable (the rest pinned)",
                path=final,
            )
        for key in victims:
            path = self.path(*key)
            try:
                _unlink(path)
            except OSError as e:
                raise StoreError(f"cannot evict block file {path}: {e}", path=path) from e
            self._untrack(key)
            self._evictions += 1
            self._evicted.append(key)

    # -- reading ---------------------------------------------------------------------------

    def get_into(self, namespace: bytes, block_hash: bytes, out: BufferLike) -> bool:
        """Read the block's payload into ``out``, a writable C-contiguous buffer exactly the
        payload's size (bytearray, memoryview, a numpy array over a torch tensor), without an
        intermediate copy.

        Returns True on a hit whose header and checksum verified: ``out`` then holds the
        payload bit for bit, and the file becomes most recently used (its mtime too, for other
        processes). Returns False on a miss. A corrupt, truncated or misnamed file, or one
        whose payload size differs from ``len(out)``, is removed, counted in
        ``stats().corrupt``, logged as a warning and reported as a miss; ``out``'s contents
        are then unspecified. Raises ``StoreError`` only for I/O errors other than a missing
        file.
        """
        self._check_open()
        path = self.path(namespace, block_hash)
        key = (namespace, block_hash)
        view = byte_view(out)
        if view.readonly:
            raise BlockBufferError("get_into needs a writable buffer")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._untrack(key)
            self._misses += 1
            return False
        except OSError as e:
            raise StoreError(f"cannot open block file {path}: {e}", path=path) from e
        error: BlockFileError | None = None
        try:
            st = os.fstat(fd)
            # One read for the header and the first piece of the payload (most files are
            # the size asked for; the header is checked before the piece is trusted).
            raw = bytearray(HEADER_SIZE)
            first = view[:_CHUNK]
            got = _readinto_all_v(fd, [memoryview(raw), first])
            header = parse_header(
                bytes(raw[: min(got, HEADER_SIZE)]),
                namespace=namespace,
                block_hash=block_hash,
                file_size=st.st_size,
            )
            if header.payload_size != view.nbytes:
                raise BlockFileError(
                    f"payload is {header.payload_size} bytes, the buffer {view.nbytes}"
                )
            verify_checksum(_read_payload(fd, view, got - HEADER_SIZE), header)
            if time.time() - st.st_mtime > _TOUCH_AFTER_S:
                _touch(fd, path)
        except BlockFileError as e:
            error = e
        except OSError as e:
            raise StoreError(f"cannot read block file {path}: {e}", path=path) from e
        finally:
            os.close(fd)
        if error is not None:
            self._drop_corrupt(key, path, st, error)
            return False
        self._track(key, st.st_size)
        self._hits += 1
        self._bytes_read += st.st_size
        return True

    def _drop_corrupt(self, key: Key, path: str, st: os.stat_result, error: BlockFileError) -> None:
        self._corrupt += 1
        self._misses += 1
        self._untrack(key)
        log.warning("removing corrupt block file %s: %s", path, error)
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return
        # Only the file we read: another process may have removed it and written a good one.
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            _unlink(path)

    # -- management ------------------------------------------------------------------------

    def discard(self, namespace: bytes, block_hash: bytes) -> bool:
        """Remove the block's file, pinned or not. Returns False if there was none."""
        self._check_open()
        path = self.path(namespace, block_hash)
        self._untrack((namespace, block_hash))
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StoreError(f"cannot remove block file {path}: {e}", path=path) from e
        return True

    def pin(self, namespace: bytes, block_hash: bytes) -> None:
        """Never evict this block from this process (pins are counted; other processes and
        :meth:`discard` may still remove the file). The block need not exist yet."""
        self._check_open()
        check_key(namespace, block_hash)
        self._pins[(namespace, block_hash)] += 1

    def unpin(self, namespace: bytes, block_hash: bytes) -> None:
        """Undo one :meth:`pin`. BlockKeyError (a ValueError) if the block is not pinned."""
        self._check_open()
        check_key(namespace, block_hash)
        key = (namespace, block_hash)
        if key not in self._pins:
            raise BlockKeyError(f"block {block_hash.hex()} is not pinned")
        self._pins[key] -= 1
        if not self._pins[key]:
            del self._pins[key]

    def rescan(self) -> None:
        """Re-read the directory: the LRU becomes every block file present, oldest mtime
        first (ties keep this process's order), and stale temporary files are removed."""
        self._check_open()
        try:
            found = _scan(self.root, self._host)
        except OSError as e:
            raise StoreError(f"cannot scan store root {self.root}: {e}", path=self.root) from e
        position = {key: i for i, key in enumerate(self._lru)}
        found.sort(key=lambda f: (f[2], position.get(f[0], -1)))
        self._lru = OrderedDict((key, size) for key, size, _ in found)
        self._used = sum(self._lru.values())
        self._last_scan = self._clock()

    def close(self) -> None:
        """Stop using the store (idempotent); files stay on disk."""
        self._close_fd()
        self._closed = True

    def __enter__(self) -> Self:
        self._check_open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._lru)} files, {self._used} bytes"
        return f"DiskStore({self.root!r}, {state}, capacity {self.capacity_bytes})"

    # -- internals -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the disk store at {self.root} is closed", path=self.root)

    def _track(self, key: Key, size: int) -> None:
        old = self._lru.pop(key, None)
        if old is not None:
            self._used -= old
        self._lru[key] = size
        self._used += size

    def _track_existing(self, key: Key, path: str) -> bool:
        """Track the block's file if it exists; returns whether it does."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            self._untrack(key)
            return False
        except OSError as e:
            raise StoreError(f"cannot stat block file {path}: {e}", path=path) from e
        self._track(key, size)
        return True

    def _untrack(self, key: Key) -> None:
        old = self._lru.pop(key, None)
        if old is not None:
            self._used -= old


def _hostname() -> str:
    # Temp names are parsed back by splitting on the last two dots; keep the name plain.
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "localhost"


def _temp_name(host: str) -> str:
    return f"{_TEMP_PREFIX}{host}.{os.getpid()}.{secrets.token_hex(8)}"


def _is_stale_temp(name: str, mtime: float, host: str) -> bool:
    if time.time() - mtime > STALE_TEMP_AGE_S:
        return True
    parts = name[len(_TEMP_PREFIX) :].rsplit(".", 2)
    if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
        return False
    return not _pid_alive(int(parts[1]))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def _scan(root: str, host: str) -> list[tuple[Key, int, int]]:
    """Every block file under ``root`` as (key, size, mtime_ns); removes stale temp files.
    Entries that vanish during the scan (another process evicting) are skipped."""
    found: list[tuple[Key, int, int]] = []
    for ns_dir in _subdirs(root):
        if len(ns_dir.name) != 2 * NAMESPACE_SIZE or not _HEX.fullmatch(ns_dir.name):
            continue
        namespace = bytes.fromhex(ns_dir.name)
        for sub in _subdirs(ns_dir.path):
            if len(sub.name) != 2 or not _HEX.fullmatch(sub.name):
                continue
            try:
                entries = list(os.scandir(sub.path))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                name = entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if name.startswith(_TEMP_PREFIX):
                    if _is_stale_temp(name, st.st_mtime, host):
                        _unlink(entry.path)
                    continue
                block_hash = _block_hash_of(name, sub.name)
                if block_hash is not None and entry.is_file(follow_symlinks=False):
                    found.append(((namespace, block_hash), st.st_size, st.st_mtime_ns))
    return found


def _block_hash_of(name: str, subdir: str) -> bytes | None:
    """The hash a block file name stands for, None if it is not a block file's name."""
    hx = name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else ""
    if len(hx) not in (2 * n for n in HASH_LENGTHS) or not _HEX.fullmatch(hx):
        return None
    return bytes.fromhex(hx) if hx.startswith(subdir) else None


def _subdirs(path: str) -> list[os.DirEntry[str]]:
    try:
        return [e for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
    except (FileNotFoundError, NotADirectoryError):
        return []


_O_TMPFILE: Final = getattr(os, "O_TMPFILE", 0)
_PROC_FD: Final = "/proc/self/fd"
#: open(O_TMPFILE) errors that mean "not supported here" (old kernel, file system).
_NO_TMPFILE_ERRNOS: Final = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL})


def _write_all(fd: int, data: memoryview) -> None:
    done, total = 0, data.nbytes
    while done < total:
        n = os.write(fd, data[done:])
        if n <= 0:
            raise OSError(errno.EIO, "write() wrote nothing")
        done += n


def _read_payload(fd: int, view: memoryview, have: int) -> bytes:
    """Read the rest of the file into ``view``, whose first ``have`` bytes are read already;
    returns the payload checksum. BlockFileError if the file ends early."""
    hasher = payload_hasher()
    for start in range(0, view.nbytes, _CHUNK):
        chunk = view[start : start + _CHUNK]
        done = min(max(have - start, 0), chunk.nbytes)
        if done < chunk.nbytes:
            done += _readinto_all(fd, chunk[done:])
        if done != chunk.nbytes:
            raise BlockFileError(f"truncated: read {start + done} of {view.nbytes} payload bytes")
        hasher.update(chunk)
    return hasher.digest()


def _touch(fd: int, path: str) -> None:
    """Make the file's mtime now (its LRU position for every process); best effort."""
    try:
        os.utime(fd if os.utime in os.supports_fd else path)
    except OSError as e:  # e.g. a file owned by another user
        log.debug("cannot refresh the mtime of %s: %s", path, e)


def _readinto_all_v(fd: int, views: list[memoryview]) -> int:
    """Fill ``views`` in order from ``fd`` (scatter reads); returns the bytes read (fewer
    only at the end of the file)."""
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        rest: list[memoryview] = []
        skip = done
        for v in views:
            if skip >= v.nbytes:
                skip -= v.nbytes
                continue
            rest.append(v[skip:])
            skip = 0
        n = os.readv(fd, rest)
        if not n:
            break
        done += n
    return done


def _readinto_all(fd: int, view: memoryview) -> int:
    done, total = 0, view.nbytes
    while done < total:
        n = os.readv(fd, [view[done:]])
        if not n:
            break
        done += n
    return done


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
