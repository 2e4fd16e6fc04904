"""The API tier's chat templates go through transformers' own ``apply_chat_template`` (issue #14): templates
with loop controls (``{% break %}``, ``{% continue %}``) render as HF renders them, template errors become
``ValueError`` (a 400), and chat_template_kwargs cannot reach the call's own parameters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from api.tokenizer import PromptTokenizer
from tests.helpers import CHAT_TEMPLATE, build_tokenizer

# Renders the conversation up to the first "stop" message, skips empty ones, and uses a template variable.
LOOP_CONTROL_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'stop' %}{% break %}{% endif %}"
    "{% if not m['content'] %}{% continue %}{% endif %}"
    "<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% if thinking %}<think>{% endif %}{% endif %}"
)
RAISING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{{ m['content'] }}{% endfor %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": ""},
    {"role": "user", "content": "Hi 🤗"},
    {"role": "stop", "content": "never shown"},
    {"role": "user", "content": "after the stop"},
]


def tokenizer_folder(tmp_path: Path, template: str | None) -> Path:
    tok = build_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(tmp_path)
    return tmp_path


def hf_render(folder: Path, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    from transformers import AutoTokenizer

    text: str = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False, **kwargs)
    return text


def test_loop_controls_render_as_transformers_renders(tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path, LOOP_CONTROL_TEMPLATE)
    tok = PromptTokenizer(folder)
    expected = "<s>system\nBe brief.</s>\n<s>user\nHi 🤗</s>\n<s>assistant\n<think>"
    text = tok.apply_chat_template(CONVERSATION, True, thinking=True)
    assert text == expected
    assert text == hf_render(folder, CONVERSATION, add_generation_prompt=True, thinking=True)
    no_prompt = tok.apply_chat_template(CONVERSATION, False)
    assert no_prompt == hf_render(folder, CONVERSATION, add_generation_prompt=False)
    assert tok.encode_chat(CONVERSATION, True, thinking=True) == tok.encode(expected, add_special_tokens=False)


def test_the_test_models_template_is_unchanged(tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path, CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "hello"}]
    assert PromptTokenizer(folder).apply_chat_template(messages) == "<s>user\nhello</s>\n<s>assistant\n"


def test_template_errors_and_reserved_kwargs_are_value_errors(tmp_path: Path) -> None:
    tok = PromptTokenizer(tokenizer_folder(tmp_path, RAISING_TEMPLATE))
    assert tok.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(ValueError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    for reserved in ("tokenize", "chat_template", "return_dict", "messages", "add_generation_prompt"):
        with pytest.raises(ValueError, match=f"may not set {reserved}"):
            tok.apply_chat_template([{"role": "user", "content": "ok"}], **{reserved: True})


def test_no_template_and_an_override(tmp_path: Path) -> None:
    folder = tokenizer_folder(tmp_path, None)
    assert not PromptTokenizer(folder).has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        PromptTokenizer(folder).encode_chat([{"role": "user", "content": "hi"}])
    tok = PromptTokenizer(folder, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert tok.has_chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "[a][b]"


def test_a_template_broken_by_the_callers_values_is_a_value_error(tmp_path: Path) -> None:
    """A template variable of the wrong type (chat_template_kwargs are the caller's) is a 400, not a 500."""
    tok = PromptTokenizer(tokenizer_folder(tmp_path, "{{ messages[0]['content'] + suffix }}"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], True, suffix="!") == "hi!"
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}], True, suffix=5)
