"""MLA's prefill attention runs torch's fused CPU kernel: MLA's V is narrower than Q and K (16 against 24 on
the tiny preset, 128 against 192 on DeepSeek-V3), which the fused kernel does not take, so every prefill fell to
the unfused path (2.5-3.4x slower at 256-1024 tokens). V is padded with zero columns, cut off after. The
outputs are the transformers oracle's (test_model_parity); here: which kernel ran, fresh and over a cached
prefix (a masked attention), and the same tokens either way."""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile

from epserve import LLM, SamplingParams

FUSED = "aten::_scaled_dot_product_flash_attention_for_cpu"
UNFUSED = "aten::_scaled_dot_product_attention_math"


def test_prefill_attention_takes_the_fused_cpu_kernel_fresh_and_over_a_cached_prefix(make_ckpt):
    llm = LLM(make_ckpt("tiny"), dtype="float32", enable_prefix_caching=True)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    prompt = list(range(10, 60))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fresh = llm.generate([prompt], greedy)[0]
            cached = llm.generate([prompt[:40] + [7, 8, 9]], greedy)[0]  # its first 32 tokens' KV cached
        names = {event.key for event in prof.key_averages()}
        again = llm.generate([prompt], greedy)[0]
    finally:
        llm.shutdown()
    assert cached.num_cached_tokens >= 32 and fresh.num_cached_tokens == 0
    assert FUSED in names and UNFUSED not in names
    assert again.token_ids == fresh.token_ids and len(fresh.token_ids) == 4
