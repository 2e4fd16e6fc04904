"""Prompt tokenization for the API tier with the ``tokenizers`` library and the model's jinja2 chat template
(``transformers.AutoTokenizer`` would import torch, which API nodes do not have)."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class PromptTokenizer:
    """Encodes prompts and chat conversations for one model folder (tokenizer.json + tokenizer_config.json)."""

    def __init__(self, folder: Path) -> None:
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (the API tier needs a fast tokenizer)")
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = _read_template(folder, config)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False, indent=indent)
        self._template = env.from_string(template) if template else None
        model_config = _read_json(folder / "config.json")
        self.model_max_len: int | None = model_config.get("max_position_embeddings")
        self._token_text_cache: dict[int, str] = {}
        # repeated prompts (system prompts, retries, cache hits) skip the ~80 us encode
        self._encode_cached = functools.lru_cache(maxsize=4096)(self._encode)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._encode_cached(text, add_special_tokens))

    def _encode(self, text: str, add_special_tokens: bool) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        # the template writes the special tokens itself; adding them again would double the BOS
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_special_tokens=False
        )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (cached: the same few thousand ids repeat)."""
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    @property
    def vocab_size(self) -> int:
        size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return size


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


def _read_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
