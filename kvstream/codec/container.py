"""Avro object container files: one record per EventBatch, readable by any Avro tool.

Layout (Avro specification): ``Obj\\x01``, a metadata map (``avro.schema``, ``avro.codec``,
plus ``kvstream.schema_version``), a 16-byte sync marker, then blocks of
``count, size, data[size], sync``. Each block is written with a single ``write`` call.

Checksums: new files use the ``snappy`` codec by default, whose blocks carry a CRC32 of their
uncompressed data (Avro specification); the reader verifies it, so a flipped byte is a
DecodeError (damage), never a different batch. ``null``, ``deflate`` carry no checksum;
``bzip2`` and ``xz`` carry their own. A header altered so that its schema no longer matches
the registered version it names is damage too.

:class:`ContainerWriter` appends to an existing file (reusing its schema, codec and sync
marker). :func:`read_container` returns a :class:`ContainerReader`; with
``tolerate_torn_tail=True`` it yields every batch of every complete block and stops cleanly at
the first truncated or corrupt block (a crash mid-write), reporting the byte offset where the
good data ends and how many bytes it ignored. Blocks are decoded whole before any of their
batches is yielded, so a bad block yields nothing.
"""

from __future__ import annotations

import bz2
import io
import json
import lzma
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from functools import lru_cache
from types import TracebackType
from typing import IO, Any, Final

import fastavro

from kvstream.codec.binary import encode_bytes, encode_long, encode_string, read_long
from kvstream.codec.column_encoder import encode_columns_body
from kvstream.codec.encoder import encode_batch_body
from kvstream.codec.records import SkippedEvent, record_to_batch
from kvstream.codec.schemas import (
    CURRENT_VERSION,
    VERSION_PROPERTY,
    SchemaInfo,
    SchemaRegistry,
    schema_registry,
)
from kvstream.errors import CodecError, DecodeError, EncodeError, UnknownSchemaError
from kvstream.events.columns import ColumnBatch
from kvstream.events.model import EventBatch

__all__ = [
    "CODECS",
    "DEFAULT_CODEC",
    "ContainerEncoder",
    "ContainerReader",
    "ContainerWriter",
    "read_container",
    "write_container",
]

MAGIC: Final = b"Obj\x01"
SYNC_SIZE: Final = 16
#: Compression codecs this module writes and reads (the Avro names).
CODECS: Final = ("null", "deflate", "snappy", "bzip2", "xz")
#: The codec of new files: snappy is fast and checksums every block (CRC32).
DEFAULT_CODEC: Final = "snappy"
#: Default uncompressed bytes per block before the writer starts a new block.
DEFAULT_SYNC_INTERVAL: Final = 64 * 1024
#: Largest block (compressed or not) the reader accepts; guards memory against corrupt sizes.
DEFAULT_MAX_BLOCK_BYTES: Final = 256 * 1024 * 1024

Target = str | os.PathLike[str] | IO[bytes]


def _open(target: Target, mode: str) -> tuple[IO[bytes], bool]:
    """(file object, whether we opened it): paths are opened, file objects used as they are."""
    if isinstance(target, (str, os.PathLike)):
        return open(target, mode), True
    return target, False


class _Truncated(DecodeError):
    """The data ended early (a torn tail when it happens after the header)."""


_CRC: Final = struct.Struct(">I")


# ------------------------------------------------------------------------------- compression


def _compress(codec: str, data: bytes, level: int | None) -> bytes:
    if codec == "null":
        return data
    if codec == "deflate":
        c = zlib.compressobj(
            zlib.Z_DEFAULT_COMPRESSION if level is None else level, zlib.DEFLATED, -15
        )
        return c.compress(data) + c.flush()
    if codec == "snappy":
        from cramjam import snappy  # imported on first use: keeps `import kvstream.codec` lean

        return bytes(snappy.compress_raw(data)) + _CRC.pack(zlib.crc32(data))
    if codec == "bzip2":
        return bz2.compress(data, 9 if level is None else level)
    if codec == "xz":
        return lzma.compress(data, preset=level)
    raise EncodeError(f"unsupported container codec {codec!r}; supported: {CODECS}")


def _snappy_length(data: bytes) -> int:
    """The uncompressed length a raw snappy block declares (its leading varint)."""
    n = 0
    for shift, byte in zip(range(0, 35, 7), data, strict=False):
        n |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return n
    raise DecodeError("snappy block has no valid length")


