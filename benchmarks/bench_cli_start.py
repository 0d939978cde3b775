"""Start-up time of the ``kvstream`` command (issue 14: ``--help`` and ``version`` <= 0.25 s).

    python benchmarks/bench_cli_start.py [--repeat 15] [--cmd "index --help" ...]

Runs each command line as a fresh process, ``--repeat`` times, interleaved so that machine
noise hits them alike, and reports the best and the median wall time. In the same run it
times the floors a user cannot go below: a bare interpreter (``python -c pass``) and a
one-command typer app (typer 0.29 coerces even ``--help`` through a pydantic TypeAdapter, so
every typer CLI pays for pydantic), and the eager CLI as it was before commands were lazy
(every command module imported and its typer command built, then ``version`` run).
``ratio`` = time / bare interpreter time (best of N each); ``over`` = time - bare interpreter
time (what kvstream itself costs). The target is an
absolute 0.25 s on an idle machine; on a loaded one compare ``over`` and the ratios.

The ``kvstream`` console script next to the running interpreter is used when it exists (what a
user runs), else ``python -m kvstream.cli.main``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 0.25


def _kvstream() -> list[str]:
    script = Path(sys.executable).with_name("kvstream")
    if script.exists():
        return [str(script)]
    found = shutil.which("kvstream")
    return [found] if found else [sys.executable, "-m", "kvstream.cli.main"]


def _time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument(
        "--cmd",
        action="append",
        help='kvstream arguments to time (repeatable; default: "--help", "version")',
    )
    args = ap.parse_args()
    kv = _kvstream()
    runs: dict[str, list[str]] = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "typer one-command app": [
            sys.executable,
            "-c",
            "import typer; app = typer.Typer(); app.command()(lambda: None); app([])",
        ],
        "eager CLI (before), version": [
            sys.executable,
            "-c",
            "import sys; from kvstream.cli.main import COMMANDS, app, load_command\n"
            "for name in COMMANDS: load_command(name)\n"
            "app(['version'])",
        ],
    }
    for cmd in args.cmd or ["--help", "version"]:
        runs[f"kvstream {cmd}"] = [*kv, *cmd.split()]
    env_note = f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}"
    for argv in runs.values():  # warm the page cache and .pyc files
        _time(argv)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeat):
        for name, argv in runs.items():
            times[name].append(_time(argv))
    base = min(times["python -c pass"])
    print(f"CLI start-up, best and median of {args.repeat} ({env_note}); console: {kv[0]}")
    print(f"{'command':<28} {'best s':>8} {'median s':>9} {'ratio':>7} {'over s':>8}")
    for name, ts in times.items():
        best = min(ts)
        print(
            f"{name:<28} {best:8.3f} {statistics.median(ts):9.3f} {best / base:7.2f} "
            f"{best - base:8.3f}"
            + ("" if not name.startswith("kvstream") else f"   target <= {TARGET_S} s")
        )


if __name__ == "__main__":
    main()
