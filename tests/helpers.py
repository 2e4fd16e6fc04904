"""Tiny random-weight HF checkpoints (and a byte-level tokenizer) built on the fly for tests.

Every builder is seeded and takes well under a second: hidden 64, 4 query / 2 KV heads of 16 dims,
vocab 320 (256 bytes + 3 specials + 61 filler tokens, so every id decodes to text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

NUM_BYTE_TOKENS = 256
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
VOCAB_SIZE = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}
_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


# Llama 3's rope scaling, with the original context shrunk to fit tiny test models
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_config(model_type: str = "llama", **overrides: Any) -> Any:
    """A float32 HF config of the given family with tiny shapes; ``overrides`` win."""
    import transformers

    kwargs: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype="float32",
    )
    if model_type == "llama3":
        model_type = "llama"
        kwargs["rope_parameters"] = dict(LLAMA3_ROPE)
    kwargs.update(overrides)
    config = getattr(transformers, _CONFIG_CLASSES[model_type])(**kwargs)
    config.architectures = [_MODEL_CLASSES[model_type]]
    return config


def build_tokenizer() -> Any:
    """Byte-level BPE with no merges: every byte is a token, so any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = list(pre_tokenizers.ByteLevel.alphabet())
    byte_chars.sort()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    fast.add_tokens([f"<extra_{i}>" for i in range(VOCAB_SIZE - len(vocab))])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    folder: str | Path,
    model_type: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> Path:
    """Save a random-weight ``model_type`` checkpoint (llama | llama3 | mistral | qwen2 | qwen3) into
    ``folder`` as safetensors (sharded when ``max_shard_size`` is given), plus a tokenizer."""
    import transformers

    folder = Path(folder)
    config = tiny_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    cls = getattr(transformers, config.architectures[0])
    model = cls(config).to(torch.float32).eval()
    _randomize(model, seed)
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    if with_tokenizer:
        build_tokenizer().save_pretrained(folder)
    return folder


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """HF's init leaves norms at 1 and biases at 0; perturb them so their loading is actually tested."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if param.ndim == 1:
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + 0.1 * torch.randn(param.shape, generator=gen))
        else:
            param.copy_(0.05 * torch.randn(param.shape, generator=gen))


def load_hf_model(folder: str | Path) -> Any:
    """The reference: transformers' own model from ``folder`` in float32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def allocate_kv_caches(model: Any, num_blocks: int, block_size: int = 16) -> None:
    """Give every attention layer of ``model`` its ``[2, blocks, block_size, kv_heads, head_dim]`` cache."""
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(
            2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim, dtype=next(model.parameters()).dtype
        )


def one_seq_metadata(block_table: list[int], num_cached: int, num_new: int, block_size: int = 16) -> Any:
    """AttentionMetadata for one sequence that has ``num_cached`` tokens in the cache and ``num_new`` in
    this step, stored in the blocks ``block_table`` (in order)."""
    from engine.attention import AttentionMetadata

    positions = range(num_cached, num_cached + num_new)
    slots = [block_table[p // block_size] * block_size + p % block_size for p in positions]
    seq_len = num_cached + num_new
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor([0, num_new], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=torch.tensor([block_table], dtype=torch.int32),
        max_query_len=num_new,
        max_seq_len=seq_len,
    )
