"""The planner held against published figures: each figure, its source and setting, the planner's price
of the same setting, the error, and the assumption the error points at.

``validation_figures.FIGURES`` lists them, each a ``Figure`` on its ``Setting`` (deployment throughputs,
per-user speeds, ratios between two settings of one system, per-kernel times); ``evaluate()`` prices
every one; ``markdown()`` writes the table of docs/planner.md ("Validation against public figures").
Figures a fit was computed from (``in_sample``) are shown apart and left out of the summary: they
test the fit, not the model.
``python -m epserve.planner.validation [--json]`` prints the table (or the results as JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from epserve.planner.validation_figures import FIGURES, NOT_PRICED, Figure, NotPriced


@dataclass(frozen=True)
class Comparison:
    figure: Figure
    predicted: float

    @property
    def error(self) -> float:
        """``predicted / published - 1``."""
        return self.predicted / self.figure.published - 1.0

    @property
    def ratio(self) -> float:
        """How far off, as a factor >= 1 either way."""
        r = self.predicted / self.figure.published
        return max(r, 1.0 / r)

    @property
    def within_band(self) -> bool:
        return abs(self.error) <= self.figure.band

    def to_json(self) -> dict[str, Any]:
        f, s = self.figure, self.figure.setting
        return {"key": f.key, "system": f.system, "metric": f.metric, "published": f.published,
                "predicted": self.predicted, "error": self.error, "band": f.band, "in_sample": f.in_sample,
                "source": f.source, "hardware": s.hardware, "model": s.model, "layout": s.layout,
                "io_mix": s.io_mix, "precision": s.precision, "mtp": s.mtp, "points_at": f.points_at}


@dataclass(frozen=True)
class Summary:
    count: int
    systems: tuple[str, ...]
    median_abs_error: float
    worst: Comparison

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "systems": list(self.systems), "median_abs_error": self.median_abs_error,
                "worst": self.worst.figure.key, "worst_error": self.worst.error, "worst_ratio": self.worst.ratio}


def evaluate(figures: Sequence[Figure] | None = None) -> list[Comparison]:
    return [Comparison(f, f.price()) for f in (FIGURES if figures is None else figures)]


def summarize(results: Sequence[Comparison]) -> Summary:
    """Over the held-out figures (``in_sample`` ones excluded)."""
    held = [r for r in results if not r.figure.in_sample]
    return Summary(len(held), tuple(sorted({r.figure.system for r in held})),
                   statistics.median(abs(r.error) for r in held), max(held, key=lambda r: r.ratio))


def _number(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _row(r: Comparison) -> str:
    f, s = r.figure, r.figure.setting
    return (f"| {f.system} | {f.metric} | {s.hardware} | {s.layout} | {s.io_mix} | {s.precision} | {s.mtp} | "
            f"{_number(f.published)} | {_number(r.predicted)} | {r.error:+.0%} | ±{f.band:.0%} | {f.points_at} | "
            f"{f.source} |")


HEADER = ("| system | figure | hardware | layout | I/O mix | precision | MTP | published | planner | error | band | "
          "the error points at | source |\n|---|---|---|---|---|---|---|---:|---:|---:|---:|---|---|")


def markdown(results: Sequence[Comparison], not_priced: Sequence[NotPriced] = ()) -> str:
    s = summarize(results)
    held = [_row(r) for r in results if not r.figure.in_sample]
    fit = [_row(r) for r in results if r.figure.in_sample]
    lines = [f"{s.count} held-out figures from {len(s.systems)} systems ({', '.join(s.systems)}): median "
             f"absolute error {s.median_abs_error:.1%}, worst {s.worst.figure.key} ({s.worst.error:+.0%}, "
             f"{s.worst.ratio:.2f}x).", "", HEADER, *held]
    if fit:
        lines += ["", "Figures the fits were computed from (in sample: they test the fit, not the model):", "",
                  HEADER, *fit]
    if not_priced:
        lines += ["", "Found but not priced:", "", "| system | figure | why not | source |", "|---|---|---|---|",
                  *(f"| {n.system} | {n.figure} | {n.reason} | {n.source} |" for n in not_priced)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epserve.planner.validation", description=__doc__)
    p.add_argument("--json", action="store_true", help="the results and the summary as JSON")
    args = p.parse_args(argv)
    results = evaluate()
    if args.json:
        print(json.dumps({"summary": summarize(results).to_json(), "figures": [r.to_json() for r in results]},
                         indent=1))
    else:
        print(markdown(results, NOT_PRICED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
