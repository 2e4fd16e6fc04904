"""``loadtest.layout_bench``'s rows on CPU (the interpreter, small shapes): every variant's launch, built from the
engine's own as the bench builds it, runs and equals the reference on a plain and a gated layer, so no row fails on
the device for a bad tile or grid."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kernels.int4_gemm import _launch_gemv, _pick, int4_gemm_gated_ref, int4_gemm_ref
from loadtest.layout_bench import GROUP, VARIANTS, variant_launch
from tests.kernels.helpers import int4_weights, rel_err, tolerance


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_every_variant_runs_and_equals_the_reference(gated: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = (512, 256) if gated else (1024, 256)
    _, qweight, scales, zeros, _ = int4_weights(k, n, GROUP, False, torch.bfloat16, gen)
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16)
    cfg = _pick(x[:, :k], qweight, scales, GROUP, None, None)
    ref = (int4_gemm_gated_ref if gated else int4_gemm_ref)(x, qweight, scales, zeros, GROUP)
    for name, (fp32, over, stream) in VARIANTS.items():
        out = torch.full((1, n), float("nan"), dtype=x.dtype)
        launch = variant_launch(cfg, over, stream, sms=2)
        _launch_gemv(x.float() if fp32 else x, qweight, scales, zeros, GROUP, None, out, launch, gated)
        assert (launch.stream_programs > 0) == (stream > 0), name
        assert rel_err(out, ref) < 2 * tolerance(x.dtype), name


def test_the_stages_name_known_rows() -> None:
    script = (Path(__file__).parents[2] / "loadtest" / "gpu_session.sh").read_text()
    defaults = re.findall(r"LAYOUT_VARIANTS:-([^}]*)\}", script)
    assert len(defaults) >= 2  # stages xa and xc
    for default in defaults:
        names = default.replace("\\", " ").split()
        assert names and set(names) <= set(VARIANTS), names
