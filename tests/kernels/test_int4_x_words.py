"""The int4 GEMV's bf16 activations loaded as int32 pairs (``Int4GemmConfig.x_words``, ``kernels.int4_plan.
GEMV_X_WORDS``): under the interpreter on CPU the GEMV gives the same bits as with bf16 loads (the deterministic
``counter`` reduction), on both tiles the plan uses at M = 1 and at several rows; x that cannot be read as pairs
(strided, fp16, odd offsets) keeps its loads and still equals the reference; the sm_90 compile loads int32 pairs.
On a GPU: the 8B shapes at M = 1 against the reference and against bf16 loads."""

from __future__ import annotations

import pytest
import torch

from kernels.int4_config import Int4GemmConfig
from kernels.int4_gemm import int4_gemm, int4_gemm_ref
from kernels.int4_gemv import _words_fit
from kernels.int4_plan import pick_config
from tests.kernels.helpers import DEVICE, int4_weights, rel_err, tolerance, ttgir_sm90

# (block_n, num_warps): the default tile and the one-warp wide tile of kernels.int4_plan
TILES = [(256, 4), (256, 1)]


def _weights(k: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, qweight, scales, zeros, _ = int4_weights(k, n, 128, False, torch.bfloat16, gen)
    return qweight.to(DEVICE), scales.to(DEVICE), zeros.to(DEVICE)


@pytest.mark.parametrize("tile", TILES, ids=["w4", "w1"])
@pytest.mark.parametrize("subnormal", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_pairs_give_the_bits_of_bf16_loads(
    tile: tuple[int, int], subnormal: bool, m: int, gen: torch.Generator
) -> None:
    qweight, scales, zeros = _weights(256, 512, gen)
    x = torch.randn(m, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    base = Int4GemmConfig(
        kernel="gemv", block_n=tile[0], num_warps=tile[1], split_k=2, split_reduce="counter", subnormal=subnormal
    )
    loads = int4_gemm(x, qweight, scales, zeros, 128, config=base)
    pairs = int4_gemm(x, qweight, scales, zeros, 128, config=Int4GemmConfig(**{**base.__dict__, "x_words": True}))
    assert torch.equal(pairs, loads)
    assert rel_err(pairs, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("case", ["strided", "fp16", "odd_offset"])
def test_x_that_cannot_be_paired_keeps_its_loads(case: str, gen: torch.Generator) -> None:
    qweight, scales, zeros = _weights(256, 256, gen)
    wide = torch.randn(2, 513, generator=gen).to(torch.bfloat16).to(DEVICE)
    x = {"strided": wide[:, :512:2], "fp16": wide[:, :256].half(), "odd_offset": wide[:, 1:257]}[case]
    if case == "fp16":
        scales = scales.half()
    out = int4_gemm(x, qweight, scales, zeros, 128, config=Int4GemmConfig(kernel="gemv", x_words=True))
    assert rel_err(out, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(x.dtype)


def test_which_x_loads_as_pairs() -> None:
    """Pairs where x is bf16 with unit stride along K, 4-byte aligned rows and whole K tiles; the plan passes the
    request on (on by default, off where asked)."""
    wide = torch.zeros(2, 514, dtype=torch.bfloat16)
    assert _words_fit(wide[:, :256], 256, 64)
    assert not _words_fit(wide[:, :512:2], 256, 64)  # strided
    assert not _words_fit(wide[:, 1:257], 256, 64)  # rows start 2 bytes in
    assert not _words_fit(torch.zeros(2, 513, dtype=torch.bfloat16)[:, :256], 256, 64)  # odd row stride
    assert not _words_fit(wide[:, :256].half(), 256, 64)
    assert not _words_fit(wide[:, :96], 96, 64)  # a partial K tile
    assert not pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(x_words=False), False).x_words
    assert pick_config(1, 4096, 4096, 128, 132, Int4GemmConfig(x_words=True), False).x_words


def test_sm90_compile_loads_int32_pairs() -> None:
    constexprs: dict[str, object] = {
        "GROUP_SIZE": 128, "HAS_G_IDX": False, "FACTORED": True, "ONE_GROUP_PER_TILE": True, "SUBNORMAL": False,
        "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 2, "SPLIT_MODE": 2, "SPLIT_CHUNK": 1, "EVEN": True,
        "GATED": False,
    }  # fmt: skip
    assert "tensor<1x8x4x!tt.ptr<i32>" in ttgir_sm90("gemv", {**constexprs, "X_WORDS": True}, 4)
    assert "tensor<1x8x4x!tt.ptr<i32>" not in ttgir_sm90("gemv", constexprs, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 4096), (28672, 4096)])
def test_pairs_at_the_8b_shapes(n: int, k: int, gen: torch.Generator) -> None:
    """The plan's own M = 1 launch with pairs, at qkv, o and gate_up (down is gated: it keeps its loads)."""
    qweight, scales, zeros = _weights(k, n, gen)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16).cuda()
    pairs = int4_gemm(x, qweight, scales, zeros, 128, config=Int4GemmConfig(x_words=True))
    loads = int4_gemm(x, qweight, scales, zeros, 128, config=Int4GemmConfig(x_words=False))
    assert rel_err(pairs, int4_gemm_ref(x, qweight, scales, zeros, 128)) < tolerance(torch.bfloat16)
    # the same fp32 sums but for the atomics' order, which can tip an output's bf16 rounding by one unit (H100,
    # Session 37: o's rel err 5.8e-5 against loads): each output within one bf16 unit of the other's
    torch.testing.assert_close(pairs, loads, rtol=2**-7, atol=1e-3)
