"""Tokenizer: a byte-level BPE in DeepSeek-V3's file layout, and the wrapper the engine uses.

``write_tokenizer_files(dir, vocab_size, ...)`` trains a real ``tokenizers`` byte-level BPE on the
small English corpus below (deterministically) and writes ``tokenizer.json`` and
``tokenizer_config.json`` as DeepSeek-V3 publishes them: id 0 is the begin-of-sentence token, id 1
the end-of-sentence token, ``<｜User｜>``/``<｜Assistant｜>`` mark chat turns, and a jinja
``chat_template`` renders conversations. ``transformers.AutoTokenizer`` loads the result too.

``Tokenizer.from_dir(dir)`` is what the engine uses: encode, decode, chat template (found and rendered
as transformers does it: ``chat_template``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from epserve.chat_template import ChatTemplate, configured_templates, read_chat_templates, tool_aware_template

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
USER_TOKEN = "<｜User｜>"
ASSISTANT_TOKEN = "<｜Assistant｜>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)  # ids 0, 1, 2, 3
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# DeepSeek-style: bos, then the system prompt(s), then turns; an assistant turn ends with eos. Tool
# calls and tool outputs as DeepSeek-V3's template writes them (the deepseek_v3 tool-call format).
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, CALL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS_BEGIN, OUTPUTS_END = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + ('\\n\\n' if ns.system else '') + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token + ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '" + USER_TOKEN + "' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT_TOKEN + "' + (message['content'] or '') -}}"
    "{%- if message['tool_calls'] -%}"
    "{{- '" + CALLS_BEGIN + "' -}}"
    "{%- for call in message['tool_calls'] -%}"
    "{{- ('\\n' if not loop.first else '') + '" + CALL_BEGIN + "' + (call['type'] or 'function') + '" + CALL_SEP + "'"
    " + call['function']['name'] + '\\n```json\\n' + call['function']['arguments'] + '\\n```" + CALL_END + "' -}}"
    "{%- endfor -%}"
    "{{- '" + CALLS_END + "' -}}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' -%}{{- '" + OUTPUTS_BEGIN + "' -}}"
    "{%- else -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '" + OUTPUT_BEGIN + "' + message['content'] + '" + OUTPUT_END + "' -}}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' -%}{{- '" + OUTPUTS_END + "' -}}{%- endif -%}"
    "{%- elif message['role'] != 'system' -%}"
    "{{- raise_exception('unsupported chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '" + ASSISTANT_TOKEN + "' -}}{%- endif -%}"
)

# Training text for the built-in tokenizer: plain English, some digits, punctuation and code-ish
# lines, so that common words become single tokens. Written for this project.
CORPUS = """\
The morning train left the station a few minutes late, and most of the passengers did not mind.
A woman by the window was reading a book about the history of bridges, and a boy across the aisle
counted the trees as they passed. When the train reached the river, the sun came out from behind
the clouds and the water turned from grey to a bright, moving silver.
In the small town at the end of the line there is a market every Saturday. Farmers bring apples,
potatoes, onions, bread, cheese and honey; a man sells old maps and another repairs clocks. People
come early, because the best things are gone before ten o'clock.
To make a simple soup, cut two onions and three carrots into small pieces. Warm a little oil in a
large pot, add the vegetables and cook them slowly for ten minutes. Pour in one litre of water, add
salt and pepper, and let it simmer for half an hour. Serve it hot with fresh bread.
Computers store numbers in binary. The number 5 is written 101, the number 12 is 1100, and 255 is
11111111, which fits in one byte. A kilobyte is 1024 bytes, a megabyte is 1024 kilobytes, and a
modern graphics card has more than 80 gigabytes of memory that it can read at several terabytes per
second.
A language model reads text as a sequence of tokens and predicts the next one. It learns which
words tend to follow which, how sentences are built, and what questions usually need as answers.
Large models are trained on a great deal of text, but the idea is simple: given the past, guess
the future, one token at a time.
The weather report said it would rain in the afternoon, so we took our coats. By three o'clock the
sky was dark, the wind was cold, and the first heavy drops were falling on the road. We waited
under a tree until the rain stopped, and then we walked home through the wet grass.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
Question: Why is the sky blue? Answer: Sunlight is scattered by the air, and blue light is
scattered more than red light, so the sky looks blue when the sun is high.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

if __name__ == "__main__":
    main()
