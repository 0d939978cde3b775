"""The one native loader (kvstream._native): the switch, loud missing builds, the report."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

import kvstream._native as native

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env: str) -> str:
    import os

    full = {k: v for k, v in os.environ.items() if not k.startswith("KVSTREAM_")}
    full.update(env)
    out = subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_every_module_pyproject_builds_is_known_to_the_loader() -> None:
    built = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # one extension per role, and every part in the role the loader looks for it in
    assert sorted(native.EXTENSIONS.values()) == sorted(m["name"] for m in built["ext-modules"])
    assert set(native.MODULES.values()) == set(native.EXTENSIONS)
    sources = {m["name"]: m["sources"] for m in built["ext-modules"]}
    for part, role in native.MODULES.items():
        source = (
            "kvstream/_native/src/index_table.c"
            if part == "kvstream._native._index"
            else (part.replace(".", "/") + ".c")
        )
        assert source in sources[native.EXTENSIONS[role]], part


def test_each_part_is_a_submodule_of_its_role() -> None:
    import importlib
    import sys

    for part, role in native.MODULES.items():
        try:
            got = native.import_part(part)
        except ImportError:
            pytest.skip(f"{native.EXTENSIONS[role]} is not built")
        assert got.__name__ == part
        assert sys.modules[part] is got  # where a pickled type's module is looked up
        assert importlib.import_module(native.EXTENSIONS[role]).__name__ == native.EXTENSIONS[role]
    with pytest.raises(KeyError):
        native.import_part("kvstream.nothing._native")


def test_this_build_has_every_native_module() -> None:
    # the dev install builds them all; CI sets KVSTREAM_REQUIRE_NATIVE to fail otherwise
    status = json.loads(_run("import json, kvstream._native as n; print(json.dumps(n.report()))"))
    assert status == dict.fromkeys(native.MODULES, "active")


# what each module's user keeps when it loaded its native module (None: the pure twin)
_USERS = """
import json
from collections.abc import Iterator
from kvstream.codec import tokens, encoder, columnar
from kvstream.events import columns
from kvstream.hashing import accel, trtllm
from kvstream.engines import vllm
from kvstream.workloads import mooncake
print(json.dumps({
    "codec.tokens": tokens.NATIVE,
    "codec.encoder": encoder._NATIVE_ENCODE is not None,
    "codec.columnar": columnar.NATIVE,
    "events.columns": columns.native_model_columns() is not None,
    "hashing.accel": accel._chainnative is not None,
    "hashing.trtllm": trtllm._v1native is not None,
    "engines.vllm": vllm._wire_native is not None,
    "workloads.mooncake": mooncake._mooncake_native is not None,
}))
"""


def test_users_take_their_native_module() -> None:
    assert set(json.loads(_run(_USERS)).values()) == {True}


def test_the_switch_is_honoured_everywhere() -> None:
    # codec.tokens and codec.encoder ignored it before the one loader
    used = json.loads(_run(_USERS, KVSTREAM_NO_NATIVE="1"))
    assert used == dict.fromkeys(used, False)
    status = json.loads(
        _run(
            "import json, kvstream._native as n; print(json.dumps(n.report()))",
            KVSTREAM_NO_NATIVE="1",
        )
    )
    assert set(status.values()) == {"off (KVSTREAM_NO_NATIVE)"}


@pytest.fixture
def absent(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "kvstream._native._not_a_module"
    monkeypatch.setitem(native.MODULES, name, "test")
    monkeypatch.setitem(native.EXTENSIONS, "test", "kvstream._native._not_an_extension")
    monkeypatch.delenv("KVSTREAM_NO_NATIVE", raising=False)
    monkeypatch.delenv("KVSTREAM_REQUIRE_NATIVE", raising=False)
    yield name
    native._loaded.pop(name, None)
    native._status.pop(name, None)


def test_a_missing_build_warns_once(absent: str) -> None:
    with pytest.warns(native.NativeMissingWarning, match="not built.*KVSTREAM_NO_NATIVE=1"):
        assert native.load(absent) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load(absent) is None  # answered once, no second warning
    assert native.report()[absent] == "not built"


def test_a_missing_build_fails_when_required(absent: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTREAM_REQUIRE_NATIVE", "1")
    with pytest.raises(native.NativeBuildError, match=absent):
        native.load(absent)
    assert native.report()[absent] == "not built"  # the report itself never raises


def test_the_switch_wins_over_required(absent: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTREAM_REQUIRE_NATIVE", "1")
    monkeypatch.setenv("KVSTREAM_NO_NATIVE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load(absent) is None
    assert native.report()[absent] == "off (KVSTREAM_NO_NATIVE)"


def test_unknown_names_are_refused() -> None:
    with pytest.raises(KeyError):
        native.load("kvstream.nothing")
