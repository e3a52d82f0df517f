"""Chat templates as transformers finds and renders them: ``chat_template.jinja`` written by
``save_pretrained``, its precedence over ``tokenizer_config.json``, named templates, template variables,
``continue_final_message``, the ``developer`` role, failing templates, and ``--chat-template`` values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epserve.chat_template import ChatTemplateError, load_chat_template
from epserve.tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    USER_TOKEN,
    Tokenizer,
    write_tokenizer_files,
)

transformers = pytest.importorskip("transformers")

# Tags no built-in template writes, so a prompt shows which template made it.
TAGGED = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% if m['role'] == 'assistant' %}"
          "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"), vocab_size=512, model_max_length=2048)


@pytest.fixture(scope="module")
def saved(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    """A tokenizer written by transformers' own ``save_pretrained``, its template in chat_template.jinja."""
    hf = transformers.AutoTokenizer.from_pretrained(base_dir)
    hf.chat_template = TAGGED
    out = tmp_path_factory.mktemp("saved")
    hf.save_pretrained(out)
    return out, transformers.AutoTokenizer.from_pretrained(out)


def test_a_tokenizer_saved_by_transformers_chats_with_its_jinja_template(saved):
    path, hf = saved
    assert (path / "chat_template.jinja").read_text() == TAGGED
    assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_dir(path)
    want = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert want.startswith(BOS_TOKEN + "[system]Be brief.")
    assert tok.apply_chat_template(CONVERSATION) == want
    assert tok.encode_chat(CONVERSATION) == hf(want, add_special_tokens=False)["input_ids"]


def test_jinja_file_and_named_templates_win_as_in_transformers(base_dir, tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((base_dir / f).read_bytes())
    builtin = Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)
    assert builtin.endswith(USER_TOKEN + "What is 2+2?" + ASSISTANT_TOKEN)  # tokenizer_config.json's
    (tmp_path / "chat_template.jinja").write_text(TAGGED)  # both: the file wins, as in transformers
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    want = hf.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION) == want != builtin
    (tmp_path / "chat_template.jinja").unlink()  # only named ones, none "default": no template to use
    (tmp_path / "chat_templates").mkdir()
    (tmp_path / "chat_templates" / "tool_use.jinja").write_text(TAGGED)
    with pytest.raises(ValueError, match=r"several chat templates \(tool_use\)"):
        Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION)
    (tmp_path / "chat_templates" / "default.jinja").write_text(TAGGED.replace("[{{ m['role'] }}]", "<{{ m['role'] }}>"))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(CONVERSATION).startswith(BOS_TOKEN + "<system>")
    override = Tokenizer.from_dir(tmp_path, chat_template="{{ messages[0]['content'] }}!")  # --chat-template
    assert override.apply_chat_template(CONVERSATION) == "Be brief.!"


def test_developer_is_system_and_kwargs_are_template_variables(base_dir):
    tok = Tokenizer.from_dir(base_dir, chat_template="{% if thinking %}<think>{% endif %}"
                             "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}")
    messages = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"}]
    assert tok.apply_chat_template(messages) == "system:rules;user:q;"
    assert tok.apply_chat_template(messages, chat_template_kwargs={"thinking": True}) == "<think>system:rules;user:q;"
    with pytest.raises(ValueError, match="may not set messages"):
        tok.apply_chat_template(messages, chat_template_kwargs={"messages": []})


def test_a_messages_name_reaches_the_template(base_dir):
    tok = Tokenizer.from_dir(base_dir, chat_template="{% for m in messages %}{{ m.get('name', '-') }}:"
                             "{{ m['content'] }};{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "q", "name": "ann"},
                                    {"role": "user", "content": "r"}]) == "ann:q;-:r;"


def test_continue_final_message_leaves_the_assistant_turn_open(base_dir):
    tok = Tokenizer.from_dir(base_dir)  # the built-in template ends an assistant turn with eos
    hf = transformers.AutoTokenizer.from_pretrained(base_dir)
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "one, two,"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith(ASSISTANT_TOKEN + "one, two,") and EOS_TOKEN not in text
    empty = [*messages[:1], {"role": "assistant", "content": ""}]  # an empty final message: the turn just opened
    assert tok.apply_chat_template(empty, False, True).endswith(USER_TOKEN + "Count:" + ASSISTANT_TOKEN)
    with pytest.raises(ValueError, match="cannot both be true"):
        tok.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="last message to be the assistant's"):
        tok.apply_chat_template(messages[:1], add_generation_prompt=False, continue_final_message=True)
    calls_only = [*messages[:1], {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
    with pytest.raises(ValueError, match="to have text content"):
        tok.apply_chat_template(calls_only, add_generation_prompt=False, continue_final_message=True)


def test_a_failing_template_is_a_chat_template_error(base_dir):
    raising = Tokenizer.from_dir(base_dir, chat_template="{% if messages|length > 1 %}"
                                 "{{ raise_exception('one message at a time') }}{% endif %}ok")
    assert raising.apply_chat_template(CONVERSATION[:1]) == "ok"
    with pytest.raises(ChatTemplateError, match="chat template failed: one message at a time"):
        raising.apply_chat_template(CONVERSATION)
    typed = Tokenizer.from_dir(base_dir, chat_template="{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        typed.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_option_values(tmp_path):
    (tmp_path / "t.jinja").write_text(TAGGED)
    assert load_chat_template(str(tmp_path / "t.jinja")) == TAGGED  # a file is read
    assert load_chat_template("{{ bos_token }}") == "{{ bos_token }}"  # else the value is the template
    with pytest.raises(ValueError, match="looks like a file path, but it cannot be read"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "bad.jinja").write_text("line one\n{% for m in messages %}")
    with pytest.raises(ValueError, match=r"\(file .*bad.jinja\): the chat template does not compile: .* \(line 2\)"):
        load_chat_template(str(tmp_path / "bad.jinja"))
    with pytest.raises(ValueError, match=r"\(given as text\): the chat template does not compile"):
        load_chat_template("{% if %}")
