"""Instructions a weight of the batch-1 int4 GEMV's K loop in sm_90 SASS, compiled on this machine (no GPU).

The GEMV at M = 1 is bound by instruction issue as much as by its bytes (docs/benchmarks.md, Sessions 13 and 34-35),
so its tiles are compared by what ptxas makes of them: each variant below is compiled for sm_90 with Triton's own
ptxas and cuobjdump (the wheel's), with the specialization the launcher gives (16-aligned pointers and sizes), and
its innermost loop (the K loop: the shortest backward branch's body) is counted. Registers bound how many programs an
SM holds. ``python -m loadtest.sass_census [--only NAME ...] [--out F]``; one JSON row a variant.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

# (kernel, num_warps, constexprs over BASE): "split" is kernels.int4_gemv's split-K grid, "stream" kernels.int4_gemv_stream
BASE: dict[str, Any] = {
    "GROUP_SIZE": 128, "SUBNORMAL": False, "BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 64, "NUM_STAGES": 2,
    "EVEN": True, "GATED": False, "PDL": True, "TRIGGER": True, "X_WORDS": False,
}  # fmt: skip
SPLIT_ONLY: dict[str, Any] = {
    "HAS_G_IDX": False, "FACTORED": True, "ONE_GROUP_PER_TILE": True, "SPLIT_MODE": 2, "SPLIT_CHUNK": 1,
}  # fmt: skip
STREAM_ONLY: dict[str, Any] = {"PREPARED": False}
VARIANTS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "split": ("split", 4, {}),  # the default tile (qkv, o)
    "split_xw": ("split", 4, {"X_WORDS": True}),
    "split_wide": ("split", 1, {"SUBNORMAL": True}),  # the wide tile (gate_up)
    "split_wide_xw": ("split", 1, {"SUBNORMAL": True, "X_WORDS": True}),
    "split_gated": ("split", 4, {"GATED": True}),  # the down projection
    "split_gated_sub": ("split", 4, {"GATED": True, "SUBNORMAL": True}),
    "split_sub_bk128": ("split", 4, {"SUBNORMAL": True, "BLOCK_K": 128}),
    "stream_xw": ("stream", 4, {"X_WORDS": True}),
    "stream_wide_xw": ("stream", 1, {"SUBNORMAL": True, "X_WORDS": True}),
    "stream_gated": ("stream", 4, {"GATED": True}),
    "stream_xw_bn512": ("stream", 4, {"X_WORDS": True, "BLOCK_N": 512}),
    "stream_xw_sub_bn512": ("stream", 4, {"X_WORDS": True, "BLOCK_N": 512, "SUBNORMAL": True}),
    "stream_xw_sub_bn1024": ("stream", 4, {"X_WORDS": True, "BLOCK_N": 1024, "SUBNORMAL": True}),
    "stream_gated_sub_bn1024": ("stream", 4, {"GATED": True, "BLOCK_N": 1024, "SUBNORMAL": True}),
    # x fp32, already scaled and summed by the kernel that writes it (kernels.int4_gemv_stream.prepare_x)
    "stream_prepared_bn512": ("stream", 4, {"PREPARED": True, "BLOCK_N": 512, "SUBNORMAL": True}),
    "stream_gated_bn512": ("stream", 4, {"GATED": True, "BLOCK_N": 512}),
    "stream_xw_sub": ("stream", 4, {"X_WORDS": True, "SUBNORMAL": True}),
    "stream_gated_sub": ("stream", 4, {"GATED": True, "SUBNORMAL": True}),
    "stream_sub_bk128": ("stream", 4, {"SUBNORMAL": True, "BLOCK_K": 128}),  # x shared through shared memory
    "stream_xw_sub_bk128_bn512": ("stream", 4, {"X_WORDS": True, "SUBNORMAL": True, "BLOCK_K": 128, "BLOCK_N": 512}),
}
# Argument types for the compile: every pointer not named here is bf16, every scalar not named here i32
POINTERS = {
    "qw_ptr": "*i32", "g_ptr": "*i32", "z_ptr": "*u8", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "ssi_ptr": "*fp32",
    "sso_ptr": "*fp32", "xs_ptr": "*fp32",
}  # fmt: skip
SCALARS = {"eps": "fp32"}
UNALIGNED = (
    "M",
    "one_bits",
    "stride_xk",
    "eps",
    "num_parts",
)  # launcher scalars Triton does not see as multiples of 16


@dataclass(frozen=True)
class Census:
    registers: int
    instructions: int  # the whole kernel
    loop: int  # the innermost loop's body
    weights: int  # weights a thread takes in one trip of that loop

    def row(self) -> dict[str, Any]:
        return {**self.__dict__, "per_weight": round(self.loop / self.weights, 2)}


def _kernel(name: str) -> Any:
    if name == "split":
        from kernels.int4_gemv import _int4_gemv_kernel

        return _int4_gemv_kernel
    from kernels.int4_gemv_stream import _int4_gemv_stream_kernel

    return _int4_gemv_stream_kernel


def compile_sm90(kernel: Any, constexprs: dict[str, Any], num_warps: int) -> Any:
    """``kernel`` (a ``triton.jit`` function) compiled for sm_90 here, as its launcher specializes it: pointers
    and sizes 16-aligned but ``UNALIGNED``'s scalars; ``NUM_STAGES`` (default 3) as the pipeline's depth."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    pointers = {**POINTERS, "x_ptr": "*fp32"} if constexprs.get("PREPARED") else POINTERS
    signature = {
        a: "constexpr" if a in constexprs else pointers.get(a, "*bf16" if a.endswith("_ptr") else SCALARS.get(a, "i32"))
        for a in names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if a not in constexprs and a not in UNALIGNED
    }
    return triton.compile(
        ASTSource(kernel, signature, constexprs, aligned), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": constexprs.get("NUM_STAGES", 3)},
    )  # fmt: skip


