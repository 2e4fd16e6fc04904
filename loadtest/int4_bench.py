"""W4A16 benchmarks (issue 13): ``python -m loadtest.int4_bench [--tiny] [--out FILE]``.

1. GEMM: both paths of the int4 linear layer (group 128) against bf16 cuBLAS (``x @ W^T``) on the
   Llama-3-8B layer shapes at M = 1 .. 4096: ``fused`` (the Triton int4 GEMM, ``kernels.int4_gemm``, and its
   ``VARIANTS``) and ``dequant+matmul`` (``kernels.int4_dequant`` into a scratch buffer, then cuBLAS, and its
   ``DEQUANT_VARIANTS``; the dequantization is also timed alone); GB/s counts weights + scales + zeros +
   activations + output once. Every variant that applies at M (aliases of one launch run once) is checked
   against the torch reference, then timed in CUDA graphs cycling through weight copies that overflow the
   L2 (``kernel_bench_common.time_graph``); then both paths are replayed from CUDA graphs and checked. Printed
   last (``loadtest.int4_stats``): per shape and M both paths, the best variant and cuBLAS; per M each
   variant's time over the best, to pick ``pick_config``'s defaults; the "crossover" line: from which M
   dequant+matmul beats the fused GEMM, i.e. what ``kernels.int4_dequant.DEQUANT_MIN_M`` should be.
2. Model (``loadtest.int4_model``): batch-1 time per output token of an 8B-shape random int4 model against
   its own 4-bit floor and the bf16 model in the same run; with ``--mixed``, the ``mixed`` workload's
   throughput for both.

``--tiny`` runs everything on CPU at tiny shapes (every variant under the Triton interpreter, checked against
the reference; the engine on the ``tiny`` shape), so the script and its variants are tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():
    # the Triton kernel runs under the interpreter; the flag is read when ``@triton.jit`` decorates
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.int4_config import Int4GemmConfig  # noqa: E402
from kernels.int4_dequant import (  # noqa: E402
    DequantConfig,
    DequantScratch,
    dequantize_int4,
    int4_dequant,
    int4_dequant_linear,
)
from kernels.int4_gemm import int4_gemm, int4_gemm_ref  # noqa: E402
from loadtest.int4_gemm_sweep import (  # noqa: E402
    LAYER_SHAPES_8B,
    LAYER_SHAPES_TINY,
    PREFILL,
    ROTATE_BYTES,
    ShapeData,
    check_and_time,
    gemv_table,
    int4_bytes,
    make_shape,
    random_int4,
    rel_err,
    time_fused_variants,
    timer,
)
from loadtest.int4_model import GEMV_VARIANTS, GROUP_SIZE, bench_models  # noqa: E402
from loadtest.int4_stats import DEQUANT, FUSED, gemm_summary  # noqa: E402

M_VALUES = (1, 2, 4, 8, 16, 64, 128, 256, 1024, 4096)
M_VALUES_TINY = (1, 4, 16, 33, 1024)  # 1024: the prefill variants


@dataclass(frozen=True)
class DequantVariant:
    """A tile of ``int4_dequant``; ``kn``: dequantize into a ``[K, N]`` buffer and multiply ``x @ W`` (vLLM's
    AWQ layout) instead of the engine's ``[N, K]`` scratch and ``F.linear`` (the dense model's call)."""

    name: str
    config: DequantConfig = field(default_factory=DequantConfig)
    kn: bool = False


DEQUANT_VARIANTS = [
    DequantVariant(DEQUANT),  # what the engine runs from DEQUANT_MIN_M rows
    DequantVariant("dequant+matmul kn", kn=True),
    DequantVariant("dequant+matmul rows", DequantConfig(unpack_in_registers=False)),
    DequantVariant("dequant+matmul bk32 bn256", DequantConfig(block_k=32, block_n=256)),
    DequantVariant("dequant+matmul bk128 w8", DequantConfig(block_k=128, num_warps=8)),
]


def dequant_bytes(n: int, k: int, elem: int = 2) -> int:
    """What ``int4_dequant`` reads (packed weights, scales, zeros) and writes (the dense weight)."""
    return int4_bytes(0, n, k, elem) + n * k * elem


def _dequant_fns(shape: ShapeData, v: DequantVariant) -> tuple[Callable[..., torch.Tensor], Callable[..., object]]:
    """``(x, w) -> x @ dequant(w)^T`` and ``w -> dequant(w)`` of one variant, into the shape's buffers."""
    if v.kn:
        out = shape.kn_buffer.t()  # [N, K] view of the [K, N] buffer

        def kn_linear(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
            int4_dequant(**w, group_size=GROUP_SIZE, out=out, config=v.config)
            return x @ shape.kn_buffer

        return kn_linear, lambda w: int4_dequant(**w, group_size=GROUP_SIZE, out=out, config=v.config)

    def linear(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        return int4_dequant_linear(x, **w, group_size=GROUP_SIZE, scratch=shape.scratch, config=v.config)

    nk = shape.scratch.weight(shape.n, shape.k, shape.kn_buffer.dtype, shape.kn_buffer.device)
    return linear, lambda w: int4_dequant(**w, group_size=GROUP_SIZE, out=nk, config=v.config)


def dequant_exact(shape: ShapeData) -> dict[str, bool]:
    """Each dequant variant's weight == ``dequantize_int4``'s, bit for bit."""
    w0 = shape.weights[0]
    ref = dequantize_int4(**w0, group_size=GROUP_SIZE)
    exact = {}
    for v in DEQUANT_VARIANTS:
        _, dequant = _dequant_fns(shape, v)
        dequant(w0)
        out = shape.kn_buffer.t() if v.kn else shape.scratch.weight(shape.n, shape.k, ref.dtype, ref.device)
        exact[v.name] = bool(torch.equal(out, ref))
    del ref
    return exact


def bench_case(
    shape: ShapeData,
    m: int,
    dtype: torch.dtype,
    device: torch.device,
    reps: int,
    with_dequant: bool = True,
) -> dict[str, Any]:
    """Every variant of both paths at this M: checked against the reference, then timed (GPU), and the
    dequantization alone; reference time (CPU)."""
    n, k, w0 = shape.n, shape.k, shape.weights[0]
    x = torch.randn(m, k, dtype=dtype, device=device)
    ref = int4_gemm_ref(x, **w0, group_size=GROUP_SIZE)
    row: dict[str, Any] = {"layer": shape.name, "m": m, "n": n, "k": k, "us": {}, "err": {}}
    time_fused_variants(row, shape, x, ref, reps)
    weights = shape.weights if m < PREFILL[0] else shape.weights[:2]  # prefill is compute bound: no L2 games
    time_it = timer(device)
    for v in DEQUANT_VARIANTS if with_dequant else ():
        linear, dequant = _dequant_fns(shape, v)
        check_and_time(row, v.name, linear, x, ref, weights, reps)
        if device.type == "cuda" and v.name in row["us"]:
            row.setdefault("dequant_us", {})[v.name] = round(
                1e6 * time_it([partial(dequant, w) for w in weights], reps), 2
            )
    if device.type == "cpu":  # interpreter: correctness only; the reference is what the CPU engine runs
        row["ref_ms"] = round(1e3 * time_it([lambda: int4_gemm_ref(x, **w0, group_size=GROUP_SIZE)], reps), 3)
        return row
    dense: list[Callable[[], object]] = [partial(torch.matmul, x, w.t()) for w in shape.dense]
    t_cublas = time_it(dense, reps) * 1e6
    row["cublas_us"] = round(t_cublas, 2)
    if m == 1:  # what any kernel that moves this many bytes takes here, launch and DRAM latency included
        row["copy_us"] = round(1e6 * same_traffic_copy_s(int4_bytes(m, n, k), reps), 2)
    _add_rates(row, t_cublas)
    return row


def same_traffic_copy_s(num_bytes: int, reps: int) -> float:
    """Seconds per device copy of ``num_bytes // 2`` bytes (read + written: ``num_bytes`` of DRAM traffic, the
    M = 1 GEMM's), timed as the GEMMs are: many in one CUDA graph, cycling through buffers that overflow the L2.
    The bytes over the copy bandwidth are the floor ``int4_model`` counts; this adds what a small kernel pays
    on top (its launch in the graph, the first loads' latency, the last wave)."""
    half = max(1, num_bytes // 2)
    copies = max(2, min(32, ROTATE_BYTES // half))
    srcs = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(copies)]
    dst = torch.empty(half, dtype=torch.uint8, device="cuda")
    seconds = timer(dst.device)([partial(dst.copy_, src) for src in srcs], reps)
    del srcs, dst
    return seconds


def _add_rates(row: dict[str, Any], t_cublas: float) -> None:
    m, n, k, us = row["m"], row["n"], row["k"], row["us"]
    best = min(us, key=us.__getitem__)
    gb = int4_bytes(m, n, k) / 1e9
    row["best"] = best
    for key, t in (("fused", us[FUSED]), ("dequant", us.get(DEQUANT)), ("best", us[best])):
        if t is not None:
            row[f"{key}_gb_s"] = round(gb / (t * 1e-6), 1)
            row[f"{key}_vs_cublas"] = round(t_cublas / t, 2)  # > 1: faster than bf16 cuBLAS
    if DEQUANT in row.get("dequant_us", {}):  # the dequantization alone: its bytes over its time
        row["dequant_gb_s"] = round(dequant_bytes(n, k) / 1e9 / (row["dequant_us"][DEQUANT] * 1e-6), 1)
    row["fused_tflops"] = round(2 * m * n * k / (us[FUSED] * 1e-6) / 1e12, 1)
    row["cublas_tflops"] = round(2 * m * n * k / (t_cublas * 1e-6) / 1e12, 1)


def bench_gemm(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    shapes = LAYER_SHAPES_TINY if args.tiny else LAYER_SHAPES_8B
    m_values = args.m or (M_VALUES_TINY if args.tiny else M_VALUES)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    rows = []
    for name, n, k in shapes:
        shape = make_shape(name, n, k, dtype, device)
        exact = {} if args.skip_dequant else dequant_exact(shape)
        for m in m_values:
            reps = args.reps if m < PREFILL[0] else max(3, args.reps // 4)
            row = bench_case(shape, m, dtype, device, reps, with_dequant=not args.skip_dequant)
            row["dequant_exact"] = exact
            print(json.dumps(row), flush=True)
            rows.append(row)
        del shape
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# at M = 1, 4 (gemv) and 16 (dot): the default (atomic), the counter and the other kernel
GRAPH_CHECKS: dict[str, dict[str, Any]] = {
    FUSED: {},
    "counter": {"split_reduce": "counter"},
    "dot": {"kernel": "dot"},
}


def _replay_error(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, w: dict[str, torch.Tensor]) -> float:
    """``fn(x)`` run once, captured in a CUDA graph and replayed 5 times with new ``x``: the worst relative
    error against the reference."""
    fn(x)  # compiles; grows the shared split-K scratch, allocates the dequant scratch
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    worst = 0.0
    for _ in range(5):
        x.copy_(torch.randn_like(x))
        graph.replay()
        worst = max(worst, rel_err(out, int4_gemm_ref(x, **w, group_size=GROUP_SIZE)))
    return float(f"{worst:.1e}")


def check_graph_replay(device: torch.device) -> dict[str, float]:
    """Both paths on down_proj (K = 14336) replayed from CUDA graphs: the fused GEMM's default launch and its
    in-kernel split reductions (the arrival counters must come back to zero for the next replay) at
    M = 1, 4, 16, and dequant+matmul (its scratch allocated before the capture) at M = 256."""
    w = random_int4(4096, 14336, torch.bfloat16, device)
    errors = {}
    for m in (1, 4, 16):
        for name, fields in GRAPH_CHECKS.items():
            cfg = Int4GemmConfig(**fields)
            x = torch.zeros(m, 14336, dtype=torch.bfloat16, device=device)
            errors[f"{name} M={m}"] = _replay_error(partial(int4_gemm, **w, group_size=GROUP_SIZE, config=cfg), x, w)
    x = torch.zeros(256, 14336, dtype=torch.bfloat16, device=device)
    scratch = DequantScratch()

    def dequant_linear(x: torch.Tensor) -> torch.Tensor:
        return int4_dequant_linear(x, w["qweight"], w["scales"], w["zeros"], GROUP_SIZE, scratch=scratch)

    errors[f"{DEQUANT} M=256"] = _replay_error(dequant_linear, x, w)
    return errors


def add_practical_floor(results: dict[str, Any], shape: str) -> None:
    """The int4 model's batch-1 floor plus what each of its layer GEMMs pays beyond its bytes, measured as a
    copy moving the same bytes (``copy_us`` of the M = 1 rows): ``practical_floor_ms`` and the TPOT over it.
    Only where both parts ran on the 8B shape, whose layers the GEMM rows are."""
    from loadtest.shapes import SHAPES

    rows = {r["layer"]: r for r in results.get("gemm", []) if r["m"] == 1 and "copy_us" in r}
    lat = results.get("int4", {}).get("latency", {})
    if shape != "8b" or "floor_ms" not in lat or set(rows) != {name for name, _, _ in LAYER_SHAPES_8B}:
        return
    tb_s = results["copy_tb_s"]
    extra_us = sum(r["copy_us"] - int4_bytes(1, r["n"], r["k"]) / (tb_s * 1e6) for r in rows.values())
    practical = lat["floor_ms"] + int(SHAPES[shape]["num_hidden_layers"]) * extra_us / 1e3  # type: ignore[call-overload]
    lat["practical_floor_ms"] = round(practical, 3)
    lat["ratio_to_practical_floor"] = round(lat["tpot_ms"] / practical, 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.int4_bench", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (correctness of the script)")
    parser.add_argument("--shape", default="8b", help="model shape of loadtest.shapes for the model part")
    parser.add_argument("--only", choices=("gemm", "model", "all"), default="all")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--mixed", action="store_true", help="also the mixed workload's throughput, int4 vs bf16")
    parser.add_argument("--batches", type=int, nargs="*", help="model: also the time per output token at these batches")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--m", type=int, nargs="+", help=f"GEMM rows to run (default {M_VALUES})")
    parser.add_argument("--skip-dequant", action="store_true", help="time the fused GEMM variants only")
    parser.add_argument(
        "--gemv-variants", nargs="+", default=[], choices=sorted(GEMV_VARIANTS),
        help="also the int4 model with these GEMV defaults (loadtest.int4_model.GEMV_VARIANTS)",
    )  # fmt: skip
    parser.add_argument(
        "--bf16-variants", nargs="+", default=[], choices=sorted(GEMV_VARIANTS),
        help="also the bf16 model with these of the same switches (those of its kernels: decode attention, norms)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("int4_bench needs CUDA (or --tiny on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if args.only in ("gemm", "all"):
        if device.type == "cuda":
            from loadtest.shapes import measure_copy_bandwidth

            results["gemm_copy_tb_s"] = round(measure_copy_bandwidth(), 3)  # the GEMV table's reference
        results["gemm"] = bench_gemm(args, device)
        if device.type == "cuda":
            results["graph_replay_err"] = check_graph_replay(device)
        if args.out:  # kept if the model part fails
            Path(args.out).write_text(json.dumps(results, indent=2))
    if args.only in ("model", "all"):
        try:
            bench_models(args, device, results)
        except Exception as exc:  # one GPU run: still print the GEMM summary below
            if args.tiny:
                raise
            results["model_error"] = f"{type(exc).__name__}: {exc}"
    add_practical_floor(results, args.shape)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "gemm"}))
    if "gemm" in results and device.type == "cuda":
        print("\n".join(gemm_summary(results["gemm"])))
        print("\n".join(gemv_table(results["gemm"], results.get("gemm_copy_tb_s"))))
        bad = {case: err for case, err in results["graph_replay_err"].items() if not err < 1e-2}
        print(f"CUDA-graph replays WRONG: {bad}" if bad else "CUDA-graph replays: all match the reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
