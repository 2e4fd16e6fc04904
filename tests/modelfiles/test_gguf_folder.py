"""The torch-free GGUF folder (issue #14) against transformers' own GGUF conversion: the same config, the same
tokenizer.json, the same token ids, text and chat rendering; a cache key that follows the content."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from api.tokenizer import PromptTokenizer
from modelfiles.gguf_folder import content_key, gguf_folder
from tests.modelfiles.conftest import load_hf_tokenizer, transformers_folder, write_tiny_gguf, write_tiny_spm_gguf

TEXTS = [
    "Hello world",
    "",
    " ",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n\n  indented",
    "emoji 🤗🚀 and a ZWJ sequence 👩\u200d💻 and flags 🇫🇷",
    "unicode: naïve café, 日本語, Ελληνικά, עברית, ﬁ ligature, \u00a0nbsp, e\u0301 combining",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "glued<|im_end|><|endoftext|>tokens <|begin_of_text|><|eot_id|>",
    "numbers 1234567 3.14159 and 10,000",
    "contractions: don't, we'll, I'M, they've",
    "code: def f(x):\n    return x**2  # done\n",
    "<think>plan</think> the world hello wörld",
]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 🤔"}],
    [
        {"role": "user", "content": "  spaced  "},
        {"role": "assistant", "content": "ok\n"},
        {"role": "user", "content": "again"},
    ],
]


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def drop_tokens_past_vocab(reference: Path) -> set[str]:
    """transformers appends GPT-2's default ``<|endoftext|>`` to a vocabulary without it, past the model's
    vocabulary (an id without embedding); the torch-free folder does not copy that. Drops it from the
    reference files and returns it."""
    vocab_size = read_json(reference / "config.json")["vocab_size"]
    tokenizer_json = read_json(reference / "tokenizer.json")
    past = {t["content"] for t in tokenizer_json["added_tokens"] if t["id"] >= vocab_size}
    assert past <= {"<|endoftext|>"}
    tokenizer_json["added_tokens"] = [t for t in tokenizer_json["added_tokens"] if t["id"] < vocab_size]
    (reference / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    return past


def assert_same_tokenizer(folder: Path, reference: Path) -> None:
    """Same files (but transformers' load-time keys) and the same behaviour through transformers and through
    the API's PromptTokenizer."""
    drop_tokens_past_vocab(reference)
    assert read_json(folder / "config.json") == read_json(reference / "config.json")
    assert read_json(folder / "tokenizer.json") == read_json(reference / "tokenizer.json")
    ours_config, ref_config = (
        read_json(folder / "tokenizer_config.json"),
        read_json(reference / "tokenizer_config.json"),
    )
    for load_time_key in ("is_local", "local_files_only"):
        ref_config.pop(load_time_key, None)
    assert ours_config == ref_config
    assert (folder / "chat_template.jinja").read_text() == (reference / "chat_template.jinja").read_text()

    # transformers' class may add to tokenizer.json when it loads (Qwen2's NFC normalizer), the API reads the
    # file as it is: each is compared with the same path through the reference folder
    ours, ref, prompt = load_hf_tokenizer(folder), load_hf_tokenizer(reference), PromptTokenizer(folder)
    ref_file = Tokenizer.from_file(str(reference / "tokenizer.json"))
    assert ours.all_special_tokens == ref.all_special_tokens
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.pad_token,
        ref.unk_token,
    )
    assert ours.get_vocab() == ref.get_vocab()
    for text in TEXTS:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == ids, text
            file_ids = ref_file.encode(text, add_special_tokens=special).ids
            assert prompt.encode(text, add_special_tokens=special) == file_ids, text
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
                expected = ref_file.decode(file_ids, skip_special_tokens=skip)
                assert prompt.decode(file_ids, skip_special_tokens=skip) == expected
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            text = ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt)
            assert (
                ours.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation_prompt) == text
            )
            assert prompt.apply_chat_template(conversation, generation_prompt) == text
            assert (
                prompt.encode_chat(conversation, generation_prompt)
                == ref_file.encode(text, add_special_tokens=False).ids
            )


@pytest.mark.slow  # ~25 s: two conversions of a 49k-token vocabulary
def test_default_model_folder_equals_transformers_conversion(
    default_gguf: Path, reference_default_folder: Path, tmp_path: Path
) -> None:
    folder = gguf_folder(default_gguf, tmp_path)
    assert (folder / "done").is_file()
    assert_same_tokenizer(folder, reference_default_folder)


@pytest.mark.parametrize(
    ("arch", "pre", "add_bos", "plain"),
    [
        ("llama", "llama-bpe", True, ()),  # Llama 3's split regex, BOS added by the post-processor
        ("qwen2", "qwen2", False, ("<|endoftext|>",)),  # a plain <|endoftext|>: transformers makes it special
        ("llama", "smollm", False, ()),  # byte-level's own GPT-2 regex
    ],
)
def test_tiny_gguf_folder_equals_transformers_conversion(
    tmp_path: Path, arch: str, pre: str, add_bos: bool, plain: tuple[str, ...]
) -> None:
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, pre, add_bos, plain)
    reference = transformers_folder(gguf_path, tmp_path / "reference")
    folder = gguf_folder(gguf_path, tmp_path / "cache")
    assert_same_tokenizer(folder, reference)
    bos_id = load_hf_tokenizer(folder).bos_token_id
    assert (PromptTokenizer(folder).encode("hi")[0] == bos_id) is add_bos


@pytest.mark.parametrize(("with_merges", "add_bos"), [(False, None), (True, False)])
def test_tiny_sentencepiece_gguf_folder_equals_transformers_conversion(
    tmp_path: Path, with_merges: bool, add_bos: bool | None
) -> None:
    """Llama 2 / Mistral style: byte fallback, merges rebuilt from scores where the file has none, BOS by default."""
    gguf_path = write_tiny_spm_gguf(tmp_path / "spm.gguf", with_merges, add_bos)
    reference = transformers_folder(gguf_path, tmp_path / "reference")
    folder = gguf_folder(gguf_path, tmp_path / "cache")
    assert_same_tokenizer(folder, reference)
    assert (PromptTokenizer(folder).encode("the world")[0] == 1) is (add_bos is None)


def test_cache_key_follows_content_not_path_or_mtime(tmp_path: Path) -> None:
    """Two installs of the same file (other paths, other mtimes: pip sets them) share one cached folder."""
    first = write_tiny_gguf(tmp_path / "a" / "tiny.gguf") if (tmp_path / "a").mkdir() is None else None
    assert first is not None
    (tmp_path / "b").mkdir()
    second = tmp_path / "b" / "tiny.gguf"
    shutil.copyfile(first, second)
    os.utime(second, (1_000_000_000, 1_000_000_000))
    assert content_key(first) == content_key(second)
    cache = tmp_path / "cache"
    folder = gguf_folder(first, cache)
    assert gguf_folder(second, cache) == folder
    assert [p.name for p in cache.iterdir()] == [folder.name]  # no leftover temporary folder

    (tmp_path / "c").mkdir()
    other = write_tiny_gguf(tmp_path / "c" / "tiny.gguf", "qwen2", "qwen2", False)
    assert content_key(other) != content_key(first)
    assert gguf_folder(other, cache) != folder
