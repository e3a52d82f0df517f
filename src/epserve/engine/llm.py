"""Offline API: ``LLM(path).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from epserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from epserve.engine.engine import LLMEngine
from epserve.engine.request import SamplingParams
from epserve.engine.sampler import TokenLogprobs

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None


class LLM:
    """A single-process engine with a tokenizer. ``model=None`` uses the built-in tiny checkpoint."""

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str = "bfloat16",
        device: str = "cpu",
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_budget_bytes: int | None = None,
        memory_utilization: float = 0.5,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
    ) -> None:
        if model is None:
            from epserve.presets import default_model_path

            model = default_model_path()
        path = str(model)
        model_config = ModelConfig.from_hf(path)
        if max_model_len is not None and max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's {model_config.max_position_embeddings} positions"
            )
        config = EngineConfig(
            model=model_config,
            model_path=path,
            dtype=dtype,
            device=device,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                memory_budget_bytes=memory_budget_bytes,
                memory_utilization=memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
        )
        self.tokenizer = _load_tokenizer(path)
        self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        outputs: dict[str, RequestOutput] = {}
        requests = {}
        order: list[str] = []
        try:
            for prompt, p in zip(prompts, params_list):
                rid = str(next(self._ids))
                token_ids = self._encode(prompt)
                out = RequestOutput(rid, prompt if isinstance(prompt, str) else None, token_ids)
                requests[rid] = self.engine.add_request(rid, token_ids, p)
                outputs[rid] = out
                order.append(rid)
            bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
            while self.engine.has_unfinished_requests():
                for update in self.engine.step():
                    out = outputs.get(update.request_id)
                    if out is None:  # e.g. the abort report of an earlier, failed call
                        continue
                    out.token_ids.extend(update.new_token_ids)
                    if update.finished:
                        out.finish_reason = update.finish_reason
                        bar.update(1)
            bar.close()
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        for rid, out in outputs.items():
            request = requests[rid]
            out.num_cached_tokens = request.num_cached_tokens
            if request.sampling_params.logprobs is not None:
                out.logprobs = list(request.output_logprobs)  # type: ignore[arg-type]
            if self.tokenizer is not None:
                out.text = self.tokenizer.decode(out.token_ids)
        return [outputs[rid] for rid in order]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer; pass token-id prompts")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of token ids")
        return list(prompt)


def _load_tokenizer(path: str):
    from epserve.tokenizer import Tokenizer

    if not (Path(path) / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(path)
