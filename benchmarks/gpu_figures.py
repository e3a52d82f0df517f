"""What the GPU benchmarks (``gpu_micro.py``, ``v3_layer.py``) measure against: DeepSeek-V3's shapes, the
bytes each op must stream, the floors (``forward_floor``: the V3-layer benchmark's) and goal ratios their
figures are read as, the V3-layer benchmark's summary (``layer_key_figures``), and the JSON they write as
they go. Torch-free, so the CPU tests check the arithmetic on known numbers.

Ceilings are measured, not taken from a datasheet: ``copy_TBps`` is a device-to-device copy counting bytes
read plus written (``gpu_micro.py``'s copy part), so a kernel that must read ``X`` bytes runs at the copy's
rate when it takes ``X / copy_TBps``. A floor counts only the bytes that must cross device memory once
(weights, block scales, the KV cache read by attention); activations at decode sizes are left out (64 tokens
of 7168 bf16 values are 0.9 MB against the layer's ~1.9 GB).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# DeepSeek-V3 as published (config.json of deepseek-ai/DeepSeek-V3)
V3: dict[str, int] = {
    "hidden": 7168, "heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "rope": 64, "nope": 128,
    "v_head": 128, "intermediate": 18432, "moe_intermediate": 2048, "experts": 256, "top_k": 8,
    "shared_experts": 1, "dense_layers": 3, "layers": 61, "fp8_block": 128,
}
EP = 8  # the target deployment: EP8 expert shards (32 local experts), DP attention (128 heads a rank)
TP = 8  # ... or TP 8 attention: 16 heads a rank
LOCAL_EXPERTS = V3["experts"] // EP
LATENT = V3["kv_lora_rank"] + V3["rope"]  # 576 columns a cached token


def gemm_shapes() -> dict[str, tuple[int, int]]:
    """The block-FP8 GEMMs of a decode step, name -> (N, K) of ``y[M, N] = x[M, K] W[N, K]^T``."""
    h, heads = V3["hidden"], V3["heads"]
    return {
        f"qkv_a_proj ({V3['q_lora_rank'] + LATENT}x{h})": (V3["q_lora_rank"] + LATENT, h),
        f"q_b_proj ({heads * (V3['nope'] + V3['rope'])}x{V3['q_lora_rank']})": (
            heads * (V3["nope"] + V3["rope"]), V3["q_lora_rank"]),
        f"o_proj ({h}x{heads * V3['v_head']})": (h, heads * V3["v_head"]),
        f"dense gate_up ({2 * V3['intermediate']}x{h})": (2 * V3["intermediate"], h),
        f"dense down ({h}x{V3['intermediate']})": (h, V3["intermediate"]),
        f"expert gate_up ({2 * V3['moe_intermediate']}x{h})": (2 * V3["moe_intermediate"], h),
        f"expert down ({h}x{V3['moe_intermediate']})": (h, V3["moe_intermediate"]),
    }


GEMM_ROWS = (1, 16, 64, 128, 4096)
MLA = {"heads": (128, 16), "batches": (1, 16, 64), "context": 4096, "block_size": 16,
       "kv_lora_rank": V3["kv_lora_rank"], "rope": V3["rope"]}
GROUPED_ROWS_PER_EXPERT = (1, 2, 4, 8, 16)  # real rows per local expert at decode sizes
# rows a padded layout hands the grouped GEMM per expert (the "with padding rows" case: the real rows first, the
# rest padding): 64 is a padded EP8 dispatch at 64 tokens a rank, where a tile chosen from all rows is BM = 64
GROUPED_CAPACITY = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fp8_weight_bytes(n: int, k: int, block: int = V3["fp8_block"]) -> int:
    """An e4m3 weight [N, K] and its fp32 128x128 block scales."""
    return n * k + cdiv(n, block) * cdiv(k, block) * 4


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def gemm_bytes(m: int, n: int, k: int, weight_bytes_per_elem: float = 1, act_bytes_per_elem: float = 1,
               out_bytes_per_elem: float = 2) -> int:
    """The fewest bytes a GEMM moves: its weight (FP8 with block scales, or ``weight_bytes_per_elem``), its
    input (FP8 with 1x128 scales when ``act_bytes_per_elem`` is 1) and its output, each once."""
    weight = fp8_weight_bytes(n, k) if weight_bytes_per_elem == 1 else int(n * k * weight_bytes_per_elem)
    act = int(m * k * act_bytes_per_elem) + (m * cdiv(k, V3["fp8_block"]) * 4 if act_bytes_per_elem == 1 else 0)
    return weight + act + int(m * n * out_bytes_per_elem)


def floor_s(nbytes: float, copy_TBps: float, flops: float = 0.0, peak_tflops: float | None = None) -> float:
    """The larger of the bytes at the copy bandwidth and the operations at ``peak_tflops`` (when given)."""
    t = nbytes / (copy_TBps * 1e12)
    if peak_tflops:
        t = max(t, flops / (peak_tflops * 1e12))
    return t


def pct(value: float, ceiling: float) -> float:
    """``value`` as a percentage of ``ceiling`` (0 for a missing ceiling)."""
    return 100.0 * value / ceiling if ceiling else 0.0


def mla_cache_bytes(batch: int, context: int, bytes_per_elem: int, latent: int = LATENT) -> int:
    """The latent cache a decode step's attention reads: every cached row of every sequence, once."""
    return batch * context * latent * bytes_per_elem


