"""EPLB placement quality on skewed synthetic expert loads: no EPLB, the published greedy policy and
the refined one (``epserve.eplb``), per deployment shape.

    .venv/bin/python benchmarks/eplb_policy.py [--layers 58] [--exponents 0.6 1.0] [--seed 0] [--threads 1]

Loads per layer are Zipf-like, ``(rank + 1) ** -s``, over a random permutation of the experts (fixed
seed). Shapes (experts / GPUs / nodes / ``n_group`` / redundant): DeepSeek-V3 (256 / 32 / 4 / 8 / 32),
a single node (64 / 8 / 1 / 8 / 8), Kimi-K2-sized (384 / 64 / 8 / 8 / 64: one group per node), DeepSeek-V2
(160 / 16 / 2 / 8 / 16: 10 experts per GPU) and Kimi-K2 as published with ``n_group`` 1, which does not
divide over its 8 nodes (the global policy). Imbalance is the busiest GPU's load over the mean GPU
load, averaged over layers. No EPLB: expert e on GPU ``e // (experts / GPUs)``, the redundant slots
idle. ``refined/greedy``: the busiest GPU's load, refined over greedy, averaged over layers; ``better``:
the layers where the refined policy's busiest GPU is lighter. Times are one call over all layers.
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from epserve.eplb import gpu_loads, greedy_rebalance_experts, imbalance, rebalance_experts


@dataclass(frozen=True)
class Shape:
    name: str
    experts: int
    gpus: int
    nodes: int
    groups: int
    redundant: int

    @property
    def policy(self) -> str:
        return "hierarchical" if self.groups % self.nodes == 0 else "global"


SHAPES = (
    Shape("DeepSeek-V3", 256, 32, 4, 8, 32),
    Shape("one node", 64, 8, 1, 8, 8),
    Shape("Kimi-K2 size", 384, 64, 8, 8, 64),
    Shape("DeepSeek-V2", 160, 16, 2, 8, 16),
    Shape("Kimi-K2", 384, 64, 8, 1, 64),
)


def zipf_loads(layers: int, experts: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """[layers, experts] loads ``(rank + 1) ** -exponent`` scaled to 10^4 at rank 0, ranks shuffled per layer."""
    ranks = torch.stack([torch.randperm(experts, generator=generator) for _ in range(layers)])
    return 1e4 * (ranks + 1.0) ** -exponent


def no_eplb_imbalance(weight: torch.Tensor, gpus: int) -> float | None:
    """Mean imbalance with contiguous placement and no replicas; None when experts do not divide."""
    layers, experts = weight.shape
    if experts % gpus:
        return None
    return imbalance(weight.double().view(layers, gpus, -1).sum(dim=-1)).mean().item()


def measure(shape: Shape, weight: torch.Tensor) -> dict[str, float | int | None]:
    """One shape and load: imbalances, busiest-GPU ratio, improved layers and run times."""
    args = (shape.experts + shape.redundant, shape.groups, shape.nodes, shape.gpus)
    start = time.perf_counter()
    greedy = greedy_rebalance_experts(weight, *args)
    greedy_s = time.perf_counter() - start
    start = time.perf_counter()
    refined = rebalance_experts(weight, *args)
    refined_s = time.perf_counter() - start
    greedy_loads = gpu_loads(weight, greedy[0], greedy[2], shape.gpus)
    refined_loads = gpu_loads(weight, refined[0], refined[2], shape.gpus)
    greedy_busiest, refined_busiest = greedy_loads.amax(dim=1), refined_loads.amax(dim=1)
    return {
        "none": no_eplb_imbalance(weight, shape.gpus),
        "greedy": imbalance(greedy_loads).mean().item(),
        "refined": imbalance(refined_loads).mean().item(),
        "ratio": (refined_busiest / greedy_busiest).mean().item(),
        "better": int((refined_busiest < greedy_busiest).sum()),
        "greedy_ms": 1e3 * greedy_s,
        "refined_ms": 1e3 * refined_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=58, help="MoE layers (DeepSeek-V3 has 58)")
    ap.add_argument("--exponents", type=float, nargs="+", default=[0.6, 1.0], help="Zipf exponents s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(args.seed)
    cases = [(shape, s) for shape in SHAPES for s in args.exponents]
    rows = []
    for shape, s in tqdm(cases, desc="eplb", leave=False):
        rows.append((shape, s, measure(shape, zipf_loads(args.layers, shape.experts, s, generator))))

    print(f"{args.layers} layers, Zipf loads, seed {args.seed}, {args.threads} thread(s)\n")
    print("| shape | experts / GPUs / nodes / n_group / redundant | policy | s | imbalance: no EPLB | greedy "
          "| refined | refined/greedy busiest | better layers | greedy ms | refined ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, s, r in rows:
        none = "n/a" if r["none"] is None else f"{r['none']:.3f}"
        print(f"| {shape.name} | {shape.experts} / {shape.gpus} / {shape.nodes} / {shape.groups} / {shape.redundant} "
              f"| {shape.policy} | {s:g} | {none} | {r['greedy']:.3f} | {r['refined']:.3f} | {r['ratio']:.3f} "
              f"| {r['better']}/{args.layers} | {r['greedy_ms']:.0f} | {r['refined_ms']:.0f} |")


if __name__ == "__main__":
    main()
