"""What installing kvstream brings: the license, and torch only where it is used."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def expand(extra: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """The requirement names ``kvstream[extra]`` installs (self-references followed)."""
    out: set[str] = set()
    for req in PROJECT["optional-dependencies"][extra]:
        m = re.fullmatch(r"kvstream\[(.+)\]", req)
        if m:
            for sub in m.group(1).split(","):
                if sub not in seen:
                    out |= expand(sub.strip(), seen | {extra})
        else:
            out.add(re.split(r"[<>=!;\[ ]", req, maxsplit=1)[0].lower())
    return out


def test_torch_comes_only_with_the_cache_extra() -> None:
    assert not any(r.startswith("torch") for r in PROJECT["dependencies"])
    assert "torch" not in expand("all")  # a default torch wheel pulls gigabytes of CUDA
    assert "torch" in expand("cache")
    assert "torch" in expand("dev")  # the test suite runs the tensor-backed cache
    assert {"aiokafka", "avro", "matplotlib", "httptools"} <= expand("all")


def test_the_license_ships() -> None:
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
