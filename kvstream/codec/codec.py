"""AvroCodec: EventBatch <-> bytes in Avro single-object, Confluent, or schemaless framing."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvstream.codec.column_encoder import encode_columns_body
from kvstream.codec.decoder import DecodeResult, decode_body
from kvstream.codec.encoder import ENCODED_VERSIONS, check_token_encoding, encode_batch_body
from kvstream.codec.framing import (
    confluent_header,
    single_object_header,
    split_confluent,
    split_single_object,
)
from kvstream.codec.schemas import CURRENT_VERSION, SchemaInfo, SchemaRegistry, schema_registry
from kvstream.errors import EncodeError, UnknownSchemaError
from kvstream.events.columns import ColumnBatch
from kvstream.events.model import EventBatch

__all__ = ["AvroCodec", "SchemaIdResolver"]

#: Maps a Confluent schema registry id to the kvstream schema version it holds.
SchemaIdResolver = Mapping[int, int] | Callable[[int], int]


class AvroCodec:
    """Encode batches with one schema version; decode any known version into the model.

    ``schema_version`` selects the writer schema (default: the current one). Writing an older
    version drops what it merely lacks room for and raises EncodeError for what it would lose
    or misstate unless ``lossy=True``: blocks' ``extra_keys`` in v1/v2 (lossy: written
    without them), ``cleared``/``lost`` events and non-``v1_block_key`` hashes in v1 (lossy:
    those events are left out); see :mod:`kvstream.codec.downgrade`. The batch's own
    ``schema_version`` field is ignored on encode and set to the writer's version on decode.

    ``token_encoding`` picks how v4 carries a batch's token ids (see
    :func:`kvstream.codec.tokens.encode_tokens`): ``auto`` (default) packs them as
    (zstd-compressed) varints when that is smaller, ``planes`` keeps the v3 bit planes, which
    readers older than v4 understand (they skip packed stored events as unknown kinds).

    Decoding resolves the writer's schema into the current one (or ``reader_version``, to
    behave like an older consumer) and builds the model. Every decoding problem raises
    :class:`~kvstream.errors.DecodeError` (or its subclass UnknownSchemaError) with a message
    saying what was wrong. Events this reader cannot represent are skipped; the ``*_result``
    methods report them. Instances are immutable and safe to share between threads.
    """

    def __init__(
        self,
        schema_version: int = CURRENT_VERSION,
        *,
        lossy: bool = False,
        reader_version: int | None = None,
        registry: SchemaRegistry | None = None,
        token_encoding: str = "auto",
    ) -> None:
        self._registry = registry if registry is not None else schema_registry()
        self._writer = self._registry.get(schema_version)
        if schema_version not in ENCODED_VERSIONS:
            raise EncodeError(f"no encoder for schema version {schema_version}")
        self._reader = (
            self._registry.current if reader_version is None else self._registry.get(reader_version)
        )
        check_token_encoding(schema_version, token_encoding)
        self._token_encoding = token_encoding
        self._lossy = lossy
        self._header = single_object_header(self._writer.fingerprint)

    @property
    def schema_version(self) -> int:
        """The version this codec writes."""
        return self._writer.version

    @property
    def schema(self) -> SchemaInfo:
        """The writer schema (canonical form, fingerprint, parsed schema)."""
        return self._writer

    @property
    def token_encoding(self) -> str:
        """How this codec writes token ids (``auto``, ``planes``, ...)."""
        return self._token_encoding

    @property
    def reader_version(self) -> int:
        """The schema version data is resolved into when decoding."""
        return self._reader.version

    @property
    def registry(self) -> SchemaRegistry:
        """The schemas this codec knows."""
        return self._registry

    # ------------------------------------------------------------------------------ bodies

    def encode_body(self, batch: EventBatch) -> bytes:
        """The schemaless Avro body of ``batch`` (no framing). Raises EncodeError."""
        return encode_batch_body(
            batch, self._writer.version, lossy=self._lossy, token_encoding=self._token_encoding
        )

    def decode_body(self, body: bytes, writer_version: int) -> EventBatch:
        """Decode a schemaless body written with schema ``writer_version``."""
        return self.decode_body_result(body, writer_version).batch

    def decode_body_result(self, body: bytes, writer_version: int) -> DecodeResult:
        """Like :meth:`decode_body`, also reporting the writer version and skipped events."""
        return decode_body(bytes(body), self._registry.get(writer_version), self._reader)

    # ------------------------------------------------------------------ single-object encoding

    def encode(self, batch: EventBatch | ColumnBatch) -> bytes:
        """Avro single-object encoding: ``C3 01`` + writer fingerprint (8 bytes LE) + body.

        A :class:`~kvstream.events.columns.ColumnBatch` is encoded from its columns (the same
        bytes as its model's, see :mod:`.column_encoder`)."""
        encode = encode_columns_body if type(batch) is ColumnBatch else encode_batch_body
        return encode(
            batch,  # type: ignore[arg-type]
            self._writer.version,
            lossy=self._lossy,
            prefix=self._header,
            token_encoding=self._token_encoding,
        )

    def decode(self, data: bytes | bytearray | memoryview) -> EventBatch:
        """Decode a single-object message of any known schema version."""
        return self.decode_result(data).batch

    def decode_result(self, data: bytes | bytearray | memoryview) -> DecodeResult:
        """Like :meth:`decode`, also reporting the writer version and skipped events.

        Raises UnknownSchemaError for a fingerprint no known version has.
        """
        fingerprint, body = split_single_object(data)
        return decode_body(body, self._registry.by_fingerprint(fingerprint), self._reader)

    # -------------------------------------------------------------------- Confluent framing

    def encode_confluent(self, batch: EventBatch | ColumnBatch, schema_id: int) -> bytes:
        """Confluent wire format: ``00`` + ``schema_id`` (4 bytes big-endian) + body.

        ``schema_id`` is the id under which this codec's writer schema is registered; columns
        are encoded as in :meth:`encode`.
        """
        encode = encode_columns_body if type(batch) is ColumnBatch else encode_batch_body
        return encode(
            batch,  # type: ignore[arg-type]
            self._writer.version,
            lossy=self._lossy,
            prefix=confluent_header(schema_id),
            token_encoding=self._token_encoding,
        )

    def decode_confluent(
        self, data: bytes | bytearray | memoryview, schema_id_to_version: SchemaIdResolver
    ) -> EventBatch:
        """Decode a Confluent wire-format message; the id is mapped to a kvstream version."""
        return self.decode_confluent_result(data, schema_id_to_version).batch

    def decode_confluent_result(
        self, data: bytes | bytearray | memoryview, schema_id_to_version: SchemaIdResolver
    ) -> DecodeResult:
        """Like :meth:`decode_confluent`, also reporting the writer version and skipped events.

        Raises UnknownSchemaError when the id maps to no known version (a mapping without the
        id, or a callable raising KeyError/LookupError).
        """
        schema_id, body = split_confluent(data)
        try:
            if callable(schema_id_to_version):
                version = schema_id_to_version(schema_id)
            else:
                version = schema_id_to_version[schema_id]
        except LookupError:
            raise UnknownSchemaError(f"unknown Confluent schema id {schema_id}") from None
        return decode_body(body, self._registry.get(version), self._reader)
