"""``kvstream bridge``: stream any engine or stream into any sinks.

Register with ``app.command("bridge")(bridge_cmd.bridge)``. Exit codes: 0 the source ended,
went idle or was stopped (SIGTERM/SIGINT) and every sink received everything; 1 a sink
failed or batches were dropped; 2 bad arguments.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:  # the CLI imports lazily: `kvstream --help` must not load the pipeline
    from rich.console import Console

    from kvstream.cli.bridge_run import BridgeOptions, BridgeResult
    from kvstream.pipeline import PipelineConfig

__all__ = ["bridge"]

#: Without a terminal, the progress line is logged this often (and when the state changes).
LOG_EVERY_S = 30.0

_SOURCE_HELP = (
    "What to read: vllm://HOST:PORT?replay=RPORT&dp_size=N&hash_algo=NAME&instance=NAME"
    "&from=0|latest, sglang://HOST:PORT?... (same options), kafka://HOST:PORT/TOPIC, a "
    "file-sink directory, or TensorRT-LLM JSON (FILE.json, FILE.jsonl, '-' for stdin)."
)


def bridge(
    source: Annotated[str, typer.Argument(help=_SOURCE_HELP, show_default=False)],
    sink: Annotated[
        list[str] | None,
        typer.Option(
            "--sink",
            "-s",
            help=(
                "Where batches go; repeat for several: file (Avro files in --out), "
                "file:///DIR, kafka://HOST:PORT/TOPIC, vllm://HOST:PORT?replay=RPORT (vLLM "
                "wire format for Dynamo / llm-d), memory. Default: file."
            ),
        ),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Directory of the 'file' sink.")
    ] = None,
    idle_exit: Annotated[
        float | None,
        typer.Option(
            "--idle-exit", min=0.0, help="Flush and exit 0 after this many seconds with no data."
        ),
    ] = None,
    max_batches: Annotated[
        int | None, typer.Option("--max-batches", min=1, help="Stop after N batches.")
    ] = None,
    follow: Annotated[
        bool | None,
        typer.Option(
            "--follow/--no-follow",
            help="Keep waiting for new data (default: yes for Kafka topics, no for files; "
            "engines are always followed).",
            show_default=False,
        ),
    ] = None,
    overflow: Annotated[
        str | None,
        typer.Option(help="Full sink queue: block, drop_oldest or drop_newest (pipeline)."),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Pipeline settings (JSON); KVSTREAM_PIPELINE_* variables override it.",
        ),
    ] = None,
    tokens_per_block: Annotated[
        int | None,
        typer.Option(help="TensorRT-LLM JSON sources: tokens per block (for partial blocks)."),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(min=1, max=65535, help="Serve Prometheus metrics on this port."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress line.")] = False,
) -> None:
    """Bridge an engine's KV-cache events (or any kvstream stream) into sinks.

    Every engine instance and data-parallel rank becomes one kvstream source
    with contiguous event ids; gaps the engine can no longer replay arrive as
    explicit `lost` markers, an engine restart as a new incarnation.

    vLLM to Kafka:
    kvstream bridge "vllm://HOST:5557?replay=5558" -s kafka://broker:9092/kv

    Kafka to NVIDIA Dynamo / llm-d (vLLM's wire format), one engine instance per sink:
    kvstream bridge kafka://broker:9092/kv -s "vllm://0.0.0.0:5600?replay=5700&instance=w0"
    """
    import asyncio

    from rich.console import Console

    from kvstream.cli.bridge_run import BridgeOptions
    from kvstream.cli.output import EXIT_RUNTIME, EXIT_USAGE, check_input_path, fail
    from kvstream.errors import ConfigError, KVStreamError

    err = Console(stderr=True)
    try:
        check_input_path(source)
        pipeline_config = _pipeline_config(config, overflow)
    except ConfigError as exc:
        fail(err, str(exc), EXIT_USAGE)
    source_options = {}
    if tokens_per_block is not None:
        source_options["tokens_per_block"] = tokens_per_block
    opts = BridgeOptions(
        source=source,
        sinks=tuple(sink or ("file",)),
        out_dir=out,
        idle_exit_s=idle_exit,
        max_batches=max_batches,
        follow=follow,
        config=pipeline_config,
        metrics_port=metrics_port,
        source_options=source_options,
    )
    try:
        result = asyncio.run(_run(opts, err, show_progress=not (quiet or as_json)))
    except ConfigError as exc:
        fail(err, str(exc), EXIT_USAGE)
    except (KVStreamError, OSError, TimeoutError) as exc:
        fail(err, f"{type(exc).__name__}: {exc}", EXIT_RUNTIME)
    if as_json:
        typer.echo(json.dumps(result.as_dict(), default=str))
    else:
        _print_summary(result, Console())
    p = result.progress
    if not p.batches and p.malformed:  # e.g. a file that is not an event file at all
        fail(err, f"{source}: no event batch read, {p.malformed} malformed input(s)", EXIT_USAGE)
    if not result.ok:
        raise typer.Exit(1)


def _pipeline_config(path: Path | None, overflow: str | None) -> PipelineConfig:
    from kvstream.pipeline import PipelineConfig

    base = PipelineConfig.from_file(path).model_dump() if path is not None else {}
    env = PipelineConfig.from_env().model_dump(exclude_unset=True)
    data = {**base, **env}
    # A bridge must not slow an engine down or lose data to a momentary sink hiccup:
    # queue generously, wait briefly for room, and keep the close deadline bounded.
    defaults = {"overflow": "block", "block_timeout_s": 5.0, **data.get("defaults", {})}
    if overflow is not None:
        defaults["overflow"] = overflow
    data["defaults"] = defaults
    data.setdefault("handoff_timeout_s", 5.0)
    return PipelineConfig.load(data)


async def _run(opts: BridgeOptions, err: Console, *, show_progress: bool) -> BridgeResult:
    import asyncio

    from rich.live import Live
    from rich.text import Text

    from kvstream.cli.bridge_run import BridgeProgress, run_bridge

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    live = Live(Text("starting"), console=err, transient=True, auto_refresh=False)
    # Not a terminal (a service's log): a plain line when the state changes, else now and then.
    logged_at = [0.0]
    logged_waiting = [""]

    def on_progress(p: BridgeProgress) -> None:
        line = (
            f"{p.batches:,} batches · {p.events:,} events · "
            f"{p.blocks_stored:,} stored / {p.blocks_removed:,} removed blocks "
            f"({p.rate():,.0f} blocks/s) · lost {p.lost_ids:,} · malformed {p.malformed:,}"
        )
        if p.waiting:
            line += f" · {p.waiting}"
        if err.is_terminal:
            live.update(Text(line), refresh=True)
            return
        now = time.monotonic()
        if p.waiting != logged_waiting[0] or now - logged_at[0] >= LOG_EVERY_S:
            err.print(line, highlight=False, soft_wrap=True)
            logged_at[0], logged_waiting[0] = now, p.waiting

    try:
        if show_progress and err.is_terminal:
            with live:
                return await run_bridge(opts, stop=stop, on_progress=on_progress)
        if show_progress:
            return await run_bridge(opts, stop=stop, on_progress=on_progress)
        return await run_bridge(opts, stop=stop)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _print_summary(result: BridgeResult, out: Console) -> None:
    from rich.table import Table

    p = result.progress
    rate = (p.blocks_stored + p.blocks_removed) / result.elapsed_s if result.elapsed_s else 0.0
    out.print(
        f"[bold]kvstream bridge[/bold] {result.source} -> {', '.join(result.sinks)}\n"
        f"stopped: {result.stop_reason} after {result.elapsed_s:.1f} s; "
        f"{p.batches:,} batches, {p.events:,} events, "
        f"{p.blocks_stored:,} blocks stored, {p.blocks_removed:,} removed ({rate:,.0f} blocks/s)"
    )
    table = Table(title="Sources", title_justify="left")
    table.add_column("source (instance/rank#incarnation)", overflow="fold")
    table.add_column("batches", justify="right")
    table.add_column("events", justify="right")
    table.add_column("ids", justify="right")
    table.add_column("lost", justify="right")
    for key, t in sorted(result.sources.items()):
        ids = f"{t.first_id}..{t.last_id}" if t.first_id is not None else "-"
        lost = f"{t.lost_ids:,} in {t.lost_markers} marker(s)" if t.lost_markers else "0"
        table.add_row(key, f"{t.batches:,}", f"{t.events:,}", ids, lost)
    if result.sources:
        out.print(table)
    if p.malformed:
        out.print(f"[yellow]{p.malformed} malformed input(s) skipped (counted, logged)[/yellow]")
    close = result.close
    if close is not None:
        for name, rep in close.sinks.items():
            state = (
                "[green]ok[/green]"
                if rep.ok
                else f"[red]{rep.undelivered_events} undelivered[/red]"
            )
            out.print(f"sink {name}: {rep.events_out:,} events delivered, {state}")
            if not rep.ok and rep.last_error:
                out.print(f"  last error: {rep.last_error}", highlight=False, markup=False)
    if p.dropped_batches:
        out.print(f"[red]{p.dropped_batches} batches dropped (sink queues full)[/red]")
