"""GPU greedy tokens against reference tokens computed on the CPU and shipped with the GPU check.

Two tiny DeepSeek-V3 checkpoints are built deterministically (``epserve.presets.make_checkpoint``, fixed
seed): ``bf16`` (the ``tiny`` preset, bfloat16) and ``fp8`` (``tiny128``, FP8 block-quantized linears,
where every dimension the FP8 runtime fuses or splits is a multiple of 128). Their LM heads carry a large
``logit_margin``, so each greedy step's top token is clear of the next by far more than bfloat16 rounding
moves a logit between two devices (the reference records the smallest top-2 gap it saw). Fixed prompts
run greedy for 64 tokens with ``epserve.LLM`` in bfloat16.

  --write-reference PATH   here, on the CPU: the tokens (the CPU's default decode, ``cpu_graph`` where the
                           C kernels build) with each checkpoint's SHA-256, so a changed generator is caught
  --check PATH             on CUDA: the captured decode (CUDA graphs) and eager, each prompt equal to the
                           reference or its first differing position; ``--json`` rewritten after every run
  --build DIR              here: both checkpoints into DIR (``.gpu-ref``, which the lease carries: ``--check
                           --workdir .gpu-ref`` then uses them instead of building them on the GPU machine)

Exit status of ``--check``: 0 all equal, 1 a token differs, 3 a checkpoint's hash differs from the
reference's (the generator changed: the tokens are not comparable), 2 no CUDA device.

Usage: python benchmarks/gpu_tokens.py --write-reference benchmarks/gpu_reference/tokens.json
       python benchmarks/gpu_tokens.py --check benchmarks/gpu_reference/tokens.json --json out.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SEED = 41
LOGIT_MARGIN = 6.0
GAP_TOLERANCE = 1.0  # nats: a top-2 gap further than this from the reference's is reported (bf16 vs fp32: ~0.2)
TOKENS = 64
PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 200, 300], [42] * 5, list(range(300, 340)), [1]]
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"preset": "tiny128", "fp8": False},
    "fp8": {"preset": "tiny128", "fp8": True},
}
ENGINE = {"dtype": "bfloat16", "num_blocks": 128, "block_size": 16, "enable_prefix_caching": False}
REFERENCE = Path(__file__).resolve().parent / "gpu_reference" / "tokens.json"


def build(variant: str, root: Path) -> Path:
    """The variant's checkpoint under ``root`` (the same arguments: byte-identical files); one already there
    (``--build`` made it on this CPU, the lease carried it) is used as it is, so the GPU machine's torch
    never has to draw the same random weights."""
    from epserve.presets import make_checkpoint

    if (root / variant / "config.json").exists():
        return root / variant
    spec = VARIANTS[variant]
    return make_checkpoint(root / variant, preset=spec["preset"], fp8=spec["fp8"], seed=SEED, dtype="bfloat16",
                           logit_margin=LOGIT_MARGIN)


def checkpoint_sha256(path: Path) -> str:
    """One hash over what the tokens depend on: config.json's values and every tensor's name, dtype, shape and
    bytes, in name order (not the files' bytes: another safetensors or tokenizers version on the GPU machine
    may lay the same checkpoint out differently)."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256(json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True).encode())
    tensors = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no iterator
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}\0".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def generate(path: Path, device: str, **options: Any) -> dict[str, Any]:
    """Greedy ``TOKENS`` tokens for each prompt; the smallest top-2 logprob gap of each; the capture mode."""
    from epserve import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(path, device=device, **ENGINE, **options)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params)
    gaps = [[round(lp.top[0][1] - lp.top[1][1], 3) for lp in out.logprobs] for out in outputs]
    result = {"tokens": [list(out.token_ids) for out in outputs], "min_top2_gap": [min(g) for g in gaps],
              "top2_gaps": gaps,
              "capture": llm.config.capture_mode, "seconds": round(time.perf_counter() - start, 2)}
    del llm
    return result


