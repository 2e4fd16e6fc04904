"""Loading 4-bit checkpoints: each format's tensors, repacked into the kernel's layout, dequantize to exactly what
the tool's own unpacking code gives (compressed-tensors' decompress, AutoAWQ's dequantize_gemm, AutoGPTQ's
QuantLinear), with the torch reference and with the Triton dequantization (the interpreter on CPU); the model
holds no dense projection weights; each TP rank's slices (column and row parallel, act-order g_idx) are exactly
its part of the single-rank weights; a rank's large steps dequantize into one scratch sized for its largest
slice; unsupported configs fail with a clear error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import modelfiles
from engine.loader import load_hf_config, load_model
from engine.parallel import ParallelState
from engine.quantization import parse_quantization
from kernels.activation import silu_and_mul_ref
from kernels.int4_dequant import DEQUANT_MIN_M, dequantize_int4, int4_dequant
from kernels.int4_gemm import int4_gemm_gated_ref, int4_gemm_ref
from tests.engine.quantized_checkpoints import build_quantized_model, import_below_init

LAYER = "model.layers.1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the Triton kernels' (interpreter on CPU)


def _load(folder: Path, rank: int = 0, world: int = 1) -> Any:
    files = modelfiles.resolve(str(folder))
    return load_model(files, load_hf_config(files), ParallelState(rank, world), torch.float32, "cpu")


def _dense(layer: Any) -> torch.Tensor:
    return dequantize_int4(layer.qweight, layer.scales, layer.zeros, layer.group_size, layer.g_idx)  # [N, K]


def _tensors(folder: Path, module: str) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {n.rpartition(".")[2]: f.get_tensor(n) for n in f.keys() if n.startswith(module + ".")}  # noqa: SIM118


def _tool_dequant(fmt: str, t: dict[str, torch.Tensor], group_size: int, config: dict[str, Any]) -> torch.Tensor:
    """The dense ``[N, K]`` weight as the tool that wrote ``t`` unpacks it (fp32)."""
    if fmt == "compressed-tensors":
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationConfig

        scheme = QuantizationConfig.model_validate(config).config_groups["group_0"]
        return PackedQuantizationCompressor.decompress(dict(t), scheme)["weight"]
    if fmt == "awq":
        utils = import_below_init("awq", "utils.packing_utils")
        return utils.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"].float(), 4, group_size).t()
    qlinear = import_below_init("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    k, n = t["qweight"].shape[0] * 8, t["qweight"].shape[1]
    q = qlinear.QuantLinear(4, group_size, k, n, bias=False, weight_dtype=torch.float32)
    q.load_state_dict({**{name: t[name] for name in ("qweight", "qzeros", "scales", "g_idx")}}, strict=False)
    return q(torch.eye(k)).t()  # x = I: the rows of W^T, exactly


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("compressed-tensors", {"group_size": 32}),
        ("compressed-tensors", {"group_size": None, "symmetric": True}),
        ("awq", {"group_size": 32}),
        ("gptq", {"group_size": 32, "act_order": True}),
        ("gptq", {"group_size": None, "symmetric": True}),
    ],
)
def test_repacked_weights_equal_the_tools_dequantization(tmp_path: Path, fmt: str, options: dict[str, Any]) -> None:
    folder, _ = build_quantized_model(tmp_path, fmt, "qwen2", seed=1, **options)
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    model = _load(folder)
    layer = model.model.layers[1]
    assert not any(name.endswith("proj.weight") for name, _ in model.named_parameters())
    assert layer.mlp.down_proj.qweight.dtype == torch.int32
    for ours, names in (
        (layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
        (layer.mlp.down_proj, ("down_proj",)),
    ):
        part = "self_attn" if names[0] != "down_proj" else "mlp"
        k = ours.qweight.shape[0] * 8
        expected = torch.cat(
            [
                _tool_dequant(fmt, _tensors(folder, f"{LAYER}.{part}.{n}"), options["group_size"] or k, config)
                for n in names
            ]
        )
        assert torch.equal(_dense(ours), expected.float())
        qweight, scales, zeros = (t.to(DEVICE) for t in (ours.qweight, ours.scales, ours.zeros))
        g_idx = ours.g_idx.to(DEVICE) if ours.g_idx is not None else None
        triton_dense = int4_dequant(qweight, scales, zeros, ours.group_size, g_idx)
        assert torch.equal(triton_dense.cpu(), expected.float())


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("compressed-tensors", {"group_size": 32}),
        ("awq", {"group_size": 16}),
        ("gptq", {"group_size": 32, "act_order": True}),
    ],
)
def test_tp_slices_are_the_ranks_part_of_the_weights(tmp_path: Path, fmt: str, options: dict[str, Any]) -> None:
    folder, _ = build_quantized_model(tmp_path, fmt, "llama", seed=2, **options)
    full = _load(folder).model.layers[0]
    ranks = [_load(folder, r, 2).model.layers[0] for r in range(2)]
    # column parallel, merged: each rank holds [gate shard | up shard]
    gate, up = _dense(full.mlp.gate_up_proj).chunk(2)
    for r, layer in enumerate(ranks):
        g, u = _dense(layer.mlp.gate_up_proj).chunk(2)
        assert torch.equal(g, gate.chunk(2)[r]) and torch.equal(u, up.chunk(2)[r])
        # row parallel: input features split (groups, and g_idx with act-order, follow them)
        assert torch.equal(_dense(layer.mlp.down_proj), _dense(full.mlp.down_proj).chunk(2, dim=1)[r])
        assert torch.equal(_dense(layer.self_attn.o_proj), _dense(full.self_attn.o_proj).chunk(2, dim=1)[r])
    # QKV: 2 KV heads, one per rank
    q, k, v = _dense(full.self_attn.qkv_proj).split([64, 32, 32])
    for r, layer in enumerate(ranks):
        qr, kr, vr = _dense(layer.self_attn.qkv_proj).split([32, 16, 16])
        assert torch.equal(qr, q.chunk(2)[r]) and torch.equal(kr, k.chunk(2)[r]) and torch.equal(vr, v.chunk(2)[r])


def test_large_steps_dequantize_into_one_scratch_per_rank(tmp_path: Path) -> None:
    """The CUDA path of the layers (here through the Triton interpreter) on rank 1 of 2: from DEQUANT_MIN_M
    tokens each projection is dequantized into the model's one scratch, reserved at load for the rank's
    largest sliced layer, and equals the GEMM reference bit for bit; a token fewer runs the fused GEMM. So does
    the down projection given gate_up's output (``apply_gated``: the activation first from DEQUANT_MIN_M on)."""
    folder, _ = build_quantized_model(tmp_path, "gptq", "llama", seed=2, group_size=32, act_order=True)
    layer = _load(folder, 1, 2).to(DEVICE).model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    method = projections[0].quant
    assert all(p.quant is method for p in projections)
    assert method.scratch.reserved_numel == max(p.qweight.shape[0] * 8 * p.qweight.shape[1] for p in projections)
    gen = torch.Generator().manual_seed(0)
    down = layer.mlp.down_proj
    for m in (DEQUANT_MIN_M - 1, DEQUANT_MIN_M):
        runs = []  # (out, ref)
        for p in projections:
            x = torch.randn(m, p.qweight.shape[0] * 8, generator=gen).to(DEVICE)
            ref = int4_gemm_ref(x, p.qweight, p.scales, p.zeros, p.group_size, p.g_idx)
            runs.append((method.apply_triton(p, x), ref))
        x2 = torch.randn(m, 2 * down.qweight.shape[0] * 8, generator=gen).to(DEVICE)  # gate | up
        ref = int4_gemm_gated_ref(x2, down.qweight, down.scales, down.zeros, down.group_size, down.g_idx)
        runs.append((method.apply_gated_triton(down, x2, silu_and_mul_ref), ref))
        for out, ref in runs:
            if m >= DEQUANT_MIN_M:
                assert torch.equal(out, ref)
            else:
                assert float((out - ref).norm() / ref.norm()) < 1e-5
        assert method.scratch.num_bytes() == (4 * method.scratch.reserved_numel if m >= DEQUANT_MIN_M else 0)


