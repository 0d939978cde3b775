"""Schema registry and the FULL_TRANSITIVE compatibility matrix."""

from __future__ import annotations

import io
import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import fastavro
import pytest

from kvstream.codec import AvroCodec, check_compatibility, load_schema_dir, schema_registry
from kvstream.codec.compat import ambiguous_unions, static_issues
from kvstream.codec.records import batch_to_record
from kvstream.codec.samples import sample_batches
from kvstream.codec.schemas import CURRENT_VERSION, RELEASED, schema_dir
from kvstream.codec.tokens import TOKEN_ENCODINGS
from kvstream.errors import SchemaCompatibilityError
from kvstream.events.model import (
    CURRENT_SCHEMA_VERSION,
    Cleared,
    EventBatch,
    KVCacheEvent,
    Lost,
    Removed,
    SourceId,
)

REGISTRY = schema_registry()
VERSIONS = REGISTRY.versions()
PAIRS = list(itertools.product(VERSIONS, VERSIONS))


def _roundtrip(record: dict[str, Any], writer: int, reader: int) -> dict[str, Any]:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, REGISTRY.get(writer).parsed, record)
    out = fastavro.schemaless_reader(
        io.BytesIO(buf.getvalue()), REGISTRY.get(writer).parsed, REGISTRY.get(reader).parsed
    )
    assert isinstance(out, dict)
    return out


# ------------------------------------------------------------------------------ registry


def test_registry_lists_every_shipped_version() -> None:
    assert VERSIONS == (1, 2, 3, 4)
    assert REGISTRY.current.version == 4  # readers resolve into the newest version
    assert CURRENT_VERSION == CURRENT_SCHEMA_VERSION in VERSIONS  # the default writer
    files = sorted(p.name for p in schema_dir().glob("*.avsc"))
    assert files == [f"kv_event_batch.v{v}.avsc" for v in VERSIONS]


def test_every_version_is_pinned_and_unchanged() -> None:
    for info in REGISTRY:
        assert RELEASED[info.version].fingerprint == info.fingerprint_hex
        assert RELEASED[info.version].resolution_digest == info.resolution_digest
        assert info.schema_json["kvstream.schema_version"] == info.version
        assert REGISTRY.by_fingerprint(info.fingerprint) is info


def test_names_are_stable_across_versions() -> None:
    for info in REGISTRY:
        assert info.schema_json["name"] == "EventBatch"
        assert info.schema_json["namespace"] == "io.kvstream"


def test_mismatched_version_property_is_rejected(tmp_path: Path) -> None:
    data = json.loads((schema_dir() / "kv_event_batch.v1.avsc").read_text())
    (tmp_path / "kv_event_batch.v3.avsc").write_text(json.dumps(data))
    with pytest.raises(SchemaCompatibilityError, match="version 3"):
        load_schema_dir(tmp_path)


def test_empty_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SchemaCompatibilityError, match="no kv_event_batch"):
        load_schema_dir(tmp_path)


# ------------------------------------------------------------------ static compatibility


@pytest.mark.parametrize(("writer", "reader"), PAIRS)
def test_apache_avro_checker_both_directions(writer: int, reader: int) -> None:
    avro_schema = pytest.importorskip("avro.schema")
    from avro.compatibility import ReaderWriterCompatibilityChecker, SchemaCompatibilityType

    w = avro_schema.parse(REGISTRY.get(writer).schema_text)
    r = avro_schema.parse(REGISTRY.get(reader).schema_text)
    result = ReaderWriterCompatibilityChecker().get_compatibility(r, w)
    assert result.compatibility is SchemaCompatibilityType.compatible, result.messages


@pytest.mark.parametrize(("writer", "reader"), PAIRS)
def test_own_static_checker(writer: int, reader: int) -> None:
    assert static_issues(REGISTRY.get(writer).schema_json, REGISTRY.get(reader).schema_json) == []


def test_check_compatibility_of_the_shipped_schemas() -> None:
    report = check_compatibility()
    assert report.ok, report.render()
    assert report.pairs == tuple(PAIRS)
    assert "avro" in report.checks
    assert "RESULT: compatible" in report.render()


# ---------------------------------------------------------------- fastavro runtime matrix


@pytest.mark.parametrize(("writer", "reader"), PAIRS)
def test_fastavro_round_trip_every_pair(writer: int, reader: int) -> None:
    encodings = TOKEN_ENCODINGS if writer >= 4 else ("auto",)
    for batch in sample_batches():
        for encoding in encodings:
            record = batch_to_record(batch, writer, lossy=True, token_encoding=encoding)
            out = _roundtrip(record, writer, reader)
            assert len(out["events"]) == len(record["events"])


