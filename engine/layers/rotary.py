"""Rotary position embedding: a float32 ``[max_positions, head_dim]`` cos/sin cache (cos half | sin half)
built exactly the way HF transformers builds ``inv_freq`` and ``cos``/``sin``, so positions rotate to the
same bits. The attention layer applies it (``engine.attention.write_kv``): on the Triton backend in the
same kernel that writes k and v into the cache, else by the torch reference.

Supported rope types: default, linear, llama3, yarn, and dynamic (which equals default for positions
within ``max_position_embeddings``, the only ones this static cache serves).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings as one dict with ``rope_type`` and ``rope_theta``, from transformers-5
    ``config.rope_parameters`` or the older ``rope_theta`` + ``rope_scaling`` attributes."""
    params: dict[str, Any] = {}
    old_scaling = getattr(hf_config, "rope_scaling", None)
    if isinstance(old_scaling, dict):
        params.update(old_scaling)
    new = getattr(hf_config, "rope_parameters", None)
    if isinstance(new, dict):
        params.update(new)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(params: dict[str, Any], dim: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(params: dict[str, Any], dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    base = params["rope_theta"]
    original_max = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original_max

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation_factor = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, float(attention_factor)


def compute_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention scaling applied to cos and sin), as HF computes them."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "llama3":
        return _llama3_inv_freq(params, head_dim), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(params, head_dim, hf_config.max_position_embeddings)
    inv_freq = _base_inv_freq(params["rope_theta"], head_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    return inv_freq, 1.0


def build_cos_sin_cache(hf_config: Any, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos(pos * inv_freq) in the first half, sin in the second."""
    with torch.device("cpu"):  # HF computes these on CPU; same device, same bits
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """The neox-style rope of one model: its cos/sin cache, shared by every attention layer, which applies
    it to q ``[T, heads, D]`` and k ``[T, kv_heads, D]`` at ``positions [T]``."""

    cos_sin_cache: torch.Tensor

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        cache_ = build_cos_sin_cache(hf_config, head_dim, max_positions)
        self.register_buffer("cos_sin_cache", cache_.to(torch.get_default_device()), persistent=False)
