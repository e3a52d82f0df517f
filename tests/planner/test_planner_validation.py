"""The planner within the stated band of every published figure (docs/planner.md, "Validation against
public figures"): a change that breaks the fit fails here, and the table in the docs is the one the
code computes."""

from __future__ import annotations

from pathlib import Path

import pytest

from epserve.planner.validation import Comparison, evaluate, markdown, summarize
from epserve.planner.validation_figures import FIGURES, NOT_PRICED

DOC = Path(__file__).resolve().parents[2] / "docs" / "planner.md"


@pytest.fixture(scope="module")
def results() -> dict[str, Comparison]:
    return {r.figure.key: r for r in evaluate(FIGURES)}


@pytest.mark.parametrize("key", [f.key for f in FIGURES])
def test_figure_within_its_band(results: dict[str, Comparison], key: str) -> None:
    r = results[key]
    assert r.within_band, f"{key}: planner {r.predicted:.4g} vs published {r.figure.published:.4g} ({r.error:+.0%})"


def test_the_goal_holds(results: dict[str, Comparison]) -> None:
    s = summarize(list(results.values()))
    assert s.count >= 20 and len(s.systems) >= 5
    assert s.median_abs_error <= 0.20
    assert s.worst.ratio <= 1.5


def test_every_figure_says_where_it_is_from_and_what_it_was_measured_on() -> None:
    keys = [f.key for f in FIGURES]
    assert len(set(keys)) == len(keys)
    for f in FIGURES:
        s = f.setting
        assert f.published > 0 and f.points_at and 0 < f.band <= 0.5
        assert all((s.hardware, s.layout, s.io_mix, s.precision, s.mtp, s.model))
        assert "@" in f.source or "https://" in f.source  # a commit or a URL
    assert all(n.reason and n.source for n in NOT_PRICED)


def test_the_docs_table_is_the_computed_one(results: dict[str, Comparison]) -> None:
    table = markdown(list(results.values()), NOT_PRICED)
    assert table in DOC.read_text(), "regenerate it: python -m epserve.planner.validation"
