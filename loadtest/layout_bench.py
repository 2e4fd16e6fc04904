"""Whether the batch-1 int4 GEMV gets faster with its activations in fp32 or as int32 pairs, other K tiles or stages,
or as stream-K.

Times, on the GPU, the engine's M = 1 launch (``kernels.int4_plan``'s default, PDL as the engine launches it) at the
8B shapes (down gated, as the engine runs it), many calls in one CUDA graph cycling weight copies past the L2,
against the same launch with x in fp32 (no conversion a value; twice its bytes), x loaded as int32 pairs of
bf16 (``x_words``: not on the gated down projection, which keeps its loads), 3 stages, K tiles of 128 and
32, and the stream-K grid (``kernels.int4_gemv_stream``) at 0.5-2x the tile's programs an SM (4; the wide tile's 8)
with and without the pairs, and with 512-column tiles of 4 warps; alternating, beside a copy of the same bytes. Each variant is checked against the
reference first. ``python -m loadtest.layout_bench [--variants NAME ...] [--out F]`` (the engine's launch always).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from kernels.int4_config import Int4Launch
from kernels.int4_gemm import _launch_gemv, _pick, int4_gemm_gated_ref, int4_gemm_ref
from kernels.int4_plan import GEMV_PROGRAMS_PER_SM, GEMV_STREAM_WIDE_PPS, num_sms
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
# name -> (x in fp32, launch overrides, stream-K programs an SM as a multiple of the tile's own: 0 for the split grid)
VARIANTS: dict[str, tuple[bool, dict[str, Any], float]] = {
    "default": (False, {}, 0),
    "x_fp32": (True, {}, 0),
    "x_words": (False, {"x_words": True}, 0),
    "stages3": (False, {"num_stages": 3}, 0),
    "bk128": (False, {"block_k": 128}, 0),
    "bk32": (False, {"block_k": 32}, 0),
    # the split grid with subnormal codes on every layer (sm_90: the gated down 3.38 instructions a weight and 64
    # registers against 4.47 and 127; 128-deep tiles 3.07), to tell the tile's part from the stream grid's
    "sub": (False, {"subnormal": True}, 0),
    "sub_bk128": (False, {"subnormal": True, "block_k": 128}, 0),
    "stream": (False, {}, 1),
    "stream_half": (False, {}, 0.5),
    "stream_2x": (False, {}, 2),
    "stream_xw": (False, {"x_words": True}, 1),
    "stream_xw_half": (False, {"x_words": True}, 0.5),
    "stream_xw_1.5x": (False, {"x_words": True}, 1.5),
    # 512-column tiles of 4 warps (gate_up too): 4 columns a thread share each x value (sm_90 K loop 3.97 instructions
    # a weight with pairs against 4.57 at 256 columns; 3.34 with subnormal codes; the gated down 3.96 against 4.47)
    "stream_xw_bn512": (False, {"x_words": True, "block_n": 512, "num_warps": 4}, 1),
    "stream_xw_bn512_half": (False, {"x_words": True, "block_n": 512, "num_warps": 4}, 0.5),
    "stream_xw_sub_bn512": (False, {"x_words": True, "block_n": 512, "num_warps": 4, "subnormal": True}, 1),
    # a stream program has several K tiles in one loop: a deeper pipeline may hide more of their loads
    "stream_xw_s3": (False, {"x_words": True, "num_stages": 3}, 1),
    "stream_xw_bn512_s3": (False, {"x_words": True, "block_n": 512, "num_warps": 4, "num_stages": 3}, 1),
    # subnormal codes (gated down: 3.36 instructions a weight, 79 registers, against 4.52 and 127), and K tiles of 128,
    # whose x tile Triton shares through shared memory (bf16 loads, subnormal: 3.06, 128 registers; with pairs and
    # 512 columns: 3.16, 80 registers); python -m loadtest.sass_census
    "stream_xw_sub": (False, {"x_words": True, "subnormal": True, "num_warps": 4, "block_n": 256}, 1),
    "stream_sub_bk128": (False, {"subnormal": True, "block_k": 128, "num_warps": 4, "block_n": 256}, 1),
    "stream_xw_sub_bk128_bn512": (
        False,
        {"x_words": True, "subnormal": True, "block_k": 128, "block_n": 512, "num_warps": 4},
        1,
    ),  # fmt: skip
}


def variant_launch(cfg: Int4Launch, over: dict[str, Any], stream: float, sms: int) -> Int4Launch:
    """The engine's launch ``cfg`` with a variant's overrides; a stream variant's grid is ``stream`` times its tile's
    programs an SM (the one-warp tile's GEMV_STREAM_WIDE_PPS, else GEMV_PROGRAMS_PER_SM)."""
    c = replace(cfg, **over)
    tile_programs = (GEMV_STREAM_WIDE_PPS if c.num_warps == 1 else GEMV_PROGRAMS_PER_SM) * sms
    return replace(c, stream_programs=int(stream * tile_programs))


def bench_shape(name: str, reps: int, gen: torch.Generator, variants: list[str]) -> dict[str, Any]:
    n, k, gated = SHAPES[name]
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16).cuda()
    copies = max(2, min(32, ROTATE_BYTES // int4_bytes(1, n, k)))
    ws = [random_int4(n, k, torch.bfloat16, x.device, seed=i) for i in range(copies)]
    cfg = _pick(x[:, :k], ws[0]["qweight"], ws[0]["scales"], GROUP, None, None)
    ref_fn = int4_gemm_gated_ref if gated else int4_gemm_ref
    ref = ref_fn(x, **ws[0], group_size=GROUP)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)

    x32 = x.float()

    sms = num_sms(x.device.index or 0)

    def call(w: dict[str, torch.Tensor], fp32: bool, over: dict[str, Any], stream: float) -> None:
        c = variant_launch(cfg, over, stream, sms)
        _launch_gemv(x32 if fp32 else x, w["qweight"], w["scales"], w["zeros"], GROUP, None, out, c, gated)

    row: dict[str, Any] = {"layer": name, "n": n, "k": k, "block_n": cfg.block_n, "split": cfg.split_k, "err": {}}
    for v, args in ((v, VARIANTS[v]) for v in variants):
        out.fill_(float("nan"))
        call(ws[0], *args)
        torch.cuda.synchronize()
        row["err"][v] = rel_err(out, ref)
    for rnd in range(2):
        for v, args in ((v, VARIANTS[v]) for v in variants):
            calls = [partial(call, w, *args) for w in ws]
            row[f"{v}_us_{rnd}"] = round(1e6 * time_graph(calls, reps), 2)
    row["copy_us"] = round(1e6 * same_traffic_copy_s(int4_bytes(1, n, k), reps), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    variants = ["default", *(v for v in args.variants if v != "default")]  # every row beside the engine's launch
    if not torch.cuda.is_available():
        print("layout_bench needs a GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name()}
    report_rows(report, (bench_shape(name, args.reps, gen, variants) for name in SHAPES), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
