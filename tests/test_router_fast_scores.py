"""The router's per-worker scores, built by the C constructor, are the dataclass's instances."""

from __future__ import annotations

import pytest

from kvstream.index import matching
from kvstream.index.matching import WorkerMatch, fast_constructor
from kvstream.index.router import WorkerScore
from kvstream.index.types import WorkerKey


@pytest.mark.skipif(matching._native is None, reason="the C extension is not built")
def test_fast_scores_equal_the_dataclass_and_alternate_with_matches() -> None:
    new_match, new_score = fast_constructor(WorkerMatch), fast_constructor(WorkerScore)
    assert new_score is not WorkerScore  # the C constructor, not the class
    for i in range(3):  # alternating classes re-learns each one's slots
        args = (WorkerKey("w", i), i, 1.5 * i, 8, 16, "vllm_sha256_cbor_64", True, "")
        m = new_match(*args)
        assert type(m) is WorkerMatch
        assert m == WorkerMatch(*args)
        s = new_score(m, i, 2 * i, 3.5, 7.25, 1.0)
        assert type(s) is WorkerScore
        assert s == WorkerScore(m, i, 2 * i, 3.5, 7.25, 1.0)
        assert s.worker == WorkerKey("w", i)
        assert s.as_dict()["cost"] == 7.25
        with pytest.raises(AttributeError):
            s.cost = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        new_score(m, 1, 2)


def test_without_the_extension_the_class_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matching, "_native", None)
    assert fast_constructor(WorkerScore) is WorkerScore
