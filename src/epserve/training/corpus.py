"""The training corpus: the Python reference manual's help topics, cleaned into English prose.

Source: ``pydoc_data.topics.topics``, the ~79 help topics (``help("if")``, ``help("FORMATTING")``, ...)
that ship inside every CPython installation as plain text generated from the Python Language
Reference and Library documentation: about 465 KB, offline, identical for a given Python version.
License: the Python Software Foundation License (the documentation's license; see
https://docs.python.org/3/license.html), which allows copying and derived works with attribution.

Cleaning (``clean_topic``) keeps prose and drops what is not: headings' underlines, grammar
productions (``::=``), interactive examples (``>>>`` / ``...``), indented code blocks that follow a
paragraph ending in ``:``, tables and deeply nested blocks. Each kept paragraph becomes one line with
normalised whitespace. ``load_corpus()`` takes the topics in sorted order, drops repeated
paragraphs (topics overlap) and splits the rest deterministically: every ``HOLDOUT_EVERY``-th
paragraph (~2%) is held out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

CORPUS_NAME = "pydoc_data.topics (Python reference manual help topics)"
CORPUS_LICENSE = "PSF-2.0 (Python Software Foundation License, Python documentation)"
HOLDOUT_EVERY = 50  # every 50th paragraph: 2% held out

_UNDERLINE = re.compile(r"^\s*([*=\-~^\"#+])\1{2,}\s*$")
_TABLE = re.compile(r"^\s*(\+[-=+]+\+?|\|.*\||={3,}(\s+={3,})+)\s*$")
_WORD = re.compile(r"[A-Za-z]{2,}")
_LABEL = re.compile(r"^(Note|Notes|See also|Warning|Caution|Important|Tip|Hint):$")


@dataclass(frozen=True)
class Corpus:
    """Paragraphs of prose, each one line: ``train`` and ``heldout`` (disjoint, deterministic)."""

    train: tuple[str, ...]
    heldout: tuple[str, ...]
    name: str = CORPUS_NAME
    license: str = CORPUS_LICENSE

    @property
    def text(self) -> str:
        """The training paragraphs, one per line (what the tokenizer is trained on)."""
        return "\n".join(self.train) + "\n"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _blocks(text: str) -> list[list[str]]:
    """Runs of non-blank lines."""
    blocks: list[list[str]] = []
    current: list[str] = []
    for line in text.expandtabs(8).splitlines():
        if line.strip():
            current.append(line.rstrip())
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    return blocks


def _is_prose(lines: list[str]) -> bool:
    """Plain sentences: no prompts, grammar, tables, and mostly words rather than symbols."""
    text = " ".join(s.strip() for s in lines)
    if any(s.lstrip().startswith((">>>", "...")) for s in lines):
        return False
    if "::=" in text or any(_TABLE.match(s) for s in lines):
        return False
    letters = sum(len(w) for w in _WORD.findall(text))
    return len(text) > 0 and letters / len(text) >= 0.6


def clean_topic(text: str) -> list[str]:
    """One help topic's prose paragraphs, each joined into one whitespace-normalised line."""
    out: list[str] = []
    opener_indent: int | None = None  # indent of the paragraph ending in ":" that opened a code block
    prev_indent = 0
    for block in _blocks(text):
        block = [s for s in block if not _UNDERLINE.match(s)]
        if not block:
            continue
        indent = _indent(block[0])
        if opener_indent is not None and indent > opener_indent:
            continue  # inside a code block (or a block nested under one)
        opener_indent = None
        text_line = re.sub(r"\s+", " ", " ".join(s.strip() for s in block)).strip()
        if _LABEL.match(text_line):
            continue  # "Note:", "See also:": the indented prose below it is kept
        if text_line.endswith(":"):
            opener_indent = indent
        if indent > prev_indent + 3 or indent > 9 or not _is_prose(block):
            prev_indent = min(prev_indent, indent)
            continue
        prev_indent = indent
        out.append(text_line.replace("\u2019", "'").replace("\u201c", '"').replace("\u201d", '"'))
    return out


@lru_cache(maxsize=1)
def load_corpus() -> Corpus:
    """The cleaned corpus, topics in sorted order, split into train / held-out paragraphs."""
    from pydoc_data.topics import topics

    # Topics repeat each other (e.g. "specialnames" holds "attribute-access"): first occurrence only.
    paragraphs = list(dict.fromkeys(p for name in sorted(topics) for p in clean_topic(topics[name])))
    train = tuple(p for i, p in enumerate(paragraphs) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1)
    heldout = tuple(p for i, p in enumerate(paragraphs) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1)
    return Corpus(train=train, heldout=heldout)
