"""The dense GEMV (``kernels.gemv``) against its torch reference under the Triton interpreter (tiny shapes,
every kernel and split reduction, M = 1..8, tails along N and K, bias), its plan and its checks. The dot
kernel runs in fp16 here: the interpreter's bf16 ``tl.dot`` is wrong (the GPU tests run it in bf16). The gated
GEMV meets its reference in fp16 too: the interpreter truncates fp32 -> bf16 casts where torch rounds them to
nearest (~1 % apart after the gated input's three casts); in bf16 it is compared with the Triton activation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import gemv_plan
from kernels.activation import silu_and_mul, silu_and_mul_ref
from kernels.gemv import (
    GEMV_LIMIT_M,
    GemvConfig,
    gemv,
    gemv_gated,
    gemv_gated_ref,
    gemv_ref,
    linear,
    linear_gated,
    plan_gemv,
    scratch_is_zero,
)
from tests.kernels.helpers import DEVICE, rel_err

H200_SMS = 132
SHAPES_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096))
# tiles small enough that the tiny shapes have several N tiles and K splits
TINY = {"fma": GemvConfig(kernel="fma", block_n=4, block_k=16), "dot": GemvConfig(kernel="dot", block_n=16, block_k=16)}
DTYPE = {"fma": torch.bfloat16, "dot": torch.float16}


def _inputs(
    m: int, n: int, k: int, dtype: torch.dtype, gen: torch.Generator, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    return x, w, b


def _config(kernel: str, split_k: int, split_reduce: str = "counter") -> GemvConfig:
    return GemvConfig(**{**TINY[kernel].__dict__, "split_k": split_k, "split_reduce": split_reduce})


@pytest.mark.parametrize("kernel", ["fma", "dot"])
@pytest.mark.parametrize("m", range(1, 9))
def test_every_row_count(kernel: str, m: int, gen: torch.Generator) -> None:
    """M = 1..8 with tails along N (37) and K (100, 7 tiles in 3 splits), bias, the counter reduction."""
    x, w, b = _inputs(m, 37, 100, DTYPE[kernel], gen, bias=m % 2 == 1)
    out = gemv(x, w, b, _config(kernel, 3))
    assert out.shape == (m, 37) and out.dtype == x.dtype
    assert rel_err(out, gemv_ref(x, w, b)) < 1e-2, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("kernel", ["fma", "dot"])
@pytest.mark.parametrize("split_reduce", ["counter", "atomic", "two_pass"])
@pytest.mark.parametrize("m", [1, 5])
def test_split_reductions(kernel: str, split_reduce: str, m: int, gen: torch.Generator) -> None:
    """Each reduction, called three times: equal to the reference every time, bit-equal across calls where
    it is deterministic, and the shared counters / accumulator back at zero after each call."""
    x, w, b = _inputs(m, 21, 160, DTYPE[kernel], gen, bias=True)  # N = 21: a 1- (fma) or 5-column (dot) tail tile
    cfg = _config(kernel, 4, split_reduce)
    plan = plan_gemv(m, 21, 160, 8, cfg)
    assert plan.split_k == 4 and plan.split_reduce == split_reduce
    ref = gemv_ref(x, w, b)
    first = gemv(x, w, b, cfg)
    for _ in range(2):
        out = gemv(x, w, b, cfg)
        assert rel_err(out, ref) < 1e-2, f"seed {gen.initial_seed()}"
        assert scratch_is_zero()
        if split_reduce != "atomic":
            assert torch.equal(out, first)


@pytest.mark.parametrize("kernel", ["fma", "dot"])
@pytest.mark.parametrize("m", [1, 4])
def test_even_tiles_and_default_knobs(kernel: str, m: int, gen: torch.Generator) -> None:
    """No tails (the unmasked loads), and the default tile of each kernel (K shorter than one tile)."""
    x, w, b = _inputs(m, 64, 128, DTYPE[kernel], gen, bias=False)
    assert rel_err(gemv(x, w, b, GemvConfig(**{**TINY[kernel].__dict__, "split_k": 2})), gemv_ref(x, w)) < 1e-2
    assert rel_err(gemv(x, w, b, GemvConfig(kernel=kernel)), gemv_ref(x, w)) < 1e-2  # type: ignore[arg-type]


def test_reference_is_f_linear() -> None:
    x, w, b = torch.randn(3, 20), torch.randn(7, 20), torch.randn(7)
    torch.testing.assert_close(gemv_ref(x, w, b), F.linear(x, w, b))


def test_plan_defaults() -> None:
    """The GEMV for qkv, o and down at M <= 8, cuBLAS for gate_up, lm_head and past 8 rows; every plan is a
    launch that fits."""
    for n, k in SHAPES_8B:
        for m in range(1, GEMV_LIMIT_M + 1):
            plan = plan_gemv(m, n, k, H200_SMS)
            assert plan.use_gemv == (m <= 8 and n * k < 64 << 20)
            assert plan.block_m >= m and plan.k_per_split % plan.block_k == 0
            assert (plan.split_k - 1) * plan.k_per_split < k <= plan.split_k * plan.k_per_split
    assert plan_gemv(1, 28672, 4096, H200_SMS, GemvConfig()).use_gemv  # a config forces the GEMV


def test_plan_picks() -> None:
    """fma at M = 1, unsplit; dot above, unsplit where N fills 70 % of the SMs, else split to fill them."""
    o_m1 = plan_gemv(1, 4096, 4096, H200_SMS)
    assert (o_m1.kernel, o_m1.split_k) == ("fma", 1)
    o_m8 = plan_gemv(8, 4096, 4096, H200_SMS)
    assert (o_m8.kernel, o_m8.block_m, o_m8.split_k) == ("dot", 16, 4)
    assert plan_gemv(4, 6144, 4096, H200_SMS).split_k == 1  # 96 tiles of 64 columns
    assert plan_gemv(8, 28672, 4096, H200_SMS).split_k == 1
    assert plan_gemv(1, 64, 4096, H200_SMS, GemvConfig(split_k=64)).split_k == 8  # no more splits than K tiles


def test_pdl_is_off_by_default_and_runs_in_the_interpreter(gen: torch.Generator) -> None:
    assert not plan_gemv(1, 4096, 4096, H200_SMS).pdl and plan_gemv(1, 64, 64, H200_SMS, GemvConfig(pdl=True)).pdl
    x, w, b = _inputs(2, 37, 100, torch.bfloat16, gen, bias=True)
    assert rel_err(gemv(x, w, b, GemvConfig(**{**_config("fma", 2).__dict__, "pdl": True})), gemv_ref(x, w, b)) < 1e-2


def test_plan_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv_plan, "GEMV_MAX_M", 4)
    monkeypatch.setattr(gemv_plan, "GEMV_MAX_WEIGHT_ELEMS", 4096 * 14336)
    assert plan_gemv(4, 4096, 14336, H200_SMS).use_gemv
    assert not plan_gemv(5, 4096, 14336, H200_SMS).use_gemv
    assert not plan_gemv(1, 28672, 4096, H200_SMS).use_gemv


@pytest.mark.parametrize(
    "m, cfg, match",
    [
        (0, GemvConfig(), "M <= 16"),
        (GEMV_LIMIT_M + 1, GemvConfig(), "M <= 16"),
        (1, GemvConfig(block_n=3), "powers of two"),
        (1, GemvConfig(kernel="dot", block_n=8), "powers of two >= 16"),
        (1, GemvConfig(kernel="wgmma"), "kernel"),  # type: ignore[arg-type]
        (1, GemvConfig(split_reduce="tree"), "split_reduce"),  # type: ignore[arg-type]
        (1, GemvConfig(split_k=0), "split_k"),
        (1, GemvConfig(num_warps=3), "num_warps"),
    ],
)
def test_plan_rejects(m: int, cfg: GemvConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_gemv(m, 64, 64, H200_SMS, cfg)


def test_wrapper_checks() -> None:
    x, w, b = torch.randn(2, 32).bfloat16(), torch.randn(16, 32).bfloat16(), torch.randn(16).bfloat16()
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        gemv(x.float(), w.float())
    with pytest.raises(ValueError, match="x's dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="x's dtype"):
        gemv(x, w, b.half())
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        gemv(x, w[:, :16])
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        gemv(x[None], w)
    with pytest.raises(ValueError, match="bias must be"):
        gemv(x, w, b[:8])
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(x, torch.randn(32, 16).bfloat16().t())
    with pytest.raises(ValueError, match="M <= 16"):
        gemv(torch.randn(17, 32).bfloat16(), w)
    with pytest.raises(ValueError, match="does not fit"):
        gemv(x, w, plan=plan_gemv(1, 16, 32, 8))


def test_linear_is_f_linear_off_cuda() -> None:
    """What the dense layers call: ``F.linear`` itself on CPU and while the plan says cuBLAS."""
    assert gemv_plan.GEMV_MAX_M >= 2  # on CPU the GEMV is still never taken
    x, w, b = torch.randn(2, 32).bfloat16(), torch.randn(16, 32).bfloat16(), torch.randn(16).bfloat16()
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x[None], w), F.linear(x[None], w))


def test_engine_layers_call_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense linear layers go through ``kernels.gemv.linear`` (bias included)."""
    from engine.layers import linear as linear_layers
    from engine.parallel import ParallelState

    calls: list[bool] = []

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        calls.append(b is not None)
        return F.linear(x, w, b)

    monkeypatch.setattr(linear_layers, "dense_linear", spy)
    layer = linear_layers.ColumnParallelLinear(32, 16, bias=True, parallel=ParallelState())
    assert layer.weight is not None and layer.bias is not None
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    row = linear_layers.RowParallelLinear(16, 8, bias=False, parallel=ParallelState())
    assert row.weight is not None
    row.weight.data.normal_()
    row(torch.randn(3, 16))
    assert calls == [True, False]


