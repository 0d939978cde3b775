"""The ``kvstream`` command line: help, hashing, schema checks, event conversion."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from typer.testing import CliRunner

from kvstream.cli.main import app

DATA = Path(__file__).parent / "data"
SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"
runner = CliRunner()


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for cmd in ("hash", "schema", "events", "version"):
        assert cmd in result.output


def test_version() -> None:
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0
    assert "schema v3" in result.output


def test_hash_matches_reference_vector() -> None:
    result = runner.invoke(
        app, ["hash", "--algo", "v1_block_key", "-b", "4", "--json", *map(str, range(1, 13))]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [b["int"] for b in doc["blocks"]] == [
        924206229973855,
        2728178455351807326,
        10011707017105896989,
    ]


def test_hash_unknown_algorithm_lists_known() -> None:
    result = runner.invoke(app, ["hash", "--algo", "md5", "1", "2"])
    assert result.exit_code == 2
    assert "v2_sha256" in result.output


def test_schema_check_passes_on_shipped_schemas() -> None:
    result = runner.invoke(app, ["schema", "check"])
    assert result.exit_code == 0, result.output
    assert "compatible" in result.output


def test_schema_check_reports_a_breaking_version(tmp_path: Path) -> None:
    for f in SCHEMAS.glob("*.avsc"):
        shutil.copy(f, tmp_path / f.name)
    v3 = json.loads((tmp_path / "kv_event_batch.v3.avsc").read_text())
    # Release a v4 that adds a field without a default: v4 cannot read v1..v3 data.
    v3["fields"].append({"name": "must_have", "type": "long"})
    v3["kvstream.schema_version"] = 4
    (tmp_path / "kv_event_batch.v4.avsc").write_text(json.dumps(v3))
    result = runner.invoke(app, ["schema", "check", str(tmp_path)])
    assert result.exit_code == 1
    assert "must_have" in result.output


def test_schema_show() -> None:
    listed = runner.invoke(app, ["schema", "show", "--list"])
    assert listed.exit_code == 0
    assert "v1" in listed.output
    assert "(current)" in listed.output
    shown = runner.invoke(app, ["schema", "show", "-v", "1"])
    assert shown.exit_code == 0
    assert json.loads(shown.output)["name"] == "EventBatch"
    missing = runner.invoke(app, ["schema", "show", "-v", "99"])
    assert missing.exit_code == 2


def test_trtllm_json_to_avro_and_back(tmp_path: Path) -> None:
    out = tmp_path / "events.avro"
    src = tmp_path / "events.json"
    fixture = json.loads((DATA / "trtllm_reference_examples.json").read_text())
    src.write_text(json.dumps(fixture["events"]))
    result = runner.invoke(
        app,
        ["events", "from-trtllm", str(src), "-o", str(out), "--tokens-per-block", "4"],
    )
    assert result.exit_code == 0, result.output
    dumped = runner.invoke(app, ["events", "dump", str(out)])
    assert dumped.exit_code == 0, dumped.output
    lines = [json.loads(line) for line in dumped.output.splitlines()]
    assert lines
    assert all("event_id" in line and "data" in line for line in lines)
    trt = runner.invoke(app, ["events", "dump", "--trtllm", str(out)])
    assert trt.exit_code == 0
    assert '"stored_block"' in trt.output


def test_from_trtllm_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('[{"event_id": 0, "data": {"type": "stored"}, "window_size": 4}]')
    result = runner.invoke(app, ["events", "from-trtllm", str(bad), "-o", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "event[0]" in result.output


def test_dump_missing_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["events", "dump", str(tmp_path / "nope.avro")])
    assert result.exit_code == 2
    assert "no such file" in result.output
