"""epserve: expert-parallel inference server for DeepSeek-V3/R1-class MoE models."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("epserve")  # pyproject's, the one place it is written (the router reads it the same way)
except PackageNotFoundError:  # a source tree on sys.path without the package installed
    __version__ = "0+unknown"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import epserve` (e.g. for the CLI's --help or the planner) does not import torch.
    if name == "LLM":
        from epserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from epserve.messages.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
