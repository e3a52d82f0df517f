"""A checkpoint's recommended sampling (``generation_config.json``) as the defaults of requests that do
not set those fields, as vLLM's ``--generation-config auto`` does: ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, and EOS ids beyond the model's own (they stop generation like EOS).

``--generation-config auto`` reads the model directory's file, ``vllm`` ignores it (OpenAI's defaults),
and any other value is a directory holding a ``generation_config.json``.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from epserve.messages.sampling import SamplingParams

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    """What the file sets (None: not set, the API's own default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = ""

    @classmethod
    def resolve(cls, choice: str, model_dir: Path | None) -> GenerationDefaults:
        """``auto`` (the model directory's file, if any), ``vllm`` (none) or a directory with the file.
        ValueError for a directory without it or a file that is not a generation config."""
        if choice == "vllm":
            return cls()
        if choice == "auto":
            if model_dir is None or not (model_dir / FILE).is_file():
                return cls()
            return cls.load(model_dir / FILE)
        path = Path(choice)
        if not (path / FILE).is_file():
            raise ValueError(f"--generation-config {choice}: expected auto, vllm or a directory holding {FILE}")
        return cls.load(path / FILE)

    @classmethod
    def load(cls, path: Path) -> GenerationDefaults:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} is not a JSON object")
        values: dict[str, Any] = {}
        for name in SAMPLING_FIELDS:
            value = data.get(name)
            if value is None:
                continue
            kind = int if name == "top_k" else float
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{path}: {name} must be a number, got {value!r}")
            values[name] = kind(value)
        eos = data.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos if isinstance(eos, list) else []
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in eos_ids):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
        try:  # values no request could ask for fail at start, not in every request
            SamplingParams(**values)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        return cls(**values, eos_token_ids=tuple(eos_ids), source=str(path))

    def fill(self, given: set[str], values: dict[str, Any]) -> dict[str, Any]:
        """``values`` (sampling fields by name) with the fields the request did not set (not in
        ``given``) taken from the file."""
        out = dict(values)
        for name in SAMPLING_FIELDS:
            default = getattr(self, name)
            if default is not None and name not in given:
                out[name] = default
        return out

    def describe(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if f.name not in ("eos_token_ids", "source") and getattr(self, f.name) is not None]
        if self.eos_token_ids:
            parts.append(f"eos_token_ids={list(self.eos_token_ids)}")
        return ", ".join(parts)

    def log(self) -> None:
        if self.source and self.describe():
            logger.info("default sampling from %s (requests that set a field override it): %s",
                        self.source, self.describe())
        elif self.source:
            logger.info("%s sets no sampling defaults", self.source)
