"""Chat templates as transformers renders them, and as vLLM users give them.

A checkpoint's template is found as transformers' ``from_pretrained`` finds it
(``read_chat_templates``): ``chat_template.jinja`` beside the tokenizer files (what recent
``save_pretrained`` writes) and named ones in ``chat_templates/NAME.jinja`` take priority over
``tokenizer_config.json``'s ``chat_template`` (one template, or a list of ``{"name", "template"}``); of
several, the one named ``default`` applies. ``load_chat_template`` reads a ``--chat-template`` value by
vLLM's rule: a file if one can be opened, else the template text itself.

``ChatTemplate`` renders a conversation in jinja2's immutable sandbox with what transformers gives a
template (``messages``, ``add_generation_prompt``, the special tokens, ``raise_exception``, the
``tojson`` filter, ``strftime_now``, loop controls) plus the request's ``chat_template_kwargs``;
``continue_final_message`` leaves the last (assistant) message open. A template that fails while
rendering raises ``ChatTemplateError``, a ValueError.

DeepSeek-V3's and R1's own templates leave ``tools`` out of the prompt, so a model asked to choose a
tool (``tool_choice: auto``) never sees one. ``tool_aware_template`` finds that out once, by rendering
with and without tools, and offers the project's tool-aware template for the same format
(``templates/deepseek_v3_tools.jinja``, ``deepseek_r1_tools.jinja``: the same text as the checkpoint's
for every probe conversation, the tools described after the system prompt), as vLLM users pass
``--chat-template tool_chat_template_deepseekv3.jinja``; the router uses it under
``--enable-auto-tool-choice`` unless ``--chat-template`` chooses a template.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' save_pretrained writes the template here
CHAT_TEMPLATES_DIR = "chat_templates"  # ... and named ones here, NAME.jinja
ROLES = ("system", "user", "assistant", "developer", "tool")  # developer: OpenAI's newer name for system
# Variables the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "continue_final_message"})
_FINAL_MARKER = "\ue000epserve:end-of-final-message\ue000"  # private-use characters: in no real message


logger = logging.getLogger(__name__)
TOOL_TEMPLATES_DIR = Path(__file__).parent / "templates"
TOOL_AWARE_TEMPLATES = ("deepseek_v3_tools.jinja", "deepseek_r1_tools.jinja")


class ChatTemplateError(ValueError):
    """The chat template failed while rendering a conversation (its ``raise_exception``, an undefined
    name, a type error): the request's fault or the template's, never the server's."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter (jinja2's own escapes HTML, which a prompt must not)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def compile_chat_template(text: str) -> Template:
    """The compiled template; ValueError naming the syntax error (and its line)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"the chat template does not compile: {e.message} (line {e.lineno})") from None
    except TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


def load_chat_template(value: str) -> str:
    """A ``--chat-template`` value as template text, as vLLM reads it: the contents of the file it
    names if that can be opened, else, if it holds ``{``, ``}`` or a newline, the value itself; a value
    that is neither (a path that cannot be read) is a ValueError. The text must compile (ValueError)."""
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
        source = f"file {value}"
    except (OSError, ValueError) as e:  # (ValueError: a NUL character, a file not in UTF-8)
        if not any(c in value for c in "{}\n"):
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(
                f"--chat-template {value!r} looks like a file path, but it cannot be read ({reason})") from None
        text, source = value, "given as text"
    try:
        compile_chat_template(text)
    except ValueError as e:
        raise ValueError(f"--chat-template ({source}): {e}") from None
    return text


def read_chat_templates(path: str | Path, config: Mapping[str, Any]) -> dict[str, str]:
    """A checkpoint directory's chat templates by name, as transformers reads them (module docstring);
    ``config``: its ``tokenizer_config.json``."""
    path = Path(path)
    templates: dict[str, str] = {}
    if (path / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (path / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if (path / CHAT_TEMPLATES_DIR).is_dir():
        for f in sorted((path / CHAT_TEMPLATES_DIR).glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    return templates or configured_templates(config)


def configured_templates(config: Mapping[str, Any]) -> dict[str, str]:
    """``tokenizer_config.json``'s ``chat_template``: one template (``default``) or a named list."""
    configured = config.get("chat_template")
    if isinstance(configured, str):
        return {"default": configured}
    if isinstance(configured, list):
        return {t["name"]: t["template"] for t in configured if isinstance(t, Mapping) and "name" in t}
    return {}


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check that ``messages`` is a list of ``{"role": system|developer|user|assistant|tool, "content": str}``
    (an assistant's may be None beside its ``tool_calls``; a tool's may carry ``tool_call_id``);
    ``developer`` (OpenAI's newer name) becomes ``system``."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages must be a list of {{role, content}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in ROLES:
            raise ValueError(
                f"messages[{i}] has unsupported role {m['role']!r}; supported: {', '.join(ROLES)}"
            )
        calls = m.get("tool_calls")
        if not isinstance(m["content"], str) and not (m["content"] is None and calls):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(m['content']).__name__}")
        checked = {"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]}
        if calls:
            checked["tool_calls"] = calls
        for key in ("tool_call_id", "name"):  # (name: vLLM hands it to the template too)
            if m.get(key) is not None:
                checked[key] = m[key]
        out.append(checked)
    return out


class ChatTemplate:
    """One compiled template and the special tokens it is rendered with."""

    def __init__(self, text: str, special_tokens: Mapping[str, str]) -> None:
        self.text = text
        self.special_tokens = dict(special_tokens)  # bos_token, eos_token, pad_token
        self._template = compile_chat_template(text)

    def render(self, messages: Any, add_generation_prompt: bool = True, continue_final_message: bool = False,
               chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The conversation as prompt text. ``chat_template_kwargs``: more variables for the template
        (``{"thinking": True}``). ``continue_final_message``: the last message (the assistant's) is left
        open, so that generation continues it (not with ``add_generation_prompt``). ValueError for bad
        messages or options, ``ChatTemplateError`` when the template fails."""
        checked = validate_messages(messages)
        variables = dict(chat_template_kwargs or {})
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES & set(variables))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (a field of the request)")
        if not continue_final_message:
            return self._render(checked, add_generation_prompt, variables)
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if not checked or checked[-1]["role"] != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        if checked[-1]["content"] is None:  # (only tool calls: no text to continue)
            raise ValueError("continue_final_message needs the assistant's last message to have text content, "
                             "not null")
        return self._open_final_message(checked, variables)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool, variables: dict[str, Any]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **variables})
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        except (RecursionError, MemoryError):
            raise
        except Exception as e:  # noqa: BLE001 -- a template's own TypeError, KeyError, ...: its fault, not ours
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from None

    def _open_final_message(self, messages: list[dict[str, str]], variables: dict[str, Any]) -> str:
        """The rendered conversation cut right after the final message's content: found by a marker
        appended to that content (any content, empty too); should the template drop the marker, by the
        content's last occurrence, as transformers finds it."""
        final = messages[-1]["content"]
        marked = [*messages[:-1], {**messages[-1], "content": final + _FINAL_MARKER}]
        rendered = self._render(marked, False, variables)
        if (i := rendered.rfind(_FINAL_MARKER)) >= 0:
            return rendered[:i]
        rendered = self._render(messages, False, variables)
        for needle in (final, final.strip()):
            if needle and (i := rendered.rfind(needle)) >= 0:
                return rendered[: i + len(needle)]
        raise ChatTemplateError("continue_final_message: the chat template does not render the final message's "
                                "content, so there is nothing to continue")


# Conversations rendered to compare templates: the roles, a system prompt, several calls with content
# and without, several tool outputs, a second turn, generation prompts open and closed.
_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
_PROBES: tuple[tuple[list[dict[str, Any]], bool], ...] = (
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Be kind."},
      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>x</think>Hello"},
      {"role": "user", "content": "2+2?"}], True),
    ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": [_CALL, _CALL]},
      {"role": "tool", "content": "20"}, {"role": "tool", "content": "21"}], True),
    ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Looking.", "tool_calls": [_CALL]},
      {"role": "tool", "content": "20"}, {"role": "assistant", "content": "It is 20."},
      {"role": "user", "content": "Thanks"}], False),
)
_PROBE_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string"}}}}}]


