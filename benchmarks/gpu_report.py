"""The GPU check's records (benchmarks/gpu_check.sh): a pytest plugin that writes each test's outcome the moment
it finishes, and the merge of every stage's records into ``summary.json`` and ``logs.tar.gz`` under ``$OUT``,
keeping what a cut-off stage left (its finished tests, the test it was in, its benchmark JSON up to the cut).

As a pytest plugin (``python -m pytest -p gpu_report --gpu-report PATH``, with this file's folder, or a folder
holding a copy of it, on PYTHONPATH: gpu_check.sh copies it alone into one, so that no other module of
benchmarks/ becomes importable): PATH gets one JSON line per event, flushed as written, so a pytest killed by
``timeout`` still leaves its report (junit XML is written only at the end): ``start``; ``begin`` (a test starts:
the last one without its ``test`` line is where a killed run was); ``test`` (outcome, seconds, the first line of
a failure); ``finish`` (pytest's exit status). ``--on-device`` keeps only the tests that run on the GPU: those
marked ``cuda`` and those taking the ``device`` fixture (``EPSERVE_TEST_DEVICE=cuda`` makes it the GPU); the
rest are CPU tests CI runs.

As a script: ``gpu_report.py summary WORK OUT BUDGET [--running STAGE]`` merges WORK/stages.tsv (one record
per finished stage, written by gpu_check.sh) with each stage's report, JSON and output into OUT/summary.json,
OUT/logs.tar.gz (every stage's complete output, reports and JSON) and OUT/tails.txt (each stage's last lines);
``--running STAGE`` (the periodic snapshot during a stage) merges that stage's records so far. ``table OUT``
prints the summary's short table.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

FIELDS = ("stage", "status", "seconds", "budget_s", "timeout_s", "rc", "log", "report", "json", "note")
LEASE_FILES = ("summary.json", "logs.tar.gz", "tails.txt")
TAIL_LINES = 40


# ---- the pytest plugin -----------------------------------------------------------------------------------


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("gpu_report", "the GPU check's per-test report")
    group.addoption("--gpu-report", metavar="PATH", help="append one JSON line per test as it finishes")
    group.addoption("--on-device", action="store_true",
                    help="only the tests that run on the GPU: marked cuda, or taking the device fixture")


class _Report:
    """The open report file: a line per event, flushed at once."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole session

    def write(self, **record: Any) -> None:
        self.file.write(json.dumps({"t": round(time.time(), 3), **record}) + "\n")
        self.file.flush()


_OPEN: dict[str, _Report] = {}  # the session's report (the controller's, where pytest-xdist runs workers)


def pytest_configure(config: Any) -> None:
    path = config.getoption("--gpu-report", None)
    if path and not hasattr(config, "workerinput"):  # an xdist worker: the controller writes its reports
        _OPEN["report"] = _Report(path)
        _OPEN["report"].write(event="start", args=[str(a) for a in config.invocation_params.args][:50])


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if not config.getoption("--on-device", False):
        return
    keep, drop = [], []
    for item in items:
        on_device = item.get_closest_marker("cuda") is not None or "device" in getattr(item, "fixturenames", ())
        (keep if on_device else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session: Any) -> None:
    if "report" in _OPEN:
        _OPEN["report"].write(event="collected", count=len(session.items))


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    if "report" in _OPEN:
        _OPEN["report"].write(event="begin", test=nodeid)


def pytest_runtest_logreport(report: Any) -> None:
    if "report" not in _OPEN:
        return
    # one line per test: its call; a setup that failed or skipped it; a teardown that failed
    if report.when == "call" or (report.when == "setup" and not report.passed) or (
            report.when == "teardown" and report.failed):
        outcome = report.outcome if report.when == "call" or report.skipped else "error"
        if getattr(report, "wasxfail", None) is not None:
            outcome = "xfailed" if report.skipped else "xpassed"
        _OPEN["report"].write(event="test", test=report.nodeid, when=report.when, outcome=outcome,
                              seconds=round(report.duration, 3), message="" if report.passed else _first_line(report))


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    report = _OPEN.pop("report", None)
    if report is not None:
        report.write(event="finish", exitstatus=int(exitstatus))
        report.file.close()


