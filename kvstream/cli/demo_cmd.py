"""``kvstream demo``: a KV cache on a realistic workload, streamed, read back, summarised.

Register with ``app.command("demo")(demo_cmd.demo)``. Exit codes: 0 every sink got every
event back identical; 1 something was lost or differs (or a sink failed at run time);
2 bad arguments (unknown trace, malformed sink URL, missing trace data); 130 Ctrl-C, after
saying how far it got. The cache, the
pipeline and the workloads are imported inside the command, so ``kvstream --help`` does not
pay for them.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvstream.cli.output import EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, fail, interruptible
from kvstream.errors import ConfigError, KVStreamError

if TYPE_CHECKING:
    from rich.console import Console

    from kvstream.cli.demo_run import DemoOptions, DemoResult

#: ``--trace`` choices (kvstream.cli.demo_run.TRACES; spelled out so --help imports nothing)
TRACES = ("chat", "mooncake-conversation", "mooncake-synthetic")

__all__ = ["demo"]

_KIND_HELP = {
    "created": "a layer group's block pools came up",
    "stored": "blocks entered the cache (new KV computed)",
    "removed": "blocks were evicted",
    "updated": "blocks moved between tiers",
    "cleared": "the cache was reset",
    "lost": "events dropped before delivery",
}


def demo(
    sink: Annotated[
        list[str] | None,
        typer.Option(
            "--sink",
            "-s",
            help=(
                "Where events go; repeat for several: file (Avro files in --out, else in a "
                "temporary directory removed at the end), memory, "
                "file:///DIR[?format=jsonl], kafka://HOST:PORT/TOPIC[?partitions=N]. "
                "Default: file."
            ),
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Directory for the file sink (kept after the run)."),
    ] = None,
    trace: Annotated[
        str,
        typer.Option(
            "--trace",
            "-t",
            help=f"Workload: {', '.join(TRACES)} (the Mooncake FAST'25 traces ship with kvstream).",
        ),
    ] = "chat",
    requests: Annotated[
        int | None, typer.Option("--requests", "-n", min=1, help="Run at most N requests.")
    ] = None,
    conversations: Annotated[
        int, typer.Option(min=1, help="Conversations of the chat workload.")
    ] = 48,
    ranks: Annotated[
        int, typer.Option(min=1, max=64, help="Attention-DP ranks (one event source each).")
    ] = 2,
    block_size: Annotated[
        int | None,
        typer.Option(min=1, help="Tokens per KV block [default: 16 chat, 64 Mooncake]."),
    ] = None,
    gpu_blocks: Annotated[
        int | None,
        typer.Option(
            min=8,
            help="GPU blocks of the full-attention group per rank [default: 2048 for chat; "
            "for a Mooncake trace, room for every distinct block of the rows replayed].",
        ),
    ] = None,
    host_tier: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Host-tier blocks per GPU block: evicted blocks move to the host and come "
            "back on a prefix hit (updated events). 0 = no host tier.",
        ),
    ] = 0.0,
    hash_algo: Annotated[str, typer.Option(help="Block hash algorithm.")] = "v2_sha256_64",
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Run a paged KV cache on multi-turn chats, stream its events, read them back.

    The cache manager serves the workload with continuous batching on every rank; each
    engine iteration's events go through the async pipeline to every sink; afterwards every
    sink is read back and checked against what the cache emitted (per source: event ids
    0..N-1, identical payloads).
    """
    from rich.console import Console

    from kvstream.cli.demo_run import DemoOptions, run_demo

    opts = DemoOptions(
        sinks=tuple(sink or ()),
        out_dir=out,
        trace=trace,
        requests=requests,
        conversations=conversations,
        ranks=ranks,
        tokens_per_block=block_size,
        gpu_blocks=gpu_blocks,
        host_ratio=host_tier,
        hash_algo=hash_algo,
        seed=seed,
    )
    err = Console(stderr=True)
    served = _Served()
    try:
        with interruptible():
            if as_json:
                result = asyncio.run(run_demo(opts, on_start=served.start, advance=served.one))
            else:
                result = _run_with_progress(opts, err, served)
    except KeyboardInterrupt:
        total = f" of {served.total:,}" if served.total else ""
        err.print(
            f"interrupted: {served.done:,}{total} requests served; nothing was read back",
            highlight=False,
            markup=False,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        fail(err, str(exc), EXIT_USAGE)
    except (KVStreamError, OSError, TimeoutError) as exc:
        fail(err, f"{type(exc).__name__}: {exc}", EXIT_RUNTIME)
    if as_json:
        typer.echo(json.dumps(result.as_dict(), default=str))
    else:
        _print_summary(result, Console())
    if not result.ok:
        from rich.markup import escape

        bad = [s for s in result.sinks if not s.ok]
        for s in bad:
            problem = escape(f"{s.url}: {s.problem or 'incomplete'}")
            err.print(f"[red]{problem}[/red]", highlight=False)
        raise typer.Exit(EXIT_RUNTIME)


class _Served:
    """Requests served so far (what an interrupted demo reports)."""

    def __init__(self) -> None:
        self.done = 0
        self.total: int | None = None

    def start(self, label: str, total: int | None) -> None:
        self.total = total

    def one(self) -> None:
        self.done += 1


def _run_with_progress(opts: DemoOptions, console: Console, served: _Served) -> DemoResult:
    """Run with a progress bar on a terminal, else a plain line every few seconds."""
    from kvstream.cli.demo_run import run_demo

    if not console.is_terminal:
        from kvstream.cli.output import PlainProgress

        plain = PlainProgress(console)

        def on_start_plain(label: str, total: int | None) -> None:
            served.start(label, total)
            plain(f"serving requests: {label}", force=True)

        def advance_plain() -> None:
            served.one()
            of = f"/{served.total:,}" if served.total else ""
            plain(f"served {served.done:,}{of} requests")

        return asyncio.run(run_demo(opts, on_start=on_start_plain, advance=advance_plain))

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task_id = progress.add_task("starting", total=None)

    def on_start(label: str, total: int | None) -> None:
        served.start(label, total)
        progress.update(task_id, description="serving requests", total=total)

    def advance() -> None:
        served.one()
        progress.advance(task_id)

    with progress:
        return asyncio.run(run_demo(opts, on_start=on_start, advance=advance))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"  # pragma: no cover


def _print_summary(r: DemoResult, out: Console) -> None:
    from rich.table import Table

    o = r.options
    out.print(f"[bold]kvstream demo[/bold] - {r.workload}")
    out.print(
        f"{o.ranks} attention-DP rank(s), each a KV cache of {len(r.groups)} layer groups "
        f"({', '.join(r.groups)}), {o.tokens_per_block} tokens/block, "
        f"{o.gpu_blocks} GPU blocks"
        + (f" + a host tier of {o.host_ratio:g}x" if o.host_ratio else "")
        + f", hashes {o.hash_algo}\n"
    )
    work = Table(title="Workload", show_header=False, title_justify="left")
    work.add_column(style="bold")
    work.add_column(justify="right")
    work.add_column(style="dim")
    work.add_row("requests served", f"{r.requests:,}", f"{r.rejected} rejected (cache full)")
    work.add_row("prompt tokens", f"{r.prompt_tokens:,}", "")
    work.add_row(
        "prefix hit rate",
        f"{r.hit_rate:.1%}",
        f"{r.reused_tokens:,} prompt tokens already cached: no prefill needed",
    )
    if r.ceiling_rate is not None:
        work.add_row(
            "  unlimited cache",
            f"{r.ceiling_rate:.1%}",
            "what these requests offer at most; a trace's first rows are cold (most reuse "
            "comes later: try --requests 4000)",
        )
    work.add_row("generated tokens", f"{r.generated_tokens:,}", f"{r.iterations:,} iterations")
    work.add_row("evicted blocks", f"{r.evictions:,}", "least recently used first")
    out.print(work)

    ev = Table(title="Events the cache emitted", title_justify="left")
    ev.add_column("kind", style="bold")
    ev.add_column("events", justify="right")
    ev.add_column("meaning", style="dim")
    for kind in ("created", "stored", "removed", "updated", "cleared", "lost"):
        n = r.events_by_kind.get(kind, 0)
        if n or kind in ("stored", "removed"):
            extra = ""
            if kind == "stored":
                extra = f" ({r.blocks_stored:,} blocks)"
            elif kind == "removed":
                extra = f" ({r.blocks_removed:,} blocks)"
            ev.add_row(kind, f"{n:,}", _KIND_HELP[kind] + extra)
    ev.add_row("total", f"{r.events:,}", f"in {r.batches:,} batches (one per rank per iteration)")
    out.print(ev)

    rate = r.events / r.engine_s if r.engine_s else 0.0
    per_event = r.encoded_bytes / r.events if r.events else 0.0
    out.print(
        f"Encoded as Avro: {_size(r.encoded_bytes)} ({per_event:.0f} B/event). "
        f"Throughput: {rate:,.0f} events/s, cache and pipeline together "
        f"({r.engine_s:.2f} s; {r.total_s:.2f} s with the read-back).\n"
    )
    sinks = Table(title="Read back from every sink", title_justify="left")
    sinks.add_column("sink", style="bold")
    sinks.add_column("where", overflow="fold")
    sinks.add_column("events", justify="right")
    sinks.add_column("size", justify="right")
    sinks.add_column("check")
    for s in r.sinks:
        size = _size(s.bytes) if s.bytes is not None else "-"
        if s.files is not None:
            size += f" in {s.files} file(s)"
        verdict = (
            "[green]identical: ids 0..N-1 per source[/green]"
            if s.ok
            else f"[red]{s.problem or 'incomplete'}[/red]"
        )
        if s.lost_ids:
            verdict += f" ({s.lost_ids} ids lost, marked)"
        sinks.add_row(s.name, s.location, f"{s.events:,}", size, verdict)
    out.print(sinks)
    if r.close is not None and r.close.undelivered_events:
        out.print(f"[red]{r.close.undelivered_events} events were not delivered[/red]")
    if r.removed_dir is not None:
        out.print(
            f"\nThe event files in {r.removed_dir} were read back and removed; keep them "
            "with --out DIR.",
            highlight=False,
        )
    files = [s for s in r.sinks if s.files and s.avro_files and s.location != r.removed_dir]
    if files:
        out.print(
            f"\nThe files are Avro object containers; read them with any Avro tool, or "
            f"kvstream.sinks.file.read_dir('{files[0].location}')."
        )