def compare(want: dict[str, Any], got: dict[str, Any]) -> list[dict[str, Any]]:
    """Per prompt: equal, or the first differing position with the reference's and this run's token; and the
    largest difference of the top-2 logprob gap over the steps where the tokens agree (the logits' drift)."""
    rows = []
    for ref, out, ref_gaps, gaps in zip(want["tokens"], got["tokens"], want["top2_gaps"], got["top2_gaps"],
                                        strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if first is None and len(ref) != len(out):
            first = min(len(ref), len(out))
        agree = len(ref) if first is None else first
        drift = max((abs(a - b) for a, b in zip(ref_gaps[:agree], gaps[:agree])), default=0.0)
        row: dict[str, Any] = {"equal": first is None, "max_gap_diff": round(drift, 3)}
        if first is not None:
            row |= {"first_diff": first, "want": ref[first] if first < len(ref) else None,
                    "got": out[first] if first < len(out) else None}
        rows.append(row)
    return rows


def compact_json(value: Any) -> str:
    """Indented JSON with each list of numbers on one line (the reference stays small and diffable)."""
    return re.sub(r"\[[-\d.,\se]*\]", lambda m: "[" + ", ".join(x.strip() for x in m[0][1:-1].split(",") if x.strip())
                  + "]", json.dumps(value, indent=1))


def write_reference(dest: Path, workdir: Path) -> dict[str, Any]:
    import torch

    ref: dict[str, Any] = {
        "generator": {"seed": SEED, "logit_margin": LOGIT_MARGIN, "dtype": "bfloat16", "tokens": TOKENS,
                      "variants": VARIANTS, "engine": ENGINE},
        "prompts": PROMPTS, "written_with": {"torch": torch.__version__, "device": "cpu"}, "variants": {},
    }
    for variant in VARIANTS:
        path = build(variant, workdir)
        run = generate(path, "cpu")
        seconds = run.pop("seconds")  # not kept: the file changes only when the tokens or checkpoints do
        ref["variants"][variant] = {"checkpoint_sha256": checkpoint_sha256(path), **run}
        print(f"{variant}: {run['capture']}, smallest top-2 gap {min(g for g in run['min_top2_gap'] if g is not None)}"
              f" nats, {seconds} s")
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(compact_json(ref) + "\n")
    return ref


def check(reference: Path, workdir: Path, device: str, out: Path | None) -> int:
    """Each variant's captured and eager run on ``device`` against the reference; the JSON after each run."""
    import torch

    ref = json.loads(reference.read_text())
    result: dict[str, Any] = {"status": "running", "device": device, "reference": str(reference),
                              "torch": torch.__version__, "variants": {}}

    def save() -> None:
        if out is not None:
            tmp = out.with_name(out.name + ".tmp")
            tmp.write_text(json.dumps(result, indent=1))
            os.replace(tmp, out)

    if ref.get("prompts") != PROMPTS or ref.get("generator", {}).get("seed") != SEED:
        result["status"] = "reference is for another generator: --write-reference again"
        save()
        return 3
    bad_hash = differs = False
    for variant in VARIANTS:
        want = ref["variants"][variant]
        path = build(variant, workdir)
        sha = checkpoint_sha256(path)
        rec: dict[str, Any] = {"checkpoint_equal": sha == want["checkpoint_sha256"], "checkpoint_sha256": sha,
                               "reference_min_top2_gap": want["min_top2_gap"], "modes": {}}
        result["variants"][variant] = rec
        bad_hash |= not rec["checkpoint_equal"]
        for mode, options in (("captured", {}), ("eager", {"cuda_graph": False})):
            try:
                run = generate(path, device, **options)
            except Exception as e:  # noqa: BLE001 - recorded, the other runs still go
                rec["modes"][mode] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                differs = True
                save()
                continue
            rows = compare(want, run)
            differs |= not all(r["equal"] for r in rows)
            drift = max(r["max_gap_diff"] for r in rows)
            rec["modes"][mode] = {"capture": run["capture"], "seconds": run["seconds"],
                                  "min_top2_gap": run["min_top2_gap"], "prompts": rows,
                                  "equal": sum(r["equal"] for r in rows), "of": len(rows),
                                  "max_gap_diff": drift, "gaps_close": drift <= GAP_TOLERANCE}
            print(f"{variant} {mode} ({run['capture']}): {rec['modes'][mode]['equal']}/{len(rows)} prompts equal "
                  f"to the CPU reference, top-2 gaps within {drift} nats of its, {run['seconds']} s", flush=True)
            save()
    result["status"] = "checkpoint differs" if bad_hash else "differs" if differs else "equal"
    result["key_figures"] = {f"{v}_{m}": {k: r.get(k) for k in ("equal", "of", "max_gap_diff", "error") if k in r}
                             for v, rec in result["variants"].items() for m, r in rec["modes"].items()}
    save()
    print(f"tokens: {result['status']}")
    return 3 if bad_hash else 1 if differs else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write-reference", type=Path, metavar="PATH")
    what.add_argument("--check", type=Path, metavar="PATH")
    what.add_argument("--build", type=Path, metavar="DIR")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, help="--check's result (rewritten after every run)")
    parser.add_argument("--workdir", type=Path, help="where the checkpoints are built (default: a temporary folder)")
    args = parser.parse_args()
    os.environ.setdefault("EPSERVE_NO_PROGRESS", "1")
    with tempfile.TemporaryDirectory(prefix="gpu_tokens.") as tmp:
        workdir = args.workdir or Path(tmp)
        if args.build:
            for variant in VARIANTS:
                print(f"{variant}: {build(variant, args.build)} ({checkpoint_sha256(args.build / variant)[:16]})")
            return 0
        if args.write_reference:
            write_reference(args.write_reference, workdir)
            return 0
        import torch

        if args.device.startswith("cuda") and not torch.cuda.is_available():
            print("gpu_tokens.py --check needs a CUDA GPU (--device cpu checks the reference here)", file=sys.stderr)
            return 2
        return check(args.check, workdir, args.device, args.json)


if __name__ == "__main__":
    sys.exit(main())
