"""The large-M path of the int4 linear layer (``kernels.int4_dequant``), under the Triton interpreter on CPU:
the dequantization equals ``dequantize_int4`` bit for bit for every layout the loader produces (group 128 and
channel-wise, symmetric and asymmetric, act-order g_idx), every scale and output dtype and both output
layouts; dequant + ``F.linear`` equals the GEMM reference exactly. The GPU checks at the 8B shapes (and from a
CUDA graph) are in ``test_int4_gemm.py``, which the GPU session runs."""

from __future__ import annotations

import pytest
import torch

from kernels.int4_dequant import (
    DequantConfig,
    DequantScratch,
    dequantize_int4,
    int4_dequant,
    int4_dequant_linear,
    pack_int4,
)
from kernels.int4_gemm import int4_gemm_ref
from tests.kernels.helpers import DEVICE


def _packed(
    k: int, n: int, group_size: int, act_order: bool, symmetric: bool, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """qweight, scales and zeros [groups, N] (all 8 if symmetric), g_idx [K] or None, on DEVICE."""
    num_groups = k // group_size
    qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen))
    scales = (0.01 + 0.05 * torch.rand(num_groups, n, generator=gen)).to(dtype)
    zeros = torch.randint(0, 16, (num_groups, n), generator=gen).to(torch.uint8)
    if symmetric:
        zeros.fill_(8)
    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // group_size).to(torch.int32) if act_order else None
    return qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE), g_idx.to(DEVICE) if g_idx is not None else None


DEQUANT_CASES = [
    # (k, n, group_size, act_order, symmetric, config): the layouts the loader produces from AWQ, GPTQ and
    # compressed-tensors (group 128 or channel-wise, symmetric or not, g_idx) and tiles that do not fit
    (256, 48, 128, False, False, None),  # group 128: one scale row per tile
    (256, 48, 128, False, True, None),
    (200, 40, 200, False, True, None),  # channel-wise (group = K), K and N not multiples of the tile
    (256, 160, 256, False, False, DequantConfig(block_n=64, unpack_in_registers=False)),  # 3 column tiles
    (128, 48, 32, True, False, None),  # GPTQ act-order: groups gathered through g_idx
    (192, 48, 96, False, False, DequantConfig(block_k=32)),  # group 96: per-feature gather
]


# (scales' dtype, layout, output dtype): a new tensor in the scales' dtype, or into [N, K] / a [K, N] buffer's
# transpose in another dtype (two roundings, as the reference; fp32 -> bf16 is what the interpreter's cast truncates)
DEQUANT_OUTPUTS = [
    (torch.bfloat16, "new", None),
    (torch.float16, "new", None),
    (torch.float32, "nk", torch.bfloat16),
    (torch.float16, "kn", torch.bfloat16),
    (torch.bfloat16, "kn", torch.float32),
]


@pytest.mark.parametrize(("dtype", "layout", "out_dtype"), DEQUANT_OUTPUTS)
@pytest.mark.parametrize(("k", "n", "group_size", "act_order", "symmetric", "config"), DEQUANT_CASES)
def test_triton_dequant_equals_reference_exactly(
    dtype: torch.dtype,
    layout: str,
    out_dtype: torch.dtype | None,
    k: int,
    n: int,
    group_size: int,
    act_order: bool,
    symmetric: bool,
    config: DequantConfig | None,
    gen: torch.Generator,
) -> None:
    """Every element, NaN-poisoned output memory included (the fixture): the kernel writes all of it."""
    qweight, scales, zeros, g = _packed(k, n, group_size, act_order, symmetric, dtype, gen)
    out = None
    if out_dtype is not None:
        out = torch.empty((n, k) if layout == "nk" else (k, n), dtype=out_dtype, device=DEVICE)
        out = out if layout == "nk" else out.t()
    got = int4_dequant(qweight, scales, zeros, group_size, g, out=out, config=config)
    want = dequantize_int4(qweight, scales, zeros, group_size, g)
    assert got.shape == (n, k) and (out is None or got is out)
    assert torch.equal(got, want.to(got.dtype))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("group_size", "act_order"), [(128, False), (256, False), (32, True)])
def test_dequant_linear_equals_the_reference(
    x_dtype: torch.dtype, group_size: int, act_order: bool, gen: torch.Generator
) -> None:
    """Dequantized into the scratch, then F.linear: the GEMM reference (dequantize, F.linear) bit for bit;
    fp32 scales under bf16 activations round twice, as the reference does."""
    qweight, scales, zeros, g = _packed(256, 48, group_size, act_order, False, torch.float32, gen)
    scratch = DequantScratch()
    scratch.reserve(64, 512)  # a larger layer: this one uses the front of the buffer
    for m in (1, 130):
        x = torch.randn(m, 256, generator=gen).to(x_dtype).to(DEVICE)
        out = int4_dequant_linear(x, qweight, scales, zeros, group_size, g, scratch=scratch)
        assert torch.equal(out, int4_gemm_ref(x, qweight, scales, zeros, group_size, g))
    assert scratch.num_bytes() == 64 * 512 * x.element_size()  # allocated once, for the reserved shape


def test_dequant_rejects_bad_inputs(gen: torch.Generator) -> None:
    qweight, scales, zeros, _ = _packed(128, 48, 32, False, False, torch.float32, gen)
    with pytest.raises(ValueError, match=r"out must be \[48, 128\]"):
        int4_dequant(qweight, scales, zeros, 32, out=torch.empty(128, 48, device=DEVICE))
    with pytest.raises(ValueError, match="zeros must be uint8"):
        int4_dequant(qweight, scales, zeros.to(torch.int32), 32)
    with pytest.raises(ValueError, match=r"x must be \[M, 128\]"):
        int4_dequant_linear(torch.randn(2, 136, device=DEVICE), qweight, scales, zeros, 32, scratch=DequantScratch())
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        DequantConfig(block_k=48)
