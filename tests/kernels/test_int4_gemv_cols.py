"""gemv_cols (``kernels.int4_gemv_cols``) against the torch reference (interpreter on CPU): M = 1..8,
symmetric and asymmetric zeros, group 32 and channel-wise, the loader's layout and the GEMV-tiled one (an N
tail padded), both split reductions, paired and unpaired nibbles; the tiling is a pure permutation; what
pick_config gives it. On a GPU: the default tiles at the 8B shapes, and replays from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kernels.int4_config import Int4GemmConfig
from kernels.int4_dequant import pack_int4
from kernels.int4_gemm import int4_gemm, int4_gemm_ref
from kernels.int4_gemv_cols import tile_qweight
from kernels.int4_plan import GEMV_COLS_LIMIT_M, pick_config
from kernels.int4_split import zeroed_scratch
from tests.kernels.helpers import DEVICE, rel_err, tolerance

K = 128


def _weights(
    k: int, n: int, group_size: int, symmetric: bool, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (k, n), generator=gen)
    groups = k // group_size
    scales = (0.01 + 0.05 * torch.rand(groups, n, generator=gen)).to(dtype)
    zeros = torch.full((groups, n), 8) if symmetric else torch.randint(0, 16, (groups, n), generator=gen)
    return pack_int4(codes).to(DEVICE), scales.to(DEVICE), zeros.to(torch.uint8).to(DEVICE)


# Each layout takes three of the cases (both took all six: twice the interpreter time, for no path these miss):
# in each, both split reductions and paired and unpaired nibbles; the tiled one also pads an N tail (40).
@pytest.mark.parametrize(
    ("m", "n", "group_size", "symmetric", "split_reduce", "paired", "tiled"),
    [
        (1, 48, 32, False, "atomic", True, False),
        (1, 48, 32, True, "counter", False, True),
        (2, 32, K, True, "counter", True, True),  # channel-wise
        (3, 32, 64, False, "atomic", False, False),
        (5, 40, 32, True, "atomic", True, True),
        (8, 32, 64, False, "counter", False, False),
    ],
)
def test_matches_reference(
    m: int,
    n: int,
    group_size: int,
    symmetric: bool,
    split_reduce: str,
    paired: bool,
    tiled: bool,
    gen: torch.Generator,
) -> None:
    qweight, scales, zeros = _weights(K, n, group_size, symmetric, torch.float32, gen)
    x = torch.randn(m, K, generator=gen).to(DEVICE)
    cfg = Int4GemmConfig(
        kernel="gemv_cols",
        block_n=16,
        block_k=32,
        split_reduce=split_reduce,  # type: ignore[arg-type]
        paired_nibbles=paired,
    )
    w = tile_qweight(qweight, 16) if tiled else qweight
    out = int4_gemm(x, w, scales, zeros, group_size, config=cfg)
    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, group_size)) < tolerance(torch.float32)
    assert not zeroed_scratch(x.device, torch.float32, 1).any()  # the atomic accumulator handed back zeroed


def test_bf16_activations_with_the_default_tiles(gen: torch.Generator) -> None:
    """The pick_config tiles (block_n 1024 at M = 1) on a narrow N: one masked column tile."""
    qweight, scales, zeros = _weights(K, 40, 32, False, torch.bfloat16, gen)
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = int4_gemm(x, qweight, scales, zeros, 32, config=Int4GemmConfig(kernel="gemv_cols"))
    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 32)) < tolerance(torch.bfloat16)


def test_tile_qweight_is_a_permutation_of_the_words(gen: torch.Generator) -> None:
    qweight = torch.randint(-(2**31), 2**31 - 1, (16, 40), generator=gen, dtype=torch.int32)
    tiled = tile_qweight(qweight, 16)  # [3, 16, 16]: 40 columns padded to 48
    assert tiled.shape == (3, 16, 16) and tiled.is_contiguous()
    assert torch.equal(tiled.permute(1, 0, 2).reshape(16, 48)[:, :40], qweight)
    assert not tiled[2, :, 8:].any()


def test_pick_config() -> None:
    auto = Int4GemmConfig(kernel="gemv_cols")
    one = pick_config(1, 28672, 4096, 128, 132, auto)  # 28 column tiles
    assert (one.kernel, one.block_n, one.block_k, one.factored, one.paired_nibbles) == (
        "gemv_cols",
        1024,
        64,
        True,
        True,
    )
    assert one.split_k == 10  # 280 programs: ~GEMV_COLS_PROGRAMS_PER_SM (2) per SM
    assert pick_config(1, 4096, 4096, 128, 132, auto).split_k == 64  # one K tile per program at most
    assert pick_config(1, 4096, 4096, 96, 132, auto).block_k == 32  # tiles inside a group of 96
    assert pick_config(1, 4096, 4096, 128, 132, auto, has_g_idx=True).kernel == "gemv"  # exact path
    more = pick_config(1, 28672, 4096, 128, 132, Int4GemmConfig(kernel="gemv_cols", programs_per_sm=4))
    assert more.split_k == 16  # 19 asked: 4 K tiles per program
    # "balance": qkv's 6 column tiles x 22 splits of 3 K tiles (the last 1) fill the 132 SMs once, where
    # "fill" gives 6 x 32 = 192 programs (2 on some SMs, 1 on others); gate_up at most 2 per SM: 28 x 4
    balance = Int4GemmConfig(kernel="gemv_cols", split_policy="balance")
    assert pick_config(1, 6144, 4096, 128, 132, auto).split_k == 32
    assert pick_config(1, 6144, 4096, 128, 132, balance).split_k == 22
    assert pick_config(1, 28672, 4096, 128, 132, balance).split_k == 4
    with pytest.raises(ValueError, match="split_policy"):
        Int4GemmConfig(split_policy="even")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holds all M rows"):
        pick_config(GEMV_COLS_LIMIT_M + 1, 4096, 4096, 128, 132, auto)


def test_tiled_weight_rejects_other_uses(gen: torch.Generator) -> None:
    qweight, scales, zeros = _weights(K, 32, 32, False, torch.float32, gen)
    x = torch.randn(2, K, generator=gen).to(DEVICE)
    tiled = tile_qweight(qweight, 16)
    with pytest.raises(ValueError, match="ceil"):
        int4_gemm(x, tile_qweight(qweight, 8)[:3], scales, zeros, 32)
    with pytest.raises(ValueError, match="gemv_cols only"):
        int4_gemm(torch.randn(9, K).to(DEVICE), tiled, scales, zeros, 32)
    with pytest.raises(ValueError, match="gemv_cols only"):
        int4_gemm(x, tiled, scales, zeros, 32, torch.zeros(K, dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (28672, 4096), (4096, 14336)], ids=["qkv", "gate_up", "down"])
def test_8b_shapes_on_the_gpu(n: int, k: int, gen: torch.Generator) -> None:
    """The default tiles at M = 1, 2, 4, 8 (paired at M <= 2), loader and tiled layouts, both reductions,
    a few times each (the in-kernel reduction races only show on a GPU)."""
    qweight, scales, zeros = _weights(k, n, 128, False, torch.bfloat16, gen)
    for m in (1, 2, 4, 8):
        for split_reduce in ("atomic", "counter"):
            cfg = Int4GemmConfig(kernel="gemv_cols", split_reduce=split_reduce)  # type: ignore[arg-type]
            tiled = tile_qweight(qweight, pick_config(m, n, k, 128, 132, cfg).block_n)
            for w in (qweight, tiled):
                for _ in range(3):
                    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(DEVICE)
                    out = int4_gemm(x, w, scales, zeros, 128, config=cfg)
                    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4])
def test_replayed_from_a_cuda_graph(m: int, gen: torch.Generator) -> None:
    """down_proj captured after one eager call and replayed with new activations (counters back to zero)."""
    qweight, scales, zeros = _weights(14336, 4096, 128, False, torch.bfloat16, gen)
    cfg = Int4GemmConfig(kernel="gemv_cols")
    x = torch.zeros(m, 14336, dtype=torch.bfloat16, device=DEVICE)
    int4_gemm(x, qweight, scales, zeros, 128, config=cfg)  # compiles, grows the shared scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_gemm(x, qweight, scales, zeros, 128, config=cfg)
    for _ in range(5):
        x.copy_(torch.randn(m, 14336, generator=gen).to(torch.bfloat16))
        graph.replay()
        assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)