def expected_active_experts(tokens: int, top_k: int = V3["top_k"], experts: int = LOCAL_EXPERTS) -> float:
    """Experts that get at least one of ``tokens`` tokens' ``top_k`` picks under uniform routing (each
    expert missed by one token with probability 1 - k/E)."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def linear_bytes(n: int, k: int, fp8: bool = True, bytes_per_elem: int = 2) -> int:
    """A linear layer's weight [N, K]: FP8 with its block scales, or ``bytes_per_elem`` a value."""
    return fp8_weight_bytes(n, k) if fp8 else n * k * bytes_per_elem


def expert_bytes(fp8: bool = True) -> int:
    """One routed (or the shared) expert: gate_up [2I, H] and down [H, I]."""
    h, i = V3["hidden"], V3["moe_intermediate"]
    return linear_bytes(2 * i, h, fp8) + linear_bytes(h, i, fp8)


def layer_stream_bytes(batch: int, context: int, kv_bytes_per_elem: int = 2, moe: bool = True,
                       experts: int = LOCAL_EXPERTS, top_k: int = V3["top_k"], heads: int = V3["heads"],
                       fp8: bool = True, bytes_per_elem: int = 2) -> dict[str, int]:
    """Bytes each op of one decode step of one layer must stream, by op name (``parallel/stages.py``'s):
    the projections (FP8 with their scales, or ``bytes_per_elem`` a value when not ``fp8``), the absorbed
    W_UK / W_UV^T and the router (``bytes_per_elem``, the model dtype), the latent cache of ``batch``
    sequences of ``context`` tokens, the experts that ``batch`` tokens reach under uniform routing over
    ``experts`` (top ``top_k``) and the shared expert, or the dense MLP."""
    h, r, v, nope = V3["hidden"], V3["kv_lora_rank"], V3["v_head"], V3["nope"]
    out = {
        "qkv_a_proj": linear_bytes(V3["q_lora_rank"] + LATENT, h, fp8),
        "q_b_proj": linear_bytes(heads * (nope + V3["rope"]), V3["q_lora_rank"], fp8),
        "q_absorb": heads * nope * r * bytes_per_elem,
        "attention_core": mla_cache_bytes(batch, context, kv_bytes_per_elem),
        "v_absorb": heads * r * v * bytes_per_elem,
        "o_proj": linear_bytes(h, heads * v, fp8),
    }
    if moe:
        out["gate"] = experts * h * bytes_per_elem
        out["experts"] = round(expected_active_experts(batch, top_k, experts) * expert_bytes(fp8))
        out["shared_expert"] = V3["shared_experts"] * expert_bytes(fp8)
    else:
        i = V3["intermediate"]
        out["mlp"] = linear_bytes(2 * i, h, fp8) + linear_bytes(h, i, fp8)
    return out


