"""The disk tier: the block file format and the multi-process DiskStore, on real files."""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.cache.block_file import (
    HEADER_SIZE,
    BlockHeader,
    encode_header,
    parse_header,
    payload_hasher,
    verify_checksum,
    verify_payload,
)
from kvstream.cache.disk_store import DiskStore
from kvstream.cache.errors import (
    BlockBufferError,
    BlockFileError,
    BlockKeyError,
    StoreError,
    StoreFullError,
)
from kvstream.errors import ConfigError, KVStreamError

NS = bytes(range(16))
NS2 = bytes(range(16, 32))
H8 = bytes.fromhex("0123456789abcdef")
H32 = bytes(range(100, 132))
BIG = 1 << 30
REPO = Path(__file__).resolve().parents[1]


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def payload_of(i: int, size: int = 4096) -> bytes:
    return random.Random(i).randbytes(size)


def block_path(root: Path, ns: bytes, block_hash: bytes) -> Path:
    hx = block_hash.hex()
    return root / ns.hex() / hx[:2] / f"{hx}.kvb"


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".tmp.*") if p.is_file()]


def run_py(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


# -- the file format ---------------------------------------------------------------------------


def test_header_layout() -> None:
    payload = b"hello kv"
    raw = encode_header(namespace=NS, block_hash=H8, payload=payload)
    assert len(raw) == HEADER_SIZE == 96
    assert raw[0:4] == b"KVSB"
    assert struct.unpack_from("<HHQ", raw, 4) == (1, 96, len(payload))
    assert raw[16:32] == NS
    assert raw[32] == 8
    assert raw[33:65] == H8 + bytes(24)
    assert raw[65:72] == bytes(7)
    assert raw[72:88] == xxhash.xxh3_128_digest(payload)
    assert raw[88:96] == xxhash.xxh3_64_digest(raw[:88])
    header = parse_header(raw, namespace=NS, block_hash=H8, file_size=96 + len(payload))
    assert header == BlockHeader(payload_size=8, payload_checksum=raw[72:88])
    verify_payload(payload, header)
    raw32 = encode_header(namespace=NS, block_hash=H32, payload=np.arange(10, dtype=np.int64))
    h32 = parse_header(raw32, namespace=NS, block_hash=H32, file_size=96 + 80)
    assert raw32[32] == 32
    assert h32.payload_size == 80


def test_streaming_checksum_matches_the_header() -> None:
    data = payload_of(11, 1_000_003)
    header = parse_header(
        encode_header(namespace=NS, block_hash=H8, payload=data),
        namespace=NS,
        block_hash=H8,
        file_size=HEADER_SIZE + len(data),
    )
    hasher = payload_hasher()
    for i in range(0, len(data), 65_537):
        hasher.update(data[i : i + 65_537])
    verify_checksum(hasher.digest(), header)
    with pytest.raises(BlockFileError, match="checksum"):
        verify_checksum(bytes(16), header)


def test_encode_header_rejects_bad_keys() -> None:
    with pytest.raises(ValueError, match="namespace"):
        encode_header(namespace=bytes(15), block_hash=H8, payload=b"")
    with pytest.raises(ValueError, match="hash"):
        encode_header(namespace=NS, block_hash=bytes(16), payload=b"")


def _rehash(raw: bytes) -> bytes:
    return raw[:88] + xxhash.xxh3_64_digest(raw[:88])


def _good() -> bytes:
    return encode_header(namespace=NS, block_hash=H8, payload=b"0123456789")


@pytest.mark.parametrize(
    ("raw", "namespace", "block_hash", "file_size", "reason"),
    [
        (_good()[:95], NS, H8, 106, "short header"),
        (b"KVSX" + _good()[4:], NS, H8, 106, "bad magic"),
        (_good()[:4] + struct.pack("<H", 2) + _good()[6:], NS, H8, 106, "unknown .*version 2"),
        (_good()[:6] + struct.pack("<H", 128) + _good()[6 + 2 :], NS, H8, 106, "header size"),
        (_good()[:20] + b"\xff" + _good()[21:], NS, H8, 106, "header checksum"),
        (_good()[:-1] + bytes([_good()[-1] ^ 1]), NS, H8, 106, "header checksum"),
        (_good()[:70] + b"\x01" + _good()[71:], NS, H8, 106, "header checksum"),  # reserved
        (_rehash(_good()[:32] + b"\x07" + _good()[33:]), NS, H8, 106, "hash length"),
        (_good(), NS2, H8, 106, "namespace differs"),
        (_good(), NS, h(7), 106, "block hash differs"),
        (_good(), NS, H8 + bytes(24), 106, "block hash differs"),
        (_good(), NS, H8, 105, "truncated"),
        (_good(), NS, H8, 96, "truncated"),
        (_good(), NS, H8, 107, "trailing bytes"),
    ],
)
def test_parse_header_names_the_reason(
    raw: bytes, namespace: bytes, block_hash: bytes, file_size: int, reason: str
) -> None:
    with pytest.raises(BlockFileError, match=reason):
        parse_header(raw, namespace=namespace, block_hash=block_hash, file_size=file_size)


def test_verify_payload_detects_changes() -> None:
    header = parse_header(_good(), namespace=NS, block_hash=H8, file_size=106)
    verify_payload(bytearray(b"0123456789"), header)
    with pytest.raises(BlockFileError, match="checksum"):
        verify_payload(b"0123456788", header)
    with pytest.raises(BlockFileError, match="11 bytes"):
        verify_payload(b"0123456789x", header)


# -- round trips -------------------------------------------------------------------------------


def test_round_trip_bytes(tmp_path: Path) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        data = payload_of(1, 100_003)
        assert not store.contains(NS, H8)
        assert store.put(NS, H8, data) is True
        assert store.contains(NS, H8)
        out = bytearray(len(data))
        assert store.get_into(NS, H8, out) is True
        assert out == data
        view = memoryview(bytearray(len(data)))
        assert store.get_into(NS, H8, view) is True
        assert view == data
        path = block_path(tmp_path, NS, H8)
        assert path.read_bytes()[HEADER_SIZE:] == data
        assert path.stat().st_size == HEADER_SIZE + len(data)
        assert temp_files(tmp_path) == []
        assert store.put(NS, H32, b"")  # an empty payload is a valid block
        assert store.get_into(NS, H32, bytearray())
        assert store.stats().hits == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_round_trip_torch_tensor_buffers(tmp_path: Path, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    src = (torch.randn(2, 8, 16, 64, generator=gen) * 50).to(dtype)
    with DiskStore(tmp_path, capacity_bytes=BIG, fsync=True) as store:
        assert store.put(NS, H32, src.view(torch.uint8).numpy())
        dst = torch.empty_like(src)
        assert store.get_into(NS, H32, dst.view(torch.uint8).numpy())
        assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8))
        # a 2-D numpy array over the same bytes works as well
        arr = np.zeros((2, src.numel() * src.element_size() // 2), dtype=np.uint8)
        assert store.get_into(NS, H32, arr)
        assert arr.tobytes() == src.view(torch.uint8).numpy().tobytes()


def test_buffers_must_be_contiguous_and_writable(tmp_path: Path) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        a = np.arange(64, dtype=np.float32).reshape(8, 8)
        with pytest.raises(TypeError, match="contiguous"):
            store.put(NS, H8, a[:, ::2])
        assert store.put(NS, H8, a)
        with pytest.raises(TypeError, match="writable"):
            store.get_into(NS, H8, bytes(a.nbytes))
        assert store.stats().corrupt == 0


# -- corruption --------------------------------------------------------------------------------


def test_truncated_file_is_a_removed_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        data = payload_of(2)
        store.put(NS, H8, data)
        path = block_path(tmp_path, NS, H8)
        os.truncate(path, HEADER_SIZE + 10)
        with caplog.at_level(logging.WARNING, logger="kvstream.cache.disk_store"):
            assert store.get_into(NS, H8, bytearray(len(data))) is False
        assert "truncated" in caplog.text
        assert str(path) in caplog.text
        assert not path.exists()
        s = store.stats()
        assert (s.corrupt, s.misses, s.hits, s.files, s.used_bytes) == (1, 1, 0, 0, 0)
        # a later miss on the now-missing file is a plain miss
        assert store.get_into(NS, H8, bytearray(len(data))) is False
        assert store.stats().corrupt == 1
        assert store.stats().misses == 2


def test_file_under_another_hash_or_namespace_is_corrupt(tmp_path: Path) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        data = payload_of(3)
        store.put(NS, h(1), data)
        src = block_path(tmp_path, NS, h(1))
        # renamed to another block's name: the header still names h(1)
        dst = block_path(tmp_path, NS, h(2))
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(src, dst)
        assert store.contains(NS, h(2))
        assert store.get_into(NS, h(2), bytearray(len(data))) is False
        assert not dst.exists()
        # copied into another namespace
        other = block_path(tmp_path, NS2, h(1))
        other.parent.mkdir(parents=True)
        other.write_bytes(src.read_bytes())
        assert store.get_into(NS2, h(1), bytearray(len(data))) is False
        assert not other.exists()
        assert store.stats().corrupt == 2
        out = bytearray(len(data))
        assert store.get_into(NS, h(1), out)
        assert out == data


def test_payload_size_other_than_the_buffer_is_corrupt(tmp_path: Path) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        store.put(NS, H8, payload_of(4, 1000))
        assert store.get_into(NS, H8, bytearray(999)) is False
        assert not store.contains(NS, H8)
        assert store.stats().corrupt == 1


@pytest.fixture(scope="module")
def damage_store(tmp_path_factory: pytest.TempPathFactory) -> DiskStore:
    return DiskStore(tmp_path_factory.mktemp("damage"), capacity_bytes=BIG)


DAMAGE_PAYLOAD = payload_of(5, 300)
FILE_SIZE = HEADER_SIZE + len(DAMAGE_PAYLOAD)
damage = st.one_of(
    st.tuples(st.just("flip"), st.sets(st.integers(0, FILE_SIZE * 8 - 1), min_size=1, max_size=6)),
    st.tuples(st.just("flip"), st.sets(st.integers(0, HEADER_SIZE * 8 - 1), min_size=1)),
    st.tuples(st.just("truncate"), st.integers(0, FILE_SIZE - 1)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=40)),
)


@settings(max_examples=300, deadline=None)
@given(damage=damage)
def test_any_damage_is_detected(
    damage_store: DiskStore, damage: tuple[str, set[int] | int | bytes]
) -> None:
    store, key = damage_store, (NS, H8)
    store.discard(*key)
    assert store.put(*key, DAMAGE_PAYLOAD)
    path = store.path(*key)
    raw = bytearray(Path(path).read_bytes())
    kind, arg = damage
    if kind == "flip":
        assert isinstance(arg, set)
        for bit in arg:
            raw[bit // 8] ^= 1 << (bit % 8)
    elif kind == "truncate":
        assert isinstance(arg, int)
        del raw[arg:]
    else:
        assert isinstance(arg, bytes)
        raw += arg
    Path(path).write_bytes(raw)
    before = store.stats().corrupt
    out = bytearray(len(DAMAGE_PAYLOAD))
    assert store.get_into(*key, out) is False
    assert not os.path.exists(path)
    assert store.stats().corrupt == before + 1


# -- capacity and LRU --------------------------------------------------------------------------


def _fill(store: DiskStore, keys: range, size: int = 1000) -> None:
    for i in keys:
        assert store.put(NS, h(i), payload_of(i, size))


def test_lru_eviction_refresh_and_pins(tmp_path: Path) -> None:
    fsize = HEADER_SIZE + 1000
    with DiskStore(tmp_path, capacity_bytes=3 * fsize + 10) as store:
        _fill(store, range(3))
        assert store.stats().used_bytes == 3 * fsize
        assert store.get_into(NS, h(0), bytearray(1000))  # 0 becomes most recent
        _fill(store, range(3, 4))  # evicts 1 (least recently used)
        assert [store.contains(NS, h(i)) for i in range(4)] == [True, False, True, True]
        store.pin(NS, h(2))
        store.pin(NS, h(2))
        _fill(store, range(4, 5))  # 2 is pinned: 0 goes
        assert [store.contains(NS, h(i)) for i in (0, 2, 3, 4)] == [False, True, True, True]
        store.unpin(NS, h(2))
        _fill(store, range(5, 6))  # still pinned once: 3 goes
        assert not store.contains(NS, h(3))
        store.unpin(NS, h(2))
        with pytest.raises(ValueError, match="not pinned"):
            store.unpin(NS, h(2))
        _fill(store, range(6, 7))  # unpinned: 2 is the oldest now
        assert not store.contains(NS, h(2))
        s = store.stats()
        assert (s.files, s.used_bytes, s.evictions, s.writes) == (3, 3 * fsize, 4, 7)
        assert store.take_evicted() == [(NS, h(i)) for i in (1, 0, 3, 2)]
        assert store.take_evicted() == []
        assert sorted(p.name for p in tmp_path.rglob("*.kvb")) == sorted(
            f"{h(i).hex()}.kvb" for i in (4, 5, 6)
        )


def test_store_full_errors_evict_nothing(tmp_path: Path) -> None:
    fsize = HEADER_SIZE + 1000
    with DiskStore(tmp_path, capacity_bytes=2 * fsize) as store:
        with pytest.raises(StoreFullError, match="exceeds"):
            store.put(NS, H8, bytes(2 * fsize))
        _fill(store, range(2))
        store.pin(NS, h(0))
        store.pin(NS, h(1))
        with pytest.raises(StoreFullError, match="pinned"):
            store.put(NS, h(9), payload_of(9, 1000))
        assert store.contains(NS, h(0))
        assert store.contains(NS, h(1))
        assert not store.contains(NS, h(9))
        assert store.stats().evictions == 0


def test_put_existing_key_does_not_rewrite(tmp_path: Path) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        assert store.put(NS, H8, b"first")
        path = block_path(tmp_path, NS, H8)
        st1 = path.stat()
        assert store.put(NS, H8, b"second, longer payload") is False
        st2 = path.stat()
        assert (st1.st_ino, st1.st_mtime_ns, st1.st_size) == (
            st2.st_ino,
            st2.st_mtime_ns,
            st2.st_size,
        )
        out = bytearray(5)
        assert store.get_into(NS, H8, out)
        assert out == b"first"
        s = store.stats()
        assert (s.writes, s.write_skipped, s.files) == (1, 1, 1)


def test_open_orders_existing_files_by_mtime(tmp_path: Path) -> None:
    fsize = HEADER_SIZE + 1000
    with DiskStore(tmp_path, capacity_bytes=BIG) as first:
        _fill(first, range(4))
    base = time.time_ns() - 10**10
    for i, age in enumerate([3, 1, 4, 2]):  # oldest: 2, then 0, 3, 1
        os.utime(block_path(tmp_path, NS, h(i)), ns=(base - age * 10**9,) * 2)
    with DiskStore(tmp_path, capacity_bytes=4 * fsize) as store:
        assert store.stats().files == 4
        assert store.stats().used_bytes == 4 * fsize
        _fill(store, range(10, 12))
        assert [store.contains(NS, h(i)) for i in range(4)] == [False, True, False, True]


def test_hits_refresh_mtime_for_other_processes(tmp_path: Path) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        _fill(store, range(1))
        path = block_path(tmp_path, NS, h(0))
        os.utime(path, ns=(10**18, 10**18))
        assert store.get_into(NS, h(0), bytearray(1000))
        assert abs(path.stat().st_mtime - time.time()) < 60


def test_rescan_counts_other_writers(tmp_path: Path) -> None:
    fsize = HEADER_SIZE + 1000
    now = [0.0]
    store = DiskStore(
        tmp_path, capacity_bytes=3 * fsize, rescan_interval_s=10, clock=lambda: now[0]
    )
    with DiskStore(tmp_path, capacity_bytes=BIG) as other:
        _fill(other, range(3))
    base = time.time_ns() - 10**10
    for i in range(3):
        os.utime(block_path(tmp_path, NS, h(i)), ns=(base + i * 10**9,) * 2)
    _fill(store, range(3, 4))  # before the interval: the other files are unknown
    assert store.stats().files == 1
    assert len(list(tmp_path.rglob("*.kvb"))) == 4
    now[0] = 10.0
    _fill(store, range(4, 5))  # rescans: 4 files known, evicts the two oldest (0 and 1)
    assert [store.contains(NS, h(i)) for i in range(5)] == [False, False, True, True, True]
    assert store.stats().files == 3
    assert store.stats().evictions == 2
    store.close()


# -- sharing between processes -----------------------------------------------------------------

READ_BLOCK = """
import sys
from kvstream.cache.disk_store import DiskStore
store = DiskStore(sys.argv[1], capacity_bytes=1 << 30)
out = bytearray(int(sys.argv[4]))
ok = store.get_into(bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3]), out)
print(ok, out.hex() if ok else "")
"""


def test_second_instance_and_subprocess_see_written_files(tmp_path: Path) -> None:
    data = payload_of(6, 5000)
    with (
        DiskStore(tmp_path, capacity_bytes=BIG) as first,
        DiskStore(tmp_path, capacity_bytes=BIG) as second,
    ):
        assert first.put(NS, H32, data)
        assert second.contains(NS, H32)
        out = bytearray(len(data))
        assert second.get_into(NS, H32, out)
        assert out == data
        assert second.stats().files == 1  # tracked once read
        assert second.put(NS, H32, data) is False
    with DiskStore(tmp_path, capacity_bytes=BIG) as third:
        assert third.stats().files == 1
        assert third.stats().used_bytes == HEADER_SIZE + len(data)
    proc = run_py(READ_BLOCK, str(tmp_path), NS.hex(), H32.hex(), str(len(data)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", data.hex()]


RACE = """
import os, random, sys, time
from kvstream.cache.disk_store import DiskStore
root, go, n, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = DiskStore(root, capacity_bytes=1 << 30)
payloads = [random.Random(i).randbytes(65536) for i in range(n)]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.0005)
results = [0] * n
for _ in range(rounds):
    for i in range(n):
        results[i] += store.put(bytes(16), i.to_bytes(8, "big"), payloads[i])
print(" ".join(map(str, results)))
"""


def test_processes_racing_on_the_same_keys(tmp_path: Path) -> None:
    n, rounds, procs = 40, 3, 4
    root, go = tmp_path / "store", tmp_path / "go"
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", RACE, str(root), str(go), str(n), str(rounds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for _ in range(procs)
    ]
    outputs = []
    try:
        for w in workers:
            assert w.stdout is not None
            assert w.stdout.readline().strip() == "ready"
        go.touch()
        for w in workers:
            out, err = w.communicate(timeout=120)
            assert w.returncode == 0, err
            outputs.append([int(x) for x in out.split()])
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.communicate()
    for i in range(n):
        assert sum(o[i] for o in outputs) == 1, f"key {i}: {[o[i] for o in outputs]}"
    assert all(x in (0, 1) for o in outputs for x in o)
    assert temp_files(root) == []
    assert len(list(root.rglob("*.kvb"))) == n
    with DiskStore(root, capacity_bytes=BIG) as store:
        for i in range(n):
            block = bytearray(65536)
            assert store.get_into(bytes(16), h(i), block)
            assert block == payload_of(i, 65536)
        assert store.stats().corrupt == 0


# -- crashes and write failures ----------------------------------------------------------------

CRASH = """
import os, sys
from kvstream.cache.disk_store import DiskStore
store = DiskStore(sys.argv[1], capacity_bytes=1 << 30, anonymous_temp=sys.argv[2] == "1")
real_write, calls = os.write, []
def dying_write(fd, data):
    calls.append(fd)
    if len(calls) > 1:  # the header went out; die before the payload
        os._exit(9)
    return real_write(fd, data)
os.write = dying_write
store.put(bytes(16), bytes(8), b"x" * 100000)
"""


def test_crash_mid_write_of_an_unnamed_file_leaves_nothing(tmp_path: Path) -> None:
    proc = run_py(CRASH, str(tmp_path), "1")
    assert proc.returncode == 9, proc.stderr
    assert not block_path(tmp_path, bytes(16), bytes(8)).exists()
    assert temp_files(tmp_path) == []
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        assert store.stats().files == 0


def test_crash_mid_write_leaves_no_block_and_temp_is_cleaned(tmp_path: Path) -> None:
    proc = run_py(CRASH, str(tmp_path), "0")
    assert proc.returncode == 9, proc.stderr
    assert not block_path(tmp_path, bytes(16), bytes(8)).exists()
    (tmp,) = temp_files(tmp_path)
    assert tmp.name.startswith(f".tmp.{socket.gethostname()}.")
    assert tmp.stat().st_size == HEADER_SIZE
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        assert temp_files(tmp_path) == []
        assert store.stats().files == 0
        assert not store.contains(bytes(16), bytes(8))


def test_stale_temp_rules(tmp_path: Path) -> None:
    d = tmp_path / NS.hex() / "01"
    d.mkdir(parents=True)
    host = socket.gethostname()
    mine_alive = d / f".tmp.{host}.{os.getpid()}.aa"
    foreign_fresh = d / ".tmp.other.host.example.1.bb"
    foreign_old = d / ".tmp.other.host.example.1.cc"
    garbage_old = d / ".tmp.garbage"
    for p in (mine_alive, foreign_fresh, foreign_old, garbage_old):
        p.write_bytes(b"partial")
    old = time.time() - 2 * 3600
    os.utime(foreign_old, (old, old))
    os.utime(garbage_old, (old, old))
    (d / "not-a-block.kvb").write_bytes(b"ignored")
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        assert sorted(p.name for p in temp_files(tmp_path)) == sorted(
            [mine_alive.name, foreign_fresh.name]
        )
        assert store.stats().files == 0


EFBIG = """
import errno, resource, signal, sys
from kvstream.cache.disk_store import DiskStore
from kvstream.cache.errors import StoreFullError
store = DiskStore(sys.argv[1], capacity_bytes=1 << 30)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
try:
    store.put(bytes(16), bytes(8), bytes(1 << 20))
except StoreFullError as e:
    print("StoreFullError", e.__cause__.errno == errno.EFBIG, store.stats().write_errors)
"""


def test_real_efbig_is_store_full(tmp_path: Path) -> None:
    proc = run_py(EFBIG, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["StoreFullError", "True", "1"]
    assert not block_path(tmp_path, bytes(16), bytes(8)).exists()
    assert temp_files(tmp_path) == []


def _failing_write(monkeypatch: pytest.MonkeyPatch, err: int) -> Callable[[int, memoryview], int]:
    real, calls = os.write, []

    def write(fd: int, data: memoryview) -> int:
        calls.append(len(data))
        if len(calls) == 2:  # half of the payload gets out
            return real(fd, data[: len(data) // 2])
        if len(calls) == 3:
            raise OSError(err, os.strerror(err))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return write


@pytest.mark.parametrize(
    ("err", "exc"), [(errno.ENOSPC, StoreFullError), (errno.EDQUOT, StoreFullError)]
)
def test_injected_disk_full_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, err: int, exc: type[StoreError]
) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        _failing_write(monkeypatch, err)
        with pytest.raises(exc) as info:
            store.put(NS, H8, payload_of(7, 100_000))
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.errno == err
        assert info.value.path == str(block_path(tmp_path, NS, H8))
        monkeypatch.undo()
        assert not store.contains(NS, H8)
        assert temp_files(tmp_path) == []
        s = store.stats()
        assert (s.write_errors, s.writes, s.files, s.used_bytes) == (1, 0, 0, 0)
        assert store.put(NS, H8, payload_of(7, 100_000))  # works again afterwards


def test_other_write_errors_are_store_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        _failing_write(monkeypatch, errno.EIO)
        with pytest.raises(StoreError) as info:
            store.put(NS, H8, payload_of(8, 10_000))
        assert not isinstance(info.value, StoreFullError)
        monkeypatch.undo()
        assert temp_files(tmp_path) == []
        assert not store.contains(NS, H8)


# -- keys, lifecycle, counters -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ns", "bh", "exc"),
    [
        ("0" * 16, H8, TypeError),
        (NS, "0" * 8, TypeError),
        (bytearray(NS), H8, TypeError),
        (NS, 12345, TypeError),
        (bytes(15), H8, ValueError),
        (bytes(17), H8, ValueError),
        (NS, bytes(7), ValueError),
        (NS, bytes(16), ValueError),
        (NS, b"", ValueError),
    ],
)
def test_bad_keys(tmp_path: Path, ns: object, bh: object, exc: type[Exception]) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        for call in (
            lambda: store.put(ns, bh, b"x"),  # type: ignore[arg-type]
            lambda: store.get_into(ns, bh, bytearray(1)),  # type: ignore[arg-type]
            lambda: store.contains(ns, bh),  # type: ignore[arg-type]
            lambda: store.discard(ns, bh),  # type: ignore[arg-type]
            lambda: store.pin(ns, bh),  # type: ignore[arg-type]
        ):
            with pytest.raises(exc) as info:
                call()
            # kvstream's own error (the README's promise), still the builtin it was
            assert isinstance(info.value, BlockKeyError)
            assert isinstance(info.value, KVStreamError)
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(BlockKeyError):
        encode_header(namespace=ns, block_hash=bh, payload=b"")  # type: ignore[arg-type]


def test_bad_arguments_are_kvstream_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        DiskStore(tmp_path, capacity_bytes=0)
    with pytest.raises(ConfigError, match="rescan_interval_s"):
        DiskStore(tmp_path, capacity_bytes=BIG, rescan_interval_s=-1)
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        with pytest.raises(BlockBufferError, match="contiguous"):
            store.put(NS, H8, np.zeros((4, 4), dtype=np.uint8)[:, ::2])
        with pytest.raises(BlockBufferError, match="writable"):
            store.get_into(NS, H8, b"read-only")
        with pytest.raises(BlockKeyError, match="not pinned"):
            store.unpin(NS, H8)


@settings(max_examples=200)
@given(
    ns=st.binary(min_size=16, max_size=16),
    bh=st.sampled_from([8, 32]).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
)
def test_paths_stay_under_root(damage_store: DiskStore, ns: bytes, bh: bytes) -> None:
    path = damage_store.path(ns, bh)
    root = damage_store.root
    assert os.path.commonpath([root, os.path.realpath(path)]) == root
    rel = os.path.relpath(path, root).split(os.sep)
    assert rel == [ns.hex(), bh.hex()[:2], f"{bh.hex()}.kvb"]
    assert all(re.fullmatch(r"[0-9a-f]+(\.kvb)?", part) for part in rel)


def test_hostile_looking_hash_bytes_stay_plain(tmp_path: Path) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG) as store:
        evil = b"/../../."
        assert store.put(b"/../../../../etc", evil, b"x")
        (found,) = tmp_path.rglob("*.kvb")
        assert found == block_path(tmp_path, b"/../../../../etc", evil)
        assert found.name == "2f2e2e2f2e2e2f2e.kvb"


def test_discard_close_and_stats(tmp_path: Path) -> None:
    store = DiskStore(tmp_path / "deep" / "root", capacity_bytes=BIG)
    assert store.put(NS, h(1), b"a" * 100)
    assert store.put(NS, h(2), b"b" * 50)
    assert store.get_into(NS, h(1), bytearray(100))
    assert not store.get_into(NS, h(3), bytearray(100))
    assert store.discard(NS, h(2)) is True
    assert store.discard(NS, h(2)) is False
    s = store.stats()
    assert s.files == 1
    assert s.used_bytes == HEADER_SIZE + 100
    assert s.capacity_bytes == BIG
    assert (s.hits, s.misses, s.corrupt) == (1, 1, 0)
    assert (s.writes, s.write_skipped, s.evictions, s.write_errors) == (2, 0, 0, 0)
    assert s.bytes_written == 2 * HEADER_SIZE + 150
    assert s.bytes_read == HEADER_SIZE + 100
    store.close()
    store.close()
    for call in (
        lambda: store.put(NS, h(4), b"x"),
        lambda: store.get_into(NS, h(1), bytearray(100)),
        lambda: store.contains(NS, h(1)),
        lambda: store.discard(NS, h(1)),
        lambda: store.pin(NS, h(1)),
        lambda: store.unpin(NS, h(1)),
        store.rescan,
        store.__enter__,
    ):
        with pytest.raises(StoreError, match="closed"):
            call()
    assert store.stats() == s
    assert "closed" in repr(store)


def test_root_must_be_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_bytes(b"")
    with pytest.raises(StoreError) as info:
        DiskStore(f, capacity_bytes=BIG)
    assert info.value.path == str(f)
    with pytest.raises(StoreError):
        DiskStore(f / "below", capacity_bytes=BIG)
    with pytest.raises(ValueError, match="capacity"):
        DiskStore(tmp_path, capacity_bytes=0)


def test_named_temp_files_publish_the_same_way(tmp_path: Path) -> None:
    with DiskStore(tmp_path, capacity_bytes=BIG, anonymous_temp=False) as store:
        assert store.put(NS, bytes(8), b"payload")
        assert not store.put(NS, bytes(8), b"payload")
        out = bytearray(7)
        assert store.get_into(NS, bytes(8), out)
        assert bytes(out) == b"payload"
    assert temp_files(tmp_path) == []
