"""Engine behaviour: outputs do not depend on caching, chunking or preemption; bad input is refused."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from epserve import LLM, SamplingParams
from epserve.config import ConfigError
from epserve.engine.memory import OutOfMemoryError

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
SHARED = list(range(40, 90))  # 50 tokens shared by several prompts
PROMPTS = [SHARED + [i, i + 1, i + 2] for i in range(3, 9)] + [[9, 8, 7], list(range(200, 237))]


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("tiny", dtype="float32")


@pytest.fixture(scope="module")
def reference(ckpt, device):
    """Greedy tokens with no prefix cache, generous blocks, large prefill budget."""
    llm = LLM(ckpt, dtype="float32", num_blocks=512, enable_prefix_caching=False, device=device)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_prefix_cache_hits_give_identical_outputs(ckpt, device, reference):
    llm = LLM(ckpt, dtype="float32", device=device, num_blocks=512, block_size=16)
    first = llm.generate(PROMPTS, GREEDY)
    second = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in second] == reference
    # On the second pass every prompt finds its full blocks cached: 48 of the shared 50 tokens.
    assert all(o.num_cached_tokens >= 48 for o in second[:6])
    assert sum(o.num_cached_tokens for o in second) > sum(o.num_cached_tokens for o in first)


def test_tiny_prefill_chunks_give_identical_outputs(ckpt, device, reference):
    llm = LLM(ckpt, dtype="float32", device=device, num_blocks=512, max_num_batched_tokens=3,
              enable_prefix_caching=False)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_forced_preemption_gives_identical_outputs(ckpt, device, reference):
    # 8 requests need up to 6 blocks each (≤ 85 tokens / 16); 14 blocks force recompute preemptions.
    llm = LLM(ckpt, dtype="float32", device=device, num_blocks=14, block_size=16, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_sampling_is_seeded_and_batch_independent(ckpt, device):
    llm = LLM(ckpt, dtype="float32", device=device, num_blocks=512)
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], p)[0].token_ids
    together = llm.generate(PROMPTS, [p] + [SamplingParams(max_tokens=16, temperature=1.0)] * 7)[0].token_ids
    assert alone == together
    other = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True))
    assert other[0].token_ids != alone


def test_stop_tokens_and_logprobs(ckpt, device, reference):
    llm = LLM(ckpt, dtype="float32", device=device, num_blocks=512)
    stop = reference[0][5]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=[stop],
                                                    logprobs=3))[0]
    assert out.token_ids == reference[0][: reference[0].index(stop) + 1]
    assert out.finish_reason == "stop"
    assert len(out.logprobs) == len(out.token_ids)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0] and len(first.top) == 3
    assert first.top[0][0] == first.token_id  # greedy picks the top-1
    assert first.logprob <= 0 and abs(first.logprob - first.top[0][1]) < 1e-6


def test_text_prompts_round_trip(ckpt):
    llm = LLM(ckpt, dtype="float32", num_blocks=128)
    out = llm.generate("Hello world", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert len(out.token_ids) == 8 and isinstance(out.text, str)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        LLM(tmp_path / "nope")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        LLM(tmp_path)


def test_prompt_longer_than_context_is_refused(ckpt):
    llm = LLM(ckpt, dtype="float32", num_blocks=64, max_model_len=64)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1, 2, 3], list(range(1, 80))], GREEDY)  # the first was queued, then aborted
    assert llm.engine.runner.num_blocks == llm.engine.scheduler.kv_manager.num_free_blocks
    # The engine is still usable afterwards.
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids) == 4


def test_bad_prompts_are_refused(ckpt):
    llm = LLM(ckpt, dtype="float32", num_blocks=64)
    with pytest.raises(ValueError, match="empty|no tokens|0 tokens"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 10**6]], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


@pytest.mark.parametrize("device, message", [("tpu", "device"), ("cuda:7", "CUDA|cuda")])
def test_bad_device_is_a_clear_error(ckpt, device, message):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has that GPU")
    with pytest.raises(ValueError, match=message):
        LLM(ckpt, dtype="float32", device=device)


def test_weights_larger_than_budget_is_a_clear_error(ckpt):
    with pytest.raises(OutOfMemoryError, match="weights need"):
        LLM(ckpt, dtype="float32", memory_budget_bytes=1000)


def test_pool_sized_from_budget(ckpt):
    llm = LLM(ckpt, dtype="float32", memory_budget_bytes=64 * 2**20, max_num_seqs=1024)
    runner = llm.engine.runner
    weights = sum(p.numel() * 4 for p in runner.model.parameters())
    kv = sum(c.numel() * 4 for c in runner.kv_caches)
    assert 0 < weights + kv <= 64 * 2**20


def test_cli_reports_bad_model_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "epserve.cli", "generate", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "epserve: error:" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_fp8_checkpoint_matches_dequantized_twin(tiny_fp8_ckpt, tmp_path):
    from epserve.checkpoint import CheckpointReader, save_checkpoint

    reader = CheckpointReader(tiny_fp8_ckpt)
    config = json.loads((tiny_fp8_ckpt / "config.json").read_text())
    config.pop("quantization_config")
    tensors = {n: reader.get(n, dtype=torch.float32) for n in reader.keys()}
    assert not any(n.endswith("_scale_inv") for n in tensors)
    save_checkpoint(tmp_path, config, tensors)
    fp8 = LLM(tiny_fp8_ckpt, dtype="float32", num_blocks=256)
    twin = LLM(tmp_path, dtype="float32", num_blocks=256)
    a = [o.token_ids for o in fp8.generate(PROMPTS, GREEDY)]
    b = [o.token_ids for o in twin.generate(PROMPTS, GREEDY)]
    assert a == b
    for name, p in twin.engine.runner.model.named_parameters():
        q = dict(fp8.engine.runner.model.named_parameters())[name]
        assert torch.equal(p, q), name