def test_v1_reader_of_v2_data() -> None:
    rich = sample_batches()[1]
    out = _roundtrip(batch_to_record(rich, 2, lossy=True), 2, 1)
    kinds = [e["kind"] for e in out["events"]]
    assert kinds == ["CREATED", "STORED", "REMOVED", "UPDATED", "UNKNOWN", "UNKNOWN"]
    assert all("hash_algo" not in e and "layer_group_id" not in e for e in out["events"])
    assert "incarnation" not in out["source"]
    assert "mm_keys" not in out["events"][1]["stored"]


def test_v2_reader_of_v1_data_gets_defaults() -> None:
    plain = sample_batches()[0]
    out = _roundtrip(batch_to_record(plain, 1), 1, 2)
    assert {e["hash_algo"] for e in out["events"]} == {"v1_block_key"}
    assert {e["layer_group_id"] for e in out["events"]} == {0}
    assert all(e["lost"] is None for e in out["events"])
    assert out["source"]["incarnation"] == 0
    created = out["events"][0]["created"]
    assert created["tokens_per_block"] == 0
    assert created["attention_kind"] == "FULL_ATTENTION"
    stored = out["events"][1]["stored"]
    assert stored["mm_keys"] == []
    assert stored["token_extra_ids"] == []
    assert stored["lora_name"] is None
    assert stored["cache_salt"] is None
    assert out["events"][2]["removed"]["cache_level"] is None


def test_old_readers_of_v3_data_ignore_extra_keys() -> None:
    rich = sample_batches()[1]
    record = batch_to_record(rich, 3)
    assert record["events"][1]["stored"]["extra_keys"]
    for reader in (1, 2):
        out = _roundtrip(record, 3, reader)
        assert "extra_keys" not in out["events"][1]["stored"]
        assert (
            out["events"][1]["stored"]["block_hashes"]
            == (record["events"][1]["stored"]["block_hashes"])
        )
    v2 = _roundtrip(record, 3, 2)
    assert v2["events"][1]["stored"]["mm_keys"] == record["events"][1]["stored"]["mm_keys"]


def test_v3_reader_of_older_data_gets_no_extra_keys() -> None:
    for writer, batch in ((1, sample_batches()[0]), (2, sample_batches()[1])):
        out = _roundtrip(batch_to_record(batch, writer, lossy=True), writer, 3)
        stored = next(e["stored"] for e in out["events"] if e["stored"])
        assert stored["extra_keys"] == []


def test_v1_reader_codec_skips_unknown_kinds() -> None:
    """An old (v1) consumer decodes v2 data: cleared/lost are UNKNOWN and skipped, counted."""
    batch = EventBatch(
        source=SourceId(instance_id="w", incarnation=3),
        ts_ns=5,
        events=(
            KVCacheEvent(event_id=0, window_size=4, data=Cleared()),
            KVCacheEvent(event_id=1, window_size=4, data=Removed(block_hashes=(b"h" * 8,))),
            KVCacheEvent(event_id=2, window_size=4, data=Lost(first_event_id=0, count=1)),
        ),
    )
    old_consumer = AvroCodec(reader_version=1)
    result = old_consumer.decode_result(AvroCodec().encode(batch))
    assert [ev.event_id for ev in result.batch.events] == [1]
    assert result.batch.source.incarnation == 0  # the v1 reader has no such field
    assert [(s.event_id, s.kind) for s in result.skipped] == [(0, "UNKNOWN"), (2, "UNKNOWN")]


def test_v2_reader_skips_created_events_of_v1_data() -> None:
    result = AvroCodec().decode_result(AvroCodec(1).encode(sample_batches()[0]))
    assert result.writer_version == 1
    assert [s.event_id for s in result.skipped] == [0]
    assert "tokens_per_block" in result.skipped[0].reason


def test_future_kind_is_skipped_by_todays_reader(tmp_path: Path) -> None:
    """A v5 that appends an event kind stays readable: today's reader skips the new kind."""
    current = json.loads((schema_dir() / "kv_event_batch.v4.avsc").read_text())
    v5 = json.loads(json.dumps(current))
    v5["kvstream.schema_version"] = 5
    event = v5["fields"][3]["type"]["items"]
    kind = next(f for f in event["fields"] if f["name"] == "kind")
    kind["type"]["symbols"].append("PINNED")
    for p in schema_dir().glob("*.avsc"):
        shutil.copy(p, tmp_path)
    (tmp_path / "kv_event_batch.v5.avsc").write_text(json.dumps(v5))
    report = check_compatibility(tmp_path)
    assert report.ok, report.render()
    assert any("v5 is not released" in n for n in report.notes)
    registry = load_schema_dir(tmp_path)
    record = batch_to_record(sample_batches()[0], 4)
    record["events"][2]["kind"] = "PINNED"
    record["events"][2]["removed"] = None
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, registry.get(5).parsed, record)
    today = AvroCodec(reader_version=4, registry=registry)
    result = today.decode_body_result(buf.getvalue(), 5)
    assert [(s.event_id, s.kind) for s in result.skipped] == [(2, "UNKNOWN")]
    assert len(result.batch.events) == 3


