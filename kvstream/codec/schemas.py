"""The versioned Avro schemas: loading, canonical forms, fingerprints, the release pins.

Every version lives in its own file ``kv_event_batch.v<N>.avsc`` of the ``kvstream.schemas``
package (the repository's ``schemas/`` directory) and is never edited once released. Each file
also states its number in the top-level property ``"kvstream.schema_version"``.

A version is identified on the wire by the CRC-64-AVRO fingerprint of its Parsing Canonical
Form (Avro single-object encoding). :data:`RELEASED` pins, per released version, that
fingerprint and a digest of everything else that affects schema resolution (defaults, enum
defaults, aliases, properties; docs excluded), so an edited release is detected.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Final

import fastavro
from fastavro.schema import to_parsing_canonical_form

from kvstream.errors import SchemaCompatibilityError, UnknownSchemaError
from kvstream.events.model import CURRENT_SCHEMA_VERSION

__all__ = [
    "CURRENT_VERSION",
    "RELEASED",
    "SCHEMA_FILE_RE",
    "ReleasedSchema",
    "SchemaInfo",
    "SchemaRegistry",
    "VERSION_PROPERTY",
    "crc64_avro",
    "load_schema_dir",
    "resolution_digest",
    "schema_dir",
    "schema_registry",
]

#: File name of one version: ``kv_event_batch.v<N>.avsc``.
SCHEMA_FILE_RE: Final = re.compile(r"^kv_event_batch\.v([1-9][0-9]*)\.avsc$")
#: Top-level schema property holding the version number.
VERSION_PROPERTY: Final = "kvstream.schema_version"
#: The version written by default (the model's ``CURRENT_SCHEMA_VERSION``, the default
#: ``EventBatch.schema_version``). Readers resolve into the highest shipped version.
CURRENT_VERSION: Final[int] = CURRENT_SCHEMA_VERSION


@dataclass(frozen=True)
class ReleasedSchema:
    """What a released version must keep: its wire fingerprint and its resolution digest."""

    fingerprint: str
    resolution_digest: str


#: Released versions. Adding a version means adding its pins here in the same change;
#: ``check_compatibility`` reports a released file whose pins no longer match.
RELEASED: Final[Mapping[int, ReleasedSchema]] = {
    1: ReleasedSchema(
        fingerprint="ac7ad987866cf437",
        resolution_digest="1b7bbeaa8a49e012aaa2b71dbd8865f6f60d2683f51dfb8fb20dfbedf5f9d50a",
    ),
    2: ReleasedSchema(
        fingerprint="f9e9d3199857e8b2",
        resolution_digest="23769e9be387328152e769609ac57528d526d309355275bae19a4e76f00744cd",
    ),
    3: ReleasedSchema(
        fingerprint="479674ac542f98fe",
        resolution_digest="3fbf8f5cfcdaf938a2cd19efb14a379a751977185cbe90e06938ddcfd983274b",
    ),
    4: ReleasedSchema(
        fingerprint="93d299a0cee609f3",
        resolution_digest="240886c5e1c8458cb386f2da544a79ebb5e2aab93970c3830d8478ac92316113",
    ),
}

_CRC64_EMPTY: Final = 0xC15D213AA4D7A795


def _crc64_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (_CRC64_EMPTY & -(fp & 1))
        table.append(fp)
    return tuple(table)


_CRC64_TABLE: Final = _crc64_table()


def crc64_avro(data: bytes) -> bytes:
    """The CRC-64-AVRO (Rabin) fingerprint of ``data`` as 8 little-endian bytes.

    This is the Avro specification's reference algorithm; the single-object encoding puts
    these 8 bytes after ``C3 01``. (``fastavro.schema.fingerprint`` agrees; see the tests.)
    """
    fp = _CRC64_EMPTY
    for byte in data:
        fp = (fp >> 8) ^ _CRC64_TABLE[(fp ^ byte) & 0xFF]
    return fp.to_bytes(8, "little")


def _strip_docs(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_docs(v) for k, v in node.items() if k != "doc"}
    if isinstance(node, list):
        return [_strip_docs(v) for v in node]
    return node


def resolution_digest(schema_json: Any) -> str:
    """SHA-256 (hex) of the schema JSON without ``doc`` strings, keys sorted.

    Unlike the Parsing Canonical Form it covers defaults, enum defaults, aliases and custom
    properties: everything a reader uses to resolve data, so editing any of it is detected.
    """
    text = json.dumps(_strip_docs(schema_json), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class SchemaInfo:
    """One schema version.

    ``schema_json`` is the file's JSON; ``parsed`` is fastavro's parsed form (for its reader
    and writer); ``canonical_form`` is the Parsing Canonical Form and ``fingerprint`` its
    CRC-64-AVRO fingerprint (8 little-endian bytes, as in the single-object header).
    """

    version: int
    source: str
    schema_json: Mapping[str, Any] = field(repr=False)
    parsed: Any = field(repr=False, compare=False)
    canonical_form: str = field(repr=False)
    fingerprint: bytes
    resolution_digest: str = field(repr=False)

    @property
    def fingerprint_hex(self) -> str:
        """The fingerprint as 16 hex digits (the little-endian bytes, as fastavro prints it)."""
        return self.fingerprint.hex()

    @property
    def schema_text(self) -> str:
        """Compact JSON text of the schema (docs included), as stored in container headers."""
        return json.dumps(self.schema_json, separators=(",", ":"))

    @classmethod
    def from_json(cls, version: int, schema_json: Mapping[str, Any], source: str) -> SchemaInfo:
        """Parse and fingerprint ``schema_json``; raises SchemaCompatibilityError if invalid."""
        try:
            parsed = fastavro.parse_schema(dict(schema_json))
            canonical = to_parsing_canonical_form(parsed)
        except Exception as exc:  # fastavro raises several unrelated types for bad schemas
            raise SchemaCompatibilityError(f"{source}: not a valid Avro schema: {exc}") from exc
        declared = schema_json.get(VERSION_PROPERTY)
        if declared is not None and declared != version:
            raise SchemaCompatibilityError(
                f"{source}: file is version {version} but {VERSION_PROPERTY} says {declared!r}"
            )
        return cls(
            version=version,
            source=source,
            schema_json=schema_json,
            parsed=parsed,
            canonical_form=canonical,
            fingerprint=crc64_avro(canonical.encode()),
            resolution_digest=resolution_digest(schema_json),
        )


class SchemaRegistry:
    """The schema versions of one directory, by version and by fingerprint."""

    def __init__(self, infos: Mapping[int, SchemaInfo]) -> None:
        self._by_version = dict(sorted(infos.items()))
        self._by_fingerprint: dict[bytes, SchemaInfo] = {}
        for info in self._by_version.values():
            other = self._by_fingerprint.get(info.fingerprint)
            if other is not None:
                raise SchemaCompatibilityError(
                    f"versions {other.version} and {info.version} have the same canonical form"
                )
            self._by_fingerprint[info.fingerprint] = info

    def versions(self) -> tuple[int, ...]:
        """Known versions, ascending."""
        return tuple(self._by_version)

    @property
    def current(self) -> SchemaInfo:
        """The highest version."""
        return self._by_version[max(self._by_version)]

    def get(self, version: int) -> SchemaInfo:
        """The schema of ``version``; raises UnknownSchemaError for an unknown version."""
        try:
            return self._by_version[version]
        except KeyError:
            raise UnknownSchemaError(
                f"unknown schema version {version!r}; known versions: {list(self._by_version)}"
            ) from None

    def by_fingerprint(self, fingerprint: bytes) -> SchemaInfo:
        """The schema whose CRC-64-AVRO fingerprint (8 little-endian bytes) is ``fingerprint``.

        Raises UnknownSchemaError when no known version has it.
        """
        info = self._by_fingerprint.get(bytes(fingerprint))
        if info is None:
            raise UnknownSchemaError(
                f"unknown schema fingerprint {bytes(fingerprint).hex()}; known: "
                + ", ".join(f"v{i.version}={i.fingerprint_hex}" for i in self._by_version.values())
            )
        return info

    def version_of_fingerprint(self, fingerprint: bytes) -> int:
        """The version with this fingerprint; raises UnknownSchemaError."""
        return self.by_fingerprint(fingerprint).version

    def __iter__(self) -> Iterator[SchemaInfo]:
        return iter(self._by_version.values())

    def __len__(self) -> int:
        return len(self._by_version)


def schema_dir() -> Path:
    """Directory of the shipped ``.avsc`` files.

    The installed package ``kvstream.schemas`` when present, else the repository's
    ``schemas/`` next to the ``kvstream/`` directory (a source checkout without install).
    """
    try:
        files = resources.files("kvstream.schemas")
        path = Path(str(files))
        if path.is_dir() and any(SCHEMA_FILE_RE.match(p.name) for p in path.iterdir()):
            return path
    except (ModuleNotFoundError, TypeError, ValueError, OSError):
        pass
    return Path(__file__).resolve().parents[2] / "schemas"


def load_schema_dir(directory: str | Path | None = None) -> SchemaRegistry:
    """Load every ``kv_event_batch.v<N>.avsc`` of ``directory`` (default: :func:`schema_dir`).

    Raises SchemaCompatibilityError for unreadable or invalid files, or an empty directory.
    """
    root = Path(directory) if directory is not None else schema_dir()
    infos: dict[int, SchemaInfo] = {}
    try:
        entries = sorted(root.iterdir())
    except OSError as exc:
        raise SchemaCompatibilityError(f"cannot list schema directory {root}: {exc}") from exc
    for path in entries:
        m = SCHEMA_FILE_RE.match(path.name)
        if not m:
            continue
        try:
            schema_json = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SchemaCompatibilityError(f"{path}: cannot read schema JSON: {exc}") from exc
        if not isinstance(schema_json, dict):
            raise SchemaCompatibilityError(f"{path}: top level must be a record schema")
        infos[int(m.group(1))] = SchemaInfo.from_json(int(m.group(1)), schema_json, str(path))
    if not infos:
        raise SchemaCompatibilityError(f"no kv_event_batch.v<N>.avsc files in {root}")
    return SchemaRegistry(infos)


@cache
def schema_registry() -> SchemaRegistry:
    """The shipped schemas (loaded once). Raises SchemaCompatibilityError if they are broken."""
    registry = load_schema_dir()
    if registry.current.version < CURRENT_VERSION:
        raise SchemaCompatibilityError(
            f"highest shipped schema is v{registry.current.version}, code writes v{CURRENT_VERSION}"
        )
    return registry
