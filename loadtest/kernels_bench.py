"""Kernel micro-benchmarks (``pagedserve bench kernels``): paged decode attention GB/s of K+V read and
prefill attention TFLOP/s, each against torch SDPA on the same dense shapes in the same run.

Correctness at real sizes runs first. Every timing captures many calls in one CUDA graph (no launch gaps)
that cycle through enough copies of the inputs to overflow the 50 MB L2, and reports the median replay.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import sys
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from loadtest.kernel_bench_common import (
    BLOCK_SIZE,
    DTYPE,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    ROTATE_BYTES,
    rel_err,
    time_graph,
)
from loadtest.prefill_bench import (
    PREFILL_CASES,
    PREFILL_VARIANTS,
    bench_prefill,
    new_kv_from_cache,
    print_prefill_variants,
)

# (name, knobs of _paged_decode_attention), the names printed in the sweep's matrix and kept in the JSON.
# "partition_scale" scales the variant's default partition; "min_partition" sizes as if no partition could
# be shorter (128: the sizing measured on 2026-11-29); "fit": kernels.decode_plan.fit_partition_size with that
# many programs per SM (ptxas for sm_90: the default tile's 128 registers allow 4, block_n 32's 80 allow 6).
# "cap": no partition longer than that; "dynamic" with "programs_per_sm": each sequence's own length cut into that
# many programs per SM (kernels.decode_plan.use_dynamic).
# Rows named default* start from the default tile, the others from (64, 3 stages).
# Removed after the 2026-12-01 sweeps, where they never won a shape: fused_p0.5, fused_s2, fused_bn128_s2(_p2),
# fused_w8, two_launch_min128, two_launch_bn128_s2; after the 2026-12-03 sweep (bdb22e2), the unrolled tile loop
# (0.43-0.60 of SDPA where the loop gave 0.85-0.99: 176-255 registers, 2 programs per SM); after the short-context
# sweep (eeac913, batch 1 at 128-1024 tokens in 4k tables, and 8k), where none won a shape: the in-kernel merge
# over the default tile (0.46-1.01), partitions 4x longer (0.62-0.92), dynamic partitions of at least 128 / 256
# tokens (0.41-0.95; at batch 1 in the engine, 256 made TPOT 4.62 ms against 4.31) and dynamic + in-kernel merge.
# The in-kernel merge itself (rows fused, fused_p2) was then removed: it never won (0.60-0.77 of SDPA at batch 1,
# 1b86deb); two_launch* keep their names (every row merges in a second launch).
DECODE_VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("default", {}),
    ("two_launch", {}),
    ("two_launch_s2", {"num_stages": 2}),
    ("two_launch_p2", {"partition_scale": 2}),
    ("default_fit3", {"fit": 3}),
    ("default_fit4", {"fit": 4}),
    ("default_fit6", {"fit": 6}),
    ("default_bn32_fit6", {"block_n": 32, "fit": 6}),
    ("default_cap256", {"cap": 256}),
    ("default_cap512", {"cap": 512}),
    ("default_fit4_cap512", {"fit": 4, "cap": 512}),
    ("default_dyn3", {"dynamic": True, "programs_per_sm": 3}),
    ("default_dyn4", {"dynamic": True, "programs_per_sm": 4}),
    ("default_dyn6", {"dynamic": True, "programs_per_sm": 6}),
    ("default_dyn8", {"dynamic": True, "programs_per_sm": 8}),
    # batch 1 over a short sequence: one partition, no merge (2026-12-03, eeac913: the best row at 128 tokens, 4.4-4.6
    # us against the default's 4.9-6.1; from 256 tokens on 0.55-0.82 of SDPA where the default gives 0.97-1.23)
    ("default_p64", {"partition_scale": 64}),
    # the second launch's merge in chunks of 16 partitions (the default before 2026-12-04; MERGE_CHUNK is 64), and
    # 3 stages for every plan (small batches take them only with dynamic partitions). Removed after the
    # 2026-12-04 sweeps, where they never won a shape: an 8-warp merge (0.82-0.95), chunks of 32 or 128, 8-warp
    # partitions, 128-key tiles with or without one stage, twice the partitions, 8 dynamic programs per SM + a 128 chunk.
    ("auto_rc16", {"reduce_chunk": 16}),
    ("auto_s3", {"num_stages": 3}),
]


def check_correctness() -> list[dict[str, Any]]:
    from kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
    from kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
    from kernels.prefill_new_kv import prefill_attention_new_kv

    gen = torch.Generator(device="cuda")
    gen.seed()
    results: list[dict[str, Any]] = []
    lens = [1, 17, 4097, 32768]
    rows = [(0, 4096), (1000, 517), (3000, 1), (0, 1)]  # prefill: (cached prefix, new tokens)
    max_len = max(lens + [c + q for c, q in rows])
    num_blocks = 4 * math.ceil(max_len / BLOCK_SIZE) + 8
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = perm[: 4 * math.ceil(max_len / BLOCK_SIZE)].view(4, -1)  # [4, max_blocks], disjoint rows
    scale = HEAD_DIM**-0.5
    for window in (None, 1024):
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(4, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
        out = paged_decode_attention(q, cache, tables, seq_lens, scale, window)
        ref = paged_decode_attention_ref(q, cache, tables, seq_lens, scale, window)
        results.append({"kernel": "decode", "lens": lens, "window": window, "rel_err": rel_err(out, ref)})
        q_lens = torch.tensor([q_ for _, q_ in rows])
        qsl = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).cuda()
        seq_lens = torch.tensor([c + q_ for c, q_ in rows], dtype=torch.int32, device="cuda")
        q = torch.randn(int(q_lens.sum()), NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
        out = paged_prefill_attention(q, cache, tables, qsl, seq_lens, scale, window)
        ref = paged_prefill_attention_ref(q, cache, tables, qsl, seq_lens, scale, window)
        results.append({"kernel": "prefill", "rows": rows, "window": window, "rel_err": rel_err(out, ref)})
        key, value = new_kv_from_cache(cache, tables, rows)
        out = prefill_attention_new_kv(q, key, value, cache, tables, qsl, seq_lens, scale, window)
        results.append({"kernel": "prefill_new_kv", "rows": rows, "window": window, "rel_err": rel_err(out, ref)})
    for r in results:
        print(f"correctness {r['kernel']:14s} window={r['window']}: rel err {r['rel_err']:.2e}", flush=True)
    return results


def bench_decode(
    batch: int, seq_len: int, reps: int, variants: list[tuple[str, dict[str, Any]]], table_len: int = 0
) -> dict[str, Any]:
    """Every sequence ``seq_len`` long; ``table_len`` > ``seq_len`` pads the block tables to that many tokens, as a
    CUDA graph captured for the longest context pads them (the plan is made for the table's width)."""
    from kernels.paged_attention import _paged_decode_attention

    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize  # K + V read once
    copies = max(1, min(32, ROTATE_BYTES // kv_bytes))
    calls_per_graph = max(copies, 8 if kv_bytes > 1 << 30 else 32)
    blocks_per_seq = seq_len // BLOCK_SIZE
    num_blocks = copies * batch * blocks_per_seq
    scale = HEAD_DIM**-0.5
    table_len = max(table_len, seq_len)
    result: dict[str, Any] = {"batch": batch, "seq_len": seq_len, "table_len": table_len, "kv_bytes": kv_bytes}

    # dense SDPA first, then free it: B=256 x 32k needs 34 GB per copy of K+V
    k = [torch.randn(batch, NUM_KV_HEADS, seq_len, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(copies)]
    v = [torch.randn_like(x) for x in k]
    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
    sdpa_calls = [
        partial(F.scaled_dot_product_attention, q, k[i % copies], v[i % copies], scale=scale, enable_gqa=True)
        for i in range(calls_per_graph)
    ]
    t = time_graph(sdpa_calls, reps)
    result["sdpa_s"], result["sdpa_gbps"] = t, kv_bytes / t / 1e9
    del k, v, sdpa_calls
    torch.cuda.empty_cache()

    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(copies, batch, blocks_per_seq)
    pad = table_len // BLOCK_SIZE - blocks_per_seq  # entries past a sequence's length: never read
    tables = torch.cat([tables, tables.new_zeros(copies, batch, pad)], dim=2)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    result["variants"] = []
    for name, variant in variants:
        kwargs, plan = _decode_variant_kwargs(batch, table_len, name, variant)
        calls = [
            partial(_paged_decode_attention, query, cache, tables[i % copies], seq_lens, scale, None, **kwargs)
            for i in range(calls_per_graph)
        ]
        try:
            t = time_graph(calls, reps)
        except Exception as exc:  # a variant that fails to compile (resources) must not end the run
            print(f"  variant {name} {variant} failed: {exc!r:.200}", flush=True)
            continue
        gbps = kv_bytes / t / 1e9
        result["variants"].append(
            {"name": name, "variant": variant, **plan, "s": t, "gbps": gbps, "ratio": gbps / result["sdpa_gbps"]}
        )
    del cache, tables
    torch.cuda.empty_cache()
    default = result["variants"][0]
    best = max(result["variants"], key=lambda r: r["gbps"])
    result.update(
        default_partition=default["partition_size"], triton_gbps=default["gbps"], best_gbps=best["gbps"],
        best_variant=best["name"],
    )  # fmt: skip
    return result


def _decode_variant_kwargs(batch: int, seq_len: int, name: str, variant: dict[str, Any]) -> tuple[dict, dict]:
    """The variant's knobs for _paged_decode_attention, and its plan as the wrapper resolves it (for the
    JSON and the matrix). Every variant but "default" has fixed partitions unless it says "dynamic", and the
    ones not named default* start from block_n 64 and 3 stages, so a row means the same whatever the defaults
    of kernels.decode_plan pick."""
    from kernels.decode_plan import decode_partition_size, fit_partition_size, num_sms, plan_decode

    if name == "default" or name.startswith("auto"):  # auto*: the default plan with the variant's knobs
        kwargs: dict[str, Any] = dict(variant)
    elif name.startswith("default"):
        tile = plan_decode(batch, NUM_KV_HEADS, seq_len, 8)  # the default tile (any SM count)
        kwargs = {"block_n": tile.block_n, "num_stages": tile.num_stages, "dynamic": False, **variant}
    else:  # fixed partitions, whatever kernels.decode_plan.use_dynamic picks for the default
        kwargs = {"block_n": 64, "num_stages": 3, "dynamic": False, **variant}
    sms = num_sms(torch.cuda.current_device())
    if "fit" in kwargs:
        kwargs["partition_size"] = fit_partition_size(batch, NUM_KV_HEADS, seq_len, sms, kwargs.pop("fit"),
                                                      kwargs["block_n"])  # fmt: skip
    if "cap" in kwargs:  # no partition longer than this (a whole number of tiles)
        cap = kwargs.pop("cap") // kwargs["block_n"] * kwargs["block_n"]
        default = plan_decode(batch, NUM_KV_HEADS, seq_len, sms, block_n=kwargs["block_n"], dynamic=False)
        kwargs["partition_size"] = min(kwargs.get("partition_size", default.partition_size), cap)
    if "min_partition" in kwargs or "partition_scale" in kwargs:
        block_n = kwargs["block_n"]
        partition = decode_partition_size(
            batch, NUM_KV_HEADS, seq_len, sms, max(block_n, kwargs.pop("min_partition", 0))
        )
        kwargs["partition_size"] = max(block_n, int(partition * kwargs.pop("partition_scale", 1)))
    knobs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "reduce_chunk")}
    return kwargs, dataclasses.asdict(plan_decode(batch, NUM_KV_HEADS, seq_len, sms, **knobs))


def _pick(rows: list, args: argparse.Namespace) -> list:
    """The default row, and with --sweep the others (only those named in --variants, when given)."""
    if not args.sweep:
        return rows[:1]
    unknown = set(args.variants or ()) - {r[0] for r in DECODE_VARIANTS + PREFILL_VARIANTS}
    if unknown:
        raise SystemExit(f"--variants: no such rows {sorted(unknown)}")
    return [r for i, r in enumerate(rows) if i == 0 or args.variants is None or r[0] in args.variants]


def bench_silu_and_mul(num_tokens: int, inter: int, reps: int) -> dict[str, Any]:
    """The fused gated activation against torch's silu + mul, GB/s of the minimum traffic (read 2I, write I)."""
    from kernels.activation import silu_and_mul, silu_and_mul_ref

    nbytes = 3 * num_tokens * inter * DTYPE.itemsize
    copies = max(1, min(16, ROTATE_BYTES // nbytes))
    xs = [torch.randn(num_tokens, 2 * inter, device="cuda", dtype=DTYPE) for _ in range(copies)]
    err = rel_err(silu_and_mul(xs[0]), silu_and_mul_ref(xs[0]))
    calls = max(copies, 8)
    t_fused = time_graph([partial(silu_and_mul, xs[i % copies]) for i in range(calls)], reps)
    t_torch = time_graph([partial(silu_and_mul_ref, xs[i % copies]) for i in range(calls)], reps)
    del xs
    torch.cuda.empty_cache()
    return {
        "num_tokens": num_tokens,
        "inter": inter,
        "rel_err": err,
        "triton_gbps": nbytes / t_fused / 1e9,
        "torch_gbps": nbytes / t_torch / 1e9,
        "speedup": t_torch / t_fused,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve bench kernels", description=__doc__)
    parser.add_argument("--out", help="write the full results as JSON here")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 8192, 32768])
    parser.add_argument(
        "--table-lens", type=int, nargs="*", default=[],
        help="also time batch 1 at each --seq-lens with block tables this many tokens wide (a CUDA graph's)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-cases", nargs="+", default=[c[0] for c in PREFILL_CASES], choices=[c[0] for c in PREFILL_CASES]
    )
    parser.add_argument(
        "--only", nargs="+", choices=("decode", "prefill", "silu"), default=("decode", "prefill", "silu"),
        help="benchmark only these kernels (the correctness check still runs unless --skip-check)",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=7, help="graph replays per timing (median reported)")
    parser.add_argument("--sweep", action="store_true", help="also time tuning variants of each kernel")
    parser.add_argument("--variants", nargs="+", default=None, help="with --sweep: only these rows (and default)")
    parser.add_argument("--skip-check", action="store_true")
    return parser


def _write(report: dict[str, Any], path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


def _run_decode(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The decode shapes, each written to ``--out`` as it is measured (a run cut short by its time limit keeps
    the shapes it measured)."""
    variants = _pick(DECODE_VARIANTS, args)
    for batch in args.batches if "decode" in args.only else []:
        for seq_len in args.seq_lens:
            for table_len in [0] + [t for t in args.table_lens if batch == 1 and t > seq_len]:
                r = bench_decode(batch, seq_len, args.reps, variants, table_len)
                report["decode"].append(r)
                _write(report, args.out)
                print(
                    f"decode B={batch:4d} L={seq_len:6d} table {r['table_len']:6d}: triton {r['triton_gbps']:7.0f} "
                    f"GB/s  best {r['best_gbps']:7.0f} {r['best_variant']}  sdpa {r['sdpa_gbps']:7.0f} GB/s  ratio "
                    f"{r['triton_gbps'] / r['sdpa_gbps']:.2f}",
                    flush=True,
                )


def _run_prefill(args: argparse.Namespace, report: dict[str, Any]) -> None:
    variants = _pick(PREFILL_VARIANTS, args)
    for case, context_len, q_len in PREFILL_CASES if "prefill" in args.only else []:
        if case in args.prefill_cases:
            report["prefill"].append(bench_prefill(case, context_len, q_len, args.reps, variants))
            p = report["prefill"][-1]
            print(
                f"prefill {case}: triton {p['triton_tflops']:.0f} TFLOP/s  best {p['best_tflops']:.0f} "
                f"{p['best_variant']}  sdpa {p['sdpa_tflops']:.0f} TFLOP/s", flush=True,
            )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "correctness": [] if args.skip_check else check_correctness(),
        "decode": [],
        "prefill": [],
    }
    ok = all(r["rel_err"] < 1e-2 for r in report["correctness"])
    _run_decode(args, report)
    _run_prefill(args, report)
    sizes = (256, 8192) if "silu" in args.only else ()
    report["silu_and_mul"] = [bench_silu_and_mul(t, 14336, args.reps) for t in sizes]
    _print_table(report)
    if args.sweep:
        _print_decode_variants(report["decode"])
        print_prefill_variants(report["prefill"])
    _write(report, args.out)
    return 0 if ok else 1


def _print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']}  torch {report['torch']}  triton {report['triton']}  {report['date']}")
    print("| B | L | KV MB | triton GB/s | SDPA GB/s | ratio | best variant GB/s (ratio) |")
    print("|---|---|---|---|---|---|---|")
    for r in report["decode"]:
        print(
            f"| {r['batch']} | {r['seq_len']} | {r['kv_bytes'] / 1e6:.0f} | {r['triton_gbps']:.0f} | "
            f"{r['sdpa_gbps']:.0f} | {r['triton_gbps'] / r['sdpa_gbps']:.2f} | "
            f"{r['best_gbps']:.0f} ({r['best_gbps'] / r['sdpa_gbps']:.2f}) {r['best_variant']} |"
        )
    for p in report["prefill"]:
        print(
            f"prefill {p['case']} (prefix {p['context_len']} + {p['num_tokens']} new, causal): triton "
            f"{p['triton_tflops']:.0f} TFLOP/s, best {p['best_tflops']:.0f} {p['best_variant']}, SDPA "
            f"{p['sdpa_tflops']:.0f} TFLOP/s, ratio {p['triton_tflops'] / p['sdpa_tflops']:.2f}"
        )
    for a in report["silu_and_mul"]:
        print(
            f"silu_and_mul T={a['num_tokens']} I={a['inter']}: triton {a['triton_gbps']:.0f} GB/s, torch "
            f"{a['torch_gbps']:.0f} GB/s ({a['speedup']:.2f}x), rel err {a['rel_err']:.1e}"
        )
    for c in report["correctness"]:
        print(f"correctness {c['kernel']} window={c['window']}: rel err {c['rel_err']:.2e}")


def _shape_name(r: dict[str, Any]) -> str:
    table = r.get("table_len", r["seq_len"])
    return f"B={r['batch']} L={r['seq_len']}" + (f" table {table}" if table > r["seq_len"] else "")


def _print_decode_variants(decode: list[dict[str, Any]]) -> None:
    """One row per decode variant: its ratio to SDPA and partition count at every shape, the best of each
    column marked with *."""
    names = list(dict.fromkeys(v["name"] for r in decode for v in r["variants"]))
    print("\ndecode variants: ratio to SDPA / partitions, * best of the shape")
    print("| variant | " + " | ".join(_shape_name(r) for r in decode) + " |")
    print("|---" * (len(decode) + 1) + "|")
    for name in names:
        cells = []
        for r in decode:
            v = next((v for v in r["variants"] if v["name"] == name), None)
            if v is None:
                cells.append("failed")
                continue
            star = "*" if v["name"] == r["best_variant"] else ""
            cells.append(f"{v['ratio']:.3f}{star} /{v['num_partitions']}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
