"""FP4 dispatch (``--dispatch-dtype nvfp4``) against the exact bf16 dispatch on a trained checkpoint in NVFP4:
greedy token agreement, the |logprob difference| of the same tokens, and the dispatch bytes (issue 42, item 5).

    .venv/bin/python benchmarks/nvfp4_dispatch.py --model /tmp/trained [--prompts 16 --max-tokens 32]
        [--dp 2 --dispatch all_to_all] [--json out.json]

``--model``: a trained bf16/fp32 checkpoint (``epserve make-checkpoint /tmp/trained --train``), converted once
into ``<model>-nvfp4`` with make-checkpoint's NVFP4 path (``checkpoint.nvfp4_export.nvfp4_checkpoint``:
ModelOpt's layout, the MLPs and experts in four bits), or an NVFP4 checkpoint used as it is. Two engines on it
in bf16, ``--dp`` ranks exchanging tokens through ``--dispatch``, one sending bf16 rows (``auto``: exact), the
other NVFP4 rows; one after the other, each alone on the machine. Both run W4A16 experts, so the difference
between them is the dispatch's quantization of the activations alone.

- greedy agreement: the prompts' greedy continuations (``ignore_eos``) from both engines; identical ones, and
  the tokens before the first difference over all tokens;
- logprobs: the bf16 engine's continuation scored by both engines as a prompt (``prompt_logprobs``: each token
  given the same context); mean and max |difference| of those tokens' logprobs, and the share of positions
  where both engines' most likely next token is the same (teacher-forced agreement);
- bytes: ``llm.comm_bytes()`` of the dispatch over the decode steps (the bytes of the full generation minus
  those of its prefill alone, ``max_tokens=1``; prefix caching off, so both compute the same prefill), NVFP4
  over bf16, beside the per-row ratio ``(H/2 + H/16 + 4) / 2H`` (all_to_all moves only the rows that cross
  ranks, so the two runs' ratio differs from it by their routing's difference).

Prompts are ``--prompt-words`` words of the training corpus's held-out paragraphs (their openings first).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # several ranks on few cores (set before torch loads)

from epserve import LLM, SamplingParams  # noqa: E402
from epserve.checkpoint import CheckpointReader, save_checkpoint  # noqa: E402
from epserve.checkpoint.nvfp4_export import nvfp4_checkpoint  # noqa: E402
from epserve.moe.dispatch.payload import nvfp4_width  # noqa: E402
from epserve.training.corpus import load_corpus  # noqa: E402

_CHECKPOINT_FILES = ("config.json", "hf_quant_config.json", "model.safetensors.index.json")


def nvfp4_model(model: Path) -> Path:
    """``model`` if it is an NVFP4 checkpoint, else its NVFP4 conversion ``<model>-nvfp4`` (made once)."""
    if (model / "hf_quant_config.json").exists():
        return model
    out = model.with_name(model.name + "-nvfp4")
    if (out / "hf_quant_config.json").exists():
        return out
    print(f"converting {model} to NVFP4 into {out}", flush=True)
    reader = CheckpointReader(model)
    tensors = {name: reader.get_raw(name) for name in reader.raw_keys()}
    reader.close()
    config, quantized, hf_quant = nvfp4_checkpoint(json.loads((model / "config.json").read_text()), tensors)
    save_checkpoint(out, config, quantized, hf_quant_config=hf_quant)
    for f in model.iterdir():  # the tokenizer and the training summary
        if f.is_file() and f.name not in _CHECKPOINT_FILES and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def prompts(n: int, words: int) -> list[str]:
    """``n`` distinct prompts of ``words`` words: each held-out paragraph's opening, then (past their number)
    the next ``words`` words of each, and so on."""
    paragraphs = [p.split() for p in load_corpus().heldout]
    windows = [" ".join(p[at : at + words]) for at in range(0, max(map(len, paragraphs)), words)
               for p in paragraphs if len(p) >= at + words]
    if len(windows) < n:
        raise SystemExit(f"the held-out paragraphs give {len(windows)} prompts of {words} words, not {n}")
    return windows[:n]


def run_engine(path: Path, dispatch_dtype: str, texts: list[str], args: argparse.Namespace,
               reference: list[list[int]] | None) -> dict:
    """One engine: its greedy continuations, the dispatch bytes of their decode steps, and its prompt logprobs
    of ``prompt + continuation`` (the reference's continuations, or its own)."""
    engine = dict(dtype="bfloat16", dp=args.dp, dispatch=args.dispatch, dispatch_dtype=dispatch_dtype,
                  max_num_seqs=len(texts), num_blocks=args.num_blocks, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    with LLM(str(path), **engine) as llm:
        llm.reset_comm_stats()
        llm.generate(texts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1))
        prefill = sum(r["dispatch"] for r in llm.comm_bytes())
        llm.reset_comm_stats()
        outputs = llm.generate(texts, greedy)
        full = sum(r["dispatch"] for r in llm.comm_bytes())
        continuations = [o.token_ids for o in outputs]
        scored = [o.prompt_token_ids + c for o, c in zip(outputs, reference or continuations)]
        logprobs = llm.generate(scored, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    per_prompt = []
    for o, prompt in zip(logprobs, outputs):
        start = len(prompt.prompt_token_ids)  # the continuation's positions
        per_prompt.append([(lp.logprob, lp.top[0][0] if lp.top else None)
                           for lp in o.prompt_logprobs[start:]])  # type: ignore[index]
    decode_tokens = len(texts) * (args.max_tokens - 1)
    return {"continuations": continuations, "scored": per_prompt, "decode_bytes": full - prefill,
            "decode_bytes_per_token": (full - prefill) / decode_tokens}


def compare(bf16: dict, nvfp4: dict) -> dict:
    """Token agreement and logprob differences of the NVFP4-dispatch engine against the bf16 one."""
    same, prefix, total = 0, 0, 0
    for a, b in zip(bf16["continuations"], nvfp4["continuations"]):
        same += a == b
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix, total = prefix + first, total + len(a)
    diffs, forced, scale = [], [], []
    for ref_prompt, nv_prompt in zip(bf16["scored"], nvfp4["scored"]):
        for (ref_lp, ref_top), (nv_lp, nv_top) in zip(ref_prompt, nv_prompt):
            diffs.append(abs(nv_lp - ref_lp))
            scale.append(ref_lp)
            forced.append(nv_top == ref_top)
    return {"identical_continuations": same, "prompts": len(bf16["continuations"]),
            "tokens_before_first_difference": prefix, "tokens": total,
            "greedy_prefix_agreement": prefix / total, "teacher_forced_agreement": sum(forced) / len(forced),
            "mean_abs_logprob_diff": statistics.fmean(diffs), "max_abs_logprob_diff": max(diffs),
            "mean_logprob_bf16": statistics.fmean(scale),  # the scale the differences compare with
            "scored_tokens": len(diffs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/trained")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--dispatch", default="all_to_all", choices=("all_to_all", "padded"))
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = nvfp4_model(Path(args.model))
    texts = prompts(args.prompts, args.prompt_words)
    bf16 = run_engine(path, "auto", texts, args, None)
    nvfp4 = run_engine(path, "nvfp4", texts, args, bf16["continuations"])
    result = compare(bf16, nvfp4)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    result.update({
        "model": str(path), "hidden_size": hidden, "dp": args.dp, "dispatch": args.dispatch,
        "max_tokens": args.max_tokens,
        "decode_dispatch_bytes": {"bf16": bf16["decode_bytes"], "nvfp4": nvfp4["decode_bytes"]},
        "decode_dispatch_bytes_per_token": {"bf16": bf16["decode_bytes_per_token"],
                                            "nvfp4": nvfp4["decode_bytes_per_token"]},
        "decode_bytes_ratio": nvfp4["decode_bytes"] / bf16["decode_bytes"] if bf16["decode_bytes"] else None,
        "row_bytes_ratio": nvfp4_width(hidden) / (2 * hidden),
    })
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
