"""vLLM's server-wide output flags as the OpenAIServer applies them: ``--response-role`` (the chat
response's ``role``), ``--return-tokens-as-token-ids`` (logprobs' tokens written ``token_id:<id>`` for
requests that do not say) and ``--max-logprobs`` (a request asking for more is a 400 naming its field;
at most the engine's own cap, ``MAX_LOGPROBS``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from epserve.messages.sampling import MAX_LOGPROBS
from epserve.router.errors import bad_request


@dataclass(frozen=True)
class OutputOptions:
    response_role: str = "assistant"
    tokens_as_ids: bool = False  # the default of a request's return_tokens_as_token_ids
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        if not self.response_role.strip():
            raise ValueError("--response-role must not be empty")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs {self.max_logprobs}: the engine gives at most {MAX_LOGPROBS} (vLLM's "
                             f"default); choose one in [0, {MAX_LOGPROBS}]")

    def as_ids(self, req: Any) -> bool:
        """Whether ``req``'s logprobs name tokens by id: its own ``return_tokens_as_token_ids`` when it
        gives one, else the server's."""
        if "return_tokens_as_token_ids" in req.model_fields_set:
            return bool(req.return_tokens_as_token_ids)
        return self.tokens_as_ids

    def check(self, req: Any) -> None:
        """A 400 naming the field when ``req`` (a completion or chat request) asks for more logprobs
        than ``max_logprobs``."""
        counts = {"prompt_logprobs": req.prompt_logprobs}
        if isinstance(req.logprobs, int) and not isinstance(req.logprobs, bool):  # completions: a count
            counts["logprobs"] = req.logprobs
        counts["top_logprobs"] = getattr(req, "top_logprobs", None)  # chat's (completions refuse it)
        for field, count in counts.items():
            if count is not None and count > self.max_logprobs:
                raise bad_request(f"{field} {count} is more than this server gives (--max-logprobs "
                                  f"{self.max_logprobs})", field)
