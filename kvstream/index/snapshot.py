"""Index snapshots: the whole index plus the source positions it reflects, in one file.

A consumer that restarts loads the snapshot and resumes reading its source from the stored
positions, instead of replaying the whole stream; the restored index equals one rebuilt from
the start (``PrefixIndex.canonical_state()`` compares equal).

File format (versions 1 to 3), all integers little-endian::

    magic    8 bytes  b"KVSIDX\\r\\n"
    version  u16      1 (an engine-keyed index), 2 (a Dynamo-keyed one; before
                      ``kvstream_tokens_v2``, also a token-keyed one) or 3 (a token-keyed
                      index whose keys are ``kvstream_tokens_v2``)
    hlen     u32      length of the header
    header   hlen     UTF-8 JSON: format version, creation time, source positions, user
                      metadata, the index's per-worker state (with its ``key_mode``), the
                      list of tables with their node counts (and, versions 2 and 3, pending
                      counts), and (versions 2 and 3) ``keys``: the key definition of the
                      tables' canonical keys (:attr:`KeyMode.domain_algo`)
    tables            per table, in header order:
                        n bytes     hash lengths
                        sum(len)    hashes, concatenated
                        8n bytes    parent index per node (i64; -1 root, -2 unknown)
                        8n bytes    packed tier reference counts per node (u64)
                      versions 2 and 3, then:
                        n bytes     canonical key lengths (0: not known yet, else 16)
                        sum(len)    canonical keys, concatenated
                        4m bytes    node index of each of the m pending payloads (u32)
                        m bytes     1 when that payload is a scoped one, else 0
                        4m bytes    payload lengths (u32)
                        sum(len)    payloads, concatenated
    digest   32 bytes SHA-256 of everything before it

Versions 2 and 3 differ from 1 only by the token-keyed tables, so an engine-keyed index is
still written as version 1 (readable by every release), and a reader refuses a snapshot of a
newer version instead of misreading it. Version 3 exists so that a release computing
``kvstream_tokens_v1`` keys refuses a ``kvstream_tokens_v2`` snapshot (its requests would
match nothing); this release refuses a version-2 token-keyed snapshot, whose v1 keys cannot
be converted (keyed nodes keep no tokens), with a :class:`SnapshotError` that says to rebuild
the index from its source.

Writes are atomic (a temporary file in the same directory, fsync, rename, fsync of the
directory), so a crash leaves the previous snapshot intact; the temporary files of writers
killed before the rename are removed by the next save to that path. Reading checks the
magic, the version, the digest, then every header field's type and range (a crafted file
with a valid digest included) before anything is built from it, and every length, raising
:class:`SnapshotError` on any problem.
"""

from __future__ import annotations

import contextlib
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
from kvstream.index.keys import CANONICAL_ALGO, LEGACY_ALGOS, KeyMode
from kvstream.index.stats import SourceStats
from kvstream.index.token_table import is_token_table
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
FORMAT_VERSION: Final = 3
_VERSIONS: Final = (1, 2, 3)
_DIGEST: Final = 32
_HEAD: Final = struct.Struct("<8sHI")
_I32: Final = 2**31 - 1
_I63: Final = 2**63 - 1
_KEY_MODES: Final = frozenset(m.value for m in KeyMode)
_STATS: Final = frozenset(SourceStats().as_dict())
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
    if len(data) % arr.itemsize:
        raise SnapshotError("snapshot table data is truncated")
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
    keyed = index.key_mode.token_keyed
    version = _version_of(index.key_mode)
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
            if not is_token_table(table):  # pragma: no cover - by construction
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
    if keyed:
        header["keys"] = index.key_mode.domain_algo
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
    _remove_dead_temporaries(target)
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


