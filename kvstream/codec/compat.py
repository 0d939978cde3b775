"""FULL_TRANSITIVE compatibility check of a schema directory.

For every ordered pair (writer, reader) of versions:

1. ``static``: kvstream's own walk of the Avro resolution rules, which names the field path
   and the rule broken (e.g. ``reader field has no default``); per version it also flags a
   union holding two branches a reader may promote into each other (``string`` and ``bytes``,
   ``int`` and ``long``, ...): fastavro resolves a writer's branch to the *first* reader branch
   that matches, promotions included, so bytes could come back as a string;
2. ``avro``: Apache avro's ``ReaderWriterCompatibilityChecker`` (the optional
   ``schema-check`` extra; imported lazily here only);
3. ``fastavro``: round trips of sample data, written with the writer schema and read with the
   reader schema. Union resolution is data-dependent, so this catches what a static check
   reports differently; the samples are kvstream's example batches plus random records.

It also detects an edited released version: each released version's wire fingerprint and
resolution digest are pinned in :data:`kvstream.codec.schemas.RELEASED`.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import fastavro
from fastavro.utils import generate_many

from kvstream.codec.downgrade import PACKED_TOKENS_SINCE, WRITABLE_VERSIONS
from kvstream.codec.records import batch_to_record
from kvstream.codec.samples import sample_batches
from kvstream.codec.schemas import RELEASED, SchemaInfo, load_schema_dir
from kvstream.codec.schemas import schema_dir as _default_schema_dir
from kvstream.errors import CodecError

__all__ = [
    "CompatIssue",
    "CompatReport",
    "ambiguous_unions",
    "check_compatibility",
    "static_issues",
]

_PRIMITIVES: Final = frozenset(
    {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
)
_PROMOTIONS: Final = {
    "int": {"long", "float", "double"},
    "long": {"float", "double"},
    "float": {"double"},
    "string": {"bytes"},
    "bytes": {"string"},
}
_RANDOM_SAMPLES: Final = 25


@dataclass(frozen=True)
class CompatIssue:
    """One problem: which check found it, for which (writer, reader) pair, where, and why."""

    check: str
    writer: int | None
    reader: int | None
    path: str
    rule: str
    detail: str = ""

    def __str__(self) -> str:
        pair = ""
        if self.writer is not None and self.reader is not None:
            pair = f"v{self.writer} data read as v{self.reader}: "
        elif self.writer is not None:
            pair = f"v{self.writer}: "
        tail = f" ({self.detail})" if self.detail else ""
        return f"[{self.check}] {pair}{self.path}: {self.rule}{tail}"


@dataclass(frozen=True)
class CompatReport:
    """The outcome of :func:`check_compatibility`; ``ok`` when no issue was found."""

    schema_dir: str
    versions: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]
    checks: tuple[str, ...]
    issues: tuple[CompatIssue, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when every pair passed every check and no released version was edited."""
        return not self.issues

    def render(self) -> str:
        """A human-readable report: one line per pair, then every issue and note."""
        lines = [
            f"schema dir: {self.schema_dir}",
            f"versions: {', '.join(f'v{v}' for v in self.versions)}",
            f"checks: {', '.join(self.checks)}",
        ]
        for w, r in self.pairs:
            bad = [i for i in self.issues if i.writer == w and i.reader == r]
            status = "OK" if not bad else f"{len(bad)} issue(s)"
            lines.append(f"  v{w} data read as v{r}: {status}")
        other = [i for i in self.issues if i.writer is None or i.reader is None]
        if self.issues:
            lines.append("issues:")
            lines.extend(f"  {i}" for i in (*other, *(i for i in self.issues if i not in other)))
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append("RESULT: " + ("compatible" if self.ok else "INCOMPATIBLE"))
        return "\n".join(lines)


# ------------------------------------------------------------------------- static resolution


def _names(schema: Any, namespace: str | None, out: dict[str, Any]) -> None:
    """Collect named types by full name (and short name) for reference lookups."""
    if isinstance(schema, list):
        for s in schema:
            _names(s, namespace, out)
        return
    if not isinstance(schema, dict):
        return
    t = schema.get("type")
    if t in ("record", "error", "enum", "fixed"):
        ns = schema.get("namespace", namespace)
        name = schema["name"]
        full = name if "." in name or not ns else f"{ns}.{name}"
        out[full] = schema
        out.setdefault(full.rsplit(".", 1)[-1], schema)
        namespace = full.rsplit(".", 1)[0] if "." in full else ns
        for f in schema.get("fields", ()):
            _names(f["type"], namespace, out)
    elif t == "array":
        _names(schema["items"], namespace, out)
    elif t == "map":
        _names(schema["values"], namespace, out)
    elif isinstance(t, (dict, list)):
        _names(t, namespace, out)


