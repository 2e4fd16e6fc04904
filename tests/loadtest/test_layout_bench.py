"""``loadtest.layout_bench``'s rows on CPU (the interpreter, small shapes): every variant's launch, built from the
engine's own as the bench builds it, runs and equals the reference on a plain and a gated layer, so no row fails on
the device for a bad tile or grid."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kernels.int4_gemm import _pick, int4_gemm_gated_ref, int4_gemm_ref
from kernels.int4_gemv_stream import prepare_x
from loadtest.layout_bench import GROUP, PREPARED_ROWS, VARIANTS, launch_variant, variant_launch
from tests.kernels.helpers import int4_weights, rel_err, tolerance


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_every_variant_runs_and_equals_the_reference(gated: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    n, k = (512, 256) if gated else (1024, 256)
    _, qweight, scales, zeros, _ = int4_weights(k, n, GROUP, False, torch.bfloat16, gen)
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16)
    cfg = _pick(x[:, :k], qweight, scales, GROUP, None, None)
    ref = (int4_gemm_gated_ref if gated else int4_gemm_ref)(x, qweight, scales, zeros, GROUP)
    w = {"qweight": qweight, "scales": scales, "zeros": zeros}
    prepared = None if gated else prepare_x(x)
    for name, (_, over, stream) in VARIANTS.items():
        if gated and name in PREPARED_ROWS:
            continue  # the bench leaves these rows out on the gated layer
        out = torch.full((1, n), float("nan"), dtype=x.dtype)
        launch_variant(x, x.float(), prepared, out, gated, cfg, cfg, 2, w, name)
        assert (variant_launch(cfg, over, stream, sms=2).stream_programs > 0) == (stream > 0), name
        assert rel_err(out, ref) < 2 * tolerance(x.dtype), name


def test_the_stages_name_known_rows() -> None:
    script = (Path(__file__).parents[2] / "loadtest" / "gpu_session.sh").read_text()
    defaults = re.findall(r"LAYOUT_VARIANTS:-([^}]*)\}", script)
    assert len(defaults) >= 2  # stages xa and xc
    for default in defaults:
        names = default.replace("\\", " ").split()
        assert names and set(names) <= set(VARIANTS), names
