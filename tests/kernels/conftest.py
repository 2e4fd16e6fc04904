"""Kernel tests run the Triton kernels through the interpreter on CPU; the flag must be set before any
kernel module is imported (``@triton.jit`` reads it when it decorates)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def poison_uninitialized_memory() -> Iterator[None]:
    """Every ``torch.empty`` (the kernels' outputs and scratch) comes back filled with NaN, so an element a
    kernel forgets to write fails the comparison instead of passing on leftover memory."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]
    yield
    torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


@pytest.fixture
def gen() -> torch.Generator:
    """Fresh random inputs on every run; the seed is in the test's id-less output via ``gen.initial_seed()``."""
    g = torch.Generator()
    g.seed()
    return g
