"""Fixtures shared by the engine tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch


@pytest.fixture(scope="session")
def hf_smollm2() -> Any:
    """transformers' own load of the default GGUF (dequantized, fp32, eager attention): the reference for the
    default model. Loaded once per session: the GGUF dequantization takes half a minute on CPU."""
    from transformers import AutoModelForCausalLM

    import modelfiles

    files = modelfiles.resolve(None)
    assert files.gguf_path is not None
    return AutoModelForCausalLM.from_pretrained(
        files.gguf_path.parent, gguf_file=files.gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
