"""``kvstream schema``: inspect the event schemas and check that versions stay compatible.

Both commands print JSON with ``--json`` (one document on stdout). Exit codes: 0 done; 1 the
check found an incompatibility; 2 bad arguments (an unknown version, a bad schema dir).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    help="Inspect the versioned Avro event schemas and check their compatibility.",
    no_args_is_help=True,
)


@app.command("check")
def check(
    schema_dir: Annotated[
        Path | None,
        typer.Argument(
            help="Directory of kv_event_batch.v<N>.avsc files (default: the shipped schemas).",
            exists=True,
            file_okay=False,
        ),
    ] = None,
    require_avro: Annotated[
        bool,
        typer.Option(help="Fail if Apache avro (the static checker) is not installed."),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the report as JSON (ok, pairs, issues).")
    ] = False,
) -> None:
    """Check that every schema version reads every other version's data (FULL_TRANSITIVE).

    Runs Apache avro's reader/writer checker in both directions for every pair, round-trips
    sample data through fastavro for every (writer, reader) pair, and verifies that released
    versions were not edited. Exits 1 with a report naming the field and the rule on failure.
    """
    from kvstream.codec import check_compatibility
    from kvstream.errors import KVStreamError

    try:
        report = check_compatibility(schema_dir, require_avro=require_avro)
    except KVStreamError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        doc: dict[str, Any] = {"ok": report.ok, **dataclasses.asdict(report)}
        doc["pairs"] = [{"writer": w, "reader": r} for w, r in report.pairs]
        typer.echo(json.dumps(doc))
    else:
        typer.echo(report.render())
    if not report.ok:
        raise typer.Exit(1)


@app.command("show")
def show(
    version: Annotated[
        int | None, typer.Option("--version", "-v", help="Schema version (default: current).")
    ] = None,
    canonical: Annotated[
        bool, typer.Option(help="Print the Parsing Canonical Form instead of the full JSON.")
    ] = False,
    list_versions: Annotated[
        bool, typer.Option("--list", help="List every version with its fingerprint.")
    ] = False,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="One JSON document: {version, fingerprint, current, schema} (with "
            "--canonical, the canonical form as a string), or with --list a list of "
            "{version, fingerprint, source, current}.",
        ),
    ] = False,
) -> None:
    """Print a schema version (full JSON with docs, or canonical form) or list them all."""
    from kvstream.codec import CURRENT_VERSION, schema_registry
    from kvstream.errors import KVStreamError

    registry = schema_registry()
    if list_versions and as_json:
        rows = [_info(registry.get(v), CURRENT_VERSION) for v in registry.versions()]
        typer.echo(json.dumps(rows))
        return
    if list_versions:
        for v in registry.versions():
            info = registry.get(v)
            mark = "  (current)" if v == CURRENT_VERSION else ""
            typer.echo(f"v{v}  fingerprint {info.fingerprint.hex()}  {info.source}{mark}")
        return
    try:
        info = registry.get(CURRENT_VERSION if version is None else version)
    except KVStreamError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        doc = _info(info, CURRENT_VERSION)
        doc["schema"] = info.canonical_form if canonical else info.schema_json
        typer.echo(json.dumps(doc))
    elif canonical:
        typer.echo(info.canonical_form)
    else:
        typer.echo(json.dumps(info.schema_json, indent=2))


def _info(info: Any, current: int) -> dict[str, Any]:
    return {
        "version": info.version,
        "fingerprint": info.fingerprint.hex(),
        "source": str(info.source),
        "current": info.version == current,
    }
