"""Each checkpoint format's packed tensors, read for one rank and repacked into the kernel's layout
(``kernels.int4_dequant``: qweight ``[K/8, N]`` int32, scales ``[groups, N]``, zeros ``[groups, N]`` uint8).

Slices are given in HF coordinates (output features ``n0 : n0 + n``, input features ``k0 : k0 + k``, groups
``g0 : g0 + g``) and mapped onto the packed dimensions, so each rank reads only its own bytes. Layouts:

- AWQ (GEMM): qweight ``[K, N/8]`` and qzeros ``[G, N/8]`` packed along N in the interleaved order
  ``AWQ_ORDER`` (nibble ``i`` of word ``c`` is column ``8c + AWQ_ORDER[i]``); scales ``[G, N]``.
- GPTQ: qweight ``[K/8, N]`` (our layout), qzeros ``[G, N/8]`` sequential along N, storing ``zero - 1`` in the
  v1 format; scales ``[G, N]``; g_idx ``[K]``.
- compressed-tensors pack-quantized: weight_packed ``[N, K/8]`` sequential along K, weight_scale ``[N, G]``,
  weight_zero_point ``[N/8, G]`` packed along N; values are signed, stored with an offset of 8.
"""

from __future__ import annotations

import torch

from engine.layers.weights import WeightSource
from engine.quantization.config import Int4Config
from kernels.int4_dequant import PACK, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column p of a word is nibble AWQ_REVERSE_ORDER[p]
SEQUENTIAL = tuple(range(PACK))

# checkpoint tensor name suffix -> our parameter (None: not loaded)
_NAMES: dict[str, dict[str, str | None]] = {
    "awq": {"qweight": "qweight", "qzeros": "zeros", "scales": "scales"},
    "gptq": {"qweight": "qweight", "qzeros": "zeros", "scales": "scales", "g_idx": "g_idx"},
    "compressed-tensors": {
        "weight_packed": "qweight",
        "weight_scale": "scales",
        "weight_zero_point": "zeros",
        "weight_shape": None,
    },
}


def param_name(config: Int4Config, tensor_name: str) -> str | None:
    """``...q_proj.qweight`` -> ``...q_proj.qweight``, CT's ``...weight_packed`` -> ``...qweight``; None for
    tensors we do not load (``weight_shape``; ``g_idx`` without act-order, where it is ``k // group_size``)."""
    prefix, _, suffix = tensor_name.rpartition(".")
    names = _NAMES[config.method]
    if suffix not in names:
        return tensor_name
    ours = names[suffix]
    if ours is None or (ours == "g_idx" and not config.act_order):
        return None
    return f"{prefix}.{ours}"


def _narrow2(src: WeightSource, start0: int, len0: int, start1: int, len1: int) -> torch.Tensor:
    """``src[start0 : start0 + len0, start1 : start1 + len1]``, reading the rows from disk first."""
    if start0 == 0 and len0 == src.shape[0]:
        return src.narrow(1, start1, len1)
    return src.narrow(0, start0, len0).narrow(1, start1, len1)


def _packed_range(start: int, size: int, what: str) -> tuple[int, int]:
    if start % PACK or size % PACK:
        raise ValueError(
            f"{what} per rank must be multiples of {PACK} to slice packed 4-bit tensors, got {size} at {start}"
        )
    return start // PACK, size // PACK


def unpack_cols(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int32 ``[R, C]`` packed along the columns -> codes uint8 ``[R, 8 C]``; column ``8c + p`` is nibble
    ``order[p]`` of word ``c``."""
    shifts = torch.tensor([4 * i for i in order], dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32)[:, :, None] >> shifts[None, None, :]) & 0xF  # [R, C, 8]
    return codes.reshape(packed.shape[0], -1).to(torch.uint8)


def read_qweight(config: Int4Config, src: WeightSource, n0: int, n: int, k0: int, k: int) -> torch.Tensor:
    """The rank's codes as ``[k / 8, n]`` int32 (our layout)."""
    if config.method == "gptq":
        r0, r = _packed_range(k0, k, "input features")
        return _narrow2(src, r0, r, n0, n).to(torch.int32)
    if config.method == "awq":
        c0, c = _packed_range(n0, n, "output features")
        return pack_int4(unpack_cols(_narrow2(src, k0, k, c0, c), AWQ_REVERSE_ORDER))  # codes [k, n]
    c0, c = _packed_range(k0, k, "input features")
    codes = unpack_cols(_narrow2(src, n0, n, c0, c), SEQUENTIAL)  # [n, k]
    return pack_int4(codes.t())


def read_scales(config: Int4Config, src: WeightSource, n0: int, n: int, g0: int, g: int) -> torch.Tensor:
    """``[g, n]`` float."""
    if config.method == "compressed-tensors":
        return _narrow2(src, n0, n, g0, g).t()
    return _narrow2(src, g0, g, n0, n)


def read_zeros(config: Int4Config, src: WeightSource, n0: int, n: int, g0: int, g: int) -> torch.Tensor:
    """``[g, n]`` uint8 codes: ``w = (code - zero) * scale``."""
    c0, c = _packed_range(n0, n, "output features")
    if config.method == "compressed-tensors":
        return unpack_cols(_narrow2(src, c0, c, g0, g).t().contiguous(), SEQUENTIAL)
    order = AWQ_REVERSE_ORDER if config.method == "awq" else SEQUENTIAL
    zeros = unpack_cols(_narrow2(src, g0, g, c0, c), order)
    if config.zeros_minus_one:
        zeros = (zeros + 1) & 0xF  # GPTQ v1 (AutoGPTQ's own unpacking: zeros + 1, then the 4-bit mask)
    return zeros
