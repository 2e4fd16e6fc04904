"""Model registry: ``build_model`` picks the class from ``hf_config.architectures`` (or ``model_type``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.parallel import ParallelState
from engine.quantization import Int4Config

CausalLM = LlamaForCausalLM  # every supported model shares this interface

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    names = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if model_type in _MODEL_TYPES:
        names.append(_MODEL_TYPES[model_type])
    for name in names:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model (architectures={names or None}, model_type={model_type!r}); "
        f"supported: {', '.join(MODEL_REGISTRY)}"
    )


@contextmanager
def _build_context(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Parameters are created directly on ``device`` in ``dtype`` (no CPU float32 copy first)."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old_dtype)


def build_model(
    hf_config: Any,
    parallel: ParallelState,
    dtype: torch.dtype,
    device: torch.device,
    quant_config: Int4Config | None = None,
) -> CausalLM:
    """An uninitialised model for this rank's shard (4-bit projections with ``quant_config``); fill it with
    ``load_weights`` (see engine.loader)."""
    cls = model_class(hf_config)
    with _build_context(dtype, device):
        model = cls(hf_config, parallel, quant_config)
    return model.eval()


__all__ = ["MODEL_REGISTRY", "CausalLM", "build_model", "model_class"]