def _remove_dead_temporaries(target: Path) -> None:
    """Remove ``.{name}.tmp-PID`` files next to ``target`` whose writer no longer runs."""
    prefix = f".{target.name}.tmp-"
    try:
        names = os.listdir(target.parent)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix) :]
        if not (name.startswith(prefix) and pid.isdigit()) or _alive(int(pid)):
            continue
        with contextlib.suppress(OSError):
            os.unlink(target.parent / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; not a pid at all
        return True
    return True


# ------------------------------------------------------------------- header validation


def _bad(where: str, what: str, value: Any) -> SnapshotError:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return SnapshotError(f"snapshot field {where} must be {what}, got {shown}")


def _obj(v: Any, where: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _bad(where, "an object", v)
    return v


def _arr(v: Any, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise _bad(where, "a list", v)
    return v


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(where, f"an integer in [{lo}, {hi}]", v)
    return v


def _opt_int(v: Any, where: str, lo: int, hi: int) -> int | None:
    return None if v is None else _int(v, where, lo, hi)


def _str(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise _bad(where, "a string", v)
    return v


def _opt_str(v: Any, where: str) -> str | None:
    return None if v is None else _str(v, where)


def _worker(v: Any, where: str) -> WorkerKey:
    """An (instance id, rank) pair as the header stores it."""
    pair = _arr(v, where)
    if len(pair) != 2:
        raise _bad(where, "an [instance_id, dp_rank] pair", v)
    return WorkerKey(_str(pair[0], f"{where}[0]"), _opt_int(pair[1], f"{where}[1]", 0, _I32))


def _check_group(g: Any, where: str) -> int:
    gd = _obj(g, where)
    gid = _int(gd.get("layer_group_id"), f"{where}.layer_group_id", 0, _I32)
    _opt_str(gd.get("hash_algo"), f"{where}.hash_algo")
    _opt_int(gd.get("tokens_per_block"), f"{where}.tokens_per_block", 1, _I32)
    _opt_int(gd.get("window_size"), f"{where}.window_size", 0, _I63)
    _opt_str(gd.get("attention_kind"), f"{where}.attention_kind")
    capacity = _arr(gd.get("capacity"), f"{where}.capacity")
    if len(capacity) > 64:
        raise _bad(f"{where}.capacity", "at most 64 tiers", capacity)
    for i, c in enumerate(capacity):
        _int(c, f"{where}.capacity[{i}]", 0, _I63)
    _int(gd.get("max_block_tokens"), f"{where}.max_block_tokens", 0, _I32)
    return gid


def _check_index_state(state: Any) -> set[tuple[WorkerKey, int]]:
    """Validate ``PrefixIndex.export_state`` output read from a file, before
    ``PrefixIndex.from_state`` uses any of it; returns the (worker, group id) pairs."""
    st = _obj(state, "index")
    _opt_int(st.get("default_tokens_per_block"), "index.default_tokens_per_block", 1, _I32)
    mode = st.get("key_mode", KeyMode.ENGINE.value)
    if not isinstance(mode, str) or mode not in _KEY_MODES:
        raise _bad("index.key_mode", f"one of {sorted(_KEY_MODES)}", mode)
    slots = [
        _worker(k, f"index.slots[{i}]") for i, k in enumerate(_arr(st.get("slots"), "index.slots"))
    ]
    if len(set(slots)) != len(slots):
        raise SnapshotError("snapshot field index.slots names a worker twice")
    groups: set[tuple[WorkerKey, int]] = set()
    seen: set[WorkerKey] = set()
    for i, w in enumerate(_arr(st.get("workers"), "index.workers")):
        at = f"index.workers[{i}]"
        wd = _obj(w, at)
        key = WorkerKey(
            _str(wd.get("instance_id"), f"{at}.instance_id"),
            _opt_int(wd.get("dp_rank"), f"{at}.dp_rank", 0, _I32),
        )
        if key in seen:
            raise SnapshotError(f"snapshot field {at} repeats worker {key}")
        seen.add(key)
        # checked before anything computes 1 << slot
        slot = _int(wd.get("slot"), f"{at}.slot", 0, len(slots) - 1)
        if slots[slot] != key:
            raise _bad(f"{at}.slot", f"the slot of {key} in index.slots", slot)
        _opt_int(wd.get("incarnation"), f"{at}.incarnation", 0, _I63)
        _opt_int(wd.get("next_id"), f"{at}.next_id", 0, _I63)
        if not isinstance(wd.get("stale"), bool):
            raise _bad(f"{at}.stale", "true or false", wd.get("stale"))
        _str(wd.get("stale_reason"), f"{at}.stale_reason")
        for j, gid in enumerate(_arr(wd.get("pending_clear"), f"{at}.pending_clear")):
            _int(gid, f"{at}.pending_clear[{j}]", 0, _I32)
        stats = _obj(wd.get("stats"), f"{at}.stats")
        for name in _STATS & stats.keys():
            _int(stats[name], f"{at}.stats.{name}", 0, _I63)
        gids = [
            _check_group(g, f"{at}.groups[{j}]")
            for j, g in enumerate(_arr(wd.get("groups"), f"{at}.groups"))
        ]
        if len(set(gids)) != len(gids):
            raise SnapshotError(f"snapshot field {at}.groups repeats a layer group")
        groups.update((key, gid) for gid in gids)
    return groups


def _check_header(header: Any) -> dict[str, Any]:
    """The top level of the header (the index state is checked by _check_index_state)."""
    h = _obj(header, "header")
    if h.get("format") != "kvstream-index":
        raise _bad("format", '"kvstream-index"', h.get("format"))
    _int(h.get("created_ns", 0), "created_ns", 0, _I63)
    if h.get("positions") is not None:
        _obj(h["positions"], "positions")
    if h.get("meta") is not None:
        _obj(h["meta"], "meta")
    _arr(h.get("tables"), "tables")
    return h


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


def _version_of(mode: KeyMode) -> int:
    """The format version a ``mode``-keyed index is written as (module doc)."""
    if mode is KeyMode.TOKENS:
        return 3
    return 2 if mode.token_keyed else 1


def _check_key_definition(version: int, mode: KeyMode, keys: Any) -> None:
    """SnapshotError unless a ``version`` snapshot of a ``mode``-keyed index, whose header
    names the key definition ``keys`` (None: absent), holds keys this release computes."""
    if version == 2 and mode is KeyMode.TOKENS:
        old = keys if isinstance(keys, str) else LEGACY_ALGOS[-1]
        raise SnapshotError(
            f"this snapshot's token-keyed index holds {old} keys; this release keys blocks "
            f"by {CANONICAL_ALGO} (kvstream.index.keys) and cannot convert them (keyed "
            "blocks keep no tokens): rebuild the index by replaying its source without the "
            "snapshot"
        )
    if not mode.token_keyed:
        return
    if version != _version_of(mode):
        raise SnapshotError(
            f"a version-{version} snapshot cannot hold a {mode.value}-keyed index (corrupt header)"
        )
    # written by every release that wrote version 3; Dynamo-keyed ones before had none
    if keys != mode.domain_algo and not (keys is None and version == 2):
        raise SnapshotError(
            f"snapshot keys are {keys!r}, expected {mode.domain_algo} for a "
            f"{mode.value}-keyed index"
        )


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
    if hlen > len(body) - pos:
        raise SnapshotError(f"snapshot header length {hlen} exceeds the file")
    try:
        raw_header = json.loads(body[pos : pos + hlen])
    except (ValueError, RecursionError) as exc:
        raise SnapshotError(f"snapshot header is not JSON: {exc}") from None
    pos += hlen
    header = _check_header(raw_header)
    groups = _check_index_state(header.get("index"))
    mode = KeyMode(header["index"].get("key_mode", KeyMode.ENGINE.value))
    keyed = mode.token_keyed
    _check_key_definition(version, mode, header.get("keys"))
    tables: dict[tuple[WorkerKey, int], tuple[Any, ...]] = {}
    for i, t in enumerate(header["tables"]):
        pos = _read_table(body, pos, i, t, keyed, groups, tables)
    if pos != len(body):
        raise SnapshotError(f"{len(body) - pos} unexpected bytes after the tables")
    if tables.keys() != groups:
        raise SnapshotError("snapshot tables do not match the index's layer groups")
    try:
        index = PrefixIndex.from_state(header["index"], tables, hasher_params=hasher_params)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as exc:
        raise SnapshotError(f"snapshot content is inconsistent: {exc!r}") from exc
    return Snapshot(
        index=index,
        positions=header.get("positions"),
        meta=header.get("meta") or {},
        created_ns=header.get("created_ns", 0),
        version=version,
    )


def _check_tree(at: str, parents: list[int], refs: list[int]) -> None:
    """The node links form a forest (no cycle) and every removed node (refs 0) is kept only
    for a descendant; the table's loader checks that parent indexes are in range."""
    n = len(parents)
    has_child = bytearray(n)
    for p in parents:
        if 0 <= p < n:
            has_child[p] = 1
    for i, r in enumerate(refs):
        if not r and not has_child[i]:
            raise SnapshotError(f"snapshot {at} node {i} is removed and has no descendants")
    state = bytearray(n)  # 0 unseen, 1 on the current path, 2 done
    for i in range(n):
        path = []
        j = i
        while 0 <= j < n and state[j] == 0:
            state[j] = 1
            path.append(j)
            j = parents[j]
        if 0 <= j < n and state[j] == 1:
            raise SnapshotError(f"snapshot {at} node {j} is its own ancestor")
        for k in path:
            state[k] = 2


def _read_table(  # noqa: PLR0917 - one private call site
    body: bytes,
    pos: int,
    i: int,
    t: Any,
    keyed: bool,
    groups: set[tuple[WorkerKey, int]],
    tables: dict[tuple[WorkerKey, int], tuple[Any, ...]],
) -> int:
    """Read table ``i`` (header entry ``t``) at ``pos`` into ``tables``; returns the
    position after it. Counts are checked against the bytes left before reading."""
    at = f"tables[{i}]"
    td = _obj(t, at)
    key = (
        WorkerKey(
            _str(td.get("instance_id"), f"{at}.instance_id"),
            _opt_int(td.get("dp_rank"), f"{at}.dp_rank", 0, _I32),
        ),
        _int(td.get("layer_group_id"), f"{at}.layer_group_id", 0, _I32),
    )
    if key not in groups or key in tables:
        raise SnapshotError(f"snapshot {at} is not the table of one of the index's layer groups")
    left = len(body) - pos
    n = _int(td.get("nodes"), f"{at}.nodes", 0, left // 17)  # >= 17 bytes per node
    hashes, pos = _blobs(body, pos, n)
    parents = _from_le(body[pos : pos + 8 * n], "q")
    pos += 8 * n
    refs = _from_le(body[pos : pos + 8 * n], "Q")
    pos += 8 * n
    if len(parents) != n or len(refs) != n or pos > len(body):
        raise SnapshotError("snapshot table data is truncated")
    _check_tree(at, parents, refs)
    if not keyed:
        tables[key] = (hashes, parents, refs)
        return pos
    keys, pos = _blobs(body, pos, n)
    m = _int(td.get("pending"), f"{at}.pending", 0, max(len(body) - pos, 0) // 9)
    where = _from_le(body[pos : pos + 4 * m], "I")
    pos += 4 * m
    flags = body[pos : pos + m]
    pos += m
    sizes = _from_le(body[pos : pos + 4 * m], "I")
    pos += 4 * m
    if len(where) != m or len(flags) != m or len(sizes) != m or pos > len(body):
        raise SnapshotError("snapshot key data is truncated")
    pending = []
    for j, f, size in zip(where, flags, sizes, strict=True):
        if f > 1:
            raise SnapshotError(f"snapshot {at} pending flag {f} is not 0 or 1")
        pending.append((j, bytes(body[pos : pos + size]), bool(f)))
        pos += size
    if pos > len(body):
        raise SnapshotError("snapshot key data is truncated")
    tables[key] = (hashes, parents, refs, keys, pending)
    return pos


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
