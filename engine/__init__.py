"""pagedserve engine: ``from engine import LLM, SamplingParams`` as in vLLM.

Exports resolve lazily so that importing a light submodule (``engine.sampling_params``) does not pull in
torch and the model code.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "CompletionOutput", "SamplingParams"]

_WHERE = {
    "LLM": "engine.llm",
    "Engine": "engine.engine",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.request",
    "CompletionOutput": "engine.request",
    "SamplingParams": "engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
