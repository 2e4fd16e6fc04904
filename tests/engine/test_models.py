"""Our Llama-family models against HF transformers in float32: the same logits for a whole prompt, and
for a prefill then token-by-token decode through the paged KV cache with a shuffled block table."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

import modelfiles
from engine.layers import RowParallelLinear
from engine.loader import load_hf_config, load_model
from engine.models import build_model, llama, model_class
from engine.parallel import ParallelState
from tests.helpers import (
    LLAMA3_ROPE,
    allocate_kv_caches,
    build_tiny_model,
    load_hf_model,
    one_seq_metadata,
    tiny_config,
)

BLOCK_SIZE = 4  # small blocks so a 40-token prompt spans many, shuffled, blocks
ATOL = 1e-4

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama3", {}),
    "llama-mha-bias": ("llama", {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True}),
    "mistral-window": ("mistral", {"sliding_window": 8}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen3": ("qwen3", {}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    model_type, overrides = VARIANTS[request.param]
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), model_type, with_tokenizer=False, **overrides)
    files = modelfiles.resolve(folder)
    ours = load_model(files, load_hf_config(files), ParallelState(), torch.float32, torch.device("cpu"))
    return folder, ours, load_hf_model(folder)


def _prompt(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(seed))


def _shuffled_table(num_blocks: int, seed: int = 0) -> list[int]:
    table = list(range(num_blocks))
    random.Random(seed).shuffle(table)
    return table


@torch.no_grad()
def test_prompt_logits_match_hf(checkpoint: tuple[Path, Any, Any]) -> None:
    _, ours, hf = checkpoint
    ids = _prompt(40)
    allocate_kv_caches(ours, num_blocks=12, block_size=BLOCK_SIZE)
    hidden = ours(ids, torch.arange(40), one_seq_metadata(_shuffled_table(12), 0, 40, BLOCK_SIZE))
    logits = ours.compute_logits(hidden)
    expected = hf(ids[None]).logits[0]
    assert logits.dtype == torch.float32 and logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@torch.no_grad()
def test_chunked_prefill_then_decode_match_hf(checkpoint: tuple[Path, Any, Any]) -> None:
    _, ours, hf = checkpoint
    n = 40
    ids = _prompt(n, seed=2)
    expected = hf(ids[None]).logits[0]  # [n, vocab]
    table = _shuffled_table(12, seed=3)
    allocate_kv_caches(ours, num_blocks=12, block_size=BLOCK_SIZE)
    got = []
    # a prefill split in two chunks (the second attends to the cached first), then one token per step
    steps = [(0, 13), (13, 10)] + [(p, 1) for p in range(23, n)]
    for start, num_new in steps:
        meta = one_seq_metadata(table, start, num_new, BLOCK_SIZE)
        hidden = ours(ids[start : start + num_new], torch.arange(start, start + num_new), meta)
        got.append(ours.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)
    assert torch.equal(torch.cat(got)[23:].argmax(-1), expected[23:].argmax(-1))


@torch.no_grad()
def test_fused_norm_decode_equals_the_unfused_one(
    checkpoint: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps (one token) with the input RMSNorms carried by the projections around them (``kernels.fused_norm``;
    on CPU the same seam runs the torch references): the logits are those of the unfused model bit for bit, and
    match HF's. Covers the fallbacks too (a biased down_proj adds its residual after the matmul)."""
    _, ours, hf = checkpoint
    n = 30
    ids = _prompt(n, seed=5)
    expected = hf(ids[None]).logits[0]
    table = _shuffled_table(12, seed=6)
    steps = [(0, 20)] + [(p, 1) for p in range(20, n)]
    residual_adds = []
    add = RowParallelLinear.forward_residual

    def counted(layer: Any, *args: Any) -> Any:
        residual_adds.append(1)
        return add(layer, *args)

    monkeypatch.setattr(RowParallelLinear, "forward_residual", counted)
    monkeypatch.setattr(ours.model, "fuse_norm", True)
    logits = {}
    for devices in ((), ("cuda", "cpu")):
        monkeypatch.setattr(llama, "FUSED_NORM_DEVICES", devices)
        allocate_kv_caches(ours, num_blocks=12, block_size=BLOCK_SIZE)
        got = []
        for start, num_new in steps:
            meta = one_seq_metadata(table, start, num_new, BLOCK_SIZE)
            got.append(
                ours.compute_logits(ours(ids[start : start + num_new], torch.arange(start, start + num_new), meta))
            )
        logits[devices] = torch.cat(got)
    # only the fused run's decode steps, one add per layer
    assert len(residual_adds) == (n - 20) * hf.config.num_hidden_layers
    assert torch.equal(logits[()], logits[("cuda", "cpu")])
    torch.testing.assert_close(logits[()], expected, atol=ATOL, rtol=0)


def test_interface(checkpoint: tuple[Path, Any, Any]) -> None:
    _, ours, hf = checkpoint
    layers = ours.attention_layers()
    assert len(layers) == hf.config.num_hidden_layers
    assert all(a.num_kv_heads == hf.config.num_key_value_heads and a.head_dim == 16 for a in layers)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    if hf.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_sliding_window_per_layer() -> None:
    mistral = build_model(tiny_config("mistral", sliding_window=8), ParallelState(), torch.float32, torch.device("cpu"))
    assert [a.sliding_window for a in mistral.attention_layers()] == [8, 8]
    qwen2 = tiny_config("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    model = build_model(qwen2, ParallelState(), torch.float32, torch.device("cpu"))
    assert [a.sliding_window for a in model.attention_layers()] == [None, 8]
    plain = build_model(tiny_config("qwen2"), ParallelState(), torch.float32, torch.device("cpu"))
    assert [a.sliding_window for a in plain.attention_layers()] == [None, None]


def test_unknown_architecture_names_supported_ones() -> None:
    config = tiny_config("llama")
    config.architectures = ["GPT2LMHeadModel"]
    config.model_type = "gpt2"
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        model_class(config)


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": LLAMA3_ROPE,
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_cache_equals_hf(case: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from engine.layers.rotary import build_cos_sin_cache

    config = tiny_config("llama", rope_parameters=dict(ROPE_CASES[case]))
    positions = torch.arange(200)[None]
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    cache = build_cos_sin_cache(config, 16, 256)[:200]
    assert torch.equal(cache[:, :8], cos[0, :, :8]) and torch.equal(cache[:, 8:], sin[0, :, :8])


def test_rope_parameters_reads_legacy_attributes() -> None:
    from types import SimpleNamespace

    from engine.layers.rotary import rope_parameters

    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(legacy) == {"rope_theta": 5e5, "type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert rope_parameters(SimpleNamespace())["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match="longrope"):
        rope_parameters(SimpleNamespace(rope_scaling={"rope_type": "longrope"}))
