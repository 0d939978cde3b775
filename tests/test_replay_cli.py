"""``kvstream replay --compare/--sweep/--report`` through typer's CliRunner, and the HTML
report opened in a real headless browser (Chromium) when one is installed."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import typer
from typer.testing import CliRunner

from kvstream.cli import replay_cmd
from kvstream.cli.replay_compare import Comparison, Sweep, run_many
from kvstream.cli.replay_run import ReplayOptions

if TYPE_CHECKING:
    from matplotlib.figure import Figure

app = typer.Typer()
app.callback()(lambda: None)  # a command group, as in kvstream's own app
app.command("replay")(replay_cmd.replay)
runner = CliRunner()
# the synthetic trace reuses prefixes from its first rows on (conversation's start is cold)
SMALL = ["synthetic", "-n", "200", "-w", "3", "-c", "600", "--no-progress"]


def run(*args: str) -> str:
    res = runner.invoke(app, ["replay", *args], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    return res.stdout


def test_compare_runs_every_policy_on_the_same_requests() -> None:
    out = json.loads(run(*SMALL, "--compare", "kv,least_loaded,round_robin,global_lru", "--json"))
    assert out["policies"] == ["kv", "least-loaded", "round-robin", "global-lru"]
    runs = out["runs"]
    assert [r["policy"] for r in runs] == out["policies"]
    assert len({r["ceiling_ratio"] for r in runs}) == 1  # the same requests, counted alike
    for r in runs:
        assert r["requests"] + r["unservable"] == r["trace_requests"] == 200
        assert r["hit_ratio"] <= r["ceiling_ratio"] <= 1.0
        assert r["prediction_accuracy"] == 1.0
        assert r["ttft_s"]["p99"] >= r["ttft_s"]["p50"] >= 0
    kv, _, rr, shared = runs
    assert kv["hit_ratio"] > rr["hit_ratio"]
    assert shared["hit_ratio"] >= rr["hit_ratio"]
    assert len(shared["workers"]) == 1
    text = run(*SMALL, "--compare", "kv,round-robin")
    assert "TTFT p50/p90/p99" in text
    assert "ceiling: " in text


def test_sweep_capacity_answers_how_much_cache() -> None:
    out = json.loads(
        run(*SMALL, "--compare", "kv,global_lru", "--sweep", "capacity=40,800", "--json")
    )
    assert out["sweep"] == {"param": "capacity", "values": [40, 800]}
    got = [(r["policy"], r["options"]["capacity_blocks"]) for r in out["runs"]]
    assert got == [("kv", 40), ("global-lru", 40), ("kv", 800), ("global-lru", 800)]
    small, big = out["runs"][0], out["runs"][2]
    assert small["unservable"] > 0  # prompts over 40 blocks cannot be served at 40
    assert small["requests"] + small["unservable"] == 200
    assert big["unservable"] == 0
    assert big["hit_ratio"] > small["hit_ratio"]
    workers = json.loads(run(*SMALL, "--sweep", "workers=1,2", "--json"))
    assert [len(r["workers"]) for r in workers["runs"]] == [1, 2]
    text = run(*SMALL, "--sweep", "workers=1,2")
    assert "ceiling at workers=2" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sweep", "memory=3"], "--sweep must be"),
        (["--sweep", "capacity=a"], "integers"),
        (["--sweep", "capacity=0"], ">= 1"),
        (["--compare", "kv,fastest"], "unknown router"),
        (["--compare", ","], "at least one"),
        (["--router", "fastest"], "unknown router"),
    ],
)
def test_bad_compare_and_sweep_exit_2(args: list[str], message: str) -> None:
    res = runner.invoke(app, ["replay", *SMALL, *args])
    assert res.exit_code == 2
    assert message in res.output


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[str, int] = {}
        self.refs: list[str] = []
        self.csp = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags[tag] = self.tags.get(tag, 0) + 1
        a = dict(attrs)
        for key in ("src", "href", "xlink:href"):
            if a.get(key):
                self.refs.append(a[key] or "")
        if a.get("http-equiv") == "Content-Security-Policy":
            self.csp = a.get("content") or ""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("matplotlib")
    path = tmp_path_factory.mktemp("report") / "out.html"
    res = runner.invoke(
        app,
        ["replay", *SMALL, "--compare", "kv,round_robin", "--sweep", "capacity=300,600",
         "--report", str(path)],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    return path


def test_report_is_self_contained_html(report: Path) -> None:
    page = _Page()
    page.feed(report.read_text())
    page.close()
    assert page.tags.get("svg", 0) >= 4  # capacity, TTFT CDF, a load plot per policy
    assert page.tags.get("table") == 1
    assert "default-src 'none'" in page.csp  # the browser may fetch nothing
    assert page.tags.get("script", 0) == 0
    assert page.refs  # matplotlib's SVG refers to its own glyphs and clip paths
    assert all(r.startswith(("#", "data:")) for r in page.refs), page.refs[:5]
    text = report.read_text()
    assert "Hit ratio against cache capacity" in text
    assert "Time to first token" in text
    assert "Per-worker load over time" in text


# ------------------------------------------------------------------ what each plot says

SWEPT = (300, 600, 1200)


@pytest.fixture(scope="module")
def swept() -> Comparison:
    """kv and round-robin over 8 workers at three capacities (the base is 600 blocks)."""
    pytest.importorskip("matplotlib")
    base = ReplayOptions(trace="synthetic", limit=200, workers=8, capacity_blocks=600)
    return asyncio.run(run_many(base, ["kv", "round_robin"], Sweep("capacity", SWEPT)))


def _drawn(fig: Figure) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig.canvas.get_renderer()  # type: ignore[attr-defined]


def test_capacity_plot_has_a_tick_at_every_swept_value_and_clips_no_marker(
    swept: Comparison,
) -> None:
    from kvstream.cli.replay_report import capacity_figure

    fig = capacity_figure(swept)
    _drawn(fig)
    (ax,) = fig.axes
    totals = [8 * v for v in SWEPT]
    lo, hi = ax.get_xlim()
    shown = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert shown == totals  # not powers of two between them
    assert [t.get_text() for t in ax.get_xticklabels() if t.get_text()] == [
        "2,400",
        "4,800",
        "9,600",
    ]
    assert not [t for t in ax.xaxis.get_minorticklabels() if t.get_text()]
    box = ax.get_window_extent()
    for line in ax.get_lines():
        radius = line.get_markersize() / 72 * fig.dpi / 2
        for x, y in ax.transData.transform(line.get_xydata()):
            assert box.x0 <= x - radius, line.get_label()
            assert x + radius <= box.x1, line.get_label()
            assert box.y0 <= y - radius, line.get_label()
            assert y + radius <= box.y1, line.get_label()
    assert "8 workers" in ax.get_xlabel()


def test_ttft_plot_names_the_capacity_it_shows_and_its_units(swept: Comparison) -> None:
    from kvstream.cli.replay_report import ttft_figure

    (ax,) = ttft_figure(swept.at(600)).axes
    assert "8 workers x 600 blocks" in ax.get_title()
    assert "seconds" in ax.get_xlabel()
    assert "%" in ax.get_ylabel()


def test_load_plot_is_a_band_whose_legend_leaves_the_axis_label_free(swept: Comparison) -> None:
    from kvstream.cli.replay_report import load_figure

    r = swept.at(600)[0]
    fig = load_figure(r)
    renderer = _drawn(fig)
    (ax,) = fig.axes
    assert "8 workers x 600 blocks" in ax.get_title()
    assert "minutes" in ax.get_xlabel()
    assert len(ax.get_lines()) == 1  # the median worker, not one line per worker
    assert len(ax.collections) == 1  # the least..most loaded band
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 2
    legend_box = legend.get_window_extent(renderer)
    for other in (ax.yaxis.label, ax.xaxis.label):
        assert not legend_box.overlaps(other.get_window_extent(renderer))
    assert legend_box.y1 <= ax.get_window_extent().y0  # under the plot: covers no data
    assert fig.bbox.contains(legend_box.x0, legend_box.y0)  # and inside the figure


def _browser() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_browser() is None, reason="no Chromium installed (parser check above)")
def test_report_renders_in_a_headless_browser(report: Path, tmp_path: Path) -> None:
    mpimg = pytest.importorskip("matplotlib.image")
    browser = _browser()
    assert browser is not None
    shot = tmp_path / "shot.png"
    base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    dom = subprocess.run(
        [*base, "--dump-dom", report.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert dom.count("<svg") >= 4  # the browser parsed every inline plot
    # the TTFT and load plots say which capacity they show (3 workers, the 600 of 300,600)
    assert "Time to first token at 3 workers x 600 blocks" in dom
    assert dom.count("(3 workers x 600 blocks).</figcaption>") == 2  # a load plot per policy
    assert "replayed total capacity: 900, 1,800 blocks" in dom
    subprocess.run(
        [*base, f"--screenshot={shot}", "--window-size=1100,1600", report.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    img = mpimg.imread(str(shot))
    rgb = (img[..., :3] * 255).round().astype(int)
    # the plots' lines are drawn: matplotlib's first two colours (tab:blue, tab:orange)
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
        near = (abs(rgb - colour).sum(axis=-1) < 40).sum()
        assert near > 200, colour


def test_requests_out_writes_every_served_request(tmp_path: Path) -> None:
    out = tmp_path / "requests.jsonl"
    summary = json.loads(
        run(*SMALL, "--compare", "kv,round_robin", "--requests-out", str(out), "--json")
    )
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    for policy, r in zip(("kv", "round-robin"), summary["runs"], strict=True):
        mine = [x for x in lines if x["policy"] == policy]
        assert len(mine) == r["requests"]
        assert sorted(x["index"] for x in mine) == list(range(r["requests"]))
        assert sum(x["hit_blocks"] for x in mine) == r["hit_blocks"]
        assert all(x["ttft_s"] >= x["queue_s"] >= 0 for x in mine)
        assert {x["worker"] for x in mine} <= set(range(3))
