"""Weight loading: sharded safetensors, lazily sliced per rank, dtype resolution, dummy weights, errors,
and the default SmolLM2 GGUF against transformers' own GGUF loader."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import modelfiles
from engine.loader import (
    gguf_to_hf_name,
    iter_safetensors,
    load_hf_config,
    load_model,
    resolve_dtype,
    safetensors_files,
    unpermute_qk,
)
from engine.parallel import ParallelState
from tests.helpers import allocate_kv_caches, build_tiny_model, load_hf_model, one_seq_metadata, tiny_config

CPU = torch.device("cpu")


@torch.no_grad()
def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    n = ids.shape[0]
    allocate_kv_caches(model, num_blocks=-(-n // 16))
    table = list(range(-(-n // 16)))
    return model.compute_logits(model(ids, torch.arange(n), one_seq_metadata(table, 0, n)))


def test_sharded_safetensors_equal_single_file(tmp_path: Path) -> None:
    single = build_tiny_model(tmp_path / "single", "qwen2", with_tokenizer=False)
    sharded = build_tiny_model(tmp_path / "sharded", "qwen2", max_shard_size="60KB", with_tokenizer=False)
    assert len(safetensors_files(sharded)) > 1 and (sharded / "model.safetensors.index.json").is_file()
    ids = torch.randint(3, 320, (20,), generator=torch.Generator().manual_seed(0))
    got = []
    for folder in (single, sharded):
        files = modelfiles.resolve(folder)
        got.append(_logits(load_model(files, load_hf_config(files), ParallelState(), torch.float32, CPU), ids))
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(got[1], load_hf_model(single)(ids[None]).logits[0], atol=1e-4, rtol=0)


def test_lazy_slices_read_only_the_requested_part(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "llama", with_tokenizer=False)
    sources = dict(iter_safetensors(folder))
    q = sources["model.layers.0.self_attn.q_proj.weight"]
    assert tuple(q.shape) == (64, 64)
    part = q.narrow(0, 32, 32)
    hf = load_hf_model(folder)
    assert part.shape == (32, 64)
    assert torch.equal(part, hf.model.layers[0].self_attn.q_proj.weight[32:])
    assert torch.equal(q.narrow(1, 16, 16), hf.model.layers[0].self_attn.q_proj.weight[:, 16:32])


def test_dtype_and_dummy_weights(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "llama3", with_tokenizer=False)
    files = modelfiles.resolve(folder)
    config = load_hf_config(files)
    assert resolve_dtype("auto", config, "cpu") == torch.float32
    assert resolve_dtype("bf16", config, "cpu") == torch.bfloat16
    config.dtype = torch.bfloat16
    assert resolve_dtype("auto", config, "cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", config, "cpu")
    model = load_model(files, config, ParallelState(), torch.bfloat16, CPU, load_format="dummy")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert 0.015 < model.model.embed_tokens.weight.float().std().item() < 0.025
    logits = _logits(model, torch.arange(3, 23))
    assert logits.shape == (20, 320) and logits.dtype == torch.float32 and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="load_format"):
        load_model(files, config, ParallelState(), torch.float32, CPU, load_format="pt")


def test_load_weights_rejects_unknown_and_missing_tensors(tmp_path: Path) -> None:
    folder = build_tiny_model(tmp_path, "llama", with_tokenizer=False)
    files = modelfiles.resolve(folder)
    model = load_model(files, load_hf_config(files), ParallelState(), torch.float32, CPU, load_format="dummy")
    with pytest.raises(KeyError, match="visual.proj"):
        model.load_weights([("visual.proj.weight", torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="missing weights for: .*lm_head.weight"):
        model.load_weights([("model.norm.weight", torch.ones(64))])
    with pytest.raises(ValueError, match="shape mismatch"):
        model.load_weights([("model.norm.weight", torch.ones(65))])


def test_gguf_names_and_qk_unpermute() -> None:
    assert gguf_to_hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(KeyError):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")
    # llama.cpp's convert_hf_to_gguf permutation, undone
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute_qk(permuted, heads), w)


@pytest.mark.slow
def test_default_gguf_matches_transformers_gguf_loader(hf_smollm2: Any) -> None:
    files = modelfiles.resolve(None)
    assert files.gguf_path is not None
    config = load_hf_config(files)
    ours = load_model(files, config, ParallelState(), torch.float32, CPU)
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 1030, 30, 378, 8640, 28, 338], dtype=torch.long)
    got = _logits(ours, ids)
    del ours
    with torch.no_grad():
        expected = hf_smollm2(ids[None]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_tiny_config_families() -> None:
    assert tiny_config("qwen3").model_type == "qwen3"
    assert tiny_config("llama3").rope_parameters["rope_type"] == "llama3"