def forward_floor(batch: int, context: int, copy_TBps: float, kv_bytes_per_elem: int = 2, fp8: bool = True,
                  experts: int = LOCAL_EXPERTS, top_k: int = V3["top_k"]) -> dict[str, Any]:
    """The weight-and-KV streaming floor of one decode step of a dense and an MoE layer (``v3_layer.py``'s
    model): bytes per op of each (``layer_stream_bytes``), their total, and the milliseconds at ``copy_TBps``."""
    layers = {kind: layer_stream_bytes(batch, context, kv_bytes_per_elem, moe=kind == "moe", experts=experts,
                                       top_k=top_k, fp8=fp8)
              for kind in ("dense", "moe")}
    total = sum(sum(b.values()) for b in layers.values())
    return {"copy_TBps": copy_TBps, "context": context, "bytes": layers, "forward_bytes": total,
            "forward_floor_ms": total / (copy_TBps * 1e12) * 1e3,
            "layer_floor_ms": {k: sum(b.values()) / (copy_TBps * 1e12) * 1e3 for k, b in layers.items()}}


# ---- goals -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Goal:
    target: float
    higher_is_better: bool
    what: str


GOALS = {
    "mla_128h_4k_pct_of_copy": Goal(60.0, True, "MLA decode at 128 heads, 4k context: cache read GB/s as % of "
                                                "the copy bandwidth (best kernel, largest batch)"),
    "fp8_gemm_pct_of_scaled_mm": Goal(70.0, True, "Triton block-FP8 GEMM TFLOP/s as % of blockwise _scaled_mm's "
                                                  "at the same shape (the worst of V3's shapes at M = 4096)"),
    "v3_layer_vs_floor": Goal(1.5, False, "captured decode forward of the V3-shaped layers over its weight-and-KV "
                                          "streaming floor at the measured copy bandwidth"),
}


def goal(name: str, value: float | None, **detail: Any) -> dict[str, Any]:
    """A key figure with its goal: ``{"value", "goal", "met", "what", ...detail}`` (met None without a value)."""
    g = GOALS[name]
    met = None if value is None else (value >= g.target if g.higher_is_better else value <= g.target)
    return {"value": None if value is None else round(value, 3), "goal": ("≥ " if g.higher_is_better else "≤ ")
            + f"{g.target:g}", "met": met, "what": g.what, **detail}


def add_floor(row: dict[str, Any], floor: dict[str, Any]) -> None:
    """The streaming floor into ``row``, with the captured forward (and each eager op) over it."""
    row["floor"] = floor
    if "captured" in row and row["captured"].get("forward_ms"):
        row["captured"]["forward_vs_floor"] = row["captured"]["forward_ms"] / floor["forward_floor_ms"]
    ops = row.get("eager", {}).get("ops", {})
    per_ms = 1e3 / (floor["copy_TBps"] * 1e12)
    row["floor"]["ops_vs_floor"] = {
        kind: {op: ms / (floor["bytes"][kind][op] * per_ms) for op, ms in rec.items()
               if ms and floor["bytes"].get(kind, {}).get(op)}
        for kind, rec in ops.items()}


