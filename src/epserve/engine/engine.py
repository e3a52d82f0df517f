"""The engine's step loop: schedule -> run the model -> sample -> update sequences."""

from __future__ import annotations

import logging

from epserve.config import EngineConfig
from epserve.engine.request import Request, SamplingParams
from epserve.engine.runner import ModelRunner
from epserve.engine.scheduler import RequestUpdate, Scheduler

logger = logging.getLogger(__name__)


class LLMEngine:
    """Token-in/token-out engine of one instance (one DP group)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks, config.max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request; raises ValueError for an empty prompt, a token outside the vocabulary, or a
        prompt that does not fit the context."""
        vocab = self.config.model.vocab_size
        bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        request = Request(request_id, prompt_token_ids, params, eos_token_ids=self.config.model.eos_token_ids)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestUpdate]:
        output = self.scheduler.schedule()
        result = self.runner.execute(output) if output.chunks else None
        updates = self.scheduler.update(
            output, result.sampled if result else {}, result.logprobs if result else None
        )
        if not output.chunks and not updates and self.scheduler.has_unfinished_requests():
            # Cannot happen while the scheduler keeps its invariants; never spin silently.
            raise RuntimeError(
                f"scheduler stalled: {self.scheduler.num_running} running, {self.scheduler.num_waiting} waiting, "
                f"{self.scheduler.kv_manager.num_free_blocks} free KV blocks"
            )
        for update in updates:
            if update.finished:
                self.runner.release(update.request_id)
        return updates
