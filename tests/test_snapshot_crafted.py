"""Crafted snapshots: content that passes the checksum (re-computed by the attacker, or written
by a buggy producer) is validated field by field before use. Loading one raises SnapshotError
or restores a consistent index; never another exception, and nothing is allocated from a
size or slot the file claims before that claim is checked."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from index_support import Producer, tokens

from kvstream.index import PrefixIndex, SnapshotError, load_snapshot, save_snapshot
from kvstream.index.snapshot import decode_snapshot, encode_snapshot

_HEAD = struct.Struct("<8sHI")
REQS = [tokens(8, seed=1) + tokens(12, seed=s) for s in range(2, 5)]


def _index(mode: str) -> PrefixIndex:
    idx = PrefixIndex(key_mode=mode, default_tokens_per_block=4)
    for w in range(3):
        p = Producer(f"w{w}", rank=w % 2)
        idx.apply(p.batch(p.created(), p.created(group=1, capacity=(10, 20))))
        for r in REQS[: w + 1]:
            idx.apply(p.batch(p.stored(p.chain(r))))
        idx.apply(p.batch(p.removed([p.chain(REQS[0])[2]])))
    return idx


SNAPSHOTS = {
    mode: encode_snapshot(_index(mode), {"kind": "t", "offset": 3}) for mode in ("engine", "tokens")
}


def _split(data: bytes) -> tuple[int, dict[str, Any], bytes]:
    """(format version, header, table bytes) of a snapshot."""
    _, version, hlen = _HEAD.unpack_from(data)
    header = json.loads(data[_HEAD.size : _HEAD.size + hlen])
    return version, header, data[_HEAD.size + hlen : -32]


def _join(version: int, header: Any, tables: bytes) -> bytes:
    """A snapshot with a valid checksum around whatever it is given."""
    head = json.dumps(header).encode()
    body = _HEAD.pack(b"KVSIDX\r\n", version, len(head)) + head + tables
    return body + hashlib.sha256(body).digest()


def _restores_or_refuses(data: bytes) -> None:
    try:
        snap = decode_snapshot(data)
    except SnapshotError:
        return
    snap.index.check()
    again = decode_snapshot(encode_snapshot(snap.index, snap.positions, snap.meta))
    assert again.index.canonical_state() == snap.index.canonical_state()


def test_a_huge_worker_slot_is_refused_before_anything_is_allocated() -> None:
    version, header, tables = _split(SNAPSHOTS["engine"])
    header["index"]["workers"][0]["slot"] = 2**31  # 1 << slot would be a 256 MiB integer
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError, match="slot"):
            decode_snapshot(_join(version, header, tables))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("created_ns",), "yesterday"),
        (("meta",), [1, 2]),
        (("positions",), 7),
        (("index",), []),
        (("index", "slots"), {"a": 1}),
        (("index", "slots", 0), ["w0", 0, 9]),
        (("index", "key_mode"), "bogus"),
        (("index", "default_tokens_per_block"), -4),
        (("index", "workers", 0, "slot"), -1),
        (("index", "workers", 0, "slot"), 1),  # another worker's slot
        (("index", "workers", 0, "slot"), True),
        (("index", "workers", 0, "incarnation"), 2.5),
        (("index", "workers", 0, "next_id"), -3),
        (("index", "workers", 0, "stale"), "no"),
        (("index", "workers", 0, "pending_clear"), [None]),
        (("index", "workers", 0, "stats"), [3]),
        (("index", "workers", 0, "groups", 0, "capacity"), [-1]),
        (("index", "workers", 0, "groups", 0, "capacity"), 10),
        (("index", "workers", 0, "groups", 0, "hash_algo"), 5),
        (("index", "workers", 0, "groups", 0, "tokens_per_block"), 0),
        (("index", "workers", 0, "groups", 0, "max_block_tokens"), "x"),
        (("index", "workers", 0, "groups", 1, "layer_group_id"), 0),  # a duplicate group
        (("index", "workers", 1, "instance_id"), "w0"),  # a duplicate worker
        (("tables",), None),
        (("tables", 0, "nodes"), 10**12),
        (("tables", 0, "nodes"), -1),
        (("tables", 0, "dp_rank"), "0"),
        (("tables", 0, "layer_group_id"), 77),  # a table no worker group owns
        (("tables", 1), None),
    ],
)
@pytest.mark.parametrize("mode", ["engine", "tokens"])
def test_crafted_fields_are_refused(mode: str, path: tuple[Any, ...], value: Any) -> None:
    version, header, tables = _split(SNAPSHOTS[mode])
    target = header
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(SnapshotError):
        decode_snapshot(_join(version, header, tables))


def test_a_header_that_is_not_an_object_is_refused() -> None:
    version, _, tables = _split(SNAPSHOTS["engine"])
    for header in ([], "x", 3, None):
        with pytest.raises(SnapshotError, match="header"):
            decode_snapshot(_join(version, header, tables))
    body = _HEAD.pack(b"KVSIDX\r\n", version, 2) + b"\xff\xfe" + tables
    with pytest.raises(SnapshotError, match="header is not JSON"):
        decode_snapshot(body + hashlib.sha256(body).digest())
    deep = b"[" * 100_000 + b"]" * 100_000
    body = _HEAD.pack(b"KVSIDX\r\n", version, len(deep)) + deep + tables
    with pytest.raises(SnapshotError, match="header is not JSON"):
        decode_snapshot(body + hashlib.sha256(body).digest())


json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2, 2**31, 2**34, 2**63, 2**64]),
    st.floats(allow_nan=False),
    st.text(max_size=4),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=6,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["engine", "tokens"]),
    edits=st.lists(
        st.tuples(st.integers(0, 10**6), json_value, st.booleans()), min_size=1, max_size=3
    ),
)
def test_crafted_headers_restore_or_raise_snapshot_error(
    mode: str, edits: list[tuple[int, Any, bool]]
) -> None:
    """Any field of the JSON header replaced by any JSON value (or removed), re-checksummed."""
    version, header, tables = _split(SNAPSHOTS[mode])
    for pick, value, remove in edits:
        paths = _paths(header)
        path = paths[pick % len(paths)]
        target = header
        for step in path[:-1]:
            target = target[step]
        if remove:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    _restores_or_refuses(_join(version, header, tables))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["engine", "tokens"]),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4),
    version=st.sampled_from([None, 1, 2]),
)
def test_crafted_table_bytes_restore_or_raise_snapshot_error(
    mode: str, edits: list[tuple[int, int]], version: int | None
) -> None:
    """Table bytes (hash lengths, hashes, parent indexes, reference counts, keys, pending
    payloads) overwritten, and the format version changed, re-checksummed."""
    v, header, tables = _split(SNAPSHOTS[mode])
    raw = bytearray(tables)
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    _restores_or_refuses(_join(version or v, header, bytes(raw)))


def test_temporary_files_of_dead_writers_are_removed(tmp_path: Path) -> None:
    """kill -9 between writing the temporary file and the rename leaves ``.name.tmp-PID``;
    the next save to that path removes those of processes that no longer run."""
    path = tmp_path / "idx.snap"
    dead = tmp_path / f".idx.snap.tmp-{_dead_pid()}"
    dead.write_bytes(b"half a snapshot")
    live = tmp_path / f".idx.snap.tmp-{os.getppid()}"  # a writer that is still running
    live.write_bytes(b"being written")
    other = tmp_path / ".other.snap.tmp-1"
    other.write_bytes(b"not ours")
    save_snapshot(path, PrefixIndex())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["idx.snap", live.name, other.name])
    assert load_snapshot(path).index.canonical_state() == PrefixIndex().canonical_state()


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout)
