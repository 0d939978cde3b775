"""The ``kvstream`` command line: help, hashing, schema checks, event conversion."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstream import EVENT_SCHEMA_VERSION
from kvstream.cli.main import COMMANDS, app, load_command
from kvstream.events.model import CURRENT_SCHEMA_VERSION

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "schemas"
runner = CliRunner()


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for cmd in ("hash", "schema", "events", "version"):
        assert cmd in result.output


def test_version() -> None:
    result = runner.invoke(app, ["version"])
    assert result.exit_code == 0
    assert f"schema v{CURRENT_SCHEMA_VERSION}" in result.output


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


# ------------------------------------------------------------------------------ start-up

HEAVY = (
    "torch",
    "numpy",
    "kvstream.cache",
    "kvstream.codec",
    "kvstream.events",
    "kvstream.index",
    "kvstream.pipeline",
    "kvstream.engines",
    "kvstream.sinks",
    "asyncio",
)


def _loaded_after(argv: list[str]) -> list[str]:
    """The heavy modules loaded by running the console entry point with ``argv``."""
    code = (
        "import sys\n"
        f"sys.argv = ['kvstream', *{argv!r}]\n"
        "from kvstream.cli.main import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT
    )
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"'))
    return loaded


@pytest.mark.parametrize("argv", [["--help"], ["version"], ["hash", "--help"]])
def test_help_and_version_import_nothing_heavy(argv: list[str]) -> None:
    """Commands are imported when they run, so ``kvstream --help`` and ``kvstream version``
    load no torch, numpy, event model, codec, index, pipeline, cache or engine module
    (benchmarks/bench_cli_start.py times them). (typer itself loads pydantic and rich.)"""
    assert _loaded_after(argv) == []


def test_a_command_still_runs_and_loads_what_it_needs() -> None:
    assert "kvstream.codec" in _loaded_after(["schema", "show", "--list"])


def test_the_listed_help_is_each_commands_own() -> None:
    """``kvstream --help`` lists commands from a table (without importing them): it must
    say what each command's own help says."""
    for name, entry in COMMANDS.items():
        cmd = load_command(name)
        own = " ".join((cmd.help or "").split("\n\n")[0].split())
        assert entry.help == own, name
        result = runner.invoke(app, [name, "--help"])
        assert result.exit_code == 0, (name, result.output)


def test_the_light_schema_version_matches_the_model() -> None:
    assert EVENT_SCHEMA_VERSION == CURRENT_SCHEMA_VERSION