def _unsnappy(data: bytes, limit: int) -> bytes:
    if len(data) < 4:
        raise DecodeError(f"snappy block of {len(data)} bytes has no CRC32")
    body, (crc,) = data[:-4], _CRC.unpack(data[-4:])
    if _snappy_length(body) > limit:
        raise DecodeError(f"block inflates to more than {limit} bytes")
    from cramjam import DecompressionError, snappy

    try:
        out = bytes(snappy.decompress_raw(body))
    except DecompressionError as exc:
        raise DecodeError(f"cannot decompress snappy block: {exc}") from exc
    if zlib.crc32(out) != crc:
        raise DecodeError("snappy block fails its CRC32 check: the file is damaged")
    return out


def _decompress(codec: str, data: bytes, limit: int) -> bytes:
    if codec == "null":
        return data
    if codec == "snappy":
        return _unsnappy(data, limit)
    try:
        if codec == "deflate":
            d = zlib.decompressobj(-15)
            out = d.decompress(data, limit)
            if d.unconsumed_tail:
                raise DecodeError(f"block inflates to more than {limit} bytes")
            if not d.eof:
                raise DecodeError("deflate block is truncated")
            return out
        if codec in ("bzip2", "xz"):
            dec: Any = bz2.BZ2Decompressor() if codec == "bzip2" else lzma.LZMADecompressor()
            out = dec.decompress(data, limit)
            if not dec.eof:
                raise DecodeError(f"{codec} block is truncated or inflates to more than {limit}")
            return bytes(out)
    except (zlib.error, OSError, lzma.LZMAError, EOFError, ValueError) as exc:
        raise DecodeError(f"cannot decompress {codec} block: {exc}") from exc
    raise DecodeError(f"unsupported container codec {codec!r}; supported: {CODECS}")


# ------------------------------------------------------------------------------------ reading


class _Input:
    """A binary file object read with exact-length reads and a byte position."""

    def __init__(self, fo: IO[bytes], start: int) -> None:
        self.fo = fo
        self.pos = start

    def read_exact(self, n: int, what: str) -> bytes:
        data = self.fo.read(n)
        self.pos += len(data)
        if len(data) != n:
            raise _Truncated(f"data ends inside {what} (at byte {self.pos})")
        return data

    def read_long(self, what: str, first: bytes = b"") -> int:
        buf = bytearray(first)
        while True:
            if len(buf) > 10:
                raise DecodeError(f"varint of {what} is longer than 10 bytes")
            if buf and not buf[-1] & 0x80:
                return read_long(bytes(buf), 0, what)[0]
            buf += self.read_exact(1, f"the varint of {what}")


def _read_header(inp: _Input) -> tuple[dict[str, bytes], bytes]:
    magic = inp.read_exact(4, "the container magic")
    if magic != MAGIC:
        raise DecodeError(
            f"not an Avro container file: starts with {magic.hex()}, expected 4f626a01"
        )
    meta: dict[str, bytes] = {}
    while True:
        count = inp.read_long("the metadata block count")
        if count == 0:
            break
        if count < 0:
            count = -count
            inp.read_long("the metadata block size")
        if count > 1_000_000:
            raise DecodeError(f"metadata block claims {count} entries")
        for _ in range(count):
            klen = inp.read_long("a metadata key length")
            if not 0 <= klen <= 1 << 20:
                raise DecodeError(f"metadata key length {klen} is not plausible")
            key = inp.read_exact(klen, "a metadata key")
            vlen = inp.read_long("a metadata value length")
            if not 0 <= vlen <= DEFAULT_MAX_BLOCK_BYTES:
                raise DecodeError(f"metadata value length {vlen} is not plausible")
            try:
                meta[key.decode("utf-8")] = inp.read_exact(vlen, "a metadata value")
            except UnicodeDecodeError as exc:
                raise DecodeError(f"metadata key is not UTF-8: {exc}") from exc
    sync = inp.read_exact(SYNC_SIZE, "the header sync marker")
    return meta, sync


def _codec_of(meta: dict[str, bytes]) -> str:
    """The container's codec (Avro: absent means null)."""
    raw = meta.get("avro.codec")
    if raw is None:
        if VERSION_PROPERTY in meta:  # kvstream always names it: the key itself was damaged
            raise DecodeError("container header has no avro.codec: the header is damaged")
        return "null"
    return raw.decode("utf-8", "replace")


