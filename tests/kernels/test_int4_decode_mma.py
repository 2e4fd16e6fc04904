"""The decode step's tensor-core GEMV (``kernels.int4_decode_mma.gemv_mma``) through a one-call probe kernel:
equal to the dequantized weights' product in float64 under the interpreter (bf16 and fp16 x, an N tail, a K range
inside the weight, two tiles a group), and compiled for sm_90 with its inline PTX: warpgroup MMAs, no spills, and
its loop's instructions a weight (the CUDA-core loop it replaces takes ~5.5)."""

from __future__ import annotations

import json

import pytest
import torch

from kernels._triton import HAS_TRITON, tl, triton
from kernels.int4_decode_mma import gemv_mma
from kernels.int4_dequant import unpack_int4
from tests.kernels.helpers import DEVICE, PTXAS_REPORT, packed_int4, run_without_interpreter

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")


@triton.jit
def _probe(x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr, N, k_lo, k_hi,
           GROUP: tl.constexpr, BK: tl.constexpr, TN: tl.constexpr, NUM_STAGES: tl.constexpr,
           COMPILED: tl.constexpr):  # fmt: skip
    offs_n = tl.program_id(0) * TN + tl.arange(0, TN)
    y = gemv_mma(x_ptr, qw_ptr, s_ptr, z_ptr, offs_n, N, k_lo, k_hi, GROUP, BK, NUM_STAGES, COMPILED)
    tl.store(out_ptr + offs_n, y, mask=offs_n < N)


@pytest.mark.parametrize(
    ("dtype", "k", "n", "group", "bk", "tn", "k_range"),
    [
        (torch.bfloat16, 256, 64, 64, 64, 32, (0, 256)),
        (torch.float16, 256, 64, 64, 64, 32, (0, 256)),
        (torch.bfloat16, 384, 40, 128, 64, 16, (128, 384)),  # an N tail, a split's K range, two tiles a group
    ],
    ids=["bf16", "fp16", "tail-range-group128"],
)
def test_equals_the_dequantized_product(
    dtype: torch.dtype, k: int, n: int, group: int, bk: int, tn: int, k_range: tuple[int, int], gen: torch.Generator
) -> None:
    """Every output within fp32's rounding of the float64 product: the MMA's sums carry x times ``128 + code`` (fp16:
    ``1024 +``), ~100x the result, and the offset's sum cancels after, so ~7-10 of fp32's 24 bits go."""
    qweight, scales, zeros = packed_int4(k, n, group, dtype, gen)
    x = torch.randn(k, generator=gen).to(dtype).to(DEVICE)
    out = torch.empty(n, dtype=torch.float32, device=DEVICE)
    k_lo, k_hi = k_range
    _probe[(triton.cdiv(n, tn),)](
        x, qweight, scales, zeros, out, n, k_lo, k_hi,
        GROUP=group, BK=bk, TN=tn, NUM_STAGES=2, COMPILED=DEVICE.type == "cuda",
    )  # fmt: skip
    groups = torch.arange(k, device=DEVICE) // group
    w = (unpack_int4(qweight).double() - zeros.double()[groups]) * scales.double()[groups]  # not rounded
    want = x[k_lo:k_hi].double() @ w[k_lo:k_hi]
    err = (out.double() - want).abs().max() / want.abs().max()
    assert err < 1e-4, err


_COMPILE_SM90 = (
    """
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tests.kernels.test_int4_decode_mma import _probe as kernel
c = json.loads(sys.argv[1])
types = {"qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "out_ptr": "*fp32", "x_ptr": "*bf16"}
names = kernel.arg_names
signature = {a: "constexpr" if a in c else types.get(a, "i32") for a in names}
aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a.endswith("_ptr") or a in ("N", "k_lo", "k_hi")}
compiled = triton.compile(ASTSource(kernel, signature, c, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})
"""
    + PTXAS_REPORT
    + """
instrs = [(int(a, 16), op) for a, op in re.findall(r"/\\*([0-9a-f]{4,})\\*/\\s+([^;]*);", sass)]
loops = [a - int(t, 16) for a, op in instrs for t in re.findall(r"BRA\\s+`?\\(?(0x[0-9a-f]+)", op) if int(t, 16) < a]
print("LOOP", max(loops) // 16 + 1)
print("HGMMA" * sass.count("HGMMA"))
"""
)


def test_compiles_for_sm90() -> None:
    """The 8B step's tile (128 columns, 128 k's, bf16): its MMAs are HGMMAs with the codes from registers, no
    spills, and the loop at most 3 SASS instructions a weight (128 x 128 weights over 128 threads: 2.77 with Triton
    3.7 here, 2.71 with 3.6; the CUDA-core loop it replaces, ~5.5)."""
    constexprs = {"GROUP": 128, "BK": 128, "TN": 128, "NUM_STAGES": 4, "COMPILED": True}
    report = run_without_interpreter(_COMPILE_SM90, json.dumps(constexprs))
    assert "0 bytes spill stores" in report, report
    assert report.count("HGMMA") >= 8, report  # four products, two 64-row MMAs each (k 32 = two k16 steps each)
    loop = int(report.split("LOOP")[1].split()[0])
    assert loop <= 3 * 128, report