# ---- gemv_gated: silu_and_mul of x2 [M, 2K] computed as the kernel loads x ----


def _gated_inputs(
    m: int, n: int, k: int, dtype: torch.dtype, gen: torch.Generator, bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x2 = (2 * torch.randn(m, 2 * k, generator=gen)).to(dtype).to(DEVICE)  # gate | up, silu's curved range
    _, w, b = _inputs(m, n, k, dtype, gen, bias)
    return x2, w, b


@pytest.mark.parametrize("kernel", ["fma", "dot"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, k", [(37, 100), (64, 128)])  # tails along N and K (masked loads), none (EVEN)
def test_gated_matches_reference(kernel: str, m: int, bias: bool, n: int, k: int, gen: torch.Generator) -> None:
    x2, w, b = _gated_inputs(m, n, k, torch.float16, gen, bias)
    out = gemv_gated(x2, w, b, _config(kernel, 1))
    assert out.shape == (m, n) and out.dtype == x2.dtype
    assert rel_err(out, gemv_gated_ref(x2, w, b)) < 1e-2, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("kernel", ["fma", "dot"])
@pytest.mark.parametrize("split_reduce", ["counter", "atomic", "two_pass"])
def test_gated_split_reductions(kernel: str, split_reduce: str, gen: torch.Generator) -> None:
    """4 K splits of 10 tiles with tails along N and K, each reduction: the scratch back at zero."""
    x2, w, b = _gated_inputs(3, 45, 160, torch.float16, gen, bias=True)
    out = gemv_gated(x2, w, b, _config(kernel, 4, split_reduce))
    assert rel_err(out, gemv_gated_ref(x2, w, b)) < 1e-2, f"seed {gen.initial_seed()}"
    assert scratch_is_zero()


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n, k", [(37, 100), (64, 128)])
def test_gated_is_gemv_of_the_activation(m: int, n: int, k: int, gen: torch.Generator) -> None:
    """fma, unsplit, bf16: the same products summed in the same order as ``gemv`` of the Triton activation
    (the same ops and casts), bit for bit."""
    x2, w, b = _gated_inputs(m, n, k, torch.bfloat16, gen, bias=True)
    cfg = _config("fma", 1)
    assert torch.equal(gemv_gated(x2, w, b, cfg), gemv(silu_and_mul(x2), w, b, cfg)), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("m", [1, 3])
def test_gated_rounds_as_the_reference(m: int, gen: torch.Generator) -> None:
    """fp16 (whose casts the interpreter rounds as torch): bit-equal to ``gemv`` of ``silu_and_mul_ref``, the
    silu and the product each rounded to x's dtype, once the gates whose fp32 silu numpy's exp and torch's
    round to neighbouring fp16 values (3 of the 63k) are set to zero."""
    x2, w, _ = _gated_inputs(m, 37, 100, torch.float16, gen, bias=False)
    differ = silu_and_mul(x2) != silu_and_mul_ref(x2)
    assert differ.sum() <= 2, f"seed {gen.initial_seed()}"
    x2[:, :100][differ] = 0.0
    cfg = _config("fma", 1)
    assert torch.equal(gemv_gated(x2, w, None, cfg), gemv(silu_and_mul_ref(x2), w, None, cfg)), (
        f"seed {gen.initial_seed()}"
    )


def test_gated_wrapper_checks() -> None:
    x2, w, b = torch.randn(2, 64).bfloat16(), torch.randn(16, 32).bfloat16(), torch.randn(16).bfloat16()
    with pytest.raises(ValueError, match="gemv_gated: x2 must be float16 or bfloat16"):
        gemv_gated(x2.float(), w.float())
    with pytest.raises(ValueError, match="x2's dtype"):
        gemv_gated(x2, w.half())
    with pytest.raises(ValueError, match="x2's dtype"):
        gemv_gated(x2, w, b.half())
    with pytest.raises(ValueError, match=r"x2 \[M, 2K\] and weight \[N, K\]"):
        gemv_gated(x2[:, :32], w)  # K columns, not 2K
    with pytest.raises(ValueError, match=r"x2 \[M, 2K\]"):
        gemv_gated(x2[None], w)
    with pytest.raises(ValueError, match="bias must be"):
        gemv_gated(x2, w, b[:8])
    with pytest.raises(ValueError, match="x2 and weight must be contiguous"):
        gemv_gated(torch.randn(64, 2).bfloat16().t(), w)
    with pytest.raises(ValueError, match="one device"):
        gemv_gated(x2.to("meta"), w)
    with pytest.raises(ValueError, match="M <= 16"):
        gemv_gated(torch.randn(17, 64).bfloat16(), w)
    with pytest.raises(ValueError, match="gemv_gated: .* does not fit"):
        gemv_gated(x2, w, plan=plan_gemv(1, 16, 32, 8))


def test_linear_gated_off_cuda() -> None:
    """``F.linear`` of ``silu_and_mul_ref`` on CPU (3-D x2 included)."""
    x2, w, b = torch.randn(2, 64).bfloat16(), torch.randn(16, 32).bfloat16(), torch.randn(16).bfloat16()
    assert torch.equal(linear_gated(x2, w, b), F.linear(silu_and_mul_ref(x2), w, b))
    assert torch.equal(linear_gated(x2[None], w), F.linear(silu_and_mul_ref(x2[None]), w))
    torch.testing.assert_close(gemv_gated_ref(x2, w, b), F.linear(F.silu(x2[:, :32]) * x2[:, 32:], w, b))


@pytest.mark.slow
def test_gemv_bench_tiny_mode(tmp_path: Path) -> None:
    from loadtest.gemv_bench import LAYER_SHAPES_TINY, M_VALUES_TINY, VARIANTS, main

    out = tmp_path / "gemv.json"
    assert main(["--tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(LAYER_SHAPES_TINY) * len(M_VALUES_TINY)
    assert not any(r.get("wrong") or r.get("skipped") or r.get("nondeterministic") for r in rows)
    assert all(r["scratch_zero"] for r in rows)
    ran = {name for r in rows for name in [*r["err"], *r["aliases"]]}
    assert ran == {name for name, _, _ in VARIANTS}
