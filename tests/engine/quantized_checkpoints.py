"""Tiny 4-bit checkpoints written by the tools' own packers, on CPU, no hub:

- compressed-tensors: ``PackedQuantizationCompressor.compress`` (what llm-compressor calls when it saves);
- AWQ: AutoAWQ's ``WQLinear_GEMM.from_linear`` (its GEMM packer, interleaved nibbles, fp16 scales);
- GPTQ: AutoGPTQ's ``QuantLinear.pack`` (v1 format: zero - 1; g_idx when act-order).

Scales and zeros are min-max over each group (the tools' calibration would only change their values). The
dense model's weights are first replaced by their dequantized values, so every packer's rounding is exact
and the same folder, dequantized to fp32, is the reference model (saved beside it in ``dense/``).
AutoAWQ's and AutoGPTQ's packages are imported below their ``__init__`` (which pulls in their model zoo,
calibration data sets and CUDA extensions); only the packing modules run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tests.helpers import build_tiny_model

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_INPUT_OF = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp", "up_proj": "mlp"}


def import_below_init(package: str, module: str) -> Any:
    """``package.module`` without running ``package/__init__.py``."""
    if package not in sys.modules or not hasattr(sys.modules[package], "__path__"):
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations is not None, f"{package} is not installed"
        stub = types.ModuleType(package)
        stub.__path__ = list(spec.submodule_search_locations)
        sys.modules[package] = stub
    return importlib.import_module(f"{package}.{module}")


def minmax_quantize(
    weight: torch.Tensor, group_size: int | None, symmetric: bool, g_idx: torch.Tensor | None, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> codes ``[N, K]`` (0..15), scales and zeros ``[N, groups]`` (zeros 0..15)."""
    n, k = weight.shape
    gs = group_size or k
    groups = g_idx.long() if g_idx is not None else torch.arange(k) // gs  # [K]
    num_groups = int(groups.max()) + 1
    scales = torch.empty(n, num_groups)
    zeros = torch.empty(n, num_groups, dtype=torch.int64)
    for g in range(num_groups):
        w = weight[:, groups == g]
        if symmetric:
            scales[:, g] = w.abs().amax(dim=1).clamp_min(1e-6) / 7.5
            zeros[:, g] = 8
        else:
            lo, hi = w.amin(dim=1).clamp(max=0), w.amax(dim=1).clamp(min=0)
            scales[:, g] = (hi - lo).clamp_min(1e-6) / 15
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(0, 15).long()
    scales = scales.to(scale_dtype).float()
    codes = torch.clamp(torch.round(weight / scales[:, groups]) + zeros[:, groups], 0, 15).long()
    return codes, scales.to(scale_dtype), zeros


def dequant(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    return (codes - zeros[:, groups]).float() * scales.float()[:, groups]


def _pack_ct(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, scheme: Any) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    state = {"weight": w, "weight_scale": scales, "weight_zero_point": (zeros - 8).to(torch.int8)}
    out = PackedQuantizationCompressor.compress(state, scheme)
    return {name: t.contiguous() for name, t in out.items()}


def _pack_awq(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    gemm = import_below_init("awq", "modules.linear.gemm")
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data.copy_(w)
    q = gemm.WQLinear_GEMM.from_linear(
        linear, 4, group_size, scales=scales.t().contiguous(), zeros=zeros.t().contiguous()
    )
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales}


def _pack_gptq(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, g_idx: torch.Tensor
) -> dict[str, torch.Tensor]:
    qlinear = import_below_init("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    n, k = w.shape
    q = qlinear.QuantLinear(4, group_size, k, n, bias=False, weight_dtype=torch.float32)
    linear = torch.nn.Linear(k, n, bias=False)
    linear.weight.data.copy_(w)
    q.pack(linear, scales, zeros, g_idx.to(torch.int32))
    return {"qweight": q.qweight, "qzeros": q.qzeros, "scales": q.scales, "g_idx": q.g_idx.to(torch.int32)}


def _quant_config(fmt: str, group_size: int | None, symmetric: bool, act_order: bool) -> tuple[dict[str, Any], Any]:
    if fmt == "compressed-tensors":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

        args = QuantizationArgs(
            num_bits=4,
            symmetric=symmetric,
            strategy="group" if group_size else "channel",
            group_size=group_size,
        )
        scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
        qc = QuantizationConfig(
            config_groups={"group_0": scheme},
            format="pack-quantized",
            quantization_status="compressed",
            ignore=["lm_head"],
        )
        return qc.model_dump(mode="json"), scheme
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}, None
    return {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size or -1,
        "desc_act": act_order,
        "sym": symmetric,
        "checkpoint_format": "gptq",
    }, None


def build_quantized_model(
    folder: str | Path,
    fmt: str,
    model_type: str = "llama",
    *,
    group_size: int | None = 32,
    symmetric: bool = False,
    act_order: bool = False,
    seed: int = 0,
    **config_overrides: Any,
) -> tuple[Path, Path]:
    """Write a 4-bit ``fmt`` checkpoint (compressed-tensors | awq | gptq) into ``folder`` and its dequantized
    fp32 twin into ``folder/dense``; returns both folders."""
    folder = Path(folder)
    dense = build_tiny_model(folder / "dense", model_type, seed=seed, **config_overrides)
    from safetensors.torch import load_file

    state = load_file(dense / "model.safetensors")
    qconfig, scheme = _quant_config(fmt, group_size, symmetric, act_order)
    gen = torch.Generator().manual_seed(seed + 100)
    perms: dict[str, torch.Tensor] = {}
    packed: dict[str, torch.Tensor] = {}
    for name in list(state):
        module, _, kind = name.rpartition(".")
        proj = module.rpartition(".")[2]
        if proj not in PROJECTIONS or kind != "weight":
            continue
        w = state[name]
        n, k = w.shape
        gs = group_size or k
        g_idx = torch.arange(k, dtype=torch.int32) // gs
        if act_order:  # one permutation per input, shared by the projections that read it (as GPTQ's Hessian)
            key = module.rpartition(".")[0] + "." + _INPUT_OF.get(proj, proj)
            perm = perms.setdefault(key, torch.randperm(k, generator=gen))
            g_idx = (torch.argsort(perm) // gs).to(torch.int32)
        scale_dtype = torch.float16 if fmt == "awq" else torch.float32
        codes, scales, zeros = minmax_quantize(w, group_size, symmetric, g_idx if act_order else None, scale_dtype)
        w_deq = dequant(codes, scales, zeros, g_idx.long())
        state[name] = w_deq  # the reference model's weight
        if fmt == "compressed-tensors":
            parts = _pack_ct(w_deq, scales, zeros, scheme)
        elif fmt == "awq":
            parts = _pack_awq(w_deq, scales, zeros, gs)
        else:
            parts = _pack_gptq(w_deq, scales, zeros, gs, g_idx)
        packed.update({f"{module}.{part}": t for part, t in parts.items()})
    save_file(state, dense / "model.safetensors")
    quantized = {n: t for n, t in state.items() if n not in _packed_modules(packed)}
    quantized.update(packed)
    save_file({n: t.contiguous() for n, t in quantized.items()}, folder / "model.safetensors")
    for path in dense.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            (folder / path.name).write_bytes(path.read_bytes())
    config = json.loads((dense / "config.json").read_text())
    config["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, dense


def _packed_modules(packed: dict[str, torch.Tensor]) -> set[str]:
    return {name.rpartition(".")[0] + ".weight" for name in packed}
