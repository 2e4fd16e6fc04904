"""The W4A16 GEMM: the torch reference equals dequantize-then-matmul exactly (fp32), and the Triton kernel
(under the interpreter on CPU) equals the reference on tiny shapes: decode-sized M with split-K, prefill-sized
M, groups, channel-wise scales, GPTQ act-order g_idx, strided activations, N not a multiple of the tile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.int4_gemm import Int4GemmConfig, dequantize_int4, int4_gemm, int4_gemm_ref, pack_int4, unpack_int4
from tests.kernels.helpers import DEVICE, rel_err, tolerance

K, N = 128, 48


def _weights(
    k: int, n: int, group_size: int, act_order: bool, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """codes [K, N], qweight, scales and zeros [groups, N], g_idx [K] or None."""
    codes = torch.randint(0, 16, (k, n), generator=gen)
    num_groups = k // group_size
    scales = (0.01 + 0.05 * torch.rand(num_groups, n, generator=gen)).to(dtype)
    zeros = torch.randint(0, 16, (num_groups, n), generator=gen).to(torch.uint8)
    g_idx = (torch.argsort(torch.randperm(k, generator=gen)) // group_size).to(torch.int32) if act_order else None
    return codes, pack_int4(codes), scales, zeros, g_idx


def test_pack_unpack_round_trip(gen: torch.Generator) -> None:
    codes = torch.randint(0, 16, (64, 24), generator=gen)
    qweight = pack_int4(codes)
    assert qweight.dtype == torch.int32 and qweight.shape == (8, 24)
    assert torch.equal(unpack_int4(qweight).long(), codes)
    # nibble j of word i is row 8 i + j
    assert int(qweight[1, 3]) & 0xFFFFFFFF == sum(int(codes[8 + j, 3]) << (4 * j) for j in range(8))


@pytest.mark.parametrize(
    ("group_size", "act_order"), [(32, False), (K, False), (32, True)], ids=["g32", "channel", "g_idx"]
)
def test_reference_equals_dequantize_then_matmul_exactly(
    group_size: int, act_order: bool, gen: torch.Generator
) -> None:
    codes, qweight, scales, zeros, g_idx = _weights(K, N, group_size, act_order, torch.float32, gen)
    groups = g_idx.long() if g_idx is not None else torch.arange(K) // group_size
    # written out element by element: w[n, k] = (code[k, n] - zero[g(k), n]) * scale[g(k), n]
    w = torch.empty(N, K)
    for k in range(K):
        g = int(groups[k])
        w[:, k] = (codes[k] - zeros[g].long()).float() * scales[g]
    assert torch.equal(dequantize_int4(qweight, scales, zeros, group_size, g_idx), w)
    x = torch.randn(7, K, generator=gen)
    assert torch.equal(int4_gemm_ref(x, qweight, scales, zeros, group_size, g_idx), F.linear(x, w))


CASES = [
    # (m, group_size, act_order, config)
    (1, 32, False, None),  # decode: split-K picked
    (3, 32, False, Int4GemmConfig(split_k=1)),
    (5, 32, True, None),
    (16, K, False, Int4GemmConfig(split_k=4, block_k=32)),  # channel-wise, split-K over several groups
    (33, 64, False, Int4GemmConfig(block_k=16)),  # 4 tiles per group: scale rows gathered per tile
    (70, 32, False, None),  # prefill tile
    (1, 32, False, Int4GemmConfig(unpack_in_registers=True)),
    (40, 32, True, Int4GemmConfig(unpack_in_registers=True, split_k=3, block_k=16)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "group_size", "act_order", "config"), CASES)
def test_triton_matches_reference(
    dtype: torch.dtype, m: int, group_size: int, act_order: bool, config: Int4GemmConfig | None, gen: torch.Generator
) -> None:
    _, qweight, scales, zeros, g_idx = _weights(K, N, group_size, act_order, dtype, gen)
    x_wide = torch.randn(m, 2 * K, generator=gen).to(dtype)
    x = x_wide[:, ::2]  # strided along K
    x, qweight, scales, zeros = (t.to(DEVICE) for t in (x, qweight, scales, zeros))
    g = g_idx.to(DEVICE) if g_idx is not None else None
    out = int4_gemm(x, qweight, scales, zeros, group_size, g, config=config)
    ref = int4_gemm_ref(x, qweight, scales, zeros, group_size, g)
    assert out.dtype == dtype and out.shape == (m, N)
    assert rel_err(out, ref) < tolerance(dtype)


def test_wrapper_rejects_bad_inputs(gen: torch.Generator) -> None:
    _, qweight, scales, zeros, _ = _weights(K, N, 32, False, torch.float32, gen)
    x = torch.randn(2, K)
    with pytest.raises(ValueError, match="qweight must be int32"):
        int4_gemm(x, qweight.to(torch.int64), scales, zeros, 32)
    with pytest.raises(ValueError, match="qweight must be int32"):
        int4_gemm(torch.randn(2, K + 8), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        int4_gemm(x, qweight, scales, zeros.to(torch.int32), 32)
    with pytest.raises(ValueError, match="group_size 64"):
        int4_gemm(x, qweight, scales, zeros, 64)
    with pytest.raises(ValueError, match="x must be float16"):
        int4_gemm(x.to(torch.int32), qweight, scales, zeros, 32)
    with pytest.raises(ValueError, match="contiguous along N"):
        int4_gemm(x, qweight, scales.t().contiguous().t(), zeros, 32)
    with pytest.raises(ValueError, match="g_idx must be int32"):
        int4_gemm(x, qweight, scales, zeros, 32, torch.zeros(K, dtype=torch.int64))
