"""Entry point of the ``kvstream`` command.

Start-up is kept to the framework's cost: every command module imports only typer and
kvstream.errors at the top and its heavy modules (the index, codec, cache, pipeline, rich,
asyncio...) inside the command, so ``kvstream --help`` and ``kvstream version`` load none of
them (tests/test_cli.py checks this; benchmarks/bench_cli_start.py times it).
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any, NamedTuple

import typer
from typer.core import TyperCommand, TyperGroup

from kvstream import EVENT_SCHEMA_VERSION, __version__


class _Lazy(NamedTuple):
    """A command imported only when it runs (or its own help is asked for)."""

    module: str
    attr: str
    group: bool  # a typer.Typer of subcommands (else a command function)
    help: str  # the first paragraph of its help, for ``kvstream --help``


#: name -> where it lives, in the order ``kvstream --help`` lists them (tests/test_cli.py
#: checks each ``help`` against the command's own).
COMMANDS: dict[str, _Lazy] = {
    "demo": _Lazy(
        "kvstream.cli.demo_cmd",
        "demo",
        False,
        "Run a paged KV cache on multi-turn chats, stream its events, read them back.",
    ),
    "bridge": _Lazy(
        "kvstream.cli.bridge_cmd",
        "bridge",
        False,
        "Bridge an engine's KV-cache events (or any kvstream stream) into sinks.",
    ),
    "replay": _Lazy(
        "kvstream.cli.replay_cmd",
        "replay",
        False,
        "Replay a request trace over N workers; report hit ratio, TTFT, balance and accuracy.",
    ),
    "index": _Lazy(
        "kvstream.cli.index_cmd",
        "index",
        False,
        "Build a prefix index from a KV-event stream, then print per-worker matches for the "
        "queries (and the state of every worker).",
    ),
    "serve": _Lazy(
        "kvstream.cli.serve_cmd",
        "serve",
        False,
        "Serve a KV index to routers over HTTP (Dynamo's standalone-indexer API).",
    ),
    "query": _Lazy(
        "kvstream.cli.query_cmd",
        "query",
        False,
        "Ask an index service which workers hold a request's prefix (POST /query).",
    ),
    "shard": _Lazy(
        "kvstream.cli.shard_cmd",
        "shard",
        False,
        "Consume one shard of a Kafka topic into an index service that a router fans out to.",
    ),
    "hash": _Lazy(
        "kvstream.cli.hash_cmd",
        "hash_tokens",
        False,
        "Print the chained block hashes of TOKENS (one line per block: index, tokens, hash).",
    ),
    "schema": _Lazy(
        "kvstream.cli.schema_cmd",
        "app",
        True,
        "Inspect the versioned Avro event schemas and check their compatibility.",
    ),
    "events": _Lazy(
        "kvstream.cli.events_cmd",
        "app",
        True,
        "Convert TensorRT-LLM event JSON to kvstream Avro files and inspect event files.",
    ),
}


def load_command(name: str) -> Any:
    """Import command ``name`` and build its click command (typer parameter adapters and
    all: the cost every command paid at start-up before they were lazy)."""
    entry = COMMANDS[name]
    target = getattr(import_module(entry.module), entry.attr)
    sub: Any
    if entry.group:
        sub = typer.main.get_group(target)
    else:
        single = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
        single.command(name)(target)
        sub = typer.main.get_command(single)
    sub.name = name
    _plain_help(sub)
    return sub


def _plain_help(cmd: Any) -> None:
    """Help as plain text, like the root's: rich markup would eat every ``[...]`` in a
    help text (``pip install 'kvstream[report]'``, ``[default: ...]``) and rich panels
    show a ``<bool>`` metavar on flags."""
    cmd.rich_markup_mode = None
    for sub in getattr(cmd, "commands", {}).values():
        _plain_help(sub)


class _LazyGroup(TyperGroup):
    """The root group: lists every command from :data:`COMMANDS` without importing it, and
    builds one only when it is invoked."""

    def list_commands(self, ctx: Any) -> list[str]:
        return [*COMMANDS, *(n for n in self.commands if n not in COMMANDS)]

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = self.commands.get(cmd_name)
        if cmd is None and cmd_name in COMMANDS:  # listed in help: name and text suffice
            text = COMMANDS[cmd_name].help
            return TyperCommand(name=cmd_name, help=text, short_help=text)
        return cmd

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        if args and args[0] in COMMANDS and args[0] not in self.commands:
            self.add_command(load_command(args[0]), args[0])
        return super().resolve_command(ctx, args)


app = typer.Typer(
    name="kvstream",
    cls=_LazyGroup,
    rich_markup_mode=None,  # plain help for the command list: rich is imported when needed
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


def _print_version(value: bool) -> None:
    if value:
        full_version()
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    show_version: bool = typer.Option(
        False,
        "--version",
        is_eager=True,
        callback=_print_version,
        help="Print the version, the event schema version and the C extensions in use.",
    ),
) -> None:
    # a callback makes the root a group even with one eager command (version); every
    # command's library logs go through one handler that collapses repeats (cli/logs.py)
    from kvstream.cli.logs import cli_logging

    ctx.with_resource(cli_logging())


@app.command(short_help="Print the kvstream version and the event schema version it writes.")
def version() -> None:
    """Print the kvstream version and the event schema version it writes."""
    typer.echo(f"kvstream {__version__} (writes event schema v{EVENT_SCHEMA_VERSION})")


def full_version() -> None:
    """``kvstream --version``: :func:`version`'s line, then each optional C extension and
    whether this installation loads it (:mod:`kvstream.cli.native_info`)."""
    from kvstream._native import EXTENSIONS, MODULES
    from kvstream.cli.native_info import native_status

    version()
    status = native_status()
    active = sum(s == "active" for s in status.values())
    typer.echo(
        f"native core: {len(EXTENSIONS)} extension modules, {active} of {len(status)} parts active"
    )
    for role, extension in EXTENSIONS.items():
        typer.echo(f"  {extension} ({role})")
        for name, state in status.items():
            if MODULES[name] == role:
                typer.echo(f"    {name.removeprefix('kvstream.')}: {state}")


def main() -> None:
    """Console-script entry point (also ``python -m kvstream``)."""
    if sys.argv[1:] == ["version"]:  # nothing to parse: skip typer's per-option coercion
        version()
        return
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
