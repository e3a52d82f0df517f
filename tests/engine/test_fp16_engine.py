"""``dtype="float16"`` (``--dtype float16``): the weights and the paged latent cache in fp16, MLA decode reading
the fp16 cache (on the CPU the op's torch reference, the C kernels taking bf16/fp32; on CUDA the Triton kernels
on fp16 tensor cores, tested in ``tests/kernels/test_mla_decode_kernel.py``). An fp16 engine decodes the tokens
the fp32 engine does where the greedy choice is clear (a checkpoint with a logit margin), with close logprobs."""

from __future__ import annotations

import pytest
import torch

from epserve import LLM, SamplingParams

MIN_MARGIN_NATS = 1.0  # a prompt counts as clear when every greedy step's top-2 gap is at least this


@pytest.fixture(scope="module")
def margin_ckpt(make_ckpt):
    return make_ckpt("tiny", dtype="float32", logit_margin=8.0)


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(2, 500, (int(torch.randint(3, 40, (1,), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]


def test_fp16_engine_decodes_the_fp32_tokens_on_clear_margins(margin_ckpt):
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2, ignore_eos=True)
    prompts = _prompts(8)
    ref = LLM(margin_ckpt, dtype="float32", num_blocks=128).generate(prompts, params)
    clear = [i for i, out in enumerate(ref) if min(a.top[0][1] - a.top[1][1] for a in out.logprobs) >= MIN_MARGIN_NATS]
    assert len(clear) >= 6, f"the fixture should give clear margins on most prompts, got {len(clear)}"
    fp16 = LLM(margin_ckpt, dtype="float16", num_blocks=128)
    runner = fp16.engine.runner
    assert runner.kv_dtype == torch.float16 and runner.kv_caches[0].dtype == torch.float16
    got = fp16.generate([prompts[i] for i in clear], params)
    for i, out in zip(clear, got):
        assert out.token_ids == ref[i].token_ids, f"prompt {i}"
        diffs = [abs(a.logprob - b.logprob) for a, b in zip(out.logprobs, ref[i].logprobs)]
        assert max(diffs) < 0.05, diffs
