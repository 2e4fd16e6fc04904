"""A GGUF's tokenizer rebuilt with the ``tokenizers`` library, without torch.

A GGUF has no ``tokenizer.json``: it stores the vocabulary, merges, token types and special token ids as
metadata under llama.cpp's key names. This builds the same fast tokenizer that transformers' GGUF reader
builds (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen2...; SentencePiece BPE: Llama 2, Mistral), which the
tests check token for token, but transformers' reader imports torch and API nodes have none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp's token types (tokenizer.ggml.token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# transformers' GPT-2 class makes this its default BOS/EOS/UNK and so a special token
GPT2_DEFAULT_SPECIAL = "<|endoftext|>"
# Tokenizer models (tokenizer.ggml.model) this module builds; others go through transformers (with torch).
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")
# transformers' Llama class registers these (its defaults) as special tokens
LLAMA_DEFAULT_SPECIALS = ("<unk>", "<s>", "</s>")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with (llama.cpp's names). Any other name
# ("smollm", "gpt-2", "default", ...) gets byte-level's own GPT-2 regex.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"],
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(["dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}

_SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@dataclass(frozen=True)
class GgufTokenizer:
    """The fast tokenizer and the ``tokenizer_config`` entries (special tokens, chat template, BOS/EOS flags)."""

    tokenizer: Tokenizer
    config: dict[str, Any]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def tokenizer_model(metadata: dict[str, Any]) -> str | None:
    model = metadata.get("tokenizer.ggml.model")
    return str(model) if model is not None else None


def build_gguf_tokenizer(metadata: dict[str, Any]) -> GgufTokenizer:
    """The tokenizer a GGUF's metadata describes (``metadata``: every key with its full value)."""
    model = tokenizer_model(metadata)
    if model not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported here (supported: {SUPPORTED_TOKENIZER_MODELS})"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or ())
    if model == "gpt2":
        tokenizer = _byte_level_bpe(tokens, metadata)
        _add_special_tokens(tokenizer, tokens, token_types, byte_level=True)
    else:
        tokenizer = _sentencepiece_bpe(tokens, metadata)
        _add_special_tokens(tokenizer, tokens, token_types, byte_level=False)
    split = PRE_TOKENIZER_SPLITS.get(str(metadata.get("tokenizer.ggml.pre")))
    if split is not None:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return GgufTokenizer(tokenizer, tokenizer_config(metadata, tokens))


def tokenizer_config(metadata: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    """Special tokens by text (None where the file names none), the chat template and BOS/EOS flags."""
    config: dict[str, Any] = {}
    if tokenizer_model(metadata) == "llama":  # llama.cpp adds BOS to a SentencePiece vocabulary unless told not to
        config["add_bos_token"] = True
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = str(metadata["tokenizer.chat_template"])
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in metadata:
            config[flag] = bool(metadata[f"tokenizer.ggml.{flag}"])
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(key)
        config[name] = tokens[int(token_id)] if token_id is not None else None
    return config


def _byte_level_bpe(tokens: list[str], metadata: dict[str, Any]) -> Tokenizer:
    """Byte-level BPE. A token the file spells outside the byte alphabet (llama.cpp writes some added tokens
    as plain text) is respelled byte by byte, so that it is found."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    if "tokenizer.ggml.merges" not in metadata:
        raise ValueError("this byte-level GGUF has no tokenizer.ggml.merges")
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    bpe = models.BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_bpe(tokens: list[str], metadata: dict[str, Any]) -> Tokenizer:
    """SentencePiece BPE as transformers' Llama class builds it: byte fallback (``<0x0A>``), ``▁`` for spaces, a
    prefix space on the first word. Files without merges get them rebuilt from the vocabulary's scores."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_scores(vocab, dict(zip(tokens, metadata["tokenizer.ggml.scores"], strict=True)))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tokenizer.normalizer = None
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    return tokenizer


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary is a merge, ranked by the token's score (then
    by the pieces' lengths), as transformers' ``generate_merges`` ranks them."""
    ranked: list[tuple[str, str, float]] = []
    for token, score in scores.items():
        pairs = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        ranked.extend(sorted(pairs, key=lambda pair: (vocab[pair[0]], vocab[pair[1]])))
    ranked.sort(key=lambda pair: (pair[2], len(pair[0]), len(pair[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


def _add_special_tokens(tokenizer: Tokenizer, tokens: list[str], token_types: list[int], byte_level: bool) -> None:
    """Control tokens (``<|im_end|>``) become special added tokens, user-defined ones (``<think>``) plain added
    tokens, so that both stay whole. A byte-level control token spelled outside the byte alphabet is a llama.cpp
    mislabel: adding it would grow the vocabulary past the model's, so it is skipped (as transformers does)."""
    alphabet = set(bytes_to_unicode().values())
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types, strict=False)
        if token_type == TOKEN_TYPE_CONTROL and (not byte_level or set(token) <= alphabet)
    ]
    if control:
        tokenizer.add_special_tokens(control)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    # transformers registers its class's default special tokens too: where the vocabulary has them, they are
    # kept whole here as well; where it has not, transformers appends them past the model's vocabulary (ids
    # with no embedding), which is not copied.
    defaults = [GPT2_DEFAULT_SPECIAL] if byte_level else list(LLAMA_DEFAULT_SPECIALS)
    added = {t.content for t in control}
    extra = [AddedToken(t, normalized=False, special=True) for t in defaults if t in vocab and t not in added]
    if extra:
        tokenizer.add_special_tokens(extra)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types, strict=False)
        if token_type == TOKEN_TYPE_USER_DEFINED and token in vocab
    ]
    if user_defined:
        tokenizer.add_tokens(user_defined)
