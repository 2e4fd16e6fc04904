"""The tensor-core GEMV (``kernels.int4_gemv_mma``, Gluon). No interpreter runs Gluon: on CPU, its k order is a
permutation inside each 32 k's, its torch model of the arithmetic matches the reference, ``int4_gemm`` falls back to
the GEMV, the plan refuses what the kernel can't run, and the kernel compiles for sm_90 with the weights reaching
the MMA without a layout conversion (``assert_trivial``) and without spills. On a GPU: the 8B shapes at M = 1..8,
fp16, narrow groups and an N tail, no split, and replays from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kernels.int4_config import Int4GemmConfig
from kernels.int4_dequant import pack_int4
from kernels.int4_gemm import int4_gemm, int4_gemm_ref
from kernels.int4_gemv_mma import PERMUTE_SPAN, gluon, int4_gemv_mma_ref, mma_position
from kernels.int4_plan import MMA_BLOCK_M, pick_config
from tests.kernels.helpers import DEVICE, dequantized_int4, gluon_sm90, packed_int4, rel_err, tolerance

MMA = Int4GemmConfig(kernel="mma")


def test_mma_position_permutes_inside_each_32_ks() -> None:
    k = torch.arange(4 * PERMUTE_SPAN)
    pos = mma_position(k)
    assert sorted(pos.tolist()) == k.tolist()
    assert torch.equal(pos // PERMUTE_SPAN, k // PERMUTE_SPAN)
    # word 4p + q of lane q: nibbles j and j + 4 (one register's two halves) stand at adjacent positions
    assert torch.equal(mma_position(torch.tensor([8 * 3 + 1, 8 * 3 + 5])), torch.tensor([8 + 6, 8 + 7]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "group_size"), [(1, 64, 128), (3, 48, 64), (8, 32, 32), (2, 40, 256)])
def test_reference_model_matches_dequantize_then_matmul(
    m: int, n: int, group_size: int, dtype: torch.dtype, gen: torch.Generator
) -> None:
    """The kernel's arithmetic (base + code through the MMA, zero and scale per group after) in torch equals
    dequantize-then-matmul up to the rounding the reference does per weight."""
    k = 256
    codes = torch.randint(0, 16, (k, n), generator=gen)
    scales = (0.01 + 0.05 * torch.rand(k // group_size, n, generator=gen)).to(dtype)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=gen).to(torch.uint8)
    x = torch.randn(m, k, generator=gen).to(dtype)
    qweight = pack_int4(codes)
    out = int4_gemv_mma_ref(x, qweight, scales, zeros, group_size)
    groups = torch.arange(k) // group_size
    exact = x.double() @ ((codes - zeros.long()[groups]) * scales.double()[groups])  # no rounding at all
    assert rel_err(out, exact) < 4e-3
    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, group_size)) < tolerance(dtype)


def test_pick_config() -> None:
    launch = pick_config(1, 28672, 4096, 128, 132, MMA)
    assert (launch.kernel, launch.block_k, launch.split_reduce) == ("mma", 128, "atomic")
    assert pick_config(1, 4096, 4096, 32, 132, MMA).block_k == 32
    assert pick_config(4, 4096, 4096, 128, 132, MMA, has_g_idx=True).kernel == "gemv"  # act-order
    assert pick_config(1, 4096, 4096, 8, 132, MMA).kernel == "gemv"  # groups narrower than the permutation
    # more rows: M's power of two up to MMA_BLOCK_M rows a program, the weights dequantized in registers from 16
    picks = {m: pick_config(m, 4096, 4096, 128, 132, MMA) for m in (8, 16, 33, 64, 200)}
    assert {m: (p.block_m, p.factored) for m, p in picks.items()} == {
        8: (8, True),
        16: (16, False),
        33: (MMA_BLOCK_M, False),
        64: (MMA_BLOCK_M, False),
        200: (MMA_BLOCK_M, False),
    }
    assert MMA_BLOCK_M == 16  # the H200 runs of int4_plan.MMA_M
    assert pick_config(64, 4096, 4096, 128, 132, Int4GemmConfig(kernel="mma", factored=True)).factored
    assert pick_config(200, 4096, 4096, 128, 132, Int4GemmConfig(kernel="mma", block_m=32)).block_m == 32
    with pytest.raises(ValueError, match="block_m"):
        pick_config(16, 4096, 4096, 128, 132, Int4GemmConfig(kernel="mma", block_m=4))
    # a deterministic split-K sum asked for: the launch that has one (the MMA sums with atomics)
    assert pick_config(4, 4096, 4096, 128, 132, Int4GemmConfig(split_reduce="counter")).kernel == "gemv"
    assert pick_config(8, 4096, 4096, 128, 132, Int4GemmConfig(split_reduce="counter")).kernel == "dot"
    with pytest.raises(ValueError, match="atomics only"):
        pick_config(4, 4096, 4096, 128, 132, Int4GemmConfig(kernel="mma", split_reduce="counter"))
    with pytest.raises(ValueError, match="block_k"):
        pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(kernel="mma", block_k=16))


def test_int4_gemm_without_gluon_runs_the_gemv(gen: torch.Generator) -> None:
    """Where the kernel can't run (no GPU here, under the interpreter), ``kernel="mma"`` gets the GEMV's result."""
    if DEVICE.type == "cuda":
        pytest.skip("the fallback is for machines without a GPU")
    qweight, scales, zeros = packed_int4(128, 48, 32, torch.float32, gen)
    x = torch.randn(2, 128, generator=gen)
    out = int4_gemm(x, qweight, scales, zeros, 32, config=MMA)
    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 32)) < tolerance(torch.float32)


@pytest.mark.skipif(gluon is None, reason="needs a Triton with Gluon")
@pytest.mark.parametrize(
    ("is_bf16", "group", "block_k", "block_n", "split", "pdl", "block_m", "dequant"),
    [
        (True, 128, 128, 128, 8, True, 8, False),
        (False, 32, 32, 256, 1, False, 8, False),
        (True, 128, 128, 128, 4, True, 16, True),  # the tiles of int4_plan._MMA_TILES above 8 rows
        (False, 128, 64, 128, 4, False, 32, True),
        (True, 128, 64, 128, 2, False, 32, True),  # 64 rows spill (int4_plan._MMA_TILES)
    ],
)
def test_compiles_for_sm90_with_the_weights_in_registers(
    is_bf16: bool, group: int, block_k: int, block_n: int, split: int, pdl: bool, block_m: int, dequant: bool
) -> None:
    """``assert_trivial`` in the kernel fails the compile if the codes need any data movement to reach the MMA;
    with PDL (``kernels.pdl``) both ``griddepcontrol`` instructions are in the PTX."""
    constexprs = {"GROUP_SIZE": group, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT": split, "EVEN_N": True,
                  "IS_BF16": is_bf16, "PDL": pdl, "BLOCK_M": block_m, "DEQUANT_A": dequant,
                  "num_warps": 4}  # fmt: skip
    report = gluon_sm90("kernels.int4_gemv_mma", "_int4_gemv_mma_kernel", constexprs)
    assert "0 bytes spill stores" in report, report
    assert report.count("griddepcontrol") == (2 if pdl else 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], ids=["qkv", "o", "gate_up", "down"]
)
def test_8b_shapes_on_the_gpu(n: int, k: int, gen: torch.Generator) -> None:
    """The default launch at M = 1, 2, 4, 8, a few times each (the in-kernel reduction's races show only here)."""
    qweight, scales, zeros = packed_int4(k, n, 128, torch.bfloat16, gen)
    for m in (1, 2, 4, 8):
        for _ in range(3):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
            out = int4_gemm(x, qweight, scales, zeros, 128, config=MMA)
            assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], ids=["qkv", "o", "gate_up", "down"]
)
def test_8b_shapes_past_8_rows_on_the_gpu(n: int, k: int, gen: torch.Generator) -> None:
    """The default launch at 16-256 rows (row tiles, a partial last one), twice each; the dequantized weights are
    rounded as the reference rounds them, so only the fp32 sums' order differs: a tighter bound than the factored
    form's."""
    qweight, scales, zeros = packed_int4(k, n, 128, torch.bfloat16, gen)
    for m in (16, 24, 64, 100, 256):
        for _ in range(2):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
            out = int4_gemm(x, qweight, scales, zeros, 128, config=MMA)
            ref = int4_gemm_ref(x, qweight, scales, zeros, 128)
            assert rel_err(out, ref) < tolerance(torch.bfloat16), m
            exact = (x.double() @ dequantized_int4(qweight, scales, zeros, 128).double()).float()
            assert rel_err(out, exact) < 1e-2, m


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("dtype", "m", "n", "group_size", "cfg"),
    [
        (torch.float16, 1, 4096, 128, MMA),
        (torch.bfloat16, 3, 1000, 32, MMA),  # narrow groups, an N tail
        (torch.bfloat16, 5, 4096, 128, Int4GemmConfig(kernel="mma", split_k=1)),  # no split: stores directly
        (torch.bfloat16, 1, 4096, 128, Int4GemmConfig(kernel="mma", block_n=128, num_warps=8)),
        (torch.bfloat16, 2, 4096, 4096, MMA),  # channel-wise
        (torch.bfloat16, 4, 1000, 128, Int4GemmConfig(kernel="mma", programs_per_sm=1)),
        (torch.float16, 8, 4096, 64, Int4GemmConfig(kernel="mma", block_n=256, split_k=1)),
        (torch.float16, 40, 1000, 32, MMA),  # dequantized, fp16, narrow groups, an N tail, a partial row tile
        (torch.bfloat16, 64, 4096, 128, Int4GemmConfig(kernel="mma", factored=True)),
        (torch.bfloat16, 130, 4096, 128, Int4GemmConfig(kernel="mma", block_m=16, split_k=1)),
        (torch.bfloat16, 12, 4096, 4096, MMA),  # channel-wise, dequantized
    ],
)
def test_variants_on_the_gpu(
    dtype: torch.dtype, m: int, n: int, group_size: int, cfg: Int4GemmConfig, gen: torch.Generator
) -> None:
    qweight, scales, zeros = packed_int4(4096, n, group_size, dtype, gen)
    x = torch.randn(m, 4096, generator=gen).to(dtype).to(DEVICE)
    out = int4_gemm(x, qweight, scales, zeros, group_size, config=cfg)
    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, group_size)) < tolerance(dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replayed_from_a_cuda_graph(gen: torch.Generator) -> None:
    """down_proj captured after one eager call and replayed with new activations (counters back to zero)."""
    qweight, scales, zeros = packed_int4(14336, 4096, 128, torch.bfloat16, gen)
    x = torch.zeros(1, 14336, dtype=torch.bfloat16, device=DEVICE)
    int4_gemm(x, qweight, scales, zeros, 128, config=MMA)  # compiles, grows the shared scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemm(x, qweight, scales, zeros, 128, config=MMA)
    for _ in range(5):
        x.copy_(torch.randn(1, 14336, generator=gen).to(torch.bfloat16))
        graph.replay()
        assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)