def tool_aware_template(template: ChatTemplate) -> str | None:
    """For ``--enable-auto-tool-choice``: the text of the project's tool-aware template to use instead of
    ``template`` when ``template`` leaves ``tools`` out of the prompt and renders every probe conversation
    as that one does without tools (DeepSeek-V3's or R1's format), else None. Says what it found in the
    log (one line: it is called once, as the router starts)."""
    def renders(t: ChatTemplate, tools: list[dict[str, Any]] | None) -> list[str] | None:
        try:
            return [t.render(m, gen, chat_template_kwargs={"tools": tools} if tools else None) for m, gen in _PROBES]
        except ValueError:  # (a template that cannot render a probe is not the one looked for)
            return None

    plain = renders(template, None)
    if plain is None or renders(template, _PROBE_TOOLS) != plain:
        return None  # it describes the tools itself (or cannot be compared)
    for name in TOOL_AWARE_TEMPLATES:
        text = (TOOL_TEMPLATES_DIR / name).read_text(encoding="utf-8")
        if renders(ChatTemplate(text, template.special_tokens), None) == plain:
            logger.info("the checkpoint's chat template leaves tools out of the prompt; --enable-auto-tool-choice "
                        "uses epserve's %s, the same format with the tools described (--chat-template to choose "
                        "another)", name)
            return text
    logger.warning("the checkpoint's chat template leaves tools out of the prompt, and it is not DeepSeek-V3's or "
                   "R1's: with tool_choice auto the model is not told which tools it has; give a template that "
                   "renders them with --chat-template")
    return None
