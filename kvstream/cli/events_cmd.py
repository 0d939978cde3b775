"""``kvstream events``: convert and inspect event streams (TensorRT-LLM JSON, Avro files).

Exit codes (docs/cli.md): 0 done; 1 a stream failed while being read or an output could not
be written; 2 bad arguments: a missing, unreadable or malformed input, an output path in a
missing directory or naming a directory; 130 Ctrl-C (ends ``dump --follow``).
"""

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
    from kvstream.cli.output import error

    error(None, message)
    return typer.Exit(code)


def _read_text(source: Path) -> str:
    """The JSON text of ``source`` (``-``: stdin); a one-line error for a missing, binary
    or unreadable file."""
    if str(source) == "-":
        return sys.stdin.read()
    try:
        return source.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _fail(f"{source}: no such file") from None
    except IsADirectoryError:
        raise _fail(f"{source} is a directory, not a JSON file") from None
    except UnicodeDecodeError as exc:
        raise _fail(f"{source}: not a JSON text file ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise _fail(f"{source}: {exc.strerror or exc}") from None


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
    from kvstream.cli.output import check_output_path
    from kvstream.codec import CURRENT_VERSION, write_container
    from kvstream.engines.trtllm import TrtllmEventReader
    from kvstream.errors import ConfigError, KVStreamError

    try:
        check_output_path(output, what="--output")
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    text = _read_text(source)
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
        raise _fail(f"{source}: {exc}") from None
    except OSError as exc:  # the output (checked above) became unwritable, or the disk is full
        raise _fail(f"{output}: {exc.strerror or exc}", 1) from None
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
    path: Annotated[
        str,
        typer.Argument(
            help="What to read: an Avro container file written by kvstream, "
            "a file sink's directory (every file, oldest first), or kafka://HOST:PORT/TOPIC "
            "(the TLS/SASL options of kvstream index apply).",
            metavar="PATH|DIR|URL",
        ),
    ],
    tolerate_torn_tail: Annotated[
        bool, typer.Option(help="Stop quietly at a torn tail (a crash mid-write).")
    ] = True,
    trtllm: Annotated[
        bool, typer.Option("--trtllm", help="Print events in TensorRT-LLM's JSON shape.")
    ] = False,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow",
            "-f",
            help="Keep waiting for new events, as tail -f (a topic: else stop at the end "
            "offsets seen at start; a directory: poll for new files). Ctrl-C ends it.",
        ),
    ] = False,
) -> None:
    """Print every event of an event file, a file sink's directory or a Kafka topic as JSON
    Lines (one event per line)."""
    from kvstream.cli.output import EXIT_INTERRUPTED, check_input_path, interruptible
    from kvstream.errors import ConfigError, KVStreamError

    def emit(batch: Any) -> None:
        from kvstream.engines.trtllm import to_trtllm_events

        if trtllm:
            for d in to_trtllm_events(batch):
                typer.echo(json.dumps(d))
            return
        src = batch.source.model_dump(mode="json")
        for ev in batch.events:
            typer.echo(json.dumps({"source": src, **ev.model_dump(mode="json")}))

    try:
        check_input_path(path)
        with interruptible():
            if "://" in path or Path(path).is_dir() or follow:
                _dump_source(path, follow, emit)
            else:
                from kvstream.codec import read_container

                for batch in read_container(Path(path), tolerate_torn_tail=tolerate_torn_tail):
                    emit(batch)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except ConfigError as exc:
        raise _fail(str(exc)) from None
    except FileNotFoundError:
        raise _fail(f"{path}: no such file") from None
    except IsADirectoryError:  # never expected: directories go through the source
        raise _fail(f"{path} is a directory") from None
    except KVStreamError as exc:
        # a file that is not an event file is a bad argument; a stream failing, a failure
        if "://" in path:
            raise _fail(str(exc), 1) from None
        raise _fail(str(exc) if path in str(exc) else f"{path}: {exc}") from None
    except OSError as exc:
        raise _fail(f"{path}: {exc.strerror or exc}", 1) from None


def _dump_source(spec: str, follow: bool, emit: Any) -> None:
    """Every batch of :func:`kvstream.index.open_source` ``spec``, in stream order;
    ConfigError when it held nothing but malformed input."""
    import asyncio

    from kvstream.errors import ConfigError
    from kvstream.index import open_source

    async def run() -> tuple[int, Any]:
        source = open_source(spec, follow=follow)
        n = 0
        async with source:
            async for item in source:
                emit(item.batch)
                n += 1
        return n, source

    n, source = asyncio.run(run())
    if not n and source.stats.malformed:
        bad = list(source.recent_malformed)[:1]
        why = f": {bad[0].where}: {bad[0].error}" if bad else ""
        raise ConfigError(
            f"{spec} holds no kvstream event batch: {source.stats.malformed} malformed "
            f"input(s){why}"
        )
