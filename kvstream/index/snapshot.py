"""Index snapshots: the whole index plus the source positions it reflects, in one file.

A consumer that restarts loads the snapshot and resumes reading its source from the stored
positions, instead of replaying the whole stream; the restored index equals one rebuilt from
the start (``PrefixIndex.canonical_state()`` compares equal).

File format (versions 1 and 2), all integers little-endian::

    magic    8 bytes  b"KVSIDX\\r\\n"
    version  u16      1 (an engine-keyed index) or 2 (a token-keyed one)
    hlen     u32      length of the header
    header   hlen     UTF-8 JSON: format version, creation time, source positions, user
                      metadata, the index's per-worker state (with its ``key_mode``) and the
                      list of tables with their node counts (and, version 2, pending counts)
    tables            per table, in header order:
                        n bytes     hash lengths
                        sum(len)    hashes, concatenated
                        8n bytes    parent index per node (i64; -1 root, -2 unknown)
                        8n bytes    packed tier reference counts per node (u64)
                      version 2 only, then:
                        n bytes     canonical key lengths (0: not known yet, else 16)
                        sum(len)    canonical keys, concatenated
                        4m bytes    node index of each of the m pending payloads (u32)
                        m bytes     1 when that payload is a scoped one, else 0
                        4m bytes    payload lengths (u32)
                        sum(len)    payloads, concatenated
    digest   32 bytes SHA-256 of everything before it

Version 2 differs only by the token-keyed tables, so an engine-keyed index is still written
as version 1 (readable by every release); a version-1 reader refuses a token-keyed snapshot
by its version instead of misreading it.

Writes are atomic (a temporary file in the same directory, fsync, rename, fsync of the
directory), so a crash leaves the previous snapshot intact. Reading checks the magic, the
version, the digest and every length, raising :class:`SnapshotError` on any problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvstream.index.errors import SnapshotError
from kvstream.index.index import PrefixIndex
from kvstream.index.keys import KeyMode
from kvstream.index.token_table import TokenGroupTable
from kvstream.index.types import WorkerKey

__all__ = [
    "FORMAT_VERSION",
    "Snapshot",
    "decode_snapshot",
    "encode_snapshot",
    "load_snapshot",
    "save_snapshot",
    "write_atomic",
]

MAGIC: Final = b"KVSIDX\r\n"
#: The newest format this module reads and writes (engine-keyed indexes are written as 1).
FORMAT_VERSION: Final = 2
_VERSIONS: Final = (1, 2)
_DIGEST: Final = 32
_HEAD: Final = struct.Struct("<8sHI")
_LITTLE: Final = sys.byteorder == "little"


@dataclass(frozen=True)
class Snapshot:
    """A loaded snapshot: the index, the source positions stored with it, user metadata."""

    index: PrefixIndex
    positions: dict[str, Any] | None
    meta: dict[str, Any] = field(default_factory=dict)
    created_ns: int = 0
    version: int = FORMAT_VERSION


def _le(values: list[int], code: str) -> bytes:
    arr = array(code, values)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _from_le(data: bytes, code: str) -> list[int]:
    arr = array(code)
    arr.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


def encode_snapshot(
    index: PrefixIndex,
    positions: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> bytes:
    """The snapshot file's bytes for ``index`` and ``positions`` (see the module doc)."""
    tables_meta = []
    chunks: list[bytes] = []
    keyed = index.key_mode is KeyMode.TOKENS
    version = 2 if keyed else 1
    for worker, gid, table in index.tables():
        hashes, parents, refs = table.dump_nodes()
        meta_t: dict[str, Any] = {
            "instance_id": worker.instance_id,
            "dp_rank": worker.dp_rank,
            "layer_group_id": gid,
            "nodes": len(hashes),
        }
        lengths = bytes(len(h) for h in hashes)
        chunks += [lengths, b"".join(hashes), _le(parents, "q"), _le(refs, "Q")]
        if keyed:
            if not isinstance(table, TokenGroupTable):  # pragma: no cover - by construction
                raise SnapshotError(f"table of {worker} group {gid} is not token-keyed")
            keys, pending = table.dump_keys()
            meta_t["pending"] = len(pending)
            chunks += [
                bytes(len(k) for k in keys),
                b"".join(keys),
                _le([i for i, _, _ in pending], "I"),
                bytes(1 if scoped else 0 for _, _, scoped in pending),
                _le([len(payload) for _, payload, _ in pending], "I"),
                b"".join(payload for _, payload, _ in pending),
            ]
        tables_meta.append(meta_t)
    header = {
        "format": "kvstream-index",
        "version": version,
        "created_ns": time.time_ns(),
        "positions": None if positions is None else dict(positions),
        "meta": dict(meta or {}),
        "index": index.export_state(),
        "tables": tables_meta,
    }
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    body = b"".join([_HEAD.pack(MAGIC, version, len(head)), head, *chunks])
    return body + hashlib.sha256(body).digest()


