"""Entry point of the ``kvstream`` command."""

from __future__ import annotations

import typer

from kvstream import __version__
from kvstream.cli import (
    bridge_cmd,
    demo_cmd,
    events_cmd,
    hash_cmd,
    index_cmd,
    replay_cmd,
    schema_cmd,
    shard_cmd,
)

app = typer.Typer(
    name="kvstream",
    help=(
        "Stream KV-cache telemetry out of LLM inference engines.\n\n"
        "Typed, windowed KV-cache events (stored / removed / updated / cleared / lost), "
        "encoded with versioned Avro schemas, and block hashes compatible with "
        "TensorRT-LLM and vLLM."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("demo")(demo_cmd.demo)
app.command("bridge")(bridge_cmd.bridge)
app.command("replay")(replay_cmd.replay)
app.command("index")(index_cmd.index)
app.command("shard")(shard_cmd.shard)
app.add_typer(schema_cmd.app, name="schema")
app.add_typer(events_cmd.app, name="events")
app.command("hash")(hash_cmd.hash_tokens)


@app.command()
def version() -> None:
    """Print the kvstream version and the event schema version it writes."""
    from kvstream.events import CURRENT_SCHEMA_VERSION

    typer.echo(f"kvstream {__version__} (writes event schema v{CURRENT_SCHEMA_VERSION})")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