def test_old_readers_of_v4_packed_tokens_skip_stored_events() -> None:
    """A v3 (or older) consumer of v4 data whose ids are packed sees every event but the
    stored ones, which it skips as an unknown kind and reports; its TokenPack is empty."""
    rich = sample_batches()[1]
    data = AvroCodec(4, token_encoding="varint+zstd").encode(rich)
    stored_ids = [ev.event_id for ev in rich.events if ev.data.type == "stored"]
    for reader in (1, 2, 3):
        record = _roundtrip(batch_to_record(rich, 4, token_encoding="varint+zstd"), 4, reader)
        assert record["tokens"] == {"count": 0, "high_bits": 0, "low16": b"", "high_planes": b""}
        assert {e["kind"] for e in record["events"] if e["event_id"] in stored_ids} == {"UNKNOWN"}
    result = AvroCodec(reader_version=3).decode_result(data)
    assert [(s.event_id, s.kind) for s in result.skipped] == [(i, "UNKNOWN") for i in stored_ids]
    kept = [ev for ev in rich.events if ev.data.type != "stored"]
    assert result.batch.events == tuple(kept)


def test_old_readers_of_v4_bit_planes_see_everything() -> None:
    """``token_encoding="planes"`` keeps v4 data fully readable by v3 consumers."""
    rich = sample_batches()[1]
    data = AvroCodec(4, token_encoding="planes").encode(rich)
    result = AvroCodec(reader_version=3).decode_result(data)
    assert result.skipped == ()
    assert result.batch == rich.model_copy(update={"schema_version": 4})


def test_v4_reader_of_older_data_sees_bit_planes() -> None:
    for writer in (1, 2, 3):
        out = _roundtrip(batch_to_record(sample_batches()[0], writer, lossy=True), writer, 4)
        tok = out["tokens"]
        assert (tok["packed_encoding"], tok["packed_compression"]) == ("NONE", "NONE")
        # fastavro fills a bytes default as str: "" here
        assert tok["packed_count"] == 0
        assert tok["packed"] in (b"", "")
        assert "STORED" in {e["kind"] for e in out["events"]}


# ------------------------------------------------------------------ broken schema dirs


def _broken_copy(tmp_path: Path, edit: Any, version: int = 2) -> Path:
    for p in schema_dir().glob("*.avsc"):
        shutil.copy(p, tmp_path)
    path = tmp_path / f"kv_event_batch.v{version}.avsc"
    schema = json.loads(path.read_text())
    edit(schema)
    path.write_text(json.dumps(schema, indent=2))
    return tmp_path