def ptxas_sass(compiled: Any) -> tuple[str, str]:
    """ptxas's report (``-v``) and cuobjdump's SASS of a ``triton.compile`` result for sm_90 (the wheel's tools)."""
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.o")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        ptxas = [os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name=sm_90a", ptx, "-o", cubin]
        report = subprocess.run(ptxas, capture_output=True, text=True, check=True).stderr
        dump = [os.path.join(bin_dir, "cuobjdump"), "-sass", cubin]
        return report, subprocess.run(dump, capture_output=True, text=True, check=True).stdout


def count(report: str, sass: str, weights: int) -> Census:
    """Registers from ptxas's report; instructions and the shortest backward branch's body from the SASS."""
    registers = re.search(r"Used (\d+) registers", report)
    if registers is None:
        raise ValueError("no register count in ptxas's report")
    addresses, loops = [], []
    for line in sass.splitlines():
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]*);", line)
        if ins is None:
            continue
        at = int(ins.group(1), 16)
        addresses.append(at)
        branch = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", ins.group(2))
        if branch and int(branch.group(1), 16) < at:  # a backward branch closes a loop
            loops.append((at - int(branch.group(1), 16)) // 16 + 1)
    if not loops:
        raise ValueError("no loop in the SASS")
    return Census(int(registers.group(1)), len(addresses), min(loops), weights)


def census(name: str) -> Census:
    kernel, warps, over = VARIANTS[name]
    constexprs = {**BASE, **(SPLIT_ONLY if kernel == "split" else STREAM_ONLY), **over}
    report, sass = ptxas_sass(compile_sm90(_kernel(kernel), constexprs, warps))
    weights = constexprs["BLOCK_N"] * constexprs["BLOCK_K"] // (32 * warps)  # one row of x: M = 1
    return count(report, sass, weights)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    for name in args.only:
        row = {"variant": name, **census(name).row()}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
