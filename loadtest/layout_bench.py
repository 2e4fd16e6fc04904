"""Whether the batch-1 int4 GEMV gets faster with its activations in fp32 or as int32 pairs, other K tiles or stages,
or as stream-K.

Times, on the GPU, the M = 1 launch at the 8B shapes (down gated, as the engine runs it; PDL as the engine launches
it), many calls in one CUDA graph cycling weight copies past the L2: the split launch with bf16 loads of x (row
"default", the engine's launch before Session 37) against the same launch with x in fp32 (no conversion a value;
twice its bytes), x loaded as int32 pairs of bf16 (``x_words``: not on the gated down projection, which keeps its
loads), 3 stages, K tiles of 128 and 32, and the stream-K grid (``kernels.int4_gemv_stream``) of 512-column tiles at
0.5-1x the tile's programs an SM, and the engine's launch now (row "engine"); alternating, beside a copy of the same
bytes. Each variant is checked against the reference first. ``python -m loadtest.layout_bench [--variants NAME ...]
[--out F]`` (row "default" always).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from kernels.int4_config import Int4GemmConfig, Int4Launch
from kernels.int4_gemm import _launch_gemv, _pick, int4_gemm_gated_ref, int4_gemm_ref
from kernels.int4_gemv_stream import int4_gemv_stream_launch, prepare_x
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
# name -> (x in fp32, launch overrides, stream-K programs an SM as a multiple of the tile's own: 0 for the split grid,
# -1 for the grid the plan chose)
# Every row but "engine" starts from the split launch with bf16 loads of x ("default": the engine's launch before
# Session 37); "engine" is the engine's launch now (stream-K on gate_up and down, pairs).
VARIANTS: dict[str, tuple[bool, dict[str, Any], float]] = {
    "engine": (False, {}, -1),
    "default": (False, {}, 0),
    "x_fp32": (True, {}, 0),
    "x_words": (False, {"x_words": True}, 0),
    "stages3": (False, {"num_stages": 3}, 0),
    "bk128": (False, {"block_k": 128}, 0),
    "bk32": (False, {"block_k": 32}, 0),
    # the split grid with subnormal codes on every layer and 128-deep tiles (sm_90: 3.07 instructions a weight)
    "sub_bk128": (False, {"subnormal": True, "block_k": 128}, 0),
    # 512-column tiles of 4 warps (gate_up too): 4 columns a thread share each x value (sm_90 K loop 3.97 instructions
    # a weight with pairs against 4.57 at 256 columns; 3.34 with subnormal codes; the gated down 3.96 against 4.47)
    "stream_xw_bn512": (False, {"x_words": True, "block_n": 512, "num_warps": 4}, 1),
    "stream_xw_bn512_half": (False, {"x_words": True, "block_n": 512, "num_warps": 4}, 0.5),
    "stream_xw_sub_bn512": (False, {"x_words": True, "block_n": 512, "num_warps": 4, "subnormal": True}, 1),
    "stream_xw_bn512_s3": (False, {"x_words": True, "block_n": 512, "num_warps": 4, "num_stages": 3}, 1),
    # 1024-column tiles: 8 columns a thread share each x value's conversion, scaling and sum (sm_90 K loop: 2.97
    # instructions a weight with pairs and subnormal codes against 3.34 at 512 columns, the gated down 2.77 against
    # 2.93; python -m loadtest.sass_census), at 147 / 168 registers: 3 programs of 4 warps an SM, not 4
    "stream_xw_sub_bn1024": (False, {"x_words": True, "block_n": 1024, "num_warps": 4, "subnormal": True}, 0.75),
    # x as the kernel that writes it would prepare it (kernels.int4_gemv_stream.prepare_x: fp32, scaled for the
    # subnormal codes, summed by word row), so the GEMV neither converts, scales nor sums x (sm_90 K loop 2.82
    # instructions a weight against 3.34, 72 registers); plain layers only (PREPARED_ROWS)
    "stream_prepared_bn512": (False, {"block_n": 512, "num_warps": 4, "subnormal": True, "x_words": False}, 1),
    # K tiles of 128, whose x tile Triton shares through shared memory (with pairs, subnormal codes and 512 columns:
    # 3.16 instructions a weight, 80 registers; python -m loadtest.sass_census)
    "stream_xw_sub_bk128_bn512": (
        False,
        {"x_words": True, "subnormal": True, "block_k": 128, "block_n": 512, "num_warps": 4},
        1,
    ),  # fmt: skip
}

PREPARED_ROWS = ("stream_prepared_bn512",)  # not on the gated down projection, whose x the GEMV computes


def variant_launch(cfg: Int4Launch, over: dict[str, Any], stream: float, sms: int) -> Int4Launch:
    """The launch ``cfg`` with a variant's overrides; a stream variant's grid is ``stream`` times its tile's programs an
    SM (the one-warp tile's GEMV_STREAM_WIDE_PPS, else GEMV_PROGRAMS_PER_SM); ``stream < 0`` keeps cfg's grid."""
    c = replace(cfg, **over)
    if stream < 0:
        return c  # the launch as the plan made it
    tile_programs = (GEMV_STREAM_WIDE_PPS if c.num_warps == 1 else GEMV_PROGRAMS_PER_SM) * sms
    return replace(c, stream_programs=int(stream * tile_programs))


def launch_variant(
    x: torch.Tensor,
    x32: torch.Tensor,
    prepared: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,
    gated: bool,
    engine: Int4Launch,
    split: Int4Launch,
    sms: int,
    w: dict[str, torch.Tensor],
    name: str,
) -> None:
    """Row ``name``'s launch on weights ``w`` (``engine``: the plan's launch, ``split``: the split launch the other
    rows start from; ``x32``: x in fp32; ``prepared``: :func:`prepare_x` of x, for PREPARED_ROWS), made before the
    timed graph."""
    fp32, over, stream = VARIANTS[name]
    c = variant_launch(engine if stream < 0 else split, over, stream, sms)
    if name not in PREPARED_ROWS:
        _launch_gemv(x32 if fp32 else x, w["qweight"], w["scales"], w["zeros"], GROUP, None, out, c, gated)
        return
    assert prepared is not None and not gated
    int4_gemv_stream_launch(
        x, w["qweight"], w["scales"], w["zeros"], GROUP, out, block_n=c.block_n, block_k=c.block_k,
        programs=c.stream_programs, num_warps=c.num_warps, num_stages=c.num_stages, subnormal=True, pdl=c.pdl,
        prepared=prepared,
    )  # fmt: skip


def bench_shape(name: str, reps: int, gen: torch.Generator, variants: list[str]) -> dict[str, Any]:
    n, k, gated = SHAPES[name]
    x = torch.randn(1, 2 * k if gated else k, generator=gen).to(torch.bfloat16).cuda()
    copies = max(2, min(32, ROTATE_BYTES // int4_bytes(1, n, k)))
    ws = [random_int4(n, k, torch.bfloat16, x.device, seed=i) for i in range(copies)]
    split = Int4GemmConfig(stream=False, x_words=False)
    cfg = _pick(x[:, :k], ws[0]["qweight"], ws[0]["scales"], GROUP, None, split)
    engine = _pick(x[:, :k], ws[0]["qweight"], ws[0]["scales"], GROUP, None, None)
    ref_fn = int4_gemm_gated_ref if gated else int4_gemm_ref
    ref = ref_fn(x, **ws[0], group_size=GROUP)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)

    sms = num_sms(x.device.index or 0)
    variants = [v for v in variants if not (gated and v in PREPARED_ROWS)]
    call = partial(launch_variant, x, x.float(), None if gated else prepare_x(x), out, gated, engine, cfg, sms)
    row: dict[str, Any] = {"layer": name, "n": n, "k": k, "block_n": cfg.block_n, "split": cfg.split_k, "err": {}}
    for v in variants:
        out.fill_(float("nan"))
        call(ws[0], v)
        torch.cuda.synchronize()
        row["err"][v] = rel_err(out, ref)
    for rnd in range(2):
        for v in variants:
            calls = [partial(call, w, v) for w in ws]
            row[f"{v}_us_{rnd}"] = round(1e6 * time_graph(calls, reps), 2)
    row["copy_us"] = round(1e6 * same_traffic_copy_s(int4_bytes(1, n, k), reps), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    variants = ["default", *(v for v in args.variants if v != "default")]  # every row beside the split launch
    if not torch.cuda.is_available():
        print("layout_bench needs a GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    report = {"device": torch.cuda.get_device_name()}
    report_rows(report, (bench_shape(name, args.reps, gen, variants) for name in SHAPES), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