def _first_line(report: Any) -> str:
    """The failure's own message (the ``E`` lines' first), else the longrepr's last line."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:300]
    text = str(report.longrepr or "")
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()[:300]
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else ""


# ---- reading what a stage left -------------------------------------------------------------------------


def read_report(path: Path) -> dict[str, Any]:
    """A stage's test report, complete or cut off: counts by outcome, the failures, the test it was in."""
    counts: dict[str, int] = {}
    failed, begun, done = [], [], set()
    collected = finish = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # the last line, cut by a kill
        event = rec.get("event")
        if event == "collected":
            collected = rec.get("count")
        elif event == "begin":
            begun.append(rec["test"])
        elif event == "test":
            counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
            done.add(rec["test"])
            if rec["outcome"] in ("failed", "error"):
                failed.append({"test": rec["test"], "message": rec.get("message", "")})
        elif event == "finish":
            finish = rec.get("exitstatus")
    out: dict[str, Any] = {**counts, "collected": collected, "finished": finish is not None,
                           "exitstatus": finish, "failed_tests": failed[:25]}
    cut_in = [t for t in begun if t not in done]
    if cut_in and finish is None:
        out["cut_off_in"] = cut_in[-1]
    return out


def salvage_json(text: str) -> tuple[Any, bool]:
    """The JSON in ``text`` and whether it was complete; a file cut mid-write gives its longest prefix that
    closes into valid JSON (the values written before the cut), else raises ``ValueError``."""
    try:
        return json.loads(text), True
    except json.JSONDecodeError:
        pass
    stack, cuts, in_string, escaped = [], [], False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "[{":
            stack.append("]" if ch == "[" else "}")
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch in "]}":
            if stack:
                stack.pop()
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch == ",":
            cuts.append((i, "".join(reversed(stack))))
    for end, closers in reversed(cuts[-2000:]):
        try:
            return json.loads(text[:end] + closers), False
        except json.JSONDecodeError:
            continue
    raise ValueError("no valid JSON prefix")


def read_json(path: Path) -> dict[str, Any]:
    """A stage's benchmark JSON (rewritten as it goes), its key figures lifted out; a cut one salvaged."""
    try:
        result, complete = salvage_json(path.read_text(errors="replace"))
    except ValueError as e:
        return {"result": {"error": f"unreadable: {e}"}}
    out: dict[str, Any] = {}
    if isinstance(result, dict):
        out["figures"] = result.pop("key_figures", None)
    out["result"] = result
    if not complete:
        out["partial"] = True
    return out


def _tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


