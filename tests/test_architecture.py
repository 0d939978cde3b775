"""Layer and dependency rules of DESIGN §1, checked on the source tree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Top-level name under kvstream -> layer. A module imports only its own or lower layers.
LAYERS = {
    "_native": 0,  # the native core: its loader, and C modules that import nothing of kvstream
    "_types": 0,
    "errors": 0,
    "clock": 0,
    "latency": 0,  # the histogram buckets the pipeline and the service share
    "config": 0,
    "kafka_security": 0,  # TLS/SASL settings of every Kafka client (stdlib ssl only)
    "events": 1,
    "hashing": 1,
    "workloads": 1,
    "codec": 2,
    "engines": 2,
    "sink": 2,
    "sinks": 2,  # adapters: L0-L2 only, never L3+
    "schemas": 2,
    "cache": 3,
    "pipeline": 3,
    "index": 3,
    "cli": 4,
    "serve": 4,  # the index service: HTTP API, feeds, snapshots
    "app": 4,
}
L3_SIBLINGS = {"cache", "pipeline", "index"}
# third-party module -> the only kvstream areas allowed to import it
CONFINED = {
    "torch": {"cache"},
    "xxhash": {"cache", "hashing"},
    "msgspec": {"engines", "serve"},  # engine wire formats; the service's JSON bodies
    "zmq": {"engines"},
    "aiokafka": {"sinks", "index"},
    "fastavro": {"codec"},
    "avro": {"codec"},
}


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted((ROOT / "kvstream").rglob("*.py")):
        rel = path.relative_to(ROOT / "kvstream").with_suffix("")
        out.append((".".join(("kvstream", *rel.parts)).removesuffix(".__init__"), path))
    for path in sorted((ROOT / "sinks").rglob("*.py")):
        rel = path.relative_to(ROOT / "sinks").with_suffix("")
        out.append((".".join(("kvstream", "sinks", *rel.parts)).removesuffix(".__init__"), path))
    return out


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: list[str] = []
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                names.append(".".join([*base, node.module] if node.module else base))
            elif node.module:
                names.append(node.module)
    return names


MODULES = _modules()


def test_found_the_package() -> None:
    assert any(m == "kvstream.events.model" for m, _ in MODULES)


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_layering(module: str, path: Path) -> None:
    area = _area(module)
    if area not in LAYERS:  # the package root re-exports; kept import-light by its own test
        return
    mine = LAYERS[area]
    for imp in _imports(module, path):
        top = imp.split(".")[0]
        if top == "kvstream":
            other = _area(imp)
            if other in ("", area):
                continue
            assert other in LAYERS, f"{module} imports unknown kvstream area {imp}"
            assert LAYERS[other] <= mine, f"{module} (L{mine}) imports higher layer {imp}"
            if area in L3_SIBLINGS:
                assert other not in L3_SIBLINGS, f"L3 siblings must not import each other: {imp}"
        elif top in CONFINED:
            assert area in CONFINED[top], f"{module} imports {top}; only {CONFINED[top]} may"


def test_core_imports_without_torch_or_kafka() -> None:
    code = (
        "import sys\n"
        "import kvstream, kvstream.events, kvstream.hashing, kvstream.codec\n"
        "bad = [m for m in ('torch', 'aiokafka', 'avro') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _runtime_imports(path: Path) -> list[str]:
    """The modules ``path`` imports at run time (``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.extend([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return names


@pytest.mark.parametrize(("module", "path"), MODULES, ids=[m for m, _ in MODULES])
def test_native_modules_load_only_through_the_one_loader(module: str, path: Path) -> None:
    # so KVSTREAM_NO_NATIVE, the missing-build warning and the version report cover them all
    from kvstream._native import MODULES as NATIVE

    if _area(module) == "_native":
        return
    direct = [imp for imp in _runtime_imports(path) if imp in NATIVE]
    assert not direct, f"{module} imports {direct} directly: use kvstream._native.load"
