"""A user's install: build the wheel, install it into a fresh virtual environment, and run
``kvstream replay conversation`` from a directory that has no checkout nearby (the traces
must come from the package). The dependencies are borrowed from the test environment through
a ``.pth`` line instead of being downloaded again; the editable checkout is not visible (its
finder lives in a ``.pth`` file of a directory that is only *added* to the path)."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installs_and_replays_the_shipped_trace_from_anywhere(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(ROOT)],
        check=True,
        timeout=600,
    )  # fmt: skip
    (wheel,) = dist.glob("kvstream-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for name in ("conversation", "synthetic"):
        assert f"kvstream/workloads/data/{name}_trace.jsonl.gz" in names
    assert "kvstream/workloads/data/NOTICE" in names
    # the license ships (pyproject license-files), and torch only with the cache extra
    (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    assert meta.replace("METADATA", "licenses/LICENSE") in names
    requires = [
        line for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist: ")
    ]  # fmt: skip
    torch = [line for line in requires if line.startswith("Requires-Dist: torch")]
    assert torch == ['Requires-Dist: torch>=2.2; extra == "cache"'], torch
    assert wheel.stat().st_size < 3_000_000  # the traces are compressed

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
         str(wheel)],
        check=True,
        timeout=300,
    )  # fmt: skip
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "zz_test_deps.pth").write_text("\n".join(deps) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("KVSTREAM_DATA_DIR", "PYTHONPATH")}
    where = subprocess.run(
        [str(py), "-c", "import kvstream; print(kvstream.__file__)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    assert where.startswith(purelib), where  # the installed wheel, not the checkout
    out = subprocess.run(
        [str(env_dir / "bin" / "kvstream"), "replay", "conversation", "--limit", "200",
         "-w", "4", "--json"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["trace_file"].startswith(purelib)
    assert r["requests"] + r["unservable"] == 200
    assert r["prediction_accuracy"] == 1.0
