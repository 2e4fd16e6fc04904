"""A decode step's weights warmed into the L2 one projection ahead (``kernels.l2_prefetch``), at small batches.

At batch 1 each projection's GEMV starts with its weights cold in HBM and is latency-bound, while the kernels
between two projections (norms, rotary, attention) leave the HBM idle. ``WeightPrefetch.before(p)`` asks for
the weights of the projection that runs after ``p``, so they stream in while ``p`` and what follows it run.
The prefetches write nothing, so a step's tokens do not depend on them.

``PAGEDSERVE_L2_PREFETCH``: ``side`` issues them on a side stream (in a CUDA graph: a branch beside the
layer's kernels), ``inline`` on the step's stream, empty or ``0`` not at all (the default until measured).
``PAGEDSERVE_L2_PREFETCH_MB`` caps each projection's prefetch (the H200's L2 is 50 MB and must also hold
what runs meanwhile); ``PAGEDSERVE_L2_PREFETCH_KIND`` is ``bulk`` or ``line`` (``kernels.l2_prefetch.MODES``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from kernels.l2_prefetch import MODES, prefetch_l2

PREFETCH_MODE = os.environ.get("PAGEDSERVE_L2_PREFETCH", "").strip().lower()
PREFETCH_MAX_M = int(os.environ.get("PAGEDSERVE_L2_PREFETCH_MAX_M", "1"))
PREFETCH_BYTES = int(float(os.environ.get("PAGEDSERVE_L2_PREFETCH_MB", "24")) * (1 << 20))
PREFETCH_KIND = os.environ.get("PAGEDSERVE_L2_PREFETCH_KIND", "bulk")
PREFETCH_CHUNK = int(os.environ.get("PAGEDSERVE_L2_PREFETCH_CHUNK", "8192"))
_ON = {"side", "inline"}
if PREFETCH_MODE not in (*_ON, "", "0", "off"):
    raise ValueError(f"PAGEDSERVE_L2_PREFETCH must be side, inline or empty, got {PREFETCH_MODE!r}")
if PREFETCH_KIND not in MODES:
    raise ValueError(f"PAGEDSERVE_L2_PREFETCH_KIND must be one of {MODES}, got {PREFETCH_KIND!r}")


def prefetch_on(hidden: torch.Tensor) -> bool:
    """Whether this step warms its weights: on, CUDA, at most ``PREFETCH_MAX_M`` tokens."""
    return PREFETCH_MODE in _ON and hidden.is_cuda and hidden.shape[0] <= PREFETCH_MAX_M


class WeightPrefetch:
    """The projections of a step in the order they run; ``before(p)`` prefetches the next one's parameters
    (largest first, ``PREFETCH_BYTES`` in all), ``join()`` ends the side stream's branch before the step's end."""

    def __init__(self, projections: Sequence[nn.Module]) -> None:
        self.next_of = {id(a): b for a, b in zip(projections, projections[1:], strict=False)}
        self.first = projections[0] if projections else None
        self.side: torch.cuda.Stream | None = None
        self.pending = False

    @staticmethod
    def tensors(module: nn.Module) -> list[torch.Tensor]:
        params = [p for p in module.parameters(recurse=False) if p.is_cuda and p.is_contiguous()]
        return sorted(params, key=lambda p: p.numel() * p.element_size(), reverse=True)

    def start(self) -> None:
        """The first projection's weights, before anything of the step runs."""
        if self.first is not None:
            self._issue(self.first)

    def before(self, module: nn.Module) -> None:
        nxt = self.next_of.get(id(module))
        if nxt is not None:
            self._issue(nxt)

    def _issue(self, module: nn.Module) -> None:
        if PREFETCH_MODE == "side":
            main = torch.cuda.current_stream()
            if self.side is None:
                self.side = torch.cuda.Stream(device=main.device)
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                self._prefetch(module)
            self.pending = True
        else:
            self._prefetch(module)

    @staticmethod
    def _prefetch(module: nn.Module) -> None:
        budget = PREFETCH_BYTES
        for t in WeightPrefetch.tensors(module):
            if budget <= 0:
                break
            budget -= prefetch_l2(t, budget, PREFETCH_KIND, PREFETCH_CHUNK)

    def join(self) -> None:
        if self.pending and self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
            self.pending = False