def _writer_schema(meta: dict[str, bytes], registry: SchemaRegistry) -> SchemaInfo:
    """The writer schema of a container: a registered version, or a resolvable unknown one."""
    raw = meta.get("avro.schema")
    if raw is None:
        raise DecodeError("container header has no avro.schema")
    return _schema_of_header(bytes(raw), registry)


@lru_cache(maxsize=64)
def _schema_of_header(raw: bytes, registry: SchemaRegistry) -> SchemaInfo:
    """:func:`_writer_schema` of a header's schema text (memoized: parsing, canonicalising
    and fingerprinting it costs milliseconds, and a following reader reopens its files)."""
    try:
        schema_json = json.loads(raw)
    except ValueError as exc:
        raise DecodeError(f"container avro.schema is not JSON: {exc}") from exc
    if not isinstance(schema_json, dict):
        raise DecodeError("container avro.schema is not a record schema")
    declared: Any = schema_json.get(VERSION_PROPERTY)
    try:
        probe = SchemaInfo.from_json(
            declared if isinstance(declared, int) else 0, schema_json, "container header"
        )
    except CodecError as exc:
        raise DecodeError(f"container avro.schema is invalid: {exc}") from exc
    try:
        return registry.by_fingerprint(probe.fingerprint)
    except UnknownSchemaError:
        if isinstance(declared, int) and declared > max(registry.versions()):
            return probe  # a version this reader does not ship; fastavro resolves it
        if isinstance(declared, int) and declared in registry.versions():
            raise DecodeError(
                f"container header names schema v{declared} but its schema differs from it: "
                "the header is damaged"
            ) from None
        raise


