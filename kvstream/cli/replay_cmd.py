"""``kvstream replay``: a Mooncake trace over N simulated workers, routed by a prefix index
built from the workers' own KV-cache events (see :mod:`kvstream.cli.replay_run`).

Register with ``app.command("replay")(replay_cmd.replay)``. Exit codes: 0 done; 1 a sink or
the stream failed; 2 bad arguments or a missing/malformed trace.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvstream.cli.replay_run import ROUTERS, ReplayOptions, ReplayResult, run_replay
from kvstream.errors import ConfigError, KVStreamError

__all__ = ["replay"]


def replay(
    trace: Annotated[
        str,
        typer.Argument(
            help="conversation, synthetic (shared/data/mooncake/*_trace.jsonl) or a JSONL path."
        ),
    ] = "conversation",
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, max=1024)] = 8,
    capacity_blocks: Annotated[
        int, typer.Option("--capacity-blocks", "-c", min=1, help="KV blocks per worker (LRU).")
    ] = 5859,
    router: Annotated[
        str, typer.Option("--router", "-r", help=f"Routing policy: {', '.join(ROUTERS)}.")
    ] = "kv",
    overlap_weight: Annotated[
        float,
        typer.Option(min=0.0, help="kv cost: weight of prefill blocks against active blocks."),
    ] = 1.0,
    limit: Annotated[
        int | None, typer.Option("--limit", "-n", min=1, help="Replay only the first N rows.")
    ] = None,
    block_size: Annotated[
        int, typer.Option(min=1, help="Tokens per KV block (the trace's hash ids are 512).")
    ] = 512,
    hash_algo: Annotated[str, typer.Option(help="Block hash algorithm of the workers.")] = (
        "blake3_64"
    ),
    key_mode: Annotated[
        str,
        typer.Option(
            help="How the index keys blocks: engine (the workers' hashes) or tokens (a "
            "canonical hash of the tokens, as for a fleet mixing engines)."
        ),
    ] = "engine",
    sink: Annotated[
        str,
        typer.Option(help="Event transport: memory, or kafka://HOST:PORT/TOPIC."),
    ] = "memory",
    max_lag: Annotated[
        int,
        typer.Option(min=0, help="Batches the index may lag behind the workers when routing."),
    ] = 0,
    prefill_tps: Annotated[
        float, typer.Option(min=1.0, help="Simulated prefill speed per worker, tokens/s.")
    ] = 10_000.0,
    decode_ms: Annotated[
        float, typer.Option(min=0.0, help="Simulated time per output token, ms.")
    ] = 20.0,
    output_to_cache: Annotated[
        bool, typer.Option(help="Append output tokens to the cache when a request finishes.")
    ] = True,
    seed: Annotated[int, typer.Option(help="Token and random-router seed.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    progress: Annotated[
        bool | None,
        typer.Option("--progress/--no-progress", help="Progress bar [default: on a terminal]."),
    ] = None,
) -> None:
    """Replay a Mooncake trace over N workers; report hit ratio, balance and accuracy.

    Each worker is a metadata-only KV cache of --capacity-blocks blocks. Its events go
    through the pipeline (memory, or Kafka) into a prefix index; the router picks workers
    from that index and their active load. Printed: prefix hit ratio, per-worker imbalance,
    how often the index predicted exactly the reuse the worker then had, simulated time to
    first token, and replay throughput.
    """
    opts = ReplayOptions(
        trace=trace,
        limit=limit,
        workers=workers,
        capacity_blocks=capacity_blocks,
        block_size=block_size,
        router=router,
        overlap_weight=overlap_weight,
        hash_algo=hash_algo,
        key_mode=key_mode,
        sink=sink,
        prefill_tokens_per_s=prefill_tps,
        decode_ms_per_token=decode_ms,
        output_to_cache=output_to_cache,
        max_lag_batches=max_lag,
        seed=seed,
    )
    err = Console(stderr=True)
    show = progress if progress is not None else (not as_json and sys.stderr.isatty())
    try:
        result = _run(opts, err) if show else asyncio.run(run_replay(opts))
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    except (KVStreamError, OSError, TimeoutError, RuntimeError) as exc:
        err.print(f"[red]error:[/red] {type(exc).__name__}: {exc}", highlight=False)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(result.as_dict()))
    else:
        print_result(result, Console())


def _run(opts: ReplayOptions, console: Console) -> ReplayResult:
    bar = Progress(
        TextColumn("[bold]replaying"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("requests"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task("replay", total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)

    with bar:
        return asyncio.run(run_replay(opts, progress=update))


def print_result(r: ReplayResult, out: Console) -> None:
    """The human-readable report."""
    o = r.options
    out.print(
        f"[bold]kvstream replay[/bold] {r.trace_file}: {r.requests:,} requests over "
        f"{o.workers} workers x {o.capacity_blocks:,} blocks of {o.block_size} tokens, "
        f"router [bold]{o.router}[/bold]"
        + (f" (overlap weight {o.overlap_weight:g})" if o.router == "kv" else "")
        + f", events via {o.sink}"
    )
    t = Table(show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")
    t.add_row(
        "prefix hit ratio",
        f"{r.hit_ratio:.1%}",
        f"{r.hit_blocks:,} of {r.prompt_blocks:,} prompt blocks reused",
    )
    if r.ceiling_blocks:
        t.add_row(
            "  unlimited shared cache", f"{r.ceiling_ratio:.1%}", "the ceiling, same counting"
        )
    t.add_row("token hit ratio", f"{r.token_hit_ratio:.1%}", f"{r.hit_tokens:,} prompt tokens")
    t.add_row(
        "index predicted the reuse",
        f"{r.prediction_accuracy:.1%}",
        f"exactly; {r.predicted_more:,} over, {r.predicted_less:,} under",
    )
    t.add_row(
        "imbalance",
        f"{r.imbalance:.2f}",
        f"max/mean requests per worker; prefill tokens {r.prefill_imbalance:.2f}",
    )
    t.add_row(
        "time to first token",
        f"{sum(r.ttft_s) / max(len(r.ttft_s), 1):.2f} s",
        f"simulated mean; p50 {r.ttft(0.5):.2f} s, p90 {r.ttft(0.9):.2f} s",
    )
    t.add_row(
        "throughput",
        f"{r.requests_per_s:,.0f} req/s",
        f"{r.wall_s:.1f} s wall for {r.simulated_s / 60:.1f} simulated minutes; "
        f"{r.events:,} events in {r.batches:,} batches",
    )
    if r.rejected or r.malformed:
        t.add_row("rejected / malformed", f"{r.rejected} / {r.malformed}", "")
    out.print(t)
    w = Table(title="Per worker", title_justify="left")
    for col in ("worker", "requests", "prompt blocks", "hit ratio", "prefill tokens", "evictions"):
        w.add_column(col, justify="left" if col == "worker" else "right")
    for ws in r.workers:
        w.add_row(
            ws.worker,
            f"{ws.requests:,}",
            f"{ws.prompt_blocks:,}",
            f"{ws.hit_ratio:.1%}",
            f"{ws.prefill_tokens:,}",
            f"{ws.evictions:,}",
        )
    out.print(w)