def stage_records(work: Path, running: str | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Every stage's merged record, in the order run; ``running``: the stage under way, as far as it got."""
    stages: dict[str, dict[str, Any]] = {}
    tsv = work / "stages.tsv"
    rows = [dict(zip(FIELDS, line.split("\t"), strict=False)) for line in
            (tsv.read_text().splitlines() if tsv.exists() else [])]
    if running and running not in {r["stage"] for r in rows}:
        rows.append({"stage": running, "status": "running (the check was cut off here if this is the last summary)",
                     "report": str(work / f"{running}.jsonl"), "json": str(work / f"{running}.json"),
                     "log": f"{running}.out"})
    for row in rows:
        rec: dict[str, Any] = {k: row.get(k) for k in FIELDS[1:]}
        for key in ("seconds", "budget_s", "timeout_s"):
            value = rec.get(key)
            rec[key] = float(value) if value not in (None, "", "-") else None
        rc = rec.get("rc") or "-"
        rec["rc"] = int(rc) if rc.lstrip("-").isdigit() else None
        report, js = rec.pop("report") or "-", rec.pop("json") or "-"
        if report != "-" and Path(report).exists():
            rec["tests"] = read_report(Path(report))
        if js != "-" and Path(js).exists():
            rec |= read_json(Path(js))
        output = work / f"{row['stage']}.out"
        if output.exists():
            m = re.search(r"ERROR SUMMARY: (\d+) error", output.read_text(errors="replace"))
            if m:
                rec["figures"] = {**(rec.get("figures") or {}), "memcheck_errors": int(m[1])}
        if not rec.get("note"):
            rec.pop("note", None)
        stages[row["stage"]] = rec
    return stages, [r["stage"] for r in rows]


def _replace(path: Path, write: Any) -> None:
    """Write ``path`` through a temporary beside it, then rename: a reader never sees half a file."""
    tmp = path.with_name(f"{path.name}.part")
    write(tmp)
    os.replace(tmp, path)


def summarize(work: Path, out: Path, budget: float, running: str | None = None) -> dict[str, Any]:
    """summary.json, logs.tar.gz and tails.txt under ``out``, from what ``work`` holds now."""
    out.mkdir(parents=True, exist_ok=True)
    with open(work / ".summary.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the periodic snapshot and the stage's own summary, one at a time
        stages, order = stage_records(work, running)
        env: dict[str, Any] = {}
        if (work / "env.json").exists():
            try:
                env = json.loads((work / "env.json").read_text())
            except json.JSONDecodeError:
                env = {"error": "env.json unreadable"}
        logs = sorted(p for p in work.iterdir() if p.is_file() and not p.name.startswith(".")
                      and p.suffix in (".out", ".jsonl", ".json", ".tsv", ".err"))

        def tar(tmp: Path) -> None:
            with tarfile.open(tmp, "w:gz", compresslevel=6) as t:
                for p in logs:
                    t.add(p, arcname=f"logs/{p.name}")

        _replace(out / "logs.tar.gz", tar)
        tails = []
        for name in order:
            tails += [f"== {name}: {stages[name].get('status')} ({stages[name].get('seconds')} s)",
                      *_tail(work / f"{name}.out"), ""]
        _replace(out / "tails.txt", lambda tmp: tmp.write_text("\n".join(tails) + "\n"))
        summary = {
            "plan": {"budget_s": budget, "stages": order, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                     "files": list(LEASE_FILES), "logs": [f"logs/{p.name}" for p in logs]},
            "env": env, "stages": stages,
            "not_ok": [n for n in order if stages[n].get("status") not in ("ok", "planned")],
        }
        build = work / "v3_build.out"  # the v3 stage's checkpoint, built in the background
        if build.exists():
            summary["v3_checkpoint_build"] = [line for line in _tail(build, 3) if line]
        _replace(out / "summary.json", lambda tmp: tmp.write_text(json.dumps(summary, indent=1, default=str)))
    return summary


def table(out: Path) -> str:
    """The summary's short table: a line per stage (status, seconds, tests, first failure)."""
    summary = json.loads((out / "summary.json").read_text())
    lines = []
    for name, rec in summary["stages"].items():
        tests = rec.get("tests") or {}
        counts = " ".join(f"{k} {tests[k]}" for k in ("passed", "failed", "error", "skipped") if tests.get(k))
        first = (tests.get("failed_tests") or [{}])[0]
        lines.append(f"  {name:10s} {str(rec.get('status'))[:34]:34s} {rec.get('seconds') or 0:6.1f}s  {counts}"
                     + (f"  first: {first['test']}: {first['message'][:100]}" if first else "")
                     + (f"  cut off in {tests['cut_off_in']}" if tests.get("cut_off_in") else ""))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["summary"] and len(argv) >= 4:
        running = argv[argv.index("--running") + 1] if "--running" in argv else None
        summarize(Path(argv[1]), Path(argv[2]), float(argv[3]), running)
        return 0
    if argv[:1] == ["table"] and len(argv) == 2:
        print(table(Path(argv[1])))
        return 0
    print("usage: gpu_report.py summary WORK OUT BUDGET [--running STAGE] | table OUT", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