def save_snapshot(
    path: str | os.PathLike[str],
    index: PrefixIndex,
    positions: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> int:
    """Write a snapshot of ``index`` (and the source ``positions`` it reflects) to ``path``
    atomically; returns the bytes written. OSError on I/O failure (the old file survives)."""
    data = encode_snapshot(index, positions, meta)
    write_atomic(path, data)
    return len(data)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: a temporary file in the same directory, fsync,
    rename over ``path``, fsync of the directory. The old file survives any failure."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        fd = os.open(target.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - some filesystems do not open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _blobs(body: bytes, pos: int, n: int) -> tuple[list[bytes], int]:
    """``n`` byte strings stored as n length bytes then the strings; SnapshotError when the
    data ends early. Returns them and the position after them."""
    lengths = body[pos : pos + n]
    pos += n
    if len(lengths) != n:
        raise SnapshotError("snapshot table data is truncated")
    out = []
    for ln in lengths:
        out.append(bytes(body[pos : pos + ln]))
        pos += ln
    if pos > len(body):
        raise SnapshotError("snapshot table data is truncated")
    return out, pos


def decode_snapshot(
    data: bytes, *, hasher_params: Mapping[str, Mapping[str, Any]] | None = None
) -> Snapshot:
    """Parse snapshot bytes; SnapshotError on any problem."""
    if len(data) < _HEAD.size + _DIGEST:
        raise SnapshotError(f"snapshot too short ({len(data)} bytes)")
    magic, version, hlen = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError(f"not a kvstream index snapshot (magic {magic!r})")
    if version not in _VERSIONS:
        raise SnapshotError(
            f"snapshot format version {version} is not supported (this reader: "
            f"{', '.join(map(str, _VERSIONS))})"
        )
    body, digest = data[:-_DIGEST], data[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise SnapshotError("snapshot checksum mismatch (truncated or corrupt file)")
    pos = _HEAD.size
    try:
        header = json.loads(body[pos : pos + hlen])
    except ValueError as exc:
        raise SnapshotError(f"snapshot header is not JSON: {exc}") from None
    pos += hlen
    tables: dict[tuple[WorkerKey, int], tuple[Any, ...]] = {}
    try:
        mode = header["index"].get("key_mode", KeyMode.ENGINE.value)
        keyed = KeyMode.parse(mode) is KeyMode.TOKENS
        if keyed and version < 2:
            raise SnapshotError(
                f"a version-{version} snapshot cannot hold a token-keyed index (corrupt header)"
            )
        for t in header["tables"]:
            n = int(t["nodes"])
            hashes, pos = _blobs(body, pos, n)
            parents = _from_le(body[pos : pos + 8 * n], "q")
            pos += 8 * n
            refs = _from_le(body[pos : pos + 8 * n], "Q")
            pos += 8 * n
            if len(parents) != n or len(refs) != n or pos > len(body):
                raise SnapshotError("snapshot table data is truncated")
            key = (WorkerKey(t["instance_id"], t["dp_rank"]), int(t["layer_group_id"]))
            if not keyed:
                tables[key] = (hashes, parents, refs)
                continue
            keys, pos = _blobs(body, pos, n)
            m = int(t["pending"])
            where = _from_le(body[pos : pos + 4 * m], "I")
            pos += 4 * m
            flags = body[pos : pos + m]
            pos += m
            sizes = _from_le(body[pos : pos + 4 * m], "I")
            pos += 4 * m
            if len(where) != m or len(flags) != m or len(sizes) != m or pos > len(body):
                raise SnapshotError("snapshot key data is truncated")
            pending = []
            for i, f, size in zip(where, flags, sizes, strict=True):
                pending.append((i, bytes(body[pos : pos + size]), bool(f)))
                pos += size
            tables[key] = (hashes, parents, refs, keys, pending)
        if pos != len(body):
            raise SnapshotError(f"{len(body) - pos} unexpected bytes after the tables")
        index = PrefixIndex.from_state(header["index"], tables, hasher_params=hasher_params)
    except SnapshotError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise SnapshotError(f"snapshot content is inconsistent: {exc!r}") from exc
    return Snapshot(
        index=index,
        positions=header.get("positions"),
        meta=header.get("meta") or {},
        created_ns=int(header.get("created_ns", 0)),
        version=version,
    )


def load_snapshot(
    path: str | os.PathLike[str],
    *,
    hasher_params: Mapping[str, Mapping[str, Any]] | None = None,
) -> Snapshot:
    """Read a snapshot written by :func:`save_snapshot`.

    Raises SnapshotError for a missing, truncated, corrupt or unknown-version file.
    """
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise SnapshotError(f"no snapshot at {path}") from None
    except OSError as exc:
        raise SnapshotError(f"cannot read snapshot {path}: {exc}") from exc
    return decode_snapshot(data, hasher_params=hasher_params)
