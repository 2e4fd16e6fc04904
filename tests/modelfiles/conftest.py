"""Fixtures of the GGUF folder tests: transformers' own GGUF conversion (the reference; imports torch) and
tiny GGUF files written with the ``gguf`` package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelfiles.gguf_tokenizer import bytes_to_unicode

# A byte-level vocabulary: the 256 byte characters, a few merges, control and user-defined tokens, and one
# token llama.cpp spells as plain text (with a space and a non-alphabet character).
_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
_CONTROL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
_USER_DEFINED = ["<think>", "</think>"]
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def write_tiny_gguf(
    path: Path, arch: str = "llama", pre: str = "llama-bpe", add_bos: bool = True, plain: tuple[str, ...] = ()
) -> Path:
    """A GGUF with a tiny byte-level tokenizer, llama-family metadata and one tensor (no output.weight: tied).
    ``plain``: extra tokens of the normal type."""
    import gguf

    tokens = sorted(bytes_to_unicode().values())
    tokens += [m.replace(" ", "") for m in _MERGES] + ["hello wörld", *plain] + _CONTROL + _USER_DEFINED
    types = [1] * (len(tokens) - len(_CONTROL) - len(_USER_DEFINED)) + [3] * len(_CONTROL) + [4] * len(_USER_DEFINED)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_context_length(256)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|eot_id|>"))
    writer.add_pad_token_id(tokens.index("<|end_of_text|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_SPM_PIECES = ["▁t", "he", "▁the", "▁w", "or", "ld", "▁wor", "▁world", "in", "▁a", "er", "▁h", "▁he", "ll", "▁hell"]
_SPM_CHARS = ["▁", *"thewordlainsxc"]


def write_tiny_spm_gguf(path: Path, with_merges: bool, add_bos: bool | None) -> Path:
    """A GGUF with a tiny SentencePiece (llama.cpp "llama") tokenizer: <unk> <s> </s>, the 256 byte tokens,
    scored pieces, control and user-defined tokens; merges in the file or only scores."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_SPM_PIECES, *_SPM_CHARS]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(_SPM_PIECES) + len(_SPM_CHARS))
    scores = [0.0] * 259 + [-float(i) for i in range(len(_SPM_PIECES))] + [-100.0 - i for i in range(len(_SPM_CHARS))]
    tokens += ["<|im_start|>", "<|im_end|>", "<think>"]
    types += [3, 3, 4]
    scores += [0.0, 0.0, 0.0]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny spm model")
    writer.add_context_length(128)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_rope_dimension_count(16)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    if with_merges:
        writer.add_token_merges(["▁ t", "h e", "▁t he", "▁ w", "o r", "l d", "▁w or", "▁wor ld", "i n", "▁ a", "e r"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TINY_CHAT_TEMPLATE.replace("<|start_header_id|>", "<|im_start|>"))
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    writer.add_tensor("output.weight", np.zeros((len(tokens), 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def transformers_folder(gguf_path: Path, folder: Path) -> Path:
    """What transformers' own GGUF reader makes of ``gguf_path`` (the folder pagedserve wrote before #14)."""
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    import modelfiles

    return modelfiles.default_model_path()


@pytest.fixture(scope="session")
def reference_default_folder(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return transformers_folder(default_gguf, tmp_path_factory.mktemp("hf-gguf"))


def load_hf_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