def _event_fields(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return schema["fields"][3]["type"]["items"]["fields"]  # type: ignore[no-any-return]


def _stored_fields(schema: dict[str, Any]) -> list[dict[str, Any]]:
    stored = next(f for f in _event_fields(schema) if f["name"] == "stored")
    return stored["type"][1]["fields"]  # type: ignore[no-any-return]


def test_removed_default_is_reported_with_field_and_rule(tmp_path: Path) -> None:
    def edit(schema: dict[str, Any]) -> None:
        field = next(f for f in _event_fields(schema) if f["name"] == "hash_algo")
        del field["default"]

    report = check_compatibility(_broken_copy(tmp_path, edit))
    assert not report.ok
    static = [i for i in report.issues if i.check == "static"]
    assert [(i.writer, i.reader, i.path, i.rule) for i in static] == [
        (1, 2, "EventBatch.events[].hash_algo", "reader field has no default")
    ]
    avro_issues = [i for i in report.issues if i.check == "avro"]
    assert any(
        i.path == "EventBatch.events[].hash_algo" and "missing_default" in i.rule
        for i in avro_issues
    )
    runtime = [i for i in report.issues if i.check == "fastavro"]
    assert any((i.writer, i.reader) == (1, 2) and "hash_algo" in i.detail for i in runtime)
    # A default is not part of the canonical form; the resolution digest still catches it.
    pinned = [i.rule for i in report.issues if i.check == "pinned"]
    assert pinned == ["released schema edited: defaults, aliases or properties changed"]
    assert "INCOMPATIBLE" in report.render()
    assert "EventBatch.events[].hash_algo: reader field has no default" in report.render()


def test_added_union_branch_is_reported(tmp_path: Path) -> None:
    def edit(schema: dict[str, Any]) -> None:
        field = next(f for f in _stored_fields(schema) if f["name"] == "lora_id")
        field["type"] = ["null", "long", "string"]

    report = check_compatibility(_broken_copy(tmp_path, edit))
    assert not report.ok
    static = [i for i in report.issues if i.check == "static"]
    assert [(i.writer, i.reader, i.path, i.rule) for i in static] == [
        (
            2,
            reader,
            "EventBatch.events[].stored.lora_id",
            "writer union branch missing from reader union",
        )
        for reader in (1, 3, 4)
    ]
    assert any(i.check == "avro" and (i.writer, i.reader) == (2, 1) for i in report.issues)
    # Data-dependent: the runtime round trips only fail if a string is ever written there.
    pinned = {i.rule for i in report.issues if i.check == "pinned"}
    assert "released schema edited: its Parsing Canonical Form changed" in pinned


def test_enum_symbol_without_default_is_reported(tmp_path: Path) -> None:
    def edit(schema: dict[str, Any]) -> None:
        kind = next(f for f in _event_fields(schema) if f["name"] == "kind")
        del kind["type"]["default"]

    report = check_compatibility(_broken_copy(tmp_path, edit, version=1))
    static = [i for i in report.issues if i.check == "static"]
    assert [(i.writer, i.reader, i.path, i.rule) for i in static] == [
        (writer, 1, "EventBatch.events[].kind", "enum symbol missing without default")
        for writer in (2, 3, 4)
    ]
    runtime = [i for i in report.issues if i.check == "fastavro" and (i.writer, i.reader) == (2, 1)]
    assert runtime, report.render()


def test_type_change_is_reported(tmp_path: Path) -> None:
    def edit(schema: dict[str, Any]) -> None:
        field = next(f for f in _event_fields(schema) if f["name"] == "window_size")
        field["type"] = "string"

    report = check_compatibility(_broken_copy(tmp_path, edit))
    rules = {(i.path, i.rule) for i in report.issues if i.check == "static"}
    assert ("EventBatch.events[].window_size", "type mismatch") in rules


def test_unloadable_dir_is_reported(tmp_path: Path) -> None:
    (tmp_path / "kv_event_batch.v1.avsc").write_text("{not json")
    report = check_compatibility(tmp_path)
    assert not report.ok
    assert report.issues[0].check == "load"


def test_missing_released_version_is_reported(tmp_path: Path) -> None:
    shutil.copy(schema_dir() / "kv_event_batch.v2.avsc", tmp_path)
    report = check_compatibility(tmp_path)
    assert [(i.writer, i.rule) for i in report.issues] == [
        (1, "released version missing from the directory"),
        (3, "released version missing from the directory"),
        (4, "released version missing from the directory"),
    ]


def test_union_of_string_and_bytes_is_reported(tmp_path: Path) -> None:
    """A reader may resolve a writer's bytes branch to its string branch (fastavro takes the
    first match, promotions included), so such a union is flagged in any version."""
    v5 = json.loads((schema_dir() / "kv_event_batch.v4.avsc").read_text())
    v5["kvstream.schema_version"] = 5
    _stored_fields(v5).append(
        {"name": "blob", "type": ["null", "string", "bytes"], "default": None}
    )
    for p in schema_dir().glob("*.avsc"):
        shutil.copy(p, tmp_path)
    (tmp_path / "kv_event_batch.v5.avsc").write_text(json.dumps(v5))
    report = check_compatibility(tmp_path)
    assert [(i.check, i.writer, i.reader, i.path, i.rule) for i in report.issues] == [
        (
            "static",
            5,
            None,
            "EventBatch.events[].stored.blob",
            "union branches a reader may promote into each other",
        )
    ]
    assert "string and bytes" in report.render()
    for info in REGISTRY:
        assert ambiguous_unions(info.schema_json) == []


def test_missing_avro_is_a_note_or_an_issue(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "avro.compatibility", None)
    report = check_compatibility()
    assert report.ok
    assert "avro" not in report.checks
    assert any("Apache avro is not installed" in n for n in report.notes)
    assert not check_compatibility(require_avro=True).ok


def test_codec_never_imports_avro() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from kvstream.codec import AvroCodec, read_container, write_container\n"
        "from kvstream.codec.samples import sample_batches\n"
        "import io\n"
        "codec = AvroCodec()\n"
        "for b in sample_batches():\n"
        "    assert codec.decode(codec.encode(b)) == b\n"
        "buf = io.BytesIO(); write_container(buf, sample_batches()); buf.seek(0)\n"
        "assert len(list(read_container(buf))) == 3\n"
        "assert 'avro' not in sys.modules, 'avro imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
