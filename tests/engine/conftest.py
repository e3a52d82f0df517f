"""Engines shared by the structured-output tests (test_structured.py, test_structured_failures.py), one per
module that asks."""

from __future__ import annotations

import pytest

from epserve import LLM


@pytest.fixture(scope="module")
def llm(tiny_ckpt, device):
    """The tiny checkpoint in fp32 (a module may define its own ``llm``)."""
    return LLM(tiny_ckpt, dtype="float32", num_blocks=128, device=device)


@pytest.fixture(scope="module")
def mtp_llm(counter_ckpt, device):
    """The MTP checkpoint (its drafts right about half the time), two drafts per step."""
    return LLM(counter_ckpt, speculative="mtp", num_speculative_tokens=2, device=device, dtype="float32",
               num_blocks=256, block_size=8)
