"""``loadtest.int4_model``'s variants: each names module constants that exist, and the device stage that runs them
(``loadtest/gpu_session.sh``, stages dm, xs, xa, xb and xc) names only variants that exist: a typo there would cost a device
call."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from loadtest.int4_model import GEMV_VARIANTS, NoLaunch


def test_every_variant_sets_constants_that_exist() -> None:
    for name, settings in GEMV_VARIANTS.items():
        for key, value in settings.items():
            module, attr = key.split(":")
            current = getattr(importlib.import_module(module), attr)  # AttributeError: a typo
            if isinstance(value, NoLaunch):  # stands in for a kernel: launched as kernel[grid](...)
                assert hasattr(current, "__getitem__") and not isinstance(current, NoLaunch), (name, key)
                continue
            assert isinstance(value, type(current)) or isinstance(current, type(value)), (name, key)


@pytest.mark.parametrize("knob", ["DM_VARIANTS", "XS_VARIANTS", "XA_VARIANTS", "XB_VARIANTS", "XC_VARIANTS"])
def test_stages_run_known_variants(knob: str) -> None:
    script = (Path(__file__).parents[2] / "loadtest" / "gpu_session.sh").read_text()
    match = re.search(knob + r":-([^}]*)\}", script)
    assert match is not None
    names = match.group(1).split()
    assert names and set(names) <= set(GEMV_VARIANTS), names


def test_variants_of_both_models_run_and_keep_every_run(tmp_path: Path) -> None:
    """``--gemv-variants`` and ``--bf16-variants`` on the tiny model (CPU): a name given twice keeps both runs (the
    second as ``#2``: bracketing runs compare the defaults early and late)."""
    import json

    from loadtest.int4_bench import main

    out = tmp_path / "model.json"
    argv = ["--tiny", "--only", "model", "--gemv-variants", "base", "base", "--bf16-variants", "noearly"]
    assert main([*argv, "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    runs = {k for k, v in res.items() if isinstance(v, dict) and "latency" in v}
    assert runs == {"int4", "int4 base", "int4 base#2", "bf16", "bf16 noearly"}
    assert res["bf16 noearly"]["model"] == "bf16" and res["int4 base#2"]["model"] == "int4"
