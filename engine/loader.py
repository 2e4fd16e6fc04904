"""Weight loading: HF safetensors (single file or sharded; each rank reads only its slices; 4-bit AWQ, GPTQ
and compressed-tensors checkpoints stay 4-bit, see ``engine.quantization``), GGUF (dequantized to float at
load, names and llama.cpp's Q/K row order mapped back to HF's), or dummy random weights for benchmarks."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, PretrainedConfig

from engine.layers.weights import WeightSource
from engine.models import CausalLM, build_model
from engine.parallel import ParallelState
from engine.quantization import parse_quantization
from modelfiles import ModelFiles

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def load_hf_config(files: ModelFiles) -> PretrainedConfig:
    return AutoConfig.from_pretrained(files.folder)


def resolve_dtype(config_dtype: str, hf_config: Any, device: torch.device | str) -> torch.dtype:
    """``auto``: float32 on CPU; on CUDA the checkpoint's dtype (float32 when it names none)."""
    if config_dtype != "auto":
        if config_dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {config_dtype!r}; use auto, float32, float16 or bfloat16")
        return _DTYPES[config_dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    ckpt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(ckpt, torch.dtype):
        return ckpt
    if isinstance(ckpt, str) and ckpt in _DTYPES:
        return _DTYPES[ckpt]
    return torch.float32


def load_model(
    files: ModelFiles,
    hf_config: Any,
    parallel: ParallelState,
    dtype: torch.dtype,
    device: torch.device | str,
    load_format: str = "auto",
    seed: int = 0,
    quantization: str = "auto",
) -> CausalLM:
    """Build this rank's shard of the model on ``device`` and fill it. ``quantization`` (``--quantization``):
    auto (the checkpoint's ``quantization_config``) or the method it must declare (awq, gptq, compressed-tensors)."""
    device = torch.device(device)
    quant_config = parse_quantization(hf_config, quantization)
    if quant_config is not None and files.gguf_path is not None and load_format != "dummy":
        raise ValueError("a GGUF file with a quantization_config: GGUF weights are dequantized, use a HF folder")
    model = build_model(hf_config, parallel, dtype, device, quant_config)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif load_format == "auto":
        if files.gguf_path is not None:
            model.load_weights(iter_gguf(files.gguf_path))
        else:
            model.load_weights(iter_safetensors(files.folder))
    else:
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    return model


@torch.no_grad()
def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """normal(0, 0.02) matrices, unit norm weights, zero biases: shaped like the real model, numerically tame.
    Parameters with their own ``dummy_init`` (4-bit codes, scales, zeros) use it."""
    for name, param in model.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(seed + sum(map(ord, name)))
        own_init = getattr(param, "dummy_init", None)
        if own_init is not None:
            own_init(param, gen)
        elif param.ndim >= 2:
            param.normal_(0.0, 0.02, generator=gen)
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.zero_()


# ---- safetensors ----


class _LazySlice:
    """A safetensors tensor read on demand: ``narrow`` reads only the requested rows/columns."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape: Sequence[int] = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / f for f in sorted(set(weight_map.values()))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, WeightSource]]:
    from safetensors import safe_open

    for path in safetensors_files(Path(folder)):
        with safe_open(path, framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, _LazySlice(handle, name)


# ---- GGUF ----

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_IGNORED = {"rope_freqs"}  # llama3 scaling factors; we rebuild them from the config
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for ignored tensors."""
    m = _GGUF_BLOCK.match(name)
    if m:
        layer, part, kind = m.groups()
        if part not in _GGUF_LAYER_NAMES:
            raise KeyError(f"GGUF tensor {name!r} has no HF equivalent in the Llama family")
        return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base in _GGUF_IGNORED:
        return None
    if base not in _GGUF_GLOBAL_NAMES:
        raise KeyError(f"GGUF tensor {name!r} has no HF equivalent in the Llama family")
    return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"


def _gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else value.tolist()[0]


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved rope pairs -> rotate-half)."""
    rows = weight.shape[0]
    w = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])  # [H, D/2, 2, ...]
    return w.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize every tensor to float32 with the ``gguf`` package, under HF names and layout."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    num_heads = _gguf_field(reader, f"{arch}.attention.head_count")
    num_kv_heads = _gguf_field(reader, f"{arch}.attention.head_count_kv") or num_heads
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)  # [out, in] float32 (numpy row-major)
        if arch == "llama" and ".attn_q." in tensor.name:
            weights = unpermute_qk(weights, num_heads)
        elif arch == "llama" and ".attn_k." in tensor.name:
            weights = unpermute_qk(weights, num_kv_heads)
        weights = np.ascontiguousarray(weights, dtype=np.float32)
        if not weights.flags.writeable:  # F32/F16 tensors come back as views of the read-only memmap
            weights = weights.copy()
        yield hf_name, torch.from_numpy(weights)
