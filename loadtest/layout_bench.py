"""Whether the batch-1 int4 GEMV gets faster with its activations in fp32 or as int32 pairs, other K tiles or stages.

Times, on the GPU, the engine's M = 1 launch (``kernels.int4_plan``'s default, PDL as the engine launches it) at the
8B shapes (down gated, as the engine runs it), many calls in one CUDA graph cycling weight copies past the L2,
against the same launch with x in fp32 (no conversion a value; twice its bytes), x loaded as int32 pairs of
bf16 (``x_words``: not on the gated down projection, which keeps its loads), 3 stages, and K tiles of 128 and
32; alternating, beside a copy of the same bytes. Each variant is checked against the reference first.
``python -m loadtest.layout_bench [--out F]``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from kernels.int4_gemm import _pick, int4_gemm_gated_ref, int4_gemm_ref
from kernels.int4_gemv import int4_gemv_launch
from loadtest.int4_bench import same_traffic_copy_s
from loadtest.int4_gemm_sweep import GROUP_SIZE, int4_bytes, random_int4
from loadtest.kernel_bench_common import ROTATE_BYTES, rel_err, report_rows, time_graph

SHAPES = {
    "qkv": (6144, 4096, False),
    "o": (4096, 4096, False),
    "gate_up": (28672, 4096, False),
    "down": (4096, 14336, True),
}
GROUP = GROUP_SIZE
# name -> (x in fp32, launch overrides)
VARIANTS: dict[str, tuple[bool, dict[str, Any]]] = {
    "default": (False, {}),
    "x_fp32": (True, {}),
    "x_words": (False, {"x_words": True}),
    "stages3": (False, {"num_stages": 3}),
    "bk128": (False, {"block_k": 128}),
    "bk32": (False, {"block_k": 32}),
}


def bench_shape(name: str, reps: int, gen: torch.Generator) -> dict[str, Any]:
    n, k, gated = SHAPES[name]
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16).cuda()
    copies = max(2, min(32, ROTATE_BYTES // int4_bytes(1, n, k)))
    ws = [random_int4(n, k, torch.bfloat16, x.device, seed=i) for i in range(copies)]
    cfg = _pick(x[:, :k], ws[0]["qweight"], ws[0]["scales"], GROUP, None, None)
    ref_fn = int4_gemm_gated_ref if gated else int4_gemm_ref
    ref = ref_fn(x, **ws[0], group_size=GROUP)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)

    x32 = x.float()

    def call(w: dict[str, torch.Tensor], fp32: bool, over: dict[str, Any]) -> None:
        c = replace(cfg, **over)
        int4_gemv_launch(
            x32 if fp32 else x, w["qweight"], w["scales"], w["zeros"], GROUP, None, out,
            block_n=c.block_n, block_k=c.block_k, split_k=c.split_k, split_reduce=c.split_reduce,
            factored=c.factored, num_warps=c.num_warps, num_stages=c.num_stages, subnormal=c.subnormal,
            gated=gated, pdl=c.pdl, x_words=c.x_words,
        )  # fmt: skip

    row: dict[str, Any] = {"layer": name, "n": n, "k": k, "block_n": cfg.block_n, "split": cfg.split_k, "err": {}}
    for v, args in VARIANTS.items():
        out.fill_(float("nan"))
        call(ws[0], *args)
        torch.cuda.synchronize()
        row["err"][v] = rel_err(out, ref)
    for rnd in range(2):
        for v, args in VARIANTS.items():
            calls = [partial(call, w, *args) for w in ws]
            row[f"{v}_us_{rnd}"] = round(1e6 * time_graph(calls, reps), 2)
    row["copy_us"] = round(1e6 * same_traffic_copy_s(int4_bytes(1, n, k), reps), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("layout_bench needs a GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name()}
    report_rows(report, (bench_shape(name, args.reps, gen) for name in SHAPES), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
