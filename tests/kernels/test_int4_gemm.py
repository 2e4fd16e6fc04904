"""The W4A16 GEMM: the torch reference equals dequantize-then-matmul exactly (fp32), and both Triton kernels
(under the interpreter on CPU) equal the reference on tiny shapes: the GEMV (M <= 16: factored or exact
dequantization) and the tl.dot path, each split-K reduced in the kernel (counter, atomic) or by torch, or not
split; groups (one or several tiles per group, a group that is not a power of two), channel-wise scales,
GPTQ act-order g_idx, asymmetric zeros, strided activations, N not a multiple of the tile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.int4_gemm import (
    GEMV_MAX_M,
    Int4GemmConfig,
    dequantize_int4,
    int4_gemm,
    int4_gemm_ref,
    pack_int4,
    pick_config,
    unpack_int4,
)
from kernels.int4_gemv import zeroed_scratch
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


Cfg = Int4GemmConfig
CASES = [
    # (m, k, n, group_size, act_order, config): the tl.dot path
    (5, K, N, 32, False, None),  # above GEMV_MAX_M: split-K picked, counter reduction
    (3, K, N, 32, False, Cfg(kernel="dot", split_k=1)),
    (5, K, N, 32, True, Cfg(split_reduce="atomic")),
    (16, K, N, K, False, Cfg(split_k=4, block_k=32, split_reduce="torch")),  # channel-wise, split over groups
    (33, K, N, 64, False, Cfg(block_k=16, unpack_in_registers=False)),  # 4 tiles per group, per-row loads
    (70, K, N, 32, False, None),  # prefill tile
    (1, K, N, 32, False, Cfg(kernel="dot", unpack_in_registers=False)),
    (40, K, N, 32, True, Cfg(split_k=3, block_k=16)),
    # the GEMV
    (1, K, N, 32, False, None),  # default: factored, split-K picked, counter reduction
    (1, 2 * K, 40, K, False, Cfg(split_reduce="atomic")),  # channel-wise
    (2, K, N, 32, True, None),  # g_idx: exact dequantization
    (3, K, N, K, False, Cfg(split_k=1)),  # no split
    (4, K, N, 32, False, Cfg(factored=False, split_reduce="torch")),
    (8, K, N, 64, False, Cfg(kernel="gemv", block_n=16, block_k=16, split_k=2)),  # 3 column tiles, 4 per group
    (16, K, N, 32, False, Cfg(kernel="gemv", split_reduce="atomic")),
    (3, 192, N, 96, False, None),  # group 96: 32-wide tiles, 3 per group
    (1, 192, N, 96, True, Cfg(block_k=64, split_k=2)),  # g_idx tile spanning groups
    (2, K, N, 4, False, None),  # groups narrower than a word: exact, scales gathered per feature
    (1, K, 256, 32, False, Cfg(split_k=2)),  # every tile full: the unmasked loads
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "n", "group_size", "act_order", "config"), CASES)
def test_triton_matches_reference(
    dtype: torch.dtype,
    m: int,
    k: int,
    n: int,
    group_size: int,
    act_order: bool,
    config: Int4GemmConfig | None,
    gen: torch.Generator,
) -> None:
    _, qweight, scales, zeros, g_idx = _weights(k, n, group_size, act_order, dtype, gen)
    x_wide = torch.randn(m, 2 * k, generator=gen).to(dtype)
    x = x_wide[:, ::2]  # strided along K
    x, qweight, scales, zeros = (t.to(DEVICE) for t in (x, qweight, scales, zeros))
    g = g_idx.to(DEVICE) if g_idx is not None else None
    out = int4_gemm(x, qweight, scales, zeros, group_size, g, config=config)
    ref = int4_gemm_ref(x, qweight, scales, zeros, group_size, g)
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("split_reduce", ["counter", "atomic"])
@pytest.mark.parametrize("kernel", ["gemv", "dot"])
def test_in_kernel_split_leaves_its_scratch_zeroed(kernel: str, split_reduce: str, gen: torch.Generator) -> None:
    """The arrival counters (and the atomic accumulator) are shared by every call and every captured graph:
    each launch must hand them back zeroed, and a second call gives the same result."""
    _, qweight, scales, zeros, _ = _weights(K, N, 32, False, torch.float32, gen)
    x = torch.randn(4, K, generator=gen)
    x, qweight, scales, zeros = (t.to(DEVICE) for t in (x, qweight, scales, zeros))
    cfg = Int4GemmConfig(kernel=kernel, split_k=4, split_reduce=split_reduce)  # type: ignore[arg-type]
    first = int4_gemm(x, qweight, scales, zeros, 32, config=cfg)
    second = int4_gemm(x, qweight, scales, zeros, 32, config=cfg)
    if split_reduce == "counter":  # partials summed in split order, whatever order the programs finish in
        assert torch.equal(second, first)
    for dtype in (torch.int32, torch.float32):
        assert not zeroed_scratch(x.device, dtype, 1).any()
    assert rel_err(first, int4_gemm_ref(x, qweight, scales, zeros, 32)) < tolerance(torch.float32)


def test_pick_config_routes_small_m_to_the_gemv() -> None:
    auto = Int4GemmConfig()
    assert pick_config(GEMV_MAX_M, 4096, 4096, 128, 132, auto).kernel == "gemv"
    assert pick_config(GEMV_MAX_M + 1, 4096, 4096, 128, 132, auto).kernel == "dot"
    gemv = pick_config(1, 4096, 4096, 128, 132, auto)
    assert gemv.factored and gemv.block_k <= 128 and 4096 // gemv.block_n * gemv.split_k >= 132
    assert not pick_config(1, 4096, 4096, 128, 132, auto, has_g_idx=True).factored
    assert pick_config(1, 4096, 4096, 96, 132, auto).block_k == 32  # tiles inside a group of 96
    assert pick_config(8, 4096, 4096, 128, 132, Int4GemmConfig(kernel="gemv")).block_m == 8
    with pytest.raises(ValueError, match="holds all M rows"):
        pick_config(17, 4096, 4096, 128, 132, Int4GemmConfig(kernel="gemv"))


def test_config_rejects_bad_choices() -> None:
    with pytest.raises(ValueError, match="kernel must be"):
        Int4GemmConfig(kernel="gemm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="split_reduce must be"):
        Int4GemmConfig(split_reduce="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        Int4GemmConfig(block_n=96)
    with pytest.raises(ValueError, match="split_k must be at least 1"):
        Int4GemmConfig(split_k=0)
    with pytest.raises(ValueError, match="tl.dot needs"):
        pick_config(32, 64, 64, 32, 8, Int4GemmConfig(kernel="dot", block_k=8))


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split_reduce", [None, "atomic"])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_real_size_replayed_from_a_cuda_graph(m: int, split_reduce: str | None, gen: torch.Generator) -> None:
    """8B down_proj (K = 14336, split-K) captured in a CUDA graph after one eager call and replayed with new
    activations: the in-kernel reductions must hand their counters back zeroed for every replay."""
    _, qweight, scales, zeros, _ = _weights(14336, 4096, 128, False, torch.bfloat16, gen)
    qweight, scales, zeros = qweight.cuda(), scales.cuda(), zeros.cuda()
    cfg = Int4GemmConfig(split_reduce=split_reduce)  # type: ignore[arg-type]
    x = torch.zeros(m, 14336, dtype=torch.bfloat16, device="cuda")
    int4_gemm(x, qweight, scales, zeros, 128, config=cfg)  # compiles, grows the shared scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemm(x, qweight, scales, zeros, 128, config=cfg)
    for _ in range(5):
        x.copy_(torch.randn(m, 14336, generator=gen).to(torch.bfloat16))
        graph.replay()
        assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)