Mixture-of-experts models send each token to a few experts chosen by a router. Each expert is a
small feed-forward network, and only the chosen experts do any work for that token. This lets the
model hold many parameters while spending little compute per token. Spreading the experts over many
GPUs is called expert parallelism; the tokens travel between the GPUs in an all-to-all exchange.
She opened the door, looked at the empty room, and smiled. Everything was ready: the table was set,
the candles were lit, and the music was playing quietly. In an hour her friends would arrive, and
the house would be full of voices and laughter again.
Good teachers ask good questions. They listen to the answers, notice what a student does not yet
understand, and explain the same idea in a different way. Learning takes time, patience and
practice, and it is easier when you are curious about the world.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. January, February, March, April,
May, June, July, August, September, October, November and December. One, two, three, four, five,
six, seven, eight, nine, ten, eleven, twelve, twenty, thirty, forty, fifty, hundred, thousand.
"Where are you going?" asked the old man. "To the sea," said the girl. "I want to see the ships
and the birds, and I want to swim in the cold water before the summer ends."
The scientist wrote her results in a notebook: temperature 21.5 degrees, pressure 101.3 kPa,
humidity 48 percent. She repeated the experiment three times, and each time the numbers were
almost the same, which meant the method was reliable and the result could be trusted.
Please send the report by Friday. If you have any questions, write to me or call the office. Thank
you for your help, and have a nice weekend!
"""


def build_tokenizer(vocab_size: int, corpus: str = CORPUS) -> _BackendTokenizer:
    """Train a byte-level BPE on ``corpus`` with at most ``vocab_size`` tokens (specials included).

    Ids 0..3 are ``SPECIAL_TOKENS``; all 256 byte symbols are in the vocabulary, so any text
    encodes. Training stops early when the corpus has no more pairs to merge, so the result may be
    smaller than ``vocab_size``, never larger. Deterministic for a given corpus and size.
    """
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level BPE (needs >= {min_size})")
    tok = _BackendTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, f"special token {t} did not get id {i}"
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` contents, DeepSeek-V3 style."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(model_max_length),
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(
    path: str | Path, vocab_size: int, model_max_length: int, corpus: str | None = None
) -> Path:
    """Train the tokenizer (at most ``vocab_size`` tokens) on ``corpus`` (default: the built-in
    ``CORPUS``) and write its two files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size) if corpus is None else build_tokenizer(vocab_size, corpus)
    (path / TOKENIZER_FILE).write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    cfg = tokenizer_config(model_max_length)
    (path / TOKENIZER_CONFIG_FILE).write_text(
        json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return path


class Tokenizer:
    """Text ↔ token ids for a checkpoint directory (``tokenizer.json`` + ``tokenizer_config.json``, the
    chat template as transformers finds it). ``chat_template``: template text that replaces the
    checkpoint's (``--chat-template``)."""

    def __init__(self, backend: _BackendTokenizer, config: Mapping[str, Any],
                 chat_template: str | None = None, templates: Mapping[str, str] | None = None) -> None:
        self._backend = backend
        self.config = dict(config)
        self.bos_token: str | None = _token_str(config.get("bos_token"))
        self.eos_token: str | None = _token_str(config.get("eos_token"))
        self.pad_token: str | None = _token_str(config.get("pad_token"))
        self.add_bos_token = bool(config.get("add_bos_token", True)) and self.bos_token is not None
        self.model_max_length: int | None = config.get("model_max_length")
        if templates is None:
            templates = configured_templates(config)
        self._template_names = sorted(templates)
        self.chat_template: str | None = chat_template if chat_template is not None else templates.get("default")
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "pad_token": self.pad_token or ""}
        self._template = None if self.chat_template is None else ChatTemplate(self.chat_template, special)

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """The tokenizer of a checkpoint directory; ``chat_template`` (text) replaces its template."""
        path = Path(path)
        tok_file, cfg_file = path / TOKENIZER_FILE, path / TOKENIZER_CONFIG_FILE
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {path}; the model directory needs tokenizer files"
            )
        config = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        templates = read_chat_templates(path, config) if chat_template is None else {}
        return cls(_BackendTokenizer.from_file(str(tok_file)), config, chat_template, templates)

    # -- vocabulary
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (the model's vocabulary may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (byte-level: ``Ġ`` for a space); ids must be in
        the vocabulary."""
        return [self._backend.id_to_token(int(i)) or "" for i in ids]

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._backend.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._backend.token_to_id(self.eos_token)

    # -- text
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens``, bos first when the config says so.
        Through ``encode_batch``, which releases the GIL while it works (``encode`` holds it: a long
        prompt tokenized in the router's worker thread would still stall its event loop)."""
        ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the tokenizer's vocabulary are dropped."""
        n = self.vocab_size
        return self._backend.decode(
            [int(i) for i in ids if 0 <= int(i) < n], skip_special_tokens=skip_special_tokens
        )

    # -- chat
    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render a conversation to the prompt text (which already starts with the bos token); see
        ``ChatTemplate.render``. ValueError (``ChatTemplateError`` when the template itself fails)."""
        if self._template is None:
            if self._template_names:
                raise ValueError(f"this model has several chat templates ({', '.join(self._template_names)}) and "
                                 "none named 'default'; choose one with --chat-template")
            raise ValueError("this tokenizer has no chat template (chat_template.jinja or tokenizer_config.json)")
        return self._template.render(messages, add_generation_prompt, continue_final_message, chat_template_kwargs)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        """Token ids of the rendered conversation (bos comes from the template; ``add_special_tokens``
        adds the tokenizer's on top, as vLLM's ``/tokenize`` does when asked)."""
        text = self.apply_chat_template(messages, add_generation_prompt, continue_final_message, chat_template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)


def load_tokenizer(path: str | Path, chat_template: str | None = None,
                   auto_tool_choice: bool = False) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory (``chat_template``: text replacing its template), or None
    if it has no ``tokenizer.json``. ``auto_tool_choice`` (``--enable-auto-tool-choice``) without a
    ``chat_template``: a checkpoint template that leaves the tools out of the prompt gives way to the
    project's tool-aware one for its format (``chat_template.tool_aware_template``)."""
    if not (Path(path) / TOKENIZER_FILE).is_file():
        return None
    tokenizer = Tokenizer.from_dir(path, chat_template)
    if auto_tool_choice and chat_template is None and tokenizer._template is not None:
        text = tool_aware_template(tokenizer._template)
        if text is not None:
            return Tokenizer.from_dir(path, text)
    return tokenizer


def _token_str(token: Any) -> str | None:
    """Special tokens appear as strings or as ``{"content": ...}`` dicts in tokenizer configs."""
    if isinstance(token, Mapping):
        return token.get("content")
    return token
