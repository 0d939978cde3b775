"""Avro encoding of event batches: versioned schemas, framings, container files, compatibility.

The only kvstream package that touches fastavro, Apache avro (lazily, in :mod:`.compat`) and
the ``schemas/`` files. Main entry points::

    codec = AvroCodec()                      # writes the current schema version
    data = codec.encode(batch)               # Avro single-object encoding
    batch = codec.decode(data)               # any known version, resolved into the model
    codec.encode_confluent(batch, schema_id) / codec.decode_confluent(data, {id: version})
    write_container(path, batches); read_container(path, tolerate_torn_tail=True)
    check_compatibility().ok                 # every version reads every other one

Schema layout (``schemas/kv_event_batch.v<N>.avsc``, record ``io.kvstream.EventBatch``): one
record per batch; the token ids of all its stored events in one packed ``TokenPack`` (a low
16-bit plane plus high bit planes: 17 bits per id for a 128k vocabulary; from v4, per batch,
varints or delta varints, optionally zstd-compressed: see :mod:`.tokens`); events carry an enum
``kind`` with default ``UNKNOWN`` (so older readers skip kinds added later) and one nullable
payload record per kind; stored payloads are columnar: hashes concatenated in one ``bytes``,
block sizes and per-block attributes stored once when uniform, per-block arrays only when they
differ, multimodal keys, extra token ids and the engines' extra keys (v3) as sparse arrays.
Encoding writes Avro binary directly (byte-identical to fastavro, several times faster);
decoding uses fastavro's schema resolution, then validates every length and count and the
event model.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstream.codec.codec import AvroCodec, SchemaIdResolver
    from kvstream.codec.compat import CompatIssue, CompatReport, check_compatibility
    from kvstream.codec.container import (
        ContainerReader,
        ContainerWriter,
        read_container,
        write_container,
    )
    from kvstream.codec.decoder import DecodeResult
    from kvstream.codec.records import SkippedEvent
    from kvstream.codec.schemas import (
        CURRENT_VERSION,
        SchemaInfo,
        SchemaRegistry,
        load_schema_dir,
        schema_registry,
    )

#: Public name -> the submodule defining it. The submodules load on first use: importing
#: ``kvstream.codec._columns_native`` (a C loop the index uses on every ingest) must not
#: bring fastavro and numpy into a process that never reads or writes Avro.
_LAZY: dict[str, str] = {
    "AvroCodec": "codec",
    "SchemaIdResolver": "codec",
    "CompatIssue": "compat",
    "CompatReport": "compat",
    "check_compatibility": "compat",
    "ContainerReader": "container",
    "ContainerWriter": "container",
    "read_container": "container",
    "write_container": "container",
    "DecodeResult": "decoder",
    "SkippedEvent": "records",
    "CURRENT_VERSION": "schemas",
    "SchemaInfo": "schemas",
    "SchemaRegistry": "schemas",
    "load_schema_dir": "schemas",
    "schema_registry": "schemas",
}


def __getattr__(name: str) -> Any:
    sub = _LAZY.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{sub}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CURRENT_VERSION",
    "AvroCodec",
    "CompatIssue",
    "CompatReport",
    "ContainerReader",
    "ContainerWriter",
    "DecodeResult",
    "SchemaIdResolver",
    "SchemaInfo",
    "SchemaRegistry",
    "SkippedEvent",
    "check_compatibility",
    "load_schema_dir",
    "read_container",
    "schema_registry",
    "write_container",
]
