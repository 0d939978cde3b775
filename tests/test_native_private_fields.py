"""No C code touches a Python object's private fields (DESIGN §1, issue 22 §2).

Native code either owns its state (a native type with its own struct, like
``_match_native.Record`` or ``_native._index.GroupTable``) or takes bytes/arrays and returns
new objects. It must not learn where a Python class keeps its values and read or write them
there: slot offsets through member descriptors, a class's ``__slots__``, pydantic's
``__pydantic_*`` slots, an instance's ``__dict__`` taken or set directly, or an attribute whose
name starts with an underscore. A rename in a Python class, or a pydantic upgrade, would
otherwise break the C silently, and neither the import graph nor the layering test sees it.

Every C source and header under ``kvstream/`` is scanned (comments left out). ``ALLOWED``
names what still does, file by file, with the reason and who owns it; an entry that no longer
matches fails too, so the list shrinks with the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_ATTR_CALLS = (
    "PyObject_GetAttrString|PyObject_SetAttrString|PyObject_HasAttrString"
    "|PyUnicode_InternFromString|PyUnicode_FromString"
)

#: what a native module must not do -> the pattern that finds it in C code
PATTERNS: dict[str, str] = {
    # a member descriptor's offset: where a Python class keeps a __slots__ value
    "member descriptor": r"PyMemberDescrObject|PyMemberDescr_Type|\bd_member\b|PyDescr_TYPE",
    "__slots__": r"__slots__",
    "pydantic internals": r"__pydantic_",
    "instance __dict__": (
        r"PyObject_GenericSetDict|PyObject_GenericGetDict|_PyObject_GetDictPtr"
        r"|PyObject_GetDictPtr|\"__dict__\"|\btp_dictoffset\b"
    ),
    # an attribute named _x, read or written by name
    "private attribute": rf"(?:{_ATTR_CALLS})\s*\((?:[^()\"]*,\s*)?\"_[A-Za-z]",
}

#: (file, pattern name) -> why it is still there. Remove an entry with the code it names.
ALLOWED: dict[tuple[str, str], str] = {
    # the codec's model readers read (never write) a pydantic model's field values from its
    # instance __dict__ in one pass (issue 22 §2 / 23).
    ("kvstream/codec/_columns_native.c", "instance __dict__"): "codec owner: model_columns",
    ("kvstream/codec/_batch_body.h", "instance __dict__"): "codec owner: encode_body",
    # its own module's pickling helper (Column.__reduce__), not another object's field
    ("kvstream/index/_table_native.c", "private attribute"): "_table_native._column_of",
}


def _code(path: Path) -> str:
    """The C text without comments (line numbers kept)."""
    text = path.read_text(errors="replace")
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _findings() -> dict[tuple[str, str], list[int]]:
    found: dict[tuple[str, str], list[int]] = {}
    for path in sorted((ROOT / "kvstream").rglob("*.[ch]")):
        code = _code(path)
        rel = path.relative_to(ROOT).as_posix()
        for name, pattern in PATTERNS.items():
            lines = [code.count("\n", 0, m.start()) + 1 for m in re.finditer(pattern, code)]
            if lines:
                found[(rel, name)] = lines
    return found


def test_no_c_code_touches_private_fields() -> None:
    found = _findings()
    new = {
        f"{f}:{lines} ({name})" for (f, name), lines in found.items() if (f, name) not in ALLOWED
    }
    assert not new, f"native code reaching into Python objects' private fields: {sorted(new)}"


def test_the_allow_list_names_only_what_is_there() -> None:
    found = _findings()
    stale = sorted(f"{f} ({name})" for f, name in ALLOWED if (f, name) not in found)
    assert not stale, f"allowed but no longer found (drop them from ALLOWED): {stale}"


@pytest.mark.parametrize(
    ("snippet", "name"),
    [
        ("PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;", "member descriptor"),
        ('PyObject_GetAttrString((PyObject *)cls, "__slots__");', "__slots__"),
        ('s = PyUnicode_InternFromString("__pydantic_fields_set__");', "pydantic internals"),
        ("PyObject_GenericSetDict(obj, dict, NULL);", "instance __dict__"),
        ("if (tp->tp_dictoffset) return 0;", "instance __dict__"),
        ('raw = PyObject_GetAttrString(packed, "_raw");', "private attribute"),
        ('s_raw = PyUnicode_InternFromString("_raw");', "private attribute"),
    ],
)
def test_the_patterns_catch_what_was_removed(snippet: str, name: str, tmp_path: Path) -> None:
    """What _table_native.slots_new and _tokens_native.gather_blocks did is caught; public
    attribute reads and a type's own members are not."""
    assert re.search(PATTERNS[name], snippet)
    for ok in (
        'PyObject_GetAttrString(m, "tokens_per_block");',
        '{"cls", T_OBJECT, offsetof(ModelFactory, cls), READONLY, "the model class"},',
        'PyModuleDef_HEAD_INIT, "_match_native",',
    ):
        assert not any(re.search(p, ok) for p in PATTERNS.values()), ok
    src = tmp_path / "x.c"
    src.write_text(f"/* {snippet} */\n// {snippet}\nint x;\n")
    assert not any(re.search(p, _code(src)) for p in PATTERNS.values())