def _deref(schema: Any, names: Mapping[str, Any]) -> Any:
    if isinstance(schema, str) and schema not in _PRIMITIVES:
        return names.get(schema, schema)
    if isinstance(schema, dict) and isinstance(schema.get("type"), (dict, list)):
        return _deref(schema["type"], names)
    if isinstance(schema, dict) and schema.get("type") in _PRIMITIVES and len(schema) == 1:
        return schema["type"]
    return schema


def _kind(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    if isinstance(schema, str):
        return schema
    t = schema.get("type")
    return str(t) if t != "error" else "record"


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def _label(schema: Any) -> str:
    k = _kind(schema)
    if k in ("record", "enum", "fixed"):
        return f"{k} {schema['name']}"
    return k


class _Static:
    """Avro schema resolution rules, reporting (path, rule, detail) for each violation."""

    def __init__(self, writer: Any, reader: Any) -> None:
        self.wnames: dict[str, Any] = {}
        self.rnames: dict[str, Any] = {}
        _names(writer, None, self.wnames)
        _names(reader, None, self.rnames)
        self.seen: set[tuple[int, int]] = set()
        self.issues: list[tuple[str, str, str]] = []

    def pick(self, w: Any, union: list[Any]) -> Any:
        """The reader union branch Avro resolves writer type ``w`` to, or None."""
        wd = _deref(w, self.wnames)
        wk = _kind(wd)
        for rb in union:
            rd = _deref(rb, self.rnames)
            if _kind(rd) != wk:
                continue
            if wk not in ("record", "enum", "fixed") or _short(rd["name"]) in (
                _short(wd["name"]),
                *(_short(a) for a in rd.get("aliases", ())),
            ):
                return rb
        for rb in union:
            if _kind(_deref(rb, self.rnames)) in _PROMOTIONS.get(wk, ()):
                return rb
        return None

    def check(self, w: Any, r: Any, path: str) -> None:
        w = _deref(w, self.wnames)
        r = _deref(r, self.rnames)
        wk, rk = _kind(w), _kind(r)
        if wk == "union":
            for i, branch in enumerate(w):
                if rk != "union":
                    self.check(branch, r, path)
                    continue
                target = self.pick(branch, r)
                if target is None:
                    self.issues.append(
                        (
                            path,
                            "writer union branch missing from reader union",
                            f"branch {i} ({_label(_deref(branch, self.wnames))})",
                        )
                    )
                else:
                    self.check(branch, target, path)
            return
        if rk == "union":
            target = self.pick(w, r)
            if target is None:
                self.issues.append(
                    (path, "reader union has no branch for the writer type", _label(w))
                )
                return
            self.check(w, target, path)
            return
        if wk != rk:
            if rk in _PROMOTIONS.get(wk, ()):
                return
            self.issues.append((path, "type mismatch", f"writer {_label(w)}, reader {_label(r)}"))
            return
        if wk in _PRIMITIVES:
            return
        key = (id(w), id(r))
        if key in self.seen:
            return
        self.seen.add(key)
        if wk in ("record", "enum", "fixed"):
            wname = _short(w["name"])
            if wname != _short(r["name"]) and wname not in {
                _short(a) for a in r.get("aliases", ())
            }:
                self.issues.append(
                    (path, "named types differ", f"writer {w['name']}, reader {r['name']}")
                )
                return
        if wk == "array":
            self.check(w["items"], r["items"], f"{path}[]")
        elif wk == "map":
            self.check(w["values"], r["values"], f"{path}{{}}")
        elif wk == "fixed":
            if w["size"] != r["size"]:
                self.issues.append(
                    (path, "fixed sizes differ", f"writer {w['size']}, reader {r['size']}")
                )
        elif wk == "enum":
            missing = [s for s in w["symbols"] if s not in r["symbols"]]
            if missing and "default" not in r:
                self.issues.append(
                    (path, "enum symbol missing without default", f"writer symbols {missing}")
                )
        elif wk == "record":
            wfields = {f["name"]: f for f in w["fields"]}
            for f in r["fields"]:
                names = [f["name"], *f.get("aliases", ())]
                wf = next((wfields[n] for n in names if n in wfields), None)
                fpath = f"{path}.{f['name']}" if path else f["name"]
                if wf is None:
                    if "default" not in f:
                        self.issues.append(
                            (fpath, "reader field has no default", "the writer has no such field")
                        )
                else:
                    self.check(wf["type"], f["type"], fpath)


def static_issues(writer_json: Any, reader_json: Any) -> list[tuple[str, str, str]]:
    """(field path, rule, detail) for every resolution rule ``writer`` -> ``reader`` breaks."""
    s = _Static(writer_json, reader_json)
    s.check(writer_json, reader_json, str(reader_json.get("name", "")))
    return s.issues


def _walk_unions(schema: Any, path: str, seen: set[int], out: list[tuple[str, str, str]]) -> None:
    if isinstance(schema, list):
        kinds = [_kind(b) if not isinstance(b, str) or b in _PRIMITIVES else b for b in schema]
        for i, a in enumerate(kinds):
            for b in kinds[i + 1 :]:
                if b in _PROMOTIONS.get(a, ()) or a in _PROMOTIONS.get(b, ()):
                    out.append(
                        (
                            path,
                            "union branches a reader may promote into each other",
                            f"{a} and {b}: fastavro resolves to the first branch that matches",
                        )
                    )
        for branch in schema:
            _walk_unions(branch, path, seen, out)
        return
    if not isinstance(schema, dict) or id(schema) in seen:
        return
    seen.add(id(schema))
    t = schema.get("type")
    if isinstance(t, (dict, list)):
        _walk_unions(t, path, seen, out)
    elif t in ("record", "error"):
        for f in schema.get("fields", ()):
            _walk_unions(f["type"], f"{path}.{f['name']}" if path else f["name"], seen, out)
    elif t == "array":
        _walk_unions(schema["items"], f"{path}[]", seen, out)
    elif t == "map":
        _walk_unions(schema["values"], f"{path}{{}}", seen, out)


def ambiguous_unions(schema_json: Any) -> list[tuple[str, str, str]]:
    """(field path, rule, detail) for every union of ``schema_json`` holding two branches of
    which one promotes to the other (e.g. ``string`` and ``bytes``)."""
    out: list[tuple[str, str, str]] = []
    _walk_unions(schema_json, str(schema_json.get("name", "")), set(), out)
    return out


# ------------------------------------------------------------------------- Apache avro


def _location_path(reader_json: Any, location: str) -> str:
    """Translate Apache avro's JSON-pointer-like location into a dotted field path."""
    names: dict[str, Any] = {}
    _names(reader_json, None, names)
    node: Any = reader_json
    path = str(reader_json.get("name", ""))
    parts = [p for p in location.split("/") if p]
    i = 0
    try:
        while i < len(parts):
            part = parts[i]
            node = _deref(node, names) if part != "type" else node
            if part == "fields":
                node = node["fields"][int(parts[i + 1])]
                path += f".{node['name']}"
                i += 2
                continue
            if part == "type":
                node = node["type"]
            elif part == "items":
                node = node["items"]
                path += "[]"
            elif part == "values":
                node = node["values"]
                path += "{}"
            elif part.isdigit() and isinstance(node, list):
                node = node[int(part)]
            elif part in ("symbols", "name", "size"):
                path += f" ({part})"
            i += 1
    except (KeyError, IndexError, TypeError, ValueError):
        return f"{path} [{location}]"
    return path


def _avro_issues(
    writer: SchemaInfo, reader: SchemaInfo, avro_schema: Any, checker: Any
) -> list[CompatIssue]:
    try:
        w = avro_schema.parse(json.dumps(writer.schema_json))
        r = avro_schema.parse(json.dumps(reader.schema_json))
        result = checker().get_compatibility(r, w)
    except Exception as exc:  # avro raises its own exception types for bad schemas
        return [
            CompatIssue(
                "avro", writer.version, reader.version, "<schema>", "avro could not check", str(exc)
            )
        ]
    if result.compatibility.name == "compatible":
        return []
    locations = sorted(loc for loc in result.locations if loc not in ("", "/")) or ["/"]
    kinds = ", ".join(sorted(str(getattr(k, "value", k)) for k in result.incompatibilities))
    messages = "; ".join(sorted(str(m) for m in result.messages))
    return [
        CompatIssue(
            "avro",
            writer.version,
            reader.version,
            _location_path(reader.schema_json, loc),
            kinds,
            messages,
        )
        for loc in locations
    ]


# ------------------------------------------------------------------------- fastavro runtime


def _samples(writer: SchemaInfo) -> Iterator[tuple[str, Any]]:
    """(label, record) pairs of the writer schema: kvstream samples, then random records."""
    if writer.version in WRITABLE_VERSIONS:
        # v4 carries token ids as bit planes or packed (its own kind): sample both layouts.
        encodings = (
            ("planes", "varint+zstd") if writer.version >= PACKED_TOKENS_SINCE else ("auto",)
        )
        for i, batch in enumerate(sample_batches()):
            for encoding in encodings:
                yield (
                    f"sample batch {i} ({encoding} tokens)",
                    batch_to_record(batch, writer.version, lossy=True, token_encoding=encoding),
                )
    state = random.getstate()
    random.seed(writer.version * 7919)
    try:
        records = list(generate_many(writer.parsed, _RANDOM_SAMPLES))
    finally:
        random.setstate(state)
    for i, rec in enumerate(records):
        yield f"random record {i}", rec


def _runtime_issues(writer: SchemaInfo, reader: SchemaInfo) -> list[CompatIssue]:
    issues: dict[str, CompatIssue] = {}
    for label, record in _samples(writer):
        buf = io.BytesIO()
        try:
            fastavro.schemaless_writer(buf, writer.parsed, record)
        except Exception as exc:  # fastavro raises many types on data/schema mismatch
            if label.startswith("sample"):
                issues.setdefault(
                    "write",
                    CompatIssue(
                        "fastavro",
                        writer.version,
                        reader.version,
                        "<sample data>",
                        f"kvstream's v{writer.version} records cannot be written with this schema",
                        f"{label}: {type(exc).__name__}: {exc}",
                    ),
                )
            continue
        try:
            fastavro.schemaless_reader(io.BytesIO(buf.getvalue()), writer.parsed, reader.parsed)
        except Exception as exc:  # fastavro raises many types on resolution failures
            msg = f"{type(exc).__name__}: {exc}"
            issues.setdefault(
                msg,
                CompatIssue(
                    "fastavro",
                    writer.version,
                    reader.version,
                    "<data>",
                    "fastavro could not resolve written data",
                    f"{label}: {msg}",
                ),
            )
    return list(issues.values())


# ------------------------------------------------------------------------- entry point


def _pin_issues(infos: Sequence[SchemaInfo], notes: list[str]) -> list[CompatIssue]:
    issues = []
    present = {i.version for i in infos}
    for version in sorted(set(RELEASED) - present):
        issues.append(
            CompatIssue(
                "pinned",
                version,
                None,
                f"kv_event_batch.v{version}.avsc",
                "released version missing from the directory",
            )
        )
    for info in infos:
        pin = RELEASED.get(info.version)
        if pin is None:
            notes.append(
                f"v{info.version} is not released yet (no pin in kvstream.codec.schemas.RELEASED)"
            )
            continue
        if info.fingerprint_hex != pin.fingerprint:
            issues.append(
                CompatIssue(
                    "pinned",
                    info.version,
                    None,
                    Path(info.source).name,
                    "released schema edited: its Parsing Canonical Form changed",
                    f"fingerprint {info.fingerprint_hex}, released {pin.fingerprint}",
                )
            )
        if info.resolution_digest != pin.resolution_digest:
            issues.append(
                CompatIssue(
                    "pinned",
                    info.version,
                    None,
                    Path(info.source).name,
                    "released schema edited: defaults, aliases or properties changed",
                    f"digest {info.resolution_digest[:16]}..., "
                    f"released {pin.resolution_digest[:16]}...",
                )
            )
    return issues


def check_compatibility(
    schema_dir: str | Path | None = None, *, require_avro: bool = False
) -> CompatReport:
    """Check every ordered (writer, reader) pair of the versions in ``schema_dir``.

    Default directory: the shipped schemas. Without Apache avro installed its check is
    skipped with a note (an issue when ``require_avro``). Never raises for incompatible or
    broken schemas: an unloadable directory is reported as an issue.
    """
    root = Path(schema_dir) if schema_dir is not None else _default_schema_dir()
    notes: list[str] = []
    try:
        registry = load_schema_dir(root)
    except CodecError as exc:
        return CompatReport(
            str(root),
            (),
            (),
            ("load",),
            (CompatIssue("load", None, None, str(root), "schemas cannot be loaded", str(exc)),),
        )
    infos = list(registry)
    checks = ["pinned", "static", "fastavro"]
    avro_schema: Any = None
    checker: Any = None
    try:
        import avro.schema
        from avro.compatibility import ReaderWriterCompatibilityChecker
    except ImportError:
        pass
    else:
        avro_schema, checker = avro.schema, ReaderWriterCompatibilityChecker
    issues = _pin_issues(infos, notes)
    if avro_schema is None:
        text = (
            "Apache avro is not installed (pip install 'kvstream[schema-check]'); "
            "its check was skipped"
        )
        if require_avro:
            issues.append(
                CompatIssue("avro", None, None, "<avro>", "Apache avro is required", text)
            )
        else:
            notes.append(text)
    else:
        checks.insert(2, "avro")
    pairs = [(w.version, r.version) for w in infos for r in infos]
    for info in infos:
        for path, rule, detail in ambiguous_unions(info.schema_json):
            issues.append(CompatIssue("static", info.version, None, path, rule, detail))
    for w in infos:
        for r in infos:
            if w.version != r.version:
                for path, rule, detail in static_issues(w.schema_json, r.schema_json):
                    issues.append(CompatIssue("static", w.version, r.version, path, rule, detail))
                if avro_schema is not None:
                    issues.extend(_avro_issues(w, r, avro_schema, checker))
            issues.extend(_runtime_issues(w, r))
    return CompatReport(
        str(root), registry.versions(), tuple(pairs), tuple(checks), tuple(issues), tuple(notes)
    )