def test_a_group_cut_by_a_tp_slice_is_an_error(tmp_path: Path) -> None:
    folder, _ = build_quantized_model(tmp_path, "gptq", "llama", group_size=64)  # o_proj: 64 inputs -> 32 per rank
    with pytest.raises(ValueError, match="multiple of group_size"):
        _load(folder, 0, 2)


def test_dummy_weights_of_a_quantized_config(tmp_path: Path) -> None:
    folder, _ = build_quantized_model(tmp_path, "compressed-tensors", "llama", group_size=32)
    files = modelfiles.resolve(str(folder))
    model = load_model(files, load_hf_config(files), ParallelState(), torch.float32, "cpu", load_format="dummy")
    layer: Any = model.model.layers[0]
    w = _dense(layer.mlp.down_proj)
    assert w.isfinite().all() and 0.005 < float(w.std()) < 0.05


CT_W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}
    },
    "ignore": ["lm_head"],
}


def _with(base: dict[str, Any], **changes: Any) -> Any:
    return type("Cfg", (), {"quantization_config": {**base, **changes}})()


@pytest.mark.parametrize(
    ("qc", "message"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit weights: only 4-bit"),
        ({"quant_method": "gptq", "bits": 3}, "3-bit"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "only the GEMM layout"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
        ({"quant_method": "fp8"}, "'fp8' is not supported"),
        (
            {**CT_W4A16, "format": "float-quantized", "config_groups": {"g": {"weights": {"num_bits": 8}}}},
            "'float-quantized'",
        ),
        ({**CT_W4A16, "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "only lm_head may be left dense"),
        (
            {
                **CT_W4A16,
                "config_groups": {"g": {"weights": {**CT_W4A16["config_groups"]["g"]["weights"], "actorder": "group"}}},
            },
            "actorder 'group'",
        ),
    ],
)
def test_unsupported_configs_fail_clearly(qc: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_quantization(type("Cfg", (), {"quantization_config": qc})())


def test_supported_configs_parse() -> None:
    ct = parse_quantization(_with(CT_W4A16))
    assert ct is not None and (ct.method, ct.group_size, ct.has_zeros) == ("compressed-tensors", 128, False)
    gptq = parse_quantization(_with({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True}))
    assert gptq is not None and gptq.group_size is None and gptq.act_order and gptq.zeros_minus_one
    assert parse_quantization(type("Dense", (), {})()) is None
    with pytest.raises(ValueError, match="quantization must be one of auto, awq, gptq, compressed-tensors"):
        parse_quantization(_with(CT_W4A16), "marlin")
    as_marlin = parse_quantization(_with({"quant_method": "gptq", "bits": 4, "group_size": 128}), "gptq_marlin")
    assert as_marlin == parse_quantization(_with({"quant_method": "gptq", "bits": 4, "group_size": 128}), "gptq")
    with pytest.raises(
        ValueError, match="--quantization awq_marlin, but the checkpoint's quantization_config says 'gptq'"
    ):
        parse_quantization(_with({"quant_method": "gptq", "bits": 4}), "awq_marlin")
