"""The launch description of the W4A16 GEMM (``kernels.int4_gemm``): what a caller may choose
(:class:`Int4GemmConfig`, ``None`` fields left to ``kernels.int4_plan.pick_config``) and every choice made
(:class:`Int4Launch`). Its own module so the plan's defaults and their measurements have room in ``int4_plan``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kernels.int4_dequant import PACK

Kernel = Literal["dot", "gemv", "mma", "wgmma"]
SplitReduce = Literal["counter", "atomic"]
KERNELS: tuple[Kernel, ...] = ("dot", "gemv", "mma", "wgmma")
SPLIT_REDUCES: tuple[SplitReduce, ...] = ("counter", "atomic")


@dataclass(frozen=True)
class Int4GemmConfig:
    """Launch choices of :func:`int4_gemm`; ``None`` fields are picked by :func:`pick_config`."""

    # "gemv" (kernels.int4_gemv: CUDA cores, all M rows in one program), "dot" (tl.dot tiles), "mma" or "wgmma"
    # (kernels.int4_gemv_mma, kernels.int4_gemm_wgmma: the tensor cores); None: int4_plan.default_kernel
    kernel: Kernel | None = None
    block_m: int | None = None  # dot and mma: rows of x a program takes (a GEMV program holds all M rows)
    block_n: int | None = None
    block_k: int | None = None
    split_k: int | None = None
    # how split-K partials are summed (kernels.int4_split's docstring); None: atomic up to ATOMIC_MAX_M rows
    split_reduce: SplitReduce | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    # dot: load each packed word once and replicate it to its 8 rows in registers, instead of one load per row
    unpack_in_registers: bool | None = None
    # gemv: scale and zero applied per group to sums instead of per weight (without g_idx only)
    # mma: the same (False: each weight dequantized in registers; None: by block_m, MMA_DEQUANT_BLOCK_M)
    factored: bool | None = None
    # gemv split-K target: about this many programs per SM (None: GEMV_PROGRAMS_PER_SM); split_k, when given, wins
    programs_per_sm: int | None = None
    # gemv (factored): codes read as subnormals (None: GEMV_SUBNORMAL)
    subnormal: bool | None = None
    # gemv, mma: launched with programmatic dependent launch where the device has it (None: GEMV_PDL)
    pdl: bool | None = None
    # gemv (factored, not gated): bf16 x loaded as int32 pairs where its strides allow (None: GEMV_X_WORDS)
    x_words: bool | None = None
    # gemv (factored, whole K tiles): stream-K (kernels.int4_gemv_stream), programs_per_sm x SMs programs sharing
    # the layer's units evenly instead of a split-K grid (None: GEMV_STREAM)
    stream: bool | None = None

    def __post_init__(self) -> None:
        if self.kernel not in (None, *KERNELS):
            raise ValueError(f"kernel must be one of {KERNELS} or None, got {self.kernel!r}")
        if self.split_reduce not in (None, *SPLIT_REDUCES):
            raise ValueError(f"split_reduce must be one of {SPLIT_REDUCES} or None, got {self.split_reduce!r}")
        for name, block in (("block_m", self.block_m), ("block_n", self.block_n), ("block_k", self.block_k)):
            if block is not None and (block < 1 or block & (block - 1)):
                raise ValueError(f"{name} must be a power of two, got {block}")
        if self.block_k is not None and self.block_k < PACK:
            raise ValueError(f"block_k must be at least {PACK} (one packed word), got {self.block_k}")
        counts = (
            ("split_k", self.split_k),
            ("num_warps", self.num_warps),
            ("num_stages", self.num_stages),
            ("programs_per_sm", self.programs_per_sm),
        )
        for name, count in counts:
            if count is not None and count < 1:
                raise ValueError(f"{name} must be at least 1, got {count}")


@dataclass(frozen=True)
class Int4Launch:
    """One launch of :func:`int4_gemm` with every choice made (what :func:`pick_config` returns)."""

    kernel: Kernel
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    split_reduce: SplitReduce
    num_warps: int
    num_stages: int
    unpack_in_registers: bool
    factored: bool
    subnormal: bool = False  # factored gemv only
    pdl: bool = False  # gemv and mma only
    x_words: bool = False  # factored gemv only
    stream_programs: int = 0  # factored gemv: the stream-K grid (kernels.int4_gemv_stream); 0: the split-K grid
