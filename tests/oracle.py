"""The numerical oracle's greedy continuation: transformers' ``generate`` on a prompt, no sampling, no EOS stop."""

from __future__ import annotations

import torch


def hf_greedy(hf: torch.nn.Module, prompt: list[int], tokens: int) -> list[int]:
    """The ``tokens`` tokens transformers' model ``hf`` appends to ``prompt`` greedily (exactly that many)."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens,  # type: ignore[operator]
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
