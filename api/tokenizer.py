"""Prompt tokenization for the API tier: token ids with the ``tokenizers`` library (tokenizer.json as it is),
chat templates through transformers' own ``apply_chat_template`` (the same Jinja environment HF renders
with: loop controls, ``raise_exception``, ``strftime_now``...). Neither imports torch, which API nodes lack."""

from __future__ import annotations

import functools
import inspect
import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# apply_chat_template's own parameters and the template's ``messages``: a request's chat_template_kwargs may
# not set them (``tokenize`` would return ids instead of text, ``chat_template`` would swap the model's
# template for the client's, ``messages`` would clash with the call)
RESERVED_TEMPLATE_KWARGS = (
    frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    - {"self", "conversation", "kwargs"}
) | {"messages"}


class PromptTokenizer:
    """Encodes prompts and chat conversations for one model folder (tokenizer.json + tokenizer_config.json).
    ``chat_template``: a Jinja template that replaces the model's own."""

    def __init__(self, folder: Path, chat_template: str | None = None) -> None:
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ValueError(f"{folder} has no tokenizer.json (the API tier needs a fast tokenizer)")
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        # the template's side: special tokens and the template (tokenizer_config.json, chat_template.jinja)
        self._hf = PreTrainedTokenizerFast.from_pretrained(folder)
        if chat_template is not None:
            self._hf.chat_template = chat_template
        self.bos_token: str = self._hf.bos_token or ""
        self.eos_token: str = self._hf.eos_token or ""
        model_config = _read_json(folder / "config.json")
        self.model_max_len: int | None = model_config.get("max_position_embeddings")
        self._token_text_cache: dict[int, str] = {}
        # repeated prompts (system prompts, retries, cache hits) skip the ~80 us encode
        self._encode_cached = functools.lru_cache(maxsize=4096)(self._encode)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._encode_cached(text, add_special_tokens))

    def _encode(self, text: str, add_special_tokens: bool) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, /, **kwargs: Any
    ) -> str:
        """The conversation as the model's template writes it; ``kwargs`` are template variables. Raises
        ``ValueError`` for a conversation the template rejects."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        try:
            text = self._hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except TemplateError as exc:
            raise ValueError(f"chat template rejected the messages: {exc}") from exc
        except (TypeError, KeyError, AttributeError, IndexError, ValueError) as exc:  # the caller's values broke it
            raise ValueError(f"chat template failed on these messages or chat_template_kwargs: {exc!r}") from exc
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, /, **kwargs: Any
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