class ContainerReader(Iterator[EventBatch]):
    """Iterates the batches of an Avro container file (see the module doc).

    After iteration: ``blocks_read``, ``batches_read``, ``skipped`` (events this reader could
    not represent), ``valid_end`` (byte offset just past the last complete block),
    ``ignored_bytes`` and ``torn_reason`` (both only set in ``tolerate_torn_tail`` mode when
    the file ends in a truncated/corrupt block). Without that mode any problem raises
    DecodeError naming the byte offset.
    """

    def __init__(
        self,
        source: Target,
        *,
        tolerate_torn_tail: bool = False,
        registry: SchemaRegistry | None = None,
        max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    ) -> None:
        self._registry = registry if registry is not None else schema_registry()
        self._reader_schema = self._registry.current
        self._tolerant = tolerate_torn_tail
        self._max_block = max_block_bytes
        fo, self._owned = _open(source, "rb")
        self._fo = fo
        try:
            start = fo.tell() if fo.seekable() else 0
        except OSError:
            start = 0
        self._start = start
        self._in = _Input(fo, start)
        self.blocks_read = 0
        self.batches_read = 0
        self.skipped: list[SkippedEvent] = []
        self.ignored_bytes = 0
        self.torn_reason: str | None = None
        self.metadata: dict[str, bytes] = {}
        self.writer_schema: SchemaInfo | None = None
        self._pending: list[EventBatch] = []
        self._done = False
        self.valid_end = start
        try:
            self.metadata, self._sync = _read_header(self._in)
            self.codec = _codec_of(self.metadata)
            if self.codec not in CODECS:
                raise DecodeError(
                    f"unsupported container codec {self.codec!r}; supported: {CODECS}"
                )
            self.writer_schema = _writer_schema(self.metadata, self._registry)
        except _Truncated as exc:
            if not tolerate_torn_tail:
                self.close()
                raise DecodeError(f"container header is truncated: {exc}") from exc
            self._sync = b""
            self.codec = "null"
            self._stop(self._start, f"header truncated: {exc}")
        except BaseException:
            self.close()
            raise
        if not self._done:
            self.valid_end = self._in.pos

    @property
    def writer_version(self) -> int | None:
        """Schema version of the file (None when its header was torn)."""
        return None if self.writer_schema is None else self.writer_schema.version

    def _stop(self, good_end: int, reason: str) -> None:
        self._done = True
        self.torn_reason = reason
        self.valid_end = good_end
        end = self._in.pos
        try:
            if self._fo.seekable():
                end = self._fo.seek(0, io.SEEK_END)
            else:
                while chunk := self._fo.read(1 << 20):
                    end += len(chunk)
        except OSError:
            pass
        self.ignored_bytes = max(0, end - good_end)
        self.close()

    def _record_reader(self) -> Any:
        """The parsed schema fastavro resolves this file's records into (None: the writer's)."""
        return None if self.writer_schema is self._reader_schema else self._reader_schema.parsed

    def _read_record(self, fo: io.BytesIO, i: int, reader: Any) -> dict[str, Any]:
        """Record ``i`` of a block, read from ``fo`` with the writer schema (resolved into
        ``reader``). Raises DecodeError naming the record."""
        writer = self.writer_schema
        assert writer is not None
        try:
            record = fastavro.schemaless_reader(fo, writer.parsed, reader)
        except Exception as exc:  # fastavro raises many unrelated types on bad input
            raise DecodeError(
                f"record {i} of the block is not a valid schema v{writer.version} record "
                f"({type(exc).__name__}: {exc or 'unexpected end of data'})"
            ) from exc
        if not isinstance(record, dict):  # pragma: no cover - a record schema
            raise DecodeError(f"record {i} of the block is not a record")
        return record

    @staticmethod
    def _check_consumed(end: int, payload: bytes, count: int) -> None:
        if end != len(payload):
            raise DecodeError(f"{len(payload) - end} bytes left over after {count} records")

    def _decode_records(self, payload: bytes, count: int) -> list[EventBatch]:
        assert self.writer_schema is not None
        version = self.writer_schema.version
        reader = self._record_reader()
        fo = io.BytesIO(payload)
        out = []
        for i in range(count):
            batch, skipped = record_to_batch(self._read_record(fo, i, reader), version)
            self.skipped.extend(skipped)
            out.append(batch)
        self._check_consumed(fo.tell(), payload, count)
        return out

    def _read_block(self) -> list[EventBatch] | None:
        inp = self._in
        first = self._fo.read(1)
        if not first:
            return None
        inp.pos += 1
        count = inp.read_long("the block's object count", first)
        size = inp.read_long("the block's byte size")
        if count < 0 or size < 0 or size > self._max_block:
            raise DecodeError(f"block claims {count} objects in {size} bytes")
        data = inp.read_exact(size, "the block data")
        if inp.read_exact(SYNC_SIZE, "the block's sync marker") != self._sync:
            raise DecodeError("block sync marker does not match the header's")
        return self._decode_records(_decompress(self.codec, data, self._max_block), count)

    def __next__(self) -> EventBatch:
        while not self._pending:
            if self._done:
                raise StopIteration
            start = self._in.pos
            try:
                batches = self._read_block()
            except DecodeError as exc:
                if not self._tolerant:
                    self.close()
                    raise DecodeError(f"container block at byte {start}: {exc}") from exc
                self._stop(start, f"block at byte {start}: {exc}")
                raise StopIteration from None
            if batches is None:
                self._done = True
                self.valid_end = self._in.pos
                self.close()
                raise StopIteration
            self.blocks_read += 1
            self.valid_end = self._in.pos
            self._pending = batches[::-1]
        self.batches_read += 1
        return self._pending.pop()

    def __iter__(self) -> ContainerReader:
        return self

    def close(self) -> None:
        """Close the file if this reader opened it."""
        if self._owned:
            self._fo.close()

    def __enter__(self) -> ContainerReader:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_container(
    source: Target,
    *,
    tolerate_torn_tail: bool = False,
    registry: SchemaRegistry | None = None,
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
) -> ContainerReader:
    """Iterate the batches of a container file (a path or a binary file object).

    Any schema version with a known fingerprint (or a later version whose header names its
    ``kvstream.schema_version``) is resolved into the current model. Raises DecodeError, or
    with ``tolerate_torn_tail=True`` stops at a truncated/corrupt tail (see ContainerReader);
    OSError when a path cannot be opened.
    """
    return ContainerReader(
        source,
        tolerate_torn_tail=tolerate_torn_tail,
        registry=registry,
        max_block_bytes=max_block_bytes,
    )


# ------------------------------------------------------------------------------------ writing


def _scan_frames(inp: _Input, sync: bytes) -> tuple[int, str | None]:
    """Walk the block frames (without decoding records): (end of last good block, problem)."""
    good = inp.pos
    while True:
        first = inp.fo.read(1)
        if not first:
            return good, None
        inp.pos += 1
        try:
            inp.read_long("the block's object count", first)
            size = inp.read_long("the block's byte size")
            if size < 0:
                raise DecodeError(f"negative block size {size}")
            inp.read_exact(size, "the block data")
            if inp.read_exact(SYNC_SIZE, "the block's sync marker") != sync:
                raise DecodeError("block sync marker does not match the header's")
        except DecodeError as exc:
            return good, f"block at byte {good}: {exc}"
        good = inp.pos


