"""``kvstream replay --report out.html``: one self-contained HTML page with the plots.

The page holds everything it shows: the plots are inline SVG drawn by matplotlib (glyphs as
paths, no fonts to fetch), the styles are inline, and a Content-Security-Policy forbids any
fetch, so it opens the same offline, from a mail attachment or a CI artefact. Plots:

1. hit ratio against cache capacity per policy (one point per policy unless the run swept
   ``capacity=``), with the ceiling (an unlimited shared cache);
2. the distribution (CDF) of the modelled time to first token per policy;
3. requests running and queued per worker over simulated time, per policy: a band from the
   least to the most loaded worker with the median worker as a line.

Plots 2 and 3 show one capacity (the swept value nearest the base options'); their titles,
headings and captions name it. The capacity axis has a tick at every replayed value.

matplotlib is an optional dependency (``pip install 'kvstream[report]'``).
"""

from __future__ import annotations

import datetime
import html
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstream.cli.replay_compare import Comparison
from kvstream.cli.replay_result import ReplayResult
from kvstream.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["capacity_figure", "load_figure", "render_report", "ttft_figure", "write_report"]

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222 }
h1 { font-size: 1.5em } h2 { font-size: 1.2em; margin-top: 2em }
table { border-collapse: collapse; margin: 1em 0 } td, th { padding: .3em .8em;
border-bottom: 1px solid #ddd; text-align: right } th:first-child, td:first-child {
text-align: left } .note { color: #666; font-size: .9em } figure { margin: 1em 0 }
figcaption { color: #555; font-size: .9em } svg { max-width: 100%; height: auto }
"""


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("--report needs matplotlib: pip install 'kvstream[report]'") from None
    return Figure(figsize=(width, height), layout="constrained")


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    return text[text.index("<svg") :]  # drop the XML prolog and doctype


def _setup(r: ReplayResult) -> str:
    """The cache a run had, in words: ``8 workers x 4,000 blocks``."""
    o = r.options
    return f"{o.workers} worker{'s' if o.workers != 1 else ''} x {o.capacity_blocks:,} blocks"


def _total(r: ReplayResult) -> int:
    return r.options.capacity_blocks * r.options.workers


def capacity_figure(c: Comparison) -> Figure:
    """Hit ratio against total cache capacity: one line per policy and the ceiling, a tick
    at every replayed capacity (log2 axis for 3+ values), margins so no marker is cut."""
    from matplotlib.ticker import FixedLocator, NullLocator

    fig = _figure(7.5, 4.2)
    ax = fig.add_subplot()
    for i, p in enumerate(c.policies):
        runs = [c.at(v)[i] for v in c.values]
        ax.plot([_total(r) for r in runs], [r.hit_ratio for r in runs], marker="o", label=p)
    first = [c.at(v)[0] for v in c.values]
    xs = [_total(r) for r in first]
    ax.plot(xs, [r.ceiling_ratio for r in first], "k--", marker="x", label="ceiling (unlimited)")
    workers = sorted({r.options.workers for r in first})
    per = f"{workers[0]} workers" if len(workers) == 1 else "workers as swept"
    ax.set_xlabel(f"total cache capacity, blocks ({per} x blocks per worker)")
    ax.set_ylabel("prefix hit ratio (share of prompt blocks cached)")
    ax.set_ylim(0, max(1e-3, *(r.ceiling_ratio for r in first)) * 1.1)
    lo, hi = min(xs), max(xs)
    if len(set(xs)) > 2:
        ax.set_xscale("log", base=2)
    if lo == hi:
        ax.set_xlim(lo * 0.5, hi * 1.5)
    elif ax.get_xscale() == "log":
        pad = (hi / lo) ** 0.06
        ax.set_xlim(lo / pad, hi * pad)
    else:
        pad = (hi - lo) * 0.06
        ax.set_xlim(lo - pad, hi + pad)
    ticks = sorted(set(xs))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticks(ticks, [f"{x:,}" for x in ticks])
    ax.set_title(f"Hit ratio at each replayed capacity ({len(ticks)} values)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def ttft_figure(runs: list[ReplayResult]) -> Figure:
    """The CDF of the modelled time to first token per policy, for one capacity (named in
    the title), cut at the largest p99."""
    fig = _figure(7.5, 4.2)
    ax = fig.add_subplot()
    top = 0.0
    for r in runs:
        xs = sorted(r.ttft_s)
        if not xs:
            continue
        n = len(xs)
        ax.step(xs, [100 * (i + 1) / n for i in range(n)], where="post", label=r.policy)
        top = max(top, r.ttft(0.99))
    ax.set_xlabel("modelled time to first token, seconds (queue wait + uncached prefill)")
    ax.set_ylabel("requests at or below, %")
    if top > 0:
        ax.set_xlim(0, top * 1.05)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    setup = _setup(runs[0]) if runs else ""
    ax.set_title(f"TTFT distribution (CDF) at {setup}, cut at the largest p99", fontsize=10)
    return fig


def load_figure(r: ReplayResult, ymax: float | None = None) -> Figure:
    """Requests running + queued per worker over simulated time, as a band: the least and
    the most loaded worker at each moment, with the median worker as a line. ``ymax``: a
    shared y limit, so the policies' plots compare at a glance."""
    fig = _figure(7.5, 3.3)
    ax = fig.add_subplot()
    ts = [s.t_s / 60 for s in r.timeline]
    loads = [sorted(a + b for a, b in zip(s.running, s.waiting, strict=True)) for s in r.timeline]
    n = len(loads[0]) if loads else 0
    if n:
        lows, highs = [x[0] for x in loads], [x[-1] for x in loads]
        mids = [(x[(n - 1) // 2] + x[n // 2]) / 2 for x in loads]
        if n > 1:
            ax.fill_between(
                ts, lows, highs, step="post", alpha=0.3, linewidth=0,
                label=f"least to most loaded of {n} workers",
            )  # fmt: skip
        ax.step(ts, mids, where="post", linewidth=1.2, label="median worker" if n > 1 else None)
    ax.set_xlabel("simulated time, minutes")
    ax.set_ylabel("requests per worker\n(running + queued)")
    if ymax:
        ax.set_ylim(0, ymax * 1.05)
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(f"{r.policy}: load per worker at {_setup(r)}", fontsize=10)
    ax.grid(alpha=0.3)
    if n > 1:  # under the plot: it covers neither data nor the axis label
        fig.legend(loc="outside lower center", ncol=2, fontsize=8, frameon=False)
    return fig


def _capacity_plot(c: Comparison) -> str:
    return _svg(capacity_figure(c))


def _ttft_plot(runs: list[ReplayResult]) -> str:
    return _svg(ttft_figure(runs))


def _load_plots(runs: list[ReplayResult]) -> list[str]:
    shown = [r for r in runs if r.timeline]
    ymax = max(
        (
            a + b
            for r in shown
            for s in r.timeline
            for a, b in zip(s.running, s.waiting, strict=True)
        ),
        default=0,
    )
    return [_svg(load_figure(r, ymax or None)) for r in shown]


def _table(runs: list[ReplayResult]) -> str:
    head = (
        "<tr><th>policy</th><th>workers x blocks</th><th>hit ratio</th><th>ceiling</th>"
        "<th>TTFT p50 s</th><th>TTFT p99 s</th><th>queue p99 s</th><th>imbalance</th>"
        "<th>predicted = actual</th><th>unservable</th></tr>"
    )
    rows = []
    for r in runs:
        o = r.options
        rows.append(
            "<tr>"
            + "".join(
                f"<td>{html.escape(str(v))}</td>"
                for v in (
                    r.policy,
                    f"{o.workers} x {o.capacity_blocks:,}",
                    f"{r.hit_ratio:.3f}",
                    f"{r.ceiling_ratio:.3f}",
                    f"{r.ttft(0.5):.2f}",
                    f"{r.ttft(0.99):.2f}",
                    f"{r.queue(0.99):.2f}",
                    f"{r.imbalance:.2f}",
                    f"{r.prediction_accuracy:.1%}",
                    f"{r.unservable:,}",
                )
            )
            + "</tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"


def render_report(c: Comparison) -> str:
    """The HTML page for a comparison (a single run is a comparison of one policy)."""
    if not c.results:
        raise ConfigError("nothing to report: no replay ran")
    base = c.base
    main = c.at(_main_value(c))
    first = c.results[0]
    swept = c.sweep is not None and c.sweep.param == "capacity"
    title = f"kvstream replay: {Path(first.trace_file).name or base.trace}"
    totals = ", ".join(f"{_total(c.at(v)[0]):,}" for v in c.values)
    parts: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="note">{first.trace_requests:,} trace requests; '
        f"{html.escape(base.hash_algo)} hashes; prefill {base.prefill_tokens_per_s:,.0f} "
        f"tokens/s per worker; decode {base.decode_ms_per_token:g} ms/token; generated "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.</p>",
        "<h2>Summary</h2>",
        _table(c.results),
        '<p class="note">hit ratio and ceiling count the same requests (the unservable ones, '
        "larger than a worker's cache, are left out of both). TTFT = queue wait + uncached "
        "prompt tokens / prefill rate.</p>",
        "<h2>Hit ratio against cache capacity</h2>",
        f"<figure>{_capacity_plot(c)}<figcaption>Prefix hit ratio per policy at each "
        f"replayed total capacity: {totals} blocks.</figcaption></figure>",
    ]
    if not swept:
        parts.append(
            '<p class="note">One capacity was replayed; run with '
            "<code>--sweep capacity=1000,2000,4000,8000</code> for the curve.</p>"
        )
    setup = html.escape(_setup(main[0]))
    parts += [
        f"<h2>Time to first token at {setup}</h2>",
        f"<figure>{_ttft_plot(main)}<figcaption>Modelled time to first token, per policy, "
        f"with {setup} each.</figcaption></figure>",
        f"<h2>Per-worker load over time at {setup}</h2>",
    ]
    parts += [
        f"<figure>{svg}<figcaption>{html.escape(r.policy)}: the band spans the least to the "
        f"most loaded worker, the line is the median worker ({setup}).</figcaption></figure>"
        for r, svg in zip([r for r in main if r.timeline], _load_plots(main), strict=True)
    ]
    if len(c.values) > 1:
        parts.append(
            f'<p class="note">The TTFT and load plots show the runs at {setup}; '
            f"the summary table has every {html.escape(c.sweep.param if c.sweep else '')} "
            "value.</p>"
        )
    parts.append("</body></html>")
    return "\n".join(parts)


def _main_value(c: Comparison) -> int:
    """The swept value closest to the base options' (the runs the CDF and load plots use)."""
    if c.sweep is None:
        return c.values[0]
    want: Any = c.base.capacity_blocks if c.sweep.param == "capacity" else c.base.workers
    return min(c.values, key=lambda v: (abs(v - want), v))


def write_report(c: Comparison, path: Path) -> Path:
    """Render and write the report; returns the path."""
    text = render_report(c)
    path.write_text(text, encoding="utf-8")
    return path
