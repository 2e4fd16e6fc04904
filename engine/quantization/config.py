"""Reading a checkpoint's ``quantization_config`` into one ``Int4Config`` (or None for a dense checkpoint).

Supported: 4-bit weights, 16/32-bit activations (W4A16) as written by AutoAWQ (GEMM), AutoGPTQ /
GPTQModel (``gptq`` and ``gptq_v2`` zero points, with or without ``desc_act``) and llm-compressor
(compressed-tensors ``pack-quantized``, group or channel-wise, symmetric or not). Anything else is a
``ValueError`` that names what was found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

QUANTIZATION_METHODS = ("awq", "gptq", "compressed-tensors")  # vLLM's names for --quantization
# vLLM's names for its Marlin kernels on the same AWQ / GPTQ checkpoints (what vLLM picks for them on recent GPUs,
# so what its users' scripts pass): here the same Triton int4 kernels serve either name.
KERNEL_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
QUANTIZATION_NAMES = ("auto", *QUANTIZATION_METHODS, *KERNEL_ALIASES)
_QUANT_LM_HEAD_NAMES = ("lm_head",)


@dataclass(frozen=True)
class Int4Config:
    """How one checkpoint stores its 4-bit linear layers (all decoder projections; embeddings, norms and
    the LM head stay dense)."""

    method: str  # awq | gptq | compressed-tensors
    group_size: int | None  # input features per scale; None = one scale per output channel
    has_zeros: bool  # asymmetric: zero points in the checkpoint (else the code offset 8 is the zero)
    act_order: bool  # GPTQ desc_act: a g_idx tensor maps input features to groups
    zeros_minus_one: bool = False  # GPTQ v1 checkpoints store zero - 1


def _as_dict(qc: Any) -> dict[str, Any]:
    if isinstance(qc, dict):
        return qc
    if hasattr(qc, "to_dict"):
        return dict(qc.to_dict())
    return dict(vars(qc))


def _check_bits(method: str, bits: Any) -> None:
    if bits != 4:
        raise ValueError(f"{method} checkpoint with {bits}-bit weights: only 4-bit weights are supported")


def _check_not_converted(method: str, names: Any) -> None:
    others = [n for n in names or [] if n.split(".")[-1] not in _QUANT_LM_HEAD_NAMES and n != "re:.*lm_head"]
    if others:
        raise ValueError(f"{method} checkpoint leaves {others} unquantized: only lm_head may be left dense")


def _group(method: str, group_size: Any) -> int | None:
    g = int(group_size) if group_size is not None else -1
    if g == -1:
        return None
    if g < 8 or g % 8:
        raise ValueError(f"{method} group_size {g} is not supported: use -1 (channel-wise) or a multiple of 8")
    return g


def _awq(qc: dict[str, Any]) -> Int4Config:
    _check_bits("awq", qc.get("bits", qc.get("w_bit")))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported: only the GEMM layout ('gemm')")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ without zero points (zero_point: false) is not supported")
    _check_not_converted("awq", qc.get("modules_to_not_convert"))
    return Int4Config("awq", _group("awq", qc.get("group_size", qc.get("q_group_size"))), True, False)


def _gptq(qc: dict[str, Any]) -> Int4Config:
    _check_bits("gptq", qc.get("bits"))
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported: use gptq or gptq_v2")
    if qc.get("modules_in_block_to_quantize"):
        raise ValueError("GPTQ modules_in_block_to_quantize is not supported: every projection must be quantized")
    group = _group("gptq", qc.get("group_size", 128))
    return Int4Config("gptq", group, True, bool(qc.get("desc_act", False)), zeros_minus_one=fmt == "gptq")


def _compressed_tensors(qc: dict[str, Any]) -> Int4Config:
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"compressed-tensors with {len(groups)} config groups: exactly one W4A16 group is supported")
    (scheme,) = groups.values()
    fmt = scheme.get("format") or qc.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported: only 'pack-quantized' (W4A16)")
    if scheme.get("input_activations") or scheme.get("output_activations"):
        raise ValueError("compressed-tensors with quantized activations is not supported: only W4A16")
    w = scheme.get("weights") or {}
    _check_bits("compressed-tensors", w.get("num_bits"))
    if w.get("type", "int") != "int":
        raise ValueError(f"compressed-tensors weight type {w.get('type')!r} is not supported: only int")
    strategy = w.get("strategy")
    if strategy not in ("group", "channel"):
        raise ValueError(f"compressed-tensors strategy {strategy!r} is not supported: use group or channel")
    actorder = w.get("actorder")
    if actorder not in (None, False, "weight", "static"):  # these reorder at quantization time: no g_idx saved
        raise ValueError(
            f"compressed-tensors actorder {actorder!r} (a weight_g_idx per layer) is not supported: "
            "use actorder 'weight' or none"
        )
    _check_not_converted("compressed-tensors", qc.get("ignore"))
    group = _group("compressed-tensors", w.get("group_size")) if strategy == "group" else None
    symmetric = bool(w.get("symmetric", True))
    return Int4Config("compressed-tensors", group, not symmetric, act_order=False)


def check_quantization_name(name: str) -> None:
    """A ``ValueError`` naming the accepted values unless ``name`` is one of ``QUANTIZATION_NAMES``."""
    if name not in QUANTIZATION_NAMES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_NAMES)}, got {name!r}")


def parse_quantization(hf_config: Any, requested: str = "auto") -> Int4Config | None:
    """The checkpoint's 4-bit scheme; ``requested`` (``--quantization``) must name the method its
    ``quantization_config`` declares (or its ``KERNEL_ALIASES`` name), or be ``auto``."""
    check_quantization_name(requested)
    wanted = KERNEL_ALIASES.get(requested, requested)
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        if requested != "auto":
            raise ValueError(f"--quantization {requested}: the checkpoint has no quantization_config (dense weights)")
        return None
    qd = _as_dict(qc)
    method = str(qd.get("quant_method", "")).lower().replace("_", "-")
    if wanted != "auto" and method != wanted:
        raise ValueError(f"--quantization {requested}, but the checkpoint's quantization_config says {method!r}")
    if method == "awq":
        return _awq(qd)
    if method == "gptq":
        return _gptq(qd)
    if method == "compressed-tensors":
        return _compressed_tensors(qd)
    raise ValueError(f"quantization method {method!r} is not supported: use {', '.join(QUANTIZATION_METHODS)}")