class ContainerEncoder:
    """The bytes of one container file, for writers that do their own I/O: :attr:`header`
    once, then one :meth:`block` per block (each ready for a single ``write``).

    :meth:`new` starts a file (schema version, codec, a random sync marker). Raises
    EncodeError for an unknown codec or a batch the schema version cannot hold.
    """

    def __init__(
        self,
        schema: SchemaInfo,
        codec: str,
        sync: bytes,
        *,
        lossy: bool = False,
        compression_level: int | None = None,
    ) -> None:
        if codec not in CODECS:
            raise EncodeError(f"unsupported container codec {codec!r}; supported: {CODECS}")
        if len(sync) != SYNC_SIZE:
            raise EncodeError(f"a sync marker is {SYNC_SIZE} bytes, got {len(sync)}")
        self.schema = schema
        self.codec = codec
        self.sync = sync
        self.lossy = lossy
        self.level = compression_level

    @classmethod
    def new(
        cls,
        *,
        schema_version: int | None = None,
        codec: str | None = None,
        lossy: bool = False,
        compression_level: int | None = None,
        registry: SchemaRegistry | None = None,
    ) -> ContainerEncoder:
        """An encoder for a new file (defaults: the current version, :data:`DEFAULT_CODEC`)."""
        reg = registry if registry is not None else schema_registry()
        schema = reg.get(CURRENT_VERSION if schema_version is None else schema_version)
        return cls(
            schema,
            DEFAULT_CODEC if codec is None else codec,
            os.urandom(SYNC_SIZE),
            lossy=lossy,
            compression_level=compression_level,
        )

    @property
    def header(self) -> bytes:
        """Magic, metadata (schema, codec, ``kvstream.schema_version``) and sync marker."""
        meta = {
            "avro.schema": self.schema.schema_text.encode(),
            "avro.codec": self.codec.encode(),
            VERSION_PROPERTY: str(self.schema.version).encode(),
        }
        parts = [MAGIC, encode_long(len(meta))]
        for key, value in meta.items():
            parts.append(encode_string(key))
            parts.append(encode_bytes(value))
        parts.append(encode_long(0))
        parts.append(self.sync)
        return b"".join(parts)

    def body(self, batch: EventBatch | ColumnBatch) -> bytes:
        """One batch's record (schemaless Avro binary); columns encode as their model would."""
        if type(batch) is ColumnBatch:
            return encode_columns_body(batch, self.schema.version, lossy=self.lossy)
        return encode_batch_body(batch, self.schema.version, lossy=self.lossy)  # type: ignore[arg-type]

    def frame(self, bodies: list[bytes]) -> bytes:
        """A block holding ``bodies`` (records from :meth:`body`); empty for none."""
        if not bodies:
            return b""
        data = _compress(self.codec, b"".join(bodies), self.level)
        return encode_long(len(bodies)) + encode_long(len(data)) + data + self.sync

    def block(self, batches: Iterable[EventBatch | ColumnBatch]) -> bytes:
        """A block holding ``batches``, one record each."""
        return self.frame([self.body(b) for b in batches])


