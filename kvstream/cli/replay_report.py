"""``kvstream replay --report out.html``: one self-contained HTML page with the plots.

The page holds everything it shows: the plots are inline SVG drawn by matplotlib (glyphs as
paths, no fonts to fetch), the styles are inline, and a Content-Security-Policy forbids any
fetch, so it opens the same offline, from a mail attachment or a CI artefact. Plots:

1. hit ratio against cache capacity per policy (one point per policy unless the run swept
   ``capacity=``), with the ceiling (an unlimited shared cache);
2. the distribution (CDF) of the modelled time to first token per policy;
3. requests running and queued per worker over simulated time, per policy.

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

__all__ = ["render_report", "write_report"]

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222 }
h1 { font-size: 1.5em } h2 { font-size: 1.2em; margin-top: 2em }
table { border-collapse: collapse; margin: 1em 0 } td, th { padding: .3em .8em;
border-bottom: 1px solid #ddd; text-align: right } th:first-child, td:first-child {
text-align: left } .note { color: #666; font-size: .9em } figure { margin: 1em 0 }
svg { max-width: 100%; height: auto }
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


def _capacity_plot(c: Comparison) -> str:
    fig = _figure(7.5, 4.2)
    ax = fig.add_subplot()
    swept = c.sweep is not None and c.sweep.param == "capacity"
    for i, p in enumerate(c.policies):
        runs = [c.at(v)[i] for v in c.values]
        xs = [r.options.capacity_blocks * r.options.workers for r in runs]
        ax.plot(xs, [r.hit_ratio for r in runs], marker="o", label=p)
    first = [c.at(v)[0] for v in c.values]
    xs = [r.options.capacity_blocks * r.options.workers for r in first]
    ax.plot(xs, [r.ceiling_ratio for r in first], "k--", marker="x", label="ceiling (unlimited)")
    ax.set_xlabel("total cache capacity, blocks (workers x blocks per worker)")
    ax.set_ylabel("prefix hit ratio")
    ax.set_ylim(0, max(1e-3, *(r.ceiling_ratio for r in first)) * 1.1)
    if swept and len(c.values) > 2:
        ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
    return _svg(fig)


def _ttft_plot(runs: list[ReplayResult]) -> str:
    fig = _figure(7.5, 4.2)
    ax = fig.add_subplot()
    top = 0.0
    for r in runs:
        xs = sorted(r.ttft_s)
        if not xs:
            continue
        n = len(xs)
        ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=r.policy)
        top = max(top, r.ttft(0.99))
    ax.set_xlabel("modelled time to first token, s (queue wait + uncached prefill)")
    ax.set_ylabel("share of requests")
    if top > 0:
        ax.set_xlim(0, top * 1.05)
    ax.set_ylim(0, 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("CDF, cut at the largest p99", fontsize=9)
    return _svg(fig)


def _load_plot(r: ReplayResult) -> str:
    fig = _figure(7.5, 3.0)
    ax = fig.add_subplot()
    ts = [s.t_s / 60 for s in r.timeline]
    n = len(r.timeline[0].running) if r.timeline else 0
    for w in range(n):
        ax.plot(
            ts,
            [s.running[w] + s.waiting[w] for s in r.timeline],
            linewidth=0.9,
            label=r.workers[w].worker if w < len(r.workers) else str(w),
        )
    ax.set_xlabel("simulated time, minutes")
    ax.set_ylabel("requests running + queued")
    ax.set_title(f"{r.policy}: per-worker load", fontsize=10)
    ax.grid(alpha=0.3)
    if 1 < n <= 16:
        ax.legend(fontsize=7, ncol=min(n, 8), loc="upper right")
    return _svg(fig)


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
        f"<figure>{_capacity_plot(c)}</figure>",
    ]
    if not swept:
        parts.append(
            '<p class="note">One capacity was replayed; run with '
            "<code>--sweep capacity=1000,2000,4000,8000</code> for the curve.</p>"
        )
    parts += [
        "<h2>Time to first token</h2>",
        f"<figure>{_ttft_plot(main)}</figure>",
        "<h2>Per-worker load over time</h2>",
    ]
    parts += [f"<figure>{_load_plot(r)}</figure>" for r in main if r.timeline]
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
