"""The wgmma int4 GEMM (``kernels.int4_gemm_wgmma``, Gluon). No interpreter runs Gluon: on CPU, the plan's tiles and
refusals, ``int4_gemm`` falling back to tl.dot, and the kernel compiled for sm_90 with the weights reaching the MMA
without a layout conversion (``assert_trivial``), no spills and the warpgroup MMA in the code. On an H200: the 8B
shapes at 16-512 rows against the reference and the exact product, other dtypes, groups and tails, and replays from
a CUDA graph."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.int4_config import Int4GemmConfig
from kernels.int4_gemm import int4_gemm, int4_gemm_ref
from kernels.int4_gemm_wgmma import gluon
from kernels.int4_plan import pick_config
from tests.kernels.helpers import DEVICE, dequantized_int4, gluon_sm90, packed_int4, rel_err, tolerance

WGMMA = Int4GemmConfig(kernel="wgmma")
ROOT = Path(__file__).resolve().parents[2]
HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an sm_90 GPU"
)


def test_pick_config() -> None:
    picks = {m: pick_config(m, 4096, 4096, 128, 132, WGMMA) for m in (5, 16, 33, 64, 300)}
    assert {m: (p.kernel, p.block_m, p.block_n, p.block_k) for m, p in picks.items()} == {
        5: ("wgmma", 8, 64, 128),
        16: ("wgmma", 16, 64, 128),
        33: ("wgmma", 64, 64, 128),
        64: ("wgmma", 64, 64, 128),
        300: ("wgmma", 64, 64, 128),
    }
    assert all(p.split_reduce == ("atomic" if p.split_k > 1 else "counter") and not p.factored for p in picks.values())
    assert pick_config(64, 4096, 4096, 32, 132, WGMMA).block_k == 32  # inside a group of 32
    assert pick_config(64, 4096, 4096, 128, 132, WGMMA, has_g_idx=True).kernel == "dot"  # act-order
    assert pick_config(64, 4096, 4096, 8, 132, WGMMA).kernel == "dot"  # groups narrower than the permutation
    auto = Int4GemmConfig()  # the default at WGMMA_M rows; a deterministic sum asked for: tl.dot
    assert [pick_config(m, 4096, 4096, 128, 132, auto).kernel for m in (16, 17, 128, 129)] == [
        "mma",
        "wgmma",
        "wgmma",
        "dot",
    ]
    assert pick_config(64, 4096, 4096, 128, 132, Int4GemmConfig(split_reduce="counter")).kernel == "dot"
    with pytest.raises(ValueError, match="atomics only"):
        pick_config(64, 4096, 4096, 128, 132, Int4GemmConfig(kernel="wgmma", split_reduce="counter"))
    with pytest.raises(ValueError, match="tile"):
        pick_config(64, 4096, 4096, 128, 132, Int4GemmConfig(kernel="wgmma", block_n=32))
    two = pick_config(300, 4096, 4096, 128, 132, Int4GemmConfig(kernel="wgmma", num_warps=8, block_n=128))
    assert (two.num_warps, two.block_n) == (8, 128)
    assert pick_config(300, 4096, 4096, 128, 132, WGMMA).num_warps == 4  # WGMMA_WARPS
    with pytest.raises(ValueError, match="64 columns a warpgroup"):
        pick_config(64, 4096, 4096, 128, 132, Int4GemmConfig(kernel="wgmma", num_warps=8))  # 64 columns, 2 groups
    with pytest.raises(ValueError, match="4 or 8 warps"):
        pick_config(64, 4096, 4096, 128, 132, Int4GemmConfig(kernel="wgmma", num_warps=2))
    with pytest.raises(TypeError, match="loop"):  # the pipelined K loops lost (Session 33) and were removed
        Int4GemmConfig(kernel="wgmma", loop="async")  # type: ignore[call-arg]


def test_int4_gemm_without_hopper_runs_tl_dot(gen: torch.Generator) -> None:
    """Where the kernel can't run (no GPU here, under the interpreter), ``kernel="wgmma"`` gets tl.dot's result."""
    if DEVICE.type == "cuda":
        pytest.skip("the fallback is for machines without a GPU")
    qweight, scales, zeros = packed_int4(128, 48, 32, torch.float32, gen)
    x = torch.randn(20, 128, generator=gen)
    out = int4_gemm(x, qweight, scales, zeros, 32, config=WGMMA)
    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 32)) < tolerance(torch.float32)


@pytest.mark.skipif(gluon is None, reason="needs a Triton with Gluon")
@pytest.mark.parametrize(
    ("is_bf16", "block_m", "block_n", "block_k", "group", "split", "warps"),
    [
        (True, 64, 64, 128, 128, 4, 4),  # the default tile
        (False, 32, 128, 128, 128, 1, 4),
        (True, 16, 64, 32, 32, 2, 4),
        (False, 128, 128, 64, 128, 1, 8),
        (True, 64, 128, 128, 128, 2, 8),  # two warpgroups sharing x's tile
    ],
)
def test_compiles_for_sm90_with_the_weights_in_registers(
    is_bf16: bool, block_m: int, block_n: int, block_k: int, group: int, split: int, warps: int
) -> None:
    """``assert_trivial`` fails the compile if the dequantized codes need data movement to reach the MMA's A operand;
    one warpgroup MMA per 16 k's and 64 output features of each warpgroup's part of the tile; no spills, and the
    MMAs not serialized by ptxas (C7514)."""
    constexprs = {"GROUP_SIZE": group, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT": split,
                  "EVEN_N": True, "IS_BF16": is_bf16, "num_warps": warps}  # fmt: skip
    report = gluon_sm90("kernels.int4_gemm_wgmma", "_int4_gemm_wgmma_kernel", constexprs)
    assert "0 bytes spill stores" in report, report
    assert "C7514" not in report, report
    assert report.count("HGMMA") == block_k // 16 * block_n // (16 * warps)


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], ids=["qkv", "o", "gate_up", "down"]
)
@pytest.mark.parametrize(
    "cfg", [WGMMA, Int4GemmConfig(kernel="wgmma", block_n=128, num_warps=8)], ids=["default", "w8"]
)
def test_8b_shapes_on_the_gpu(n: int, k: int, cfg: Int4GemmConfig, gen: torch.Generator) -> None:
    """16-512 rows (row tiles, partial last ones), twice each (the in-kernel reduction's races show only here):
    within bf16's tolerance of the reference, and of the exact product of the dequantized weights (only the fp32
    sums' order differs from it). The default launch, and two warpgroups a program."""
    qweight, scales, zeros = packed_int4(k, n, 128, torch.bfloat16, gen)
    w = dequantized_int4(qweight, scales, zeros, 128).double()
    for m in (16, 40, 64, 100, 256, 512):
        for _ in range(2):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
            out = int4_gemm(x, qweight, scales, zeros, 128, config=cfg)
            assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16), m
            assert rel_err(out, (x.double() @ w).float()) < 1e-2, m


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize(
    ("dtype", "m", "n", "group_size", "cfg"),
    [
        (torch.float16, 64, 4096, 128, WGMMA),
        (torch.bfloat16, 37, 1000, 32, WGMMA),  # narrow groups, an N tail, a partial row tile
        (torch.bfloat16, 200, 4096, 128, Int4GemmConfig(kernel="wgmma", split_k=1)),  # no split: stores directly
        (torch.bfloat16, 130, 4096, 4096, WGMMA),  # channel-wise
        (torch.float16, 96, 4096, 128, Int4GemmConfig(kernel="wgmma", block_m=128, block_n=128, block_k=128)),
        (torch.bfloat16, 8, 4096, 128, WGMMA),
        (torch.bfloat16, 100, 1000, 64, WGMMA),
        (torch.float16, 40, 4096, 4096, Int4GemmConfig(kernel="wgmma", split_k=3)),
        (torch.bfloat16, 200, 4096, 32, Int4GemmConfig(kernel="wgmma", split_k=1)),  # one K tile a program
        (torch.bfloat16, 37, 1000, 32, Int4GemmConfig(kernel="wgmma", block_n=128, num_warps=8)),
        (
            torch.float16,
            300,
            4096,
            128,
            Int4GemmConfig(kernel="wgmma", block_m=128, block_k=64, block_n=128, num_warps=8),
        ),
        (torch.bfloat16, 130, 4096, 128, Int4GemmConfig(kernel="wgmma", block_n=128, num_warps=8)),
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
@HOPPER
def test_replayed_from_a_cuda_graph(gen: torch.Generator) -> None:
    """down_proj at 128 rows captured after one eager call and replayed with new activations (counters back to 0)."""
    qweight, scales, zeros = packed_int4(14336, 4096, 128, torch.bfloat16, gen)
    x = torch.zeros(128, 14336, dtype=torch.bfloat16, device=DEVICE)
    int4_gemm(x, qweight, scales, zeros, 128, config=WGMMA)  # compiles, grows the shared scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemm(x, qweight, scales, zeros, 128, config=WGMMA)
    for _ in range(3):
        x.copy_(torch.randn(128, 14336, generator=gen).to(torch.bfloat16))
        graph.replay()
        assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)


def test_switched_off_by_environment() -> None:
    """``PAGEDSERVE_INT4_WGMMA=0``: tl.dot at 17-64 rows, and the linear layer dequantizes from 65 again."""
    script = (
        "from kernels.int4_config import Int4GemmConfig\nfrom kernels.int4_plan import pick_config\n"
        "print(pick_config(64, 4096, 4096, 128, 132, Int4GemmConfig()).kernel)\n"
    )
    env = {**os.environ, "PAGEDSERVE_INT4_WGMMA": "0"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "dot"


def test_the_linear_layer_dequantizes_only_past_the_wgmma_rows() -> None:
    """``Int4LinearMethod.dequantizes``: from DEQUANT_MIN_M rows the layer's weight goes dense for cuBLAS, except at
    the rows the wgmma GEMM takes where it can run (an sm_90 GPU, bf16/fp16, no g_idx)."""
    from types import SimpleNamespace

    from engine.quantization.config import Int4Config
    from engine.quantization.int4_linear import Int4LinearMethod
    from kernels.int4_dequant import DEQUANT_MIN_M
    from kernels.int4_plan import WGMMA_M

    method = Int4LinearMethod(Int4Config("awq", 128, True, False))
    hopper = DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] == 9
    layer = SimpleNamespace(group_size=128, g_idx=None)
    for m, wgmma_rows in (
        (DEQUANT_MIN_M - 1, False),
        (DEQUANT_MIN_M, True),
        (WGMMA_M[1], True),
        (WGMMA_M[1] + 1, False),
    ):
        x = torch.zeros(m, 256, dtype=torch.bfloat16, device=DEVICE)
        assert method.dequantizes(layer, x) == (m >= DEQUANT_MIN_M and not (wgmma_rows and hopper)), m
    act_order = SimpleNamespace(group_size=128, g_idx=torch.zeros(256, dtype=torch.int32))
    assert method.dequantizes(act_order, torch.zeros(WGMMA_M[1], 256, dtype=torch.bfloat16, device=DEVICE))
