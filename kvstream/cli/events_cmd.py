"""``kvstream events``: convert and inspect event streams (TensorRT-LLM JSON, Avro files)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(
    help="Convert TensorRT-LLM event JSON to kvstream Avro files and inspect event files.",
    no_args_is_help=True,
)


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@app.command("from-trtllm")
def from_trtllm(
    source: Annotated[
        Path,
        typer.Argument(
            help="JSON file: the array that LLM.get_kv_cache_events() or POST "
            "/kv_cache_events returns (or JSON Lines, one array or event per line); '-' = stdin.",
            allow_dash=True,
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Avro container file to write.")],
    instance_id: Annotated[str, typer.Option(help="Source instance id to stamp.")] = "trtllm",
    tokens_per_block: Annotated[
        int | None,
        typer.Option(help="Block size (TensorRT-LLM does not publish it; needed for created)."),
    ] = None,
    mm_token_id_offset: Annotated[
        int | None, typer.Option(help="V2 multimodal token id offset (vocab size).")
    ] = None,
    schema_version: Annotated[int | None, typer.Option(help="Schema version to write.")] = None,
) -> None:
    """Convert TensorRT-LLM KV-cache event JSON into an Avro container file."""
    from kvstream.codec import CURRENT_VERSION, write_container
    from kvstream.engines.trtllm import TrtllmEventReader
    from kvstream.errors import KVStreamError

    text = sys.stdin.read() if str(source) == "-" else source.read_text()
    try:
        chunks = _json_chunks(text)
    except ValueError as exc:
        raise _fail(f"{source}: not JSON: {exc}") from None
    reader = TrtllmEventReader(
        instance_id=instance_id,
        tokens_per_block=tokens_per_block,
        mm_token_id_offset=mm_token_id_offset,
    )
    try:
        batches = [b for chunk in chunks for b in reader.read(chunk)]
        write_container(
            output,
            batches,
            schema_version=CURRENT_VERSION if schema_version is None else schema_version,
        )
    except KVStreamError as exc:
        raise _fail(str(exc)) from None
    n_events = sum(len(b.events) for b in batches)
    typer.echo(f"wrote {n_events} events in {len(batches)} batches to {output}")


def _json_chunks(text: str) -> list[list[Any]]:
    stripped = text.strip()
    if not stripped:
        return []
    try:
        doc = json.loads(stripped)
    except json.JSONDecodeError:
        lines = [json.loads(line) for line in stripped.splitlines() if line.strip()]
        return [x if isinstance(x, list) else [x] for x in lines]
    return [doc if isinstance(doc, list) else [doc]]


@app.command("dump")
def dump(
    path: Annotated[Path, typer.Argument(help="Avro container file written by kvstream.")],
    tolerate_torn_tail: Annotated[
        bool, typer.Option(help="Stop quietly at a torn tail (a crash mid-write).")
    ] = True,
    trtllm: Annotated[
        bool, typer.Option("--trtllm", help="Print events in TensorRT-LLM's JSON shape.")
    ] = False,
) -> None:
    """Print every event of an Avro container file as JSON Lines (one event per line)."""
    from kvstream.codec import read_container
    from kvstream.engines.trtllm import to_trtllm_events
    from kvstream.errors import KVStreamError

    try:
        for batch in read_container(path, tolerate_torn_tail=tolerate_torn_tail):
            if trtllm:
                for d in to_trtllm_events(batch):
                    typer.echo(json.dumps(d))
                continue
            src = batch.source.model_dump(mode="json")
            for ev in batch.events:
                typer.echo(json.dumps({"source": src, **ev.model_dump(mode="json")}))
    except FileNotFoundError:
        raise _fail(f"{path}: no such file") from None
    except KVStreamError as exc:
        raise _fail(str(exc)) from None
