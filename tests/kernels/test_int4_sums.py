"""A batch-1 GEMV's split-K sums left to the RMSNorm that reads them (``kernels.int4_gemm.int4_gemv_sums``,
``kernels.norm.rms_norm(..., sums=True)``): the GEMV adds its fp32 partials into a zeroed accumulator and stops;
the norm rounds them to the residual's dtype, adds the residual and zeroes the accumulator for the next launch.
Under the interpreter on CPU: the pair equals the GEMV + norm it replaces (the GEMV's own reduction, then
``rms_norm``), for the plain and the gated GEMV, split or not; the accumulator is zero after the norm. On a GPU: the
same at the 8B shapes, replayed from a CUDA graph (a replay reads what the replay before left)."""

from __future__ import annotations

import pytest
import torch

from kernels.int4_config import Int4GemmConfig
from kernels.int4_gemm import int4_gemm, int4_gemm_gated, int4_gemv_sums
from kernels.norm import rms_norm, rms_norm_ref
from tests.kernels.helpers import DEVICE, capture_graph, packed_int4, rel_err, tolerance, ttgir_sm90


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("m", "split_k"), [(1, None), (1, 1), (3, None)])
def test_sums_then_norm_equal_gemv_then_norm(m: int, split_k: int | None, gated: bool, gen: torch.Generator) -> None:
    k, n, dtype = 128, 96, torch.float32
    qweight, scales, zeros = packed_int4(k, n, 32, dtype, gen)
    x = torch.randn(m, 2 * k if gated else k, generator=gen).to(DEVICE)
    residual = torch.randn(m, n, generator=gen).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(DEVICE)
    cfg = Int4GemmConfig(kernel="gemv", split_k=split_k)
    gemm = int4_gemm_gated if gated else int4_gemm
    y = gemm(x, qweight, scales, zeros, 32, config=cfg)
    want, want_res = rms_norm_ref(y, weight, 1e-5, residual)
    sums = torch.zeros(m, n, dtype=torch.float32, device=DEVICE)
    int4_gemv_sums(x, qweight, scales, zeros, 32, sums, gated=gated)
    assert rel_err(sums, y.float()) < tolerance(dtype)
    out, res_out = rms_norm(sums, weight, 1e-5, residual, sums=True)
    assert rel_err(out, want) < tolerance(dtype) and rel_err(res_out, want_res) < tolerance(dtype)
    assert not sums.any(), "the norm leaves the accumulator zeroed for the next GEMV"


def test_norm_rounds_the_sums_to_the_residual_dtype(gen: torch.Generator) -> None:
    """bf16 stream: the sums are rounded to bf16 before the residual add, as the GEMV's own store rounds them
    (bit for bit on a GPU; Triton's interpreter rounds fp32 -> bf16 by truncation, so within bf16's error on CPU)."""
    n = 64
    sums = torch.randn(2, n, generator=gen).to(DEVICE)
    residual = torch.randn(2, n, generator=gen).to(torch.bfloat16).to(DEVICE)
    weight = torch.randn(n, generator=gen).to(torch.bfloat16).to(DEVICE)
    want, want_res = rms_norm_ref(sums.to(torch.bfloat16), weight, 1e-6, residual)
    out, res_out = rms_norm(sums.clone(), weight, 1e-6, residual, sums=True)
    assert out.dtype == torch.bfloat16 and res_out.dtype == torch.bfloat16
    assert rel_err(res_out, want_res) < tolerance(torch.bfloat16)
    assert rel_err(out, want) < tolerance(torch.bfloat16)
    if DEVICE.type == "cuda":
        assert torch.equal(res_out, want_res)


def test_sums_inputs_are_checked(gen: torch.Generator) -> None:
    qweight, scales, zeros = packed_int4(128, 64, 32, torch.float32, gen)
    x = torch.randn(1, 128, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="contiguous fp32"):
        int4_gemv_sums(x, qweight, scales, zeros, 32, torch.zeros(1, 64, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="at most"):
        int4_gemv_sums(x.expand(64, 128), qweight, scales, zeros, 32, torch.zeros(64, 64, device=DEVICE))
    with pytest.raises(ValueError, match="gate \\| up"):
        int4_gemv_sums(x, qweight, scales, zeros, 32, torch.zeros(1, 64, device=DEVICE), gated=True)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.zeros(1, 64, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6, sums=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(("n", "k", "gated"), [(4096, 4096, False), (4096, 14336, True)], ids=["o", "down"])
def test_8b_pairs_replayed_from_a_cuda_graph(n: int, k: int, gated: bool, gen: torch.Generator) -> None:
    """o_proj -> post-attention norm and gated down_proj -> input norm at batch 1 (bf16, group 128), as one graph
    replayed with new inputs: every replay equals the GEMV + norm path (the accumulator starts each at zero)."""
    dtype = torch.bfloat16
    qweight, scales, zeros = packed_int4(k, n, 128, dtype, gen)
    x = torch.zeros(1, 2 * k if gated else k, dtype=dtype, device="cuda")
    residual = torch.zeros(1, n, dtype=dtype, device="cuda")
    weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype).cuda()
    sums = torch.zeros(1, n, dtype=torch.float32, device="cuda")

    def pair() -> torch.Tensor:
        int4_gemv_sums(x, qweight, scales, zeros, 128, sums, gated=gated)
        return rms_norm(sums, weight, 1e-5, residual, sums=True)[0]  # type: ignore[index]

    graph, out = capture_graph(pair)
    gemm = int4_gemm_gated if gated else int4_gemm
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen).to(dtype))
        residual.copy_(torch.randn(residual.shape, generator=gen).to(dtype))
        graph.replay()
        want = rms_norm(gemm(x, qweight, scales, zeros, 128), weight, 1e-5, residual)[0]
        assert rel_err(out, want) < tolerance(dtype)
        assert not sums.any()


def test_sums_gemv_compiles_for_sm90_with_its_adds_only() -> None:
    """The ``sums`` GEMV (SPLIT_MODE 3) at the 8B batch-1 tile: one fp32 atomic add and nothing after it (no arrival
    counter, no last program's pass), where the ``atomic`` mode (2) has the add and the counter's."""
    constexprs: dict[str, object] = {
        "GROUP_SIZE": 128, "HAS_G_IDX": False, "FACTORED": True, "ONE_GROUP_PER_TILE": True, "SUBNORMAL": False,
        "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 2, "SPLIT_MODE": 3, "SPLIT_CHUNK": 1,
        "EVEN": True, "GATED": True, "PDL": True, "TRIGGER": True,
    }  # fmt: skip
    sums = ttgir_sm90("gemv", constexprs, 4)
    atomic = ttgir_sm90("gemv", {**constexprs, "SPLIT_MODE": 2}, 4)
    assert sums.count("tt.atomic_rmw") == 1 and atomic.count("tt.atomic_rmw") == 2
    assert "fadd" in sums.split("tt.atomic_rmw")[1].split("\n")[0]