class ContainerWriter:
    """Writes batches to an Avro container file, one record per batch, appending if it exists.

    ``target`` is a path (opened for appending; a new or empty file gets a header) or a
    binary file object (appended to when it is readable, seekable and not empty, else a
    header is written at its position). A new file is written with ``schema_version``
    (default: the current one) and ``codec`` (default :data:`DEFAULT_CODEC`, checksummed).
    When appending, the file's schema version and codec are used; passing a different
    ``schema_version``/``codec`` raises EncodeError. A file ending in a torn block raises
    DecodeError unless ``truncate_torn_tail=True``, which cuts it back
    to the last complete block first.

    Batches are buffered and written as one block when ``sync_interval`` bytes are pending,
    on :meth:`flush`, and on :meth:`close`. A crash loses at most the unflushed batches.
    """

    def __init__(
        self,
        target: Target,
        *,
        schema_version: int | None = None,
        codec: str | None = None,
        lossy: bool = False,
        sync_interval: int = DEFAULT_SYNC_INTERVAL,
        compression_level: int | None = None,
        truncate_torn_tail: bool = False,
        append: bool = True,
        registry: SchemaRegistry | None = None,
    ) -> None:
        self._registry = registry if registry is not None else schema_registry()
        fo, self._owned = _open(target, "a+b" if append else "wb")
        self._fo = fo
        self._lossy = lossy
        self._sync_interval = sync_interval
        self._level = compression_level
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._closed = False
        try:
            if append and self._existing_size():
                self._open_existing(schema_version, codec, truncate_torn_tail)
            else:
                self._start_new(schema_version, codec)
        except BaseException:
            if self._owned:
                fo.close()
            raise

    def _existing_size(self) -> int:
        fo = self._fo
        try:
            if not (fo.readable() and fo.seekable()):
                return 0
            here = fo.tell()
            end = fo.seek(0, io.SEEK_END)
            fo.seek(here)
            return end
        except (OSError, ValueError):
            return 0

    def _start_new(self, schema_version: int | None, codec: str | None) -> None:
        self._enc = ContainerEncoder.new(
            schema_version=schema_version,
            codec=codec,
            lossy=self._lossy,
            compression_level=self._level,
            registry=self._registry,
        )
        self._fo.write(self._enc.header)
        self._fo.flush()

    def _open_existing(
        self, schema_version: int | None, codec: str | None, truncate_torn_tail: bool
    ) -> None:
        fo = self._fo
        fo.seek(0)
        inp = _Input(fo, 0)
        try:
            meta, sync = _read_header(inp)
        except _Truncated as exc:
            raise DecodeError(f"cannot append: the existing header is truncated: {exc}") from exc
        schema = _writer_schema(meta, self._registry)
        file_codec = _codec_of(meta)
        if schema_version is not None and schema_version != schema.version:
            raise EncodeError(
                f"cannot append schema v{schema_version} batches to a v{schema.version} file"
            )
        if codec is not None and codec != file_codec:
            raise EncodeError(f"cannot append with codec {codec!r} to a {file_codec!r} file")
        self._enc = ContainerEncoder(
            schema, file_codec, sync, lossy=self._lossy, compression_level=self._level
        )
        good_end, problem = _scan_frames(inp, sync)
        if problem is not None:
            if not truncate_torn_tail:
                raise DecodeError(f"cannot append: the file ends in a torn block ({problem})")
            fo.truncate(good_end)
        fo.seek(0, io.SEEK_END)

    @property
    def schema_version(self) -> int:
        """The schema version of the file."""
        return self._enc.schema.version

    @property
    def codec(self) -> str:
        """The file's compression codec."""
        return self._enc.codec

    def write(self, batch: EventBatch | ColumnBatch) -> None:
        """Buffer one batch; writes a block once ``sync_interval`` bytes are pending."""
        if self._closed:
            raise EncodeError("container writer is closed")
        body = self._enc.body(batch)
        self._pending.append(body)
        self._pending_bytes += len(body)
        if self._pending_bytes >= self._sync_interval:
            self._write_block()

    def write_many(self, batches: Iterable[EventBatch | ColumnBatch]) -> int:
        """Write every batch; returns how many."""
        n = 0
        for batch in batches:
            self.write(batch)
            n += 1
        return n

    def _write_block(self) -> None:
        if not self._pending:
            return
        frame = self._enc.frame(self._pending)
        self._pending = []
        self._pending_bytes = 0
        self._fo.write(frame)

    def flush(self, *, fsync: bool = False) -> None:
        """Write pending batches as a block and flush the file (``fsync`` to disk too)."""
        self._write_block()
        self._fo.flush()
        if fsync:
            os.fsync(self._fo.fileno())

    def close(self) -> None:
        """Flush and, if this writer opened the file, close it. Idempotent."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            if self._owned:
                self._fo.close()

    def __enter__(self) -> ContainerWriter:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def write_container(
    target: Target,
    batches: Iterable[EventBatch],
    *,
    schema_version: int = CURRENT_VERSION,
    codec: str = DEFAULT_CODEC,
    lossy: bool = False,
    sync_interval: int = DEFAULT_SYNC_INTERVAL,
) -> int:
    """Write ``batches`` as a new container file (a path is created or truncated, a file
    object gets a header at its position).

    Returns the number of batches written. Raises EncodeError.
    """
    writer = ContainerWriter(
        target,
        schema_version=schema_version,
        codec=codec,
        lossy=lossy,
        sync_interval=sync_interval,
        append=False,
    )
    try:
        return writer.write_many(batches)
    finally:
        writer.close()
