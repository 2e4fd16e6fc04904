"""Programmatic dependent launch (PDL, Hopper and later): a kernel launched with Triton's ``launch_pdl=True``
may start while the kernel before it on the stream is still running. Its programs may do work that reads
nothing the kernel before writes (load weights) and must then call :func:`wait_prior_grids` before any other
load or store; that waits until the kernel before has completed and its writes are visible. A kernel calls
:func:`launch_dependents` once its own programs no longer need the SMs to themselves: the next kernel's
programs are scheduled once every program of this one has called it or exited. Without a PDL launch after it
the call does nothing, and without ``launch_pdl`` on this kernel the wait returns at once.

Triton 3.6 and 3.7 both compile ``griddepcontrol`` from inline PTX (sm_90+); the interpreter cannot run it, so
callers pass a constexpr that :func:`pdl_supported` decides.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from kernels._triton import HAS_TRITON, tl, triton

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The RMSNorm and the decode-attention kernels are launched with PDL (where their switches are on) for at most this
# many rows: batch-1 decode. H200 at caa17d7 (int4_bench --batches 2 4 8, one process each, alternating): with them
# on at every batch, bf16 decode at batches 2 / 4 / 8 took 4.462 / 4.570 / 4.709 ms against 4.319-4.320 / 4.393 /
# 4.520-4.534 off (batch 1 4.180 against 4.181-4.186), the int4 model 3.044 against 2.995 at batch 8; at batch 1
# int4 2.300 against 2.400.
PDL_MAX_ROWS = 1


def pdl_supported(t: torch.Tensor) -> bool:
    """Whether a kernel on ``t``'s device can use ``griddepcontrol`` (compiled, not interpreted; sm_90+)."""
    return (
        t.is_cuda
        and not _INTERPRET
        and _hopper_or_later(t.device.index if t.device.index is not None else torch.cuda.current_device())
    )


@lru_cache(maxsize=8)
def _hopper_or_later(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# The two instructions as inline PTX (returning a dummy register: inline asm must return something); the Gluon
# kernel (kernels.int4_gemv_mma) issues the same strings
WAIT_ASM = "griddepcontrol.wait; mov.u32 $0, 0;"
LAUNCH_DEPENDENTS_ASM = "griddepcontrol.launch_dependents; mov.u32 $0, 0;"
_WAIT_ASM = tl.constexpr(WAIT_ASM) if HAS_TRITON else WAIT_ASM  # without Triton: nothing to compile
_LAUNCH_DEPENDENTS_ASM = tl.constexpr(LAUNCH_DEPENDENTS_ASM) if HAS_TRITON else LAUNCH_DEPENDENTS_ASM


@triton.jit
def wait_prior_grids():
    """``griddepcontrol.wait``: the kernel before this one has completed and its memory is visible."""
    tl.inline_asm_elementwise(_WAIT_ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def launch_dependents():
    """``griddepcontrol.launch_dependents``: this program lets a PDL-launched next kernel start."""
    tl.inline_asm_elementwise(_LAUNCH_DEPENDENTS_ASM, "=r", [], dtype=tl.int32, is_pure=False, pack=1)