def layer_key_figures(result: dict[str, Any]) -> dict[str, Any]:
    """What ``v3_layer.py``'s summary shows (its model: a dense then an MoE layer): per variant, tokens equal,
    graph memory, KV bytes per token, and per batch the step and per-layer forward times, the eager ops' grouped
    times, the streaming floor and the captured forward over it; an estimate of DeepSeek-V3's whole decode
    forward (3 dense + 58 MoE layers, the embedding and head left out): the captured two-layer forward scaled by
    the dense and MoE layers' shares of the eager forward; and ``goals``: the captured forward over its floor at
    the largest batch of the first FP8-weight variant (goal <= 1.5x)."""
    figures: dict[str, Any] = {}
    goal_row: tuple[str, dict[str, Any]] | None = None
    for v in result["variants"]:
        f: dict[str, Any] = {"tokens_equal": v.get("tokens_equal")}
        cap = v.get("modes", {}).get("captured", {})
        f |= {k: cap[k] for k in ("graphs", "capture_s", "graph_memory_MiB") if k in cap}
        first = next(iter(v.get("modes", {}).values()), {})
        f |= {"kv_bytes_per_token": first.get("bytes_per_token"), "kv_bytes": first.get("kv_bytes"),
              "weight_bytes": first.get("weight_bytes")}
        for row in v.get("rows", []):
            b = f"b{row['batch']}"
            for mode in ("eager", "captured"):
                if "step_ms" in row.get(mode, {}):
                    f[f"{b} {mode} step_ms"] = round(row[mode]["step_ms"], 3)
                    f[f"{b} {mode} forward_ms_per_layer"] = round(row[mode]["forward_ms_per_layer"], 3)
            layers = row.get("eager", {}).get("layers", {})
            for kind, rec in layers.items():
                f[f"{b} eager {kind} layer_ms"] = rec["layer"] and round(rec["layer"], 3)
            for kind, groups in row.get("eager", {}).get("op_groups", {}).items():
                f[f"{b} eager {kind} ops_ms"] = {k: round(ms, 3) for k, ms in groups.items()}
            if "step_ms" in row.get("captured", {}) and layers.get("dense", {}).get("layer") and layers.get(
                    "moe", {}).get("layer"):
                dense, moe = layers["dense"]["layer"], layers["moe"]["layer"]
                f[f"{b} captured {V3['layers']}-layer forward estimate_ms"] = round(row["captured"]["forward_ms"] * (
                    V3["dense_layers"] * dense + (V3["layers"] - V3["dense_layers"]) * moe) / (dense + moe), 2)
            floor = row.get("floor")
            if floor:
                f[f"{b} forward floor_ms"] = round(floor["forward_floor_ms"], 3)
                if "forward_vs_floor" in row.get("captured", {}):
                    f[f"{b} captured forward / floor"] = round(row["captured"]["forward_vs_floor"], 3)
                    if v["options"].get("quantization") == "fp8" and (goal_row is None or (
                            goal_row[0] == v["variant"] and row["batch"] > goal_row[1]["batch"])):
                        goal_row = (v["variant"], row)
        figures[v["variant"]] = f
    if goal_row is None:
        figures["goals"] = {"v3_layer_vs_floor": goal("v3_layer_vs_floor", None, note="not measured in this run")}
    else:
        variant, row = goal_row
        figures["goals"] = {"v3_layer_vs_floor": goal(
            "v3_layer_vs_floor", row["captured"]["forward_vs_floor"], variant=variant, batch=row["batch"],
            context=row["floor"]["context"], forward_ms=round(row["captured"]["forward_ms"], 3),
            floor_ms=round(row["floor"]["forward_floor_ms"], 3), copy_TBps=round(row["floor"]["copy_TBps"], 3))}
    return figures


# ---- the JSON, written as it goes ----------------------------------------------------------------------------
class JsonProgress:
    """A result dict rewritten to ``path`` after every measurement (``save()``), atomically: written to a
    temporary file beside it, then renamed over it, so a run cut off at any point leaves the last complete
    JSON, with ``"complete": false`` until ``finish()``. ``path`` None: nothing written."""

    def __init__(self, path: Path | None, result: dict[str, Any]) -> None:
        self.path, self.result = path, result
        self.writes = 0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def save(self, complete: bool = False) -> None:
        if self.path is None:
            return
        self.result["complete"] = complete
        text = json.dumps(self.result, indent=1, default=str)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.writes += 1

    def finish(self) -> None:
        self.save(complete=True)


def write_skipped(path: Path | None, reason: str) -> None:
    """``{"status": "skipped", "reason", "complete": true}`` to ``path`` (no CUDA: nothing to measure)."""
    JsonProgress(path, {"status": "skipped", "reason": reason}).finish()
