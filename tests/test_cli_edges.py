"""Where the command line meets a user: one-line errors and consistent exit codes (2 usage,
1 run time, 130 Ctrl-C), install hints that keep the extra's name, plain help, output paths
checked before a long run, progress off a terminal, Ctrl-C that reports what was done, and
``events dump`` of a directory. Commands run as a user runs them: in a subprocess, through
``kvstream.cli.main``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
# run kvstream's entry point with SIGINT back to Python's default (a test runner started in
# the background inherits SIGINT ignored) and the modules named in argv[1] unimportable
RUN = (
    "import signal, sys\n"
    "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
    "for m in filter(None, sys.argv[1].split(',')):\n"
    "    sys.modules[m] = None\n"
    "sys.argv = ['kvstream', *sys.argv[2:]]\n"
    "from kvstream.cli.main import main\n"
    "main()\n"
)


def kvstream(
    *args: str, hide: str = "", env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN, hide, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        timeout=300,
        check=False,
    )


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", RUN, "", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


def one_line_error(res: subprocess.CompletedProcess[str], code: int) -> str:
    """The command failed with ``code`` and one ``error:`` line, no traceback."""
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, res.stderr
    return errors[0]


# ------------------------------------------------------------------------ help and hints


def test_help_is_plain_text_that_keeps_brackets_and_shows_no_bool_metavar() -> None:
    for cmd in (["replay"], ["demo"], ["bridge"], ["events", "dump"], ["index"]):
        res = kvstream(*cmd, "--help")
        assert res.returncode == 0, res.stderr
        assert "<bool>" not in res.stdout, cmd
        assert "--help" in res.stdout, cmd
    text = kvstream("replay", "--help").stdout
    assert "pip install 'kvstream[report]'" in " ".join(text.split())
    assert "[default: adapt the weight online]" in " ".join(text.split())


@pytest.mark.parametrize(
    ("hide", "args", "extra"),
    [
        ("aiokafka", ["demo", "-n", "3", "-s", "kafka://127.0.0.1:9/t"], "kafka"),
        ("aiokafka", ["bridge", "{tmp}", "-s", "kafka://127.0.0.1:9/t"], "kafka"),
        ("aiokafka", ["replay", "synthetic", "-n", "3", "--sink", "kafka://127.0.0.1:9/t"],
         "kafka"),
        ("aiokafka", ["index", "kafka://127.0.0.1:9/t"], "kafka"),
        ("matplotlib", ["replay", "synthetic", "-n", "3", "--report", "{tmp}/r.html"], "report"),
    ],
)  # fmt: skip
def test_install_hints_keep_the_extra(
    hide: str, args: list[str], extra: str, tmp_path: Path
) -> None:
    res = kvstream(*(a.replace("{tmp}", str(tmp_path)) for a in args), hide=hide)
    line = one_line_error(res, 2 if extra == "report" else 1)
    assert f"pip install 'kvstream[{extra}]'" in line


# ------------------------------------------------------------------ errors and exit codes


def test_from_trtllm_bad_paths_are_one_line_usage_errors(tmp_path: Path) -> None:
    good = DATA / "trtllm_reference_examples.json"
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    cases = [
        ([str(tmp_path / "missing.json"), "-o", str(tmp_path / "o.avro")], "no such file"),
        ([str(binary), "-o", str(tmp_path / "o.avro")], "not a JSON text file"),
        ([str(good), "-o", str(tmp_path / "no" / "o.avro")], "does not exist"),
        ([str(good), "-o", str(tmp_path)], "is a directory"),
    ]
    for args, message in cases:
        line = one_line_error(kvstream("events", "from-trtllm", *args), 2)
        assert message in line, (args, line)


def test_missing_and_malformed_inputs_are_usage_errors_everywhere(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x90\x0a" * 1500)
    missing = str(tmp_path / "missing.avro")
    for cmd in (["index"], ["events", "dump"], ["bridge", "-q", "-s", "memory"]):
        assert "no such file" in one_line_error(kvstream(*cmd, missing), 2)
        assert "garbage.bin" in one_line_error(kvstream(*cmd, str(garbage)), 2)


def test_a_port_out_of_range_is_a_usage_error_before_any_connect(tmp_path: Path) -> None:
    url = "kafka://127.0.0.1:99999/x"
    for args in (
        ["index", url],
        ["events", "dump", url],
        ["bridge", str(tmp_path), "-s", url],
        ["demo", "-n", "3", "-s", url],
    ):
        line = one_line_error(kvstream(*args), 2)
        assert "'99999'" in line, args
        assert "1..65535" in line, args


def test_dump_reads_a_file_sink_directory(tmp_path: Path) -> None:
    out = tmp_path / "events"
    res = kvstream("demo", "-s", "file", "-o", str(out), "-n", "12", "--ranks", "2", "--json")
    assert res.returncode == 0, res.stderr
    files = sorted(out.iterdir())
    assert files
    whole = kvstream("events", "dump", str(out))
    assert whole.returncode == 0, whole.stderr
    per_file = [kvstream("events", "dump", str(f)).stdout.splitlines() for f in files]
    lines = whole.stdout.splitlines()
    assert sorted(lines) == sorted(line for f in per_file for line in f)
    assert len(lines) == json.loads(res.stdout)["events"]


# ------------------------------------------------------------------------------ long runs


def test_replay_checks_its_outputs_before_replaying(tmp_path: Path) -> None:
    for flag in ("--report", "--requests-out"):
        for target, message in ((tmp_path / "no" / "x", "does not exist"), (tmp_path, "dir")):
            res = kvstream("replay", "conversation", "--progress", flag, str(target))
            assert message in one_line_error(res, 2)
            assert "replaying" not in res.stderr  # failed before the first run started


def test_replay_off_a_terminal_prints_plain_progress_lines() -> None:
    res = kvstream("replay", "synthetic", "-n", "100", "-w", "2", "--compare", "kv,random")
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert "replaying kv (1/2)" in lines
    assert "replaying random (2/2)" in lines


def interrupt_when(proc: subprocess.Popen[str], marker: str) -> tuple[str, str]:
    """Send SIGINT once stderr shows ``marker``; return (stdout, stderr)."""
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if marker in line:
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=120)
    return out, "".join(seen) + err


def test_ctrl_c_in_a_comparison_prints_the_finished_runs_and_exits_130() -> None:
    proc = start(
        "replay", "synthetic", "-w", "3", "-c", "600", "--compare", "kv,random,round_robin"
    )
    out, err = interrupt_when(proc, "replaying random (2/3)")
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted: 1 of 3 run(s) finished" in err
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert [r.split("│")[1].strip() for r in rows] == ["kv"]


def test_ctrl_c_in_the_demo_says_how_far_it_got_and_leaves_no_temp_dir(tmp_path: Path) -> None:
    proc = start("demo", "--conversations", "3000", env={"TMPDIR": str(tmp_path)})
    _, err = interrupt_when(proc, "serving requests")
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted: " in err
    assert "requests served" in err
    assert list(tmp_path.iterdir()) == []


def test_the_demo_removes_its_temp_dir_and_keeps_out(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    res = kvstream("demo", "-n", "8", env={"TMPDIR": str(temp)})
    assert res.returncode == 0, res.stderr
    assert list(temp.iterdir()) == []
    assert "read back and removed; keep them with --out DIR" in " ".join(res.stdout.split())
    kept = tmp_path / "kept"
    res = kvstream("demo", "-n", "8", "--sink", "file", "-o", str(kept), env={"TMPDIR": str(temp)})
    assert res.returncode == 0, res.stderr
    assert any(kept.glob("*.avro"))
    assert list(temp.iterdir()) == []


# ----------------------------------------------------------------------- small but visible


def test_version_flag_lists_every_native_extension_and_python_m_runs_the_cli() -> None:
    from kvstream._native import EXTENSIONS
    from kvstream.cli.native_info import NATIVE_MODULES

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")

    built = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert sorted(EXTENSIONS.values()) == sorted(m["name"] for m in built["ext-modules"])
    res = subprocess.run(
        [sys.executable, "-m", "kvstream", "--version"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("kvstream 0.1.0 (writes event schema v")
    assert lines[1].startswith(f"native core: {len(EXTENSIONS)} extension modules, ")
    roles = {line.strip() for line in lines[2:] if not line.startswith("    ")}
    assert roles == {f"{ext} ({role})" for role, ext in EXTENSIONS.items()}
    named = {line.split(":")[0].strip() for line in lines[2:] if line.startswith("    ")}
    assert named == {m.removeprefix("kvstream.") for m in NATIVE_MODULES}
    off = kvstream("--version", env={"KVSTREAM_NO_NATIVE": "1"})
    assert " 0 of " in off.stdout.splitlines()[1]
    assert off.stdout.count("off (KVSTREAM_NO_NATIVE)") == len(NATIVE_MODULES)


def test_schema_commands_print_json() -> None:
    listed = json.loads(kvstream("schema", "show", "--list", "--json").stdout)
    assert [r["version"] for r in listed] == sorted(r["version"] for r in listed)
    assert sum(r["current"] for r in listed) == 1
    one = json.loads(kvstream("schema", "show", "-v", "1", "--json").stdout)
    assert one["version"] == 1
    assert one["schema"]["type"] == "record"
    check = json.loads(kvstream("schema", "check", "--json").stdout)
    assert check["ok"] is True
    assert check["issues"] == []
    assert {"writer": 1, "reader": len(listed)} in check["pairs"]


def test_a_busy_metrics_port_is_named(tmp_path: Path) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = kvstream("bridge", str(tmp_path), "-s", "memory", "-q", "--metrics-port", str(port))
    assert f"--metrics-port {port}" in one_line_error(res, 2)


def test_metrics_has_process_python_and_build_info(tmp_path: Path) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start(
        "bridge", str(tmp_path), "-s", "memory", "-q", "--follow", "--idle-exit", "120",
        "--metrics-port", str(port),
    )  # fmt: skip
    try:
        text = ""
        for _ in range(600):  # until the bridge serves (it exits only when told)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    text = r.read().decode()
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                import time

                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    for name in ("process_cpu_seconds_total", "python_info", "python_gc_objects_collected_total"):
        assert name in text, name
    build = [line for line in text.splitlines() if line.startswith("kvstream_build_info{")]
    assert len(build) == 1
    assert 'version="0.1.0"' in build[0]
    assert "native=" in build[0]
    assert "schema_version=" in build[0]
