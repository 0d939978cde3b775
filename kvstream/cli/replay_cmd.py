"""``kvstream replay``: a request trace over N simulated workers, routed by a prefix index
built from the workers' own KV-cache events (see :mod:`kvstream.cli.replay_run`).

Register with ``app.command("replay")(replay_cmd.replay)``. Exit codes: 0 done; 1 a sink or
the stream failed; 2 bad arguments, a missing/malformed trace or an output path that cannot
be written (checked before the replay); 130 Ctrl-C, after printing the runs that finished.
The simulation modules are imported inside the command, so ``kvstream --help`` does not pay
for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvstream.cli.output import (
    EXIT_INTERRUPTED,
    EXIT_RUNTIME,
    EXIT_USAGE,
    PlainProgress,
    fail,
    interruptible,
)
from kvstream.errors import ConfigError, KVStreamError

if TYPE_CHECKING:
    from rich.console import Console

    from kvstream.cli.replay_compare import Comparison
    from kvstream.cli.replay_result import ReplayResult
    from kvstream.cli.replay_run import ReplayOptions

__all__ = ["print_comparison", "print_result", "replay"]

_POLICIES = "kv, round-robin, random, least-loaded, global-lru"


def replay(
    trace: Annotated[
        str,
        typer.Argument(
            help="A shipped trace (conversation, synthetic: Mooncake FAST'25) or a JSONL "
            "file (.jsonl or .jsonl.gz): hash_ids + input_length rows, or token ids."
        ),
    ] = "conversation",
    workers: Annotated[int, typer.Option("--workers", "-w", min=1, max=1024)] = 8,
    capacity_blocks: Annotated[
        int, typer.Option("--capacity-blocks", "-c", min=1, help="KV blocks per worker (LRU).")
    ] = 5859,
    router: Annotated[
        str, typer.Option("--router", "-r", help=f"Routing policy: {_POLICIES}.")
    ] = "kv",
    overlap_weight: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Fix the kv cost to Dynamo's: weight x prefill blocks + active blocks "
            "[default: adapt the weight online].",
        ),
    ] = None,
    compare: Annotated[
        str | None,
        typer.Option(
            help="Replay each policy on the same trace and print one table, e.g. "
            "kv,least_loaded,round_robin,global_lru.",
        ),
    ] = None,
    sweep: Annotated[
        str | None,
        typer.Option(
            help="Repeat over capacity=N,N,... (blocks per worker) or workers=N,N,...",
        ),
    ] = None,
    report: Annotated[
        Path | None,
        typer.Option(
            help="Write a self-contained HTML report with plots (needs matplotlib: "
            "pip install 'kvstream[report]').",
        ),
    ] = None,
    requests_out: Annotated[
        Path | None,
        typer.Option(
            help="Write every served request as JSON Lines: policy, trace row, worker, "
            "arrival, queue_s, ttft_s, prompt and reused blocks.",
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", "-n", min=1, help="Replay only the first N rows.")
    ] = None,
    block_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Tokens per KV block [default: the trace's tokens per hash id, 512 for "
            "Mooncake; 16 for token-id traces].",
        ),
    ] = None,
    trace_block_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="Tokens per hash id of the trace [default: inferred]."),
    ] = None,
    time_unit: Annotated[
        str, typer.Option(help="Unit of the trace's timestamp field: ms or s.")
    ] = "ms",
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
        typer.Option(
            "--progress/--no-progress",
            help="Progress on stderr: a bar on a terminal, else a line every few seconds "
            "[default: on, but for --json].",
        ),
    ] = None,
) -> None:
    """Replay a request trace over N workers; report hit ratio, TTFT, balance and accuracy.

    Each worker is a metadata-only KV cache of --capacity-blocks blocks with a request queue;
    a request waits there until the cache has room, and only one larger than a whole cache
    is left unserved (counted, and out of every ratio). The workers' events go through the
    pipeline (memory, or Kafka) into a prefix index; the router picks workers from that
    index and their load. Printed: prefix hit ratio and its ceiling, modelled time to first
    token (queue wait + uncached prefill), imbalance, how often the index predicted exactly
    the reuse the worker then had, and replay throughput.
    """
    from rich.console import Console

    from kvstream.cli.replay_run import ReplayOptions

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
        trace_block_tokens=trace_block_tokens,
        time_unit=time_unit,
    )
    err = Console(stderr=True)
    show = progress if progress is not None else not as_json
    try:
        _check_outputs(report, requests_out)
        comparison = _comparison(opts, compare, sweep)
    except ConfigError as exc:
        fail(err, str(exc), EXIT_USAGE)
    done = _Done()
    try:
        _run(comparison, err if show else None, done)
        if report is not None:
            from kvstream.cli.replay_report import write_report

            write_report(comparison, report)
        if requests_out is not None:
            _write_requests(comparison, requests_out)
    except KeyboardInterrupt:
        _interrupted(comparison, done, err, as_json)
    except (ConfigError, FileNotFoundError, ValueError) as exc:
        fail(err, str(exc), EXIT_USAGE)
    except (KVStreamError, OSError, TimeoutError, RuntimeError) as exc:
        fail(err, f"{type(exc).__name__}: {exc}", EXIT_RUNTIME)
    _print(comparison, as_json, single=compare is None and sweep is None)
    if report is not None and not as_json:
        err.print(f"report: {report}", highlight=False, markup=False)


def _check_outputs(report: Path | None, requests_out: Path | None) -> None:
    """Fail before a long replay, not after it, on an output that cannot be written."""
    from kvstream.cli.output import check_output_path

    if report is not None:
        check_output_path(report, what="--report")
        try:
            import matplotlib  # noqa: F401  (the report needs it; found out before the run)
        except ImportError:
            raise ConfigError("--report needs matplotlib: pip install 'kvstream[report]'") from None
    if requests_out is not None:
        check_output_path(requests_out, what="--requests-out")


def _comparison(opts: ReplayOptions, compare: str | None, sweep: str | None) -> Comparison:
    from kvstream.cli.replay_compare import Comparison, parse_compare, parse_sweep

    policies = parse_compare(compare) if compare is not None else [opts.router]
    spec = parse_sweep(sweep) if sweep is not None else None
    opts.check()
    return Comparison(opts, policies, spec)


def _print(comparison: Comparison, as_json: bool, *, single: bool) -> None:
    from rich.console import Console

    if as_json:
        out = comparison.results[0].as_dict() if single else comparison.as_dict()
        typer.echo(json.dumps(out))
    elif single:
        print_result(comparison.results[0], Console())
    else:  # a wide table: piped into a file it need not fit 80 columns
        print_comparison(comparison, Console() if sys.stdout.isatty() else Console(width=140))


class _Done:
    """How far the replay got: the run under way and its requests (for Ctrl-C)."""

    def __init__(self) -> None:
        self.label = ""
        self.requests = 0
        self.total = 0


def _interrupted(comparison: Comparison, done: _Done, err: Console, as_json: bool) -> None:
    """Ctrl-C: print the runs that finished (as a normal result would be printed) and what
    the one under way had done, then exit 130."""
    finished = comparison.finished()
    n, total = len(comparison.results), comparison.total_runs
    line = f"interrupted: {n} of {total} run(s) finished"
    if n < total and done.total:
        line += f"; {done.label} had replayed {done.requests:,} of {done.total:,} requests"
    err.print(line, highlight=False, markup=False, soft_wrap=True)
    if finished.results:  # only a comparison has finished runs to show
        if as_json:
            typer.echo(json.dumps({**finished.as_dict(), "interrupted": True}))
        else:
            _print(finished, False, single=False)
    raise typer.Exit(EXIT_INTERRUPTED)


def _run(comparison: Comparison, console: Console | None, done: _Done) -> None:
    """Run every replay of ``comparison`` into it; progress on ``console`` (None: none): a
    bar on a terminal, else a plain line every few seconds."""
    from kvstream.cli.replay_compare import run_many

    c = comparison
    bar: Any = None
    task: Any = None
    plain: PlainProgress | None = None
    if console is not None and console.is_terminal:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("requests"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        task = bar.add_task("replaying", total=None)
    elif console is not None:
        plain = PlainProgress(console)

    def on_run(i: int, total: int, label: str) -> None:
        done.label = f"replaying {label}" + (f" ({i + 1}/{total})" if total > 1 else "")
        done.requests = done.total = 0
        if bar is not None:
            bar.reset(task, description=done.label, total=None)
        elif plain is not None:
            plain(f"{done.label}", force=True)

    def update(n: int, total: int) -> None:
        done.requests, done.total = n, total
        if bar is not None:
            bar.update(task, completed=n, total=total)
        elif plain is not None:
            plain(f"{done.label}: {n:,}/{total:,} requests")

    coro = run_many(c.base, c.policies, c.sweep, on_run=on_run, progress=update, into=comparison)
    with interruptible(), bar if bar is not None else contextlib.nullcontext():
        asyncio.run(coro)


def _write_requests(c: Comparison, path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for r in c.results:
            o = r.options
            head = {"policy": r.policy, "workers": o.workers, "capacity_blocks": o.capacity_blocks}
            for rec in r.per_request:
                f.write(json.dumps({**head, **rec.as_dict()}) + "\n")


def print_result(r: ReplayResult, out: Console) -> None:
    """The human-readable report of one run."""
    from rich.table import Table

    from kvstream.kafka_security import redact_url

    o = r.options
    weight = (
        f" (overlap weight {o.overlap_weight:g})" if o.overlap_weight is not None else " (adaptive)"
    )
    out.print(
        f"[bold]kvstream replay[/bold] {r.trace_file}: {r.trace_requests:,} requests over "
        f"{o.workers} workers x {o.capacity_blocks:,} blocks of {r.block_size} tokens, "
        f"router [bold]{r.policy}[/bold]"
        + (weight if r.policy == "kv" else "")
        + f", events via {redact_url(o.sink)}"
    )
    t = Table(show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="dim")
    t.add_row(
        "requests served",
        f"{r.requests:,}",
        f"{r.unservable:,} unservable (larger than a worker's cache; out of every ratio)",
    )
    t.add_row(
        "prefix hit ratio",
        f"{r.hit_ratio:.1%}",
        f"{r.hit_blocks:,} of {r.prompt_blocks:,} prompt blocks reused",
    )
    t.add_row("  unlimited shared cache", f"{r.ceiling_ratio:.1%}", "the ceiling, same requests")
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
        f"{r.ttft(0.5):.2f} s",
        f"p50, modelled; p90 {r.ttft(0.9):.2f} s, p99 {r.ttft(0.99):.2f} s",
    )
    t.add_row(
        "queueing delay",
        f"{r.queue(0.99):.2f} s",
        f"p99; p50 {r.queue(0.5):.2f} s (waiting for cache room and earlier prefills)",
    )
    if r.router_signals:
        s = r.router_signals
        t.add_row(
            "router signals",
            f"w {s['affinity_weight']:.2f}",
            f"affinity weight at the end: reuse {s['reuse']:.2f}, "
            f"utilisation {s['utilisation']:.2f}",
        )
    t.add_row(
        "throughput",
        f"{r.requests_per_s:,.0f} req/s",
        f"{r.wall_s:.1f} s wall for {r.simulated_s / 60:.1f} simulated minutes; "
        f"{r.events:,} events in {r.batches:,} batches",
    )
    if r.malformed:
        t.add_row("malformed batches", f"{r.malformed}", "")
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


def print_comparison(c: Comparison, out: Console) -> None:
    """One table for ``--compare``/``--sweep``: a row per policy (per swept value)."""
    from rich.table import Table

    first = c.results[0]
    o = c.base
    out.print(
        f"[bold]kvstream replay[/bold] {first.trace_file}: {first.trace_requests:,} requests, "
        f"{o.workers} workers x {o.capacity_blocks:,} blocks of {first.block_size} tokens"
        + (f", sweeping {c.sweep.param}" if c.sweep is not None else "")
    )
    t = Table(
        title_justify="left",
        caption="hit: prefix hit ratio; /ceil: of the ceiling; "
        "pred: index predicted the reuse; unserv: larger than a worker's cache",
        caption_justify="left",
    )
    cols = ["policy"]
    if c.sweep is not None:
        cols.append(c.sweep.param)
    cols += ["hit", "/ceil", "TTFT p50/p90/p99 s", "imbal", "queue p99 s", "pred", "unserv"]
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right", no_wrap=True)
    for value in c.values:
        for r in c.at(value):
            row = [r.policy]
            if c.sweep is not None:
                row.append(f"{value:,}")
            row += [
                f"{r.hit_ratio:.3f}",
                f"{r.hit_ratio / r.ceiling_ratio:.0%}" if r.ceiling_ratio else "-",
                f"{r.ttft(0.5):.2f}/{r.ttft(0.9):.2f}/{r.ttft(0.99):.2f}",
                f"{r.imbalance:.2f}",
                f"{r.queue(0.99):.2f}",
                f"{r.prediction_accuracy:.0%}",
                f"{r.unservable:,}",
            ]
            t.add_row(*row)
    out.print(t)
    for value in c.values:
        r = c.at(value)[0]
        where = f" at {c.sweep.param}={value:,}" if c.sweep is not None else ""
        out.print(
            f"ceiling{where}: {r.ceiling_ratio:.3f} (an unlimited cache shared by everyone, "
            f"same {r.requests:,} requests; {r.unservable:,} unservable left out)"
        )
