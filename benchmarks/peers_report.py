"""vs_peers.py's report: the table of medians, epserve's lead over each peer, issue 44's goals against it, and
the section of docs/benchmarks.md the run writes."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import peer_vllm

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
HEADING = "## Beside vLLM's CPU build, llama.cpp and transformers (issue 44)"
BEGIN, END = "<!-- vs_peers:begin -->", "<!-- vs_peers:end -->"
PRESETS = {"small": None, "small-mla": dict(peer_vllm.DEEPSEEK_V3_MLA)}  # make_checkpoint overrides of `small`
PEERS = ("vLLM", "llama.cpp", "transformers")
LABELS = {"offline_out_tok_s": "offline: 16 prompts, 64 in / 32 out (output tok/s)",
          "decode_b1": "batch-1 decode (tok/s)", "decode_b4": "batch-4 decode (tok/s)",
          "decode_b16": "batch-16 decode (tok/s)", "prefill_b16": "batch-16 prefill, 64 tokens (tok/s)",
          "served_out_tok_s": "served: 64 requests, concurrency 16, 256 in / 32 out (output tok/s)",
          "served_ttft_ms": "served: median TTFT (ms)", "served_tpot_ms": "served: median TPOT (ms)"}
SHORT = {"offline_out_tok_s": "offline", "decode_b1": "batch-1 decode", "decode_b4": "batch-4 decode",
         "decode_b16": "batch-16 decode", "prefill_b16": "batch-16 prefill", "served_out_tok_s": "served output",
         "served_ttft_ms": "served TTFT", "served_tpot_ms": "served TPOT"}
LOWER_IS_BETTER = ("served_ttft_ms", "served_tpot_ms")
GOALS = (("vLLM", "decode_b1", 1.5), ("vLLM", "decode_b16", 1.5), ("vLLM", "served_out_tok_s", 1.3),
         ("llama.cpp", "decode_b1", 1.2), ("transformers", "offline_out_tok_s", 3.0))  # issue 44's, besides ">1"


def table(runs: dict[str, list], served_runs: dict[str, list], batches: list[int]) -> dict[str, dict]:
    """{name: {row key: median}} over the rounds (a row a peer did not run is absent)."""
    def med(values: Iterator[float]) -> float:
        kept = [x for x in values if x == x]  # NaN: no measurement
        return statistics.median(kept) if kept else float("nan")

    rows: dict[str, dict] = {}
    for name in runs.keys() | served_runs.keys():
        row: dict[str, float] = {}
        if runs.get(name):
            row["offline_out_tok_s"] = med(run["offline"] for run in runs[name])
            row.update({f"decode_b{b}": med(run[b]["decode"] for run in runs[name]) for b in batches})
            if 16 in batches:
                row["prefill_b16"] = med(run[16]["prefill"] for run in runs[name])
        if served_runs.get(name):
            for key, field in (("served_out_tok_s", "output_token_throughput"), ("served_ttft_ms", "median_ttft_ms"),
                               ("served_tpot_ms", "median_tpot_ms")):
                row[key] = med(s[field] for s in served_runs[name])
        rows[name] = row
    return rows


def ratio(key: str, ours: float, theirs: float) -> float:
    """epserve's lead: above 1 it is ahead (speeds: ours / theirs; times: theirs / ours)."""
    return theirs / ours if key in LOWER_IS_BETTER else ours / theirs


def markdown(preset: str, result: dict) -> str:
    rows = result["table"]
    peers = [p for p in PEERS if p in rows]
    v = result.get("vllm") or {}
    vllm = f"; vLLM's attention: {v.get('attention')}" + (" (`VLLM_MLA_DISABLE=1`)" if v.get("mla_disabled") else "")
    widths = " (DeepSeek-V3's MLA widths: latent 512, rope 64)" if PRESETS.get(preset) else ""
    lines = [f"**{preset}**{widths}{vllm if v else ''}",
             "", "| | epserve | " + " | ".join(peers) + " | " + " | ".join(f"epserve / {p}" for p in peers) + " |",
             "|---|---|" + "---|" * (2 * len(peers))]
    for key, label in LABELS.items():
        ours = rows["epserve"].get(key)
        if ours is None:
            continue
        cells = [f"{rows[p][key]:.0f}" if key in rows[p] else "–" for p in peers]
        ratios = [f"**{ratio(key, ours, rows[p][key]):.2f}×**" if key in rows[p] else "–" for p in peers]
        lines.append(f"| {label} | {ours:.0f} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    lines += ["", goals(rows)]
    agree = "; ".join(f"{p} {a['equal']}/{a['tokens']} (logprobs within {a['max_logprob_diff']:.1e})"
                      for p, a in result["agreement"].items())
    load = result.get("load")
    busy = f" The host's 1-minute load average through the timings: {min(load):.1f}–{max(load):.1f}." if load else ""
    return "\n".join([*lines, "", f"fp32 greedy tokens equal to epserve's: {agree}.{busy}"])


def goals(rows: dict[str, dict]) -> str:
    """Issue 44's goals against this table: ahead of every peer on every row, and the margins ``GOALS`` names."""
    behind = [f"{SHORT[k]} vs {p} ({ratio(k, rows['epserve'][k], rows[p][k]):.2f}×)"
              for p in PEERS if p in rows for k in LABELS if k in rows[p] and k in rows["epserve"]
              and ratio(k, rows["epserve"][k], rows[p][k]) <= 1]
    short = [f"{SHORT[k]} vs {p}: {ratio(k, rows['epserve'][k], rows[p][k]):.2f}× (goal ≥ {g}×)"
             for p, k, g in GOALS if k in rows.get(p, {}) and k in rows["epserve"]
             and ratio(k, rows["epserve"][k], rows[p][k]) < g]
    return (f"Goals: ahead on every row: {'yes' if not behind else 'no, behind on ' + '; '.join(behind)}. "
            f"Margins: {'all met' if not short else 'short of ' + '; '.join(short)}.")


def document(results: dict, command: str) -> str:
    intro = ("`benchmarks/vs_peers.py`: epserve, vLLM's CPU build (its own venv), llama.cpp (GGUF of the same "
             "weights) and transformers on one checkpoint, fp32 greedy agreement first, then bf16 timings: offline, "
             "decode and prefill alternated in one run (medians), then each server in turn under `epserve bench "
             "serve`. Ratios are epserve's lead (speeds: epserve / peer; TTFT and TPOT: peer / epserve).")
    parts = [intro, *(markdown(preset, r) for preset, r in results["presets"].items())]
    vllm = results.get("vllm_version")
    return "\n\n".join([*parts, f"{results['machine']}; vLLM's CPU build {vllm or '(not run)'} (`{peer_vllm.VLLM}`, "
                        f"malloc: {results.get('vllm_malloc', 'system')}), "
                        f"llama.cpp from llama-cpp-python {results['llama_cpp_python']}, transformers "
                        f"{results['transformers']}. `{command}`, {results['date']}."])


def write_docs(text: str, path: Path = DOCS) -> None:
    """``text`` between the section's markers in ``path``; the section (``HEADING``) added at its end if absent."""
    doc = path.read_text()
    if BEGIN not in doc or END not in doc:
        path.write_text(f"{doc.rstrip()}\n\n{HEADING}\n\n{BEGIN}\n{text}\n{END}\n")
        return
    head, rest = doc.split(BEGIN, 1)
    path.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
