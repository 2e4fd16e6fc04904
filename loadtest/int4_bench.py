"""W4A16 benchmarks (issue 13): ``python -m loadtest.int4_bench [--tiny] [--out FILE]``.

1. GEMM: the Triton int4 GEMM (group 128) against bf16 cuBLAS (``x @ W^T``) on the Llama-3-8B layer shapes
   at M = 1 .. 4096: GB/s (weights + scales + zeros + activations + output, each read or written once).
   Every variant of ``VARIANTS`` that applies at M (aliases of one launch run once) is checked against the
   torch reference, then timed in CUDA graphs cycling through weight copies that overflow the L2
   (``kernels_bench.time_graph``); then the defaults are replayed from CUDA graphs and checked. Printed
   last: per shape and M the default, the best variant and cuBLAS; per M each variant's time
   over the best (geometric mean over the shapes), to pick ``kernels.int4_gemm.pick_config``'s defaults.
2. Model: batch-1 time per output token of an 8B-shape random int4 model (dummy weights, same layers)
   against its own 4-bit floor (bytes of every weight read per token / measured copy bandwidth) and against
   the bf16 model in the same run; with ``--mixed``, the ``mixed`` workload's throughput for both.

``--tiny`` runs everything on CPU at tiny shapes (every variant under the Triton interpreter, checked against
the reference; the engine on the ``tiny`` shape), so the script and its variants are tested without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():
    # the Triton kernel runs under the interpreter; the flag is read when ``@triton.jit`` decorates
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.int4_gemm import Int4GemmConfig, Int4Launch, int4_gemm, int4_gemm_ref, pack_int4, pick_config  # noqa: E402

GROUP_SIZE = 128
ROTATE_BYTES = 512 << 20  # weight copies cycled per graph: ~10x the H200's L2
M_VALUES = (1, 2, 4, 8, 16, 64, 256, 4096)
M_VALUES_TINY = (1, 4, 16, 33, 1024)  # 1024: the prefill variants
# Llama-3-8B: (name, N, K) of each projection, fused as the engine runs them
LAYER_SHAPES_8B = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LAYER_SHAPES_TINY = (("qkv", 256, 128), ("down", 128, 256))
DECODE, PREFILL = (1, 16), (1024, 1 << 30)


@dataclass(frozen=True)
class Variant:
    """``Int4GemmConfig`` fields, run at ``m_range[0] <= M <= m_range[1]``."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    m_range: tuple[int, int] = (1, 1 << 30)


# the defaults (kernels.int4_gemm.pick_config) and the alternatives that came close in the H200 run at 7f8955d
# or were the defaults before it; where one is the default's launch at an M it is timed once, as an alias
VARIANTS = [
    Variant("default"),
    Variant("gemv", {"kernel": "gemv"}, DECODE),
    Variant("gemv counter", {"kernel": "gemv", "split_reduce": "counter"}, (1, 8)),
    Variant("gemv atomic", {"kernel": "gemv", "split_reduce": "atomic"}, (1, 8)),
    Variant("gemv bn128", {"kernel": "gemv", "block_n": 128}, (1, 8)),
    Variant("gemv bk128", {"kernel": "gemv", "block_k": 128}, (1, 1)),
    Variant("gemv split32", {"kernel": "gemv", "split_k": 32}, (1, 4)),
    Variant("gemv stages3", {"kernel": "gemv", "num_stages": 3}, (1, 2)),
    Variant("gemv exact", {"kernel": "gemv", "factored": False}, (1, 1)),  # what g_idx checkpoints run
    Variant("dot", {"kernel": "dot"}),
    Variant("dot counter", {"kernel": "dot", "split_reduce": "counter"}, (8, 256)),
    Variant("dot atomic", {"kernel": "dot", "split_reduce": "atomic"}, (8, 256)),
    Variant("dot rows", {"kernel": "dot", "unpack_in_registers": False}, (8, 1 << 30)),  # no unpack_in_registers
    Variant("dot unpack", {"kernel": "dot", "unpack_in_registers": True}, (8, 1 << 30)),
    Variant("dot bn128", {"kernel": "dot", "block_n": 128}, (16, 64)),
    Variant("dot stages4", {"kernel": "dot", "num_stages": 4}, PREFILL),
    Variant("dot bm128", {"kernel": "dot", "block_m": 128}, PREFILL),
]


def variants_at(m: int, n: int, k: int, num_sms: int) -> tuple[dict[str, Int4GemmConfig], dict[str, str]]:
    """The variants that run at this shape, one per distinct launch ("default" first), and the aliases
    dropped (name -> the variant with the same launch)."""
    launches: dict[Int4Launch, str] = {}
    configs, aliases = {}, {}
    for v in VARIANTS:
        if not v.m_range[0] <= m <= v.m_range[1]:
            continue
        cfg = Int4GemmConfig(**v.fields)
        launch = pick_config(m, n, k, GROUP_SIZE, num_sms, cfg)
        if launch in launches:
            aliases[v.name] = launches[launch]
        else:
            launches[launch] = v.name
            configs[v.name] = cfg
    return configs, aliases


def random_int4(n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    groups = k // GROUP_SIZE
    codes = torch.randint(0, 16, (k, n), generator=gen, device=device)
    return {
        "qweight": pack_int4(codes),
        "scales": (0.002 + 0.004 * torch.rand(groups, n, generator=gen, device=device)).to(dtype),
        "zeros": torch.randint(6, 10, (groups, n), generator=gen, device=device).to(torch.uint8),
    }


def int4_bytes(m: int, n: int, k: int, elem: int = 2) -> int:
    groups = k // GROUP_SIZE
    return n * k // 2 + groups * n * (elem + 1) + m * k * elem + m * n * elem


def _timer(device: torch.device) -> Callable[[list[Callable[[], object]], int], float]:
    if device.type == "cuda":
        from loadtest.kernels_bench import time_graph

        return time_graph

    def wall(calls: list[Callable[[], object]], reps: int) -> float:
        calls[0]()
        start = time.perf_counter()
        for _ in range(reps):
            for fn in calls:
                fn()
        return (time.perf_counter() - start) / (reps * len(calls))

    return wall


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@dataclass
class ShapeData:
    """One layer shape's weights on the device: int4 copies and dense bf16 copies (GPU only) to cycle."""

    name: str
    n: int
    k: int
    weights: list[dict[str, torch.Tensor]]
    dense: list[torch.Tensor]


def make_shape(name: str, n: int, k: int, dtype: torch.dtype, device: torch.device) -> ShapeData:
    on_gpu = device.type == "cuda"
    copies = max(1, min(16, ROTATE_BYTES // (n * k // 2))) if on_gpu else 1
    weights = [random_int4(n, k, dtype, device, seed=i) for i in range(copies)]
    dense_copies = max(1, min(8, ROTATE_BYTES // (2 * n * k))) if on_gpu else 0
    dense = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(dense_copies)]
    return ShapeData(name, n, k, weights, dense)


def bench_case(shape: ShapeData, m: int, dtype: torch.dtype, device: torch.device, reps: int) -> dict[str, Any]:
    """Every variant at this M: checked against the reference, then timed (GPU); reference time (CPU)."""
    n, k, w0 = shape.n, shape.k, shape.weights[0]
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    x = torch.randn(m, k, dtype=dtype, device=device)
    ref = int4_gemm_ref(x, **w0, group_size=GROUP_SIZE)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    configs, aliases = variants_at(m, n, k, num_sms)
    row: dict[str, Any] = {"layer": shape.name, "m": m, "n": n, "k": k, "aliases": aliases, "us": {}, "err": {}}
    timer = _timer(device)
    weights = shape.weights if m < PREFILL[0] else shape.weights[:2]  # prefill is compute bound: no L2 games
    for name, cfg in configs.items():
        try:
            err = _rel_err(int4_gemm(x, **w0, group_size=GROUP_SIZE, config=cfg), ref)  # compiles
            row["err"][name] = float(f"{err:.1e}")
            if err > tol:
                row.setdefault("wrong", []).append(name)
            elif device.type == "cuda":
                calls: list[Callable[[], object]] = [
                    partial(int4_gemm, x, **w, group_size=GROUP_SIZE, config=cfg) for w in weights
                ]
                row["us"][name] = round(1e6 * timer(calls, reps), 2)
        except Exception as exc:  # a variant past the shared-memory limit (OutOfResources): skip it
            if name == "default":
                raise
            row.setdefault("skipped", {})[name] = f"{type(exc).__name__}: {str(exc)[:80]}"
    if device.type == "cpu":  # interpreter: correctness only; the reference is what the CPU engine runs
        row["ref_ms"] = round(1e3 * timer([lambda: int4_gemm_ref(x, **w0, group_size=GROUP_SIZE)], reps), 3)
        return row
    dense: list[Callable[[], object]] = [partial(torch.matmul, x, w.t()) for w in shape.dense]
    t_cublas = timer(dense, reps) * 1e6
    row["cublas_us"] = round(t_cublas, 2)
    _add_rates(row, t_cublas)
    return row


def _add_rates(row: dict[str, Any], t_cublas: float) -> None:
    m, n, k, us = row["m"], row["n"], row["k"], row["us"]
    best = min(us, key=us.__getitem__)
    gb = int4_bytes(m, n, k) / 1e9
    row["best"] = best
    for key, t in (("default", us["default"]), ("best", us[best])):
        row[f"{key}_gb_s"] = round(gb / (t * 1e-6), 1)
        row[f"{key}_vs_cublas"] = round(t_cublas / t, 2)  # > 1: faster than bf16 cuBLAS
    row["default_tflops"] = round(2 * m * n * k / (us["default"] * 1e-6) / 1e12, 1)
    row["cublas_tflops"] = round(2 * m * n * k / (t_cublas * 1e-6) / 1e12, 1)


def bench_gemm(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    shapes = LAYER_SHAPES_TINY if args.tiny else LAYER_SHAPES_8B
    m_values = M_VALUES_TINY if args.tiny else M_VALUES
    dtype = torch.float32 if args.tiny else torch.bfloat16
    rows = []
    for name, n, k in shapes:
        shape = make_shape(name, n, k, dtype, device)
        for m in m_values:
            row = bench_case(shape, m, dtype, device, args.reps if m < PREFILL[0] else max(3, args.reps // 4))
            print(json.dumps(row), flush=True)
            rows.append(row)
        del shape
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# at M = 1, 4 (gemv) and 16 (dot): the default (atomic), the counter and the other kernel
GRAPH_CHECKS: dict[str, dict[str, Any]] = {
    "default": {},
    "counter": {"split_reduce": "counter"},
    "dot": {"kernel": "dot"},
}


def check_graph_replay(device: torch.device) -> dict[str, float]:
    """The default launch and the in-kernel split reductions, down_proj (K = 14336, split-K) captured in a
    CUDA graph and replayed with new activations: the worst relative error of 5 replays per case (the
    arrival counters must come back to zero for the next replay)."""
    w = random_int4(4096, 14336, torch.bfloat16, device)
    errors = {}
    for m in (1, 4, 16):
        for name, fields in GRAPH_CHECKS.items():
            cfg = Int4GemmConfig(**fields)
            x = torch.zeros(m, 14336, dtype=torch.bfloat16, device=device)
            int4_gemm(x, **w, group_size=GROUP_SIZE, config=cfg)  # compile and grow the scratch first
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = int4_gemm(x, **w, group_size=GROUP_SIZE, config=cfg)
            worst = 0.0
            for _ in range(5):
                x.copy_(torch.randn_like(x))
                graph.replay()
                worst = max(worst, _rel_err(out, int4_gemm_ref(x, **w, group_size=GROUP_SIZE)))
            errors[f"{name} M={m}"] = float(f"{worst:.1e}")
    return errors


def gemm_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per shape and M: default, best variant, cuBLAS; per M: each variant's time over the
    case's best, geometric mean over the shapes that ran it (1.00 = best everywhere)."""
    lines = [
        "layer    M    | default us  GB/s TFLOP/s x-cublas | best variant           us   GB/s x-cublas"
        " | cublas us TFLOP/s"
    ]
    for r in (r for r in rows if "best" in r):
        us = r["us"]
        lines.append(
            f"{r['layer']:8s} {r['m']:<4d} | {us['default']:8.1f} {r['default_gb_s']:6.0f} {r['default_tflops']:6.1f} "
            f"{r['default_vs_cublas']:6.2f} | {r['best']:20s} "
            f"{us[r['best']]:6.1f} {r['best_gb_s']:6.0f} {r['best_vs_cublas']:6.2f} | {r['cublas_us']:8.1f} "
            f"{r['cublas_tflops']:6.1f}"
        )
    for m in sorted({r["m"] for r in rows if "best" in r}):
        cases = [r for r in rows if r["m"] == m and "best" in r]
        ratios: dict[str, list[float]] = {}
        for r in cases:
            best = r["us"][r["best"]]
            for name, t in [*r["us"].items(), *((a, r["us"][b]) for a, b in r["aliases"].items() if b in r["us"])]:
                ratios.setdefault(name, []).append(t / best)
        geomean = {name: math.prod(v) ** (1 / len(v)) for name, v in ratios.items()}
        cells = [
            f"{name} {geomean[name]:.2f}" + ("" if len(ratios[name]) == len(cases) else f" ({len(ratios[name])})")
            for name in sorted(geomean, key=geomean.__getitem__)
        ]
        lines.append(f"M={m} time/best: " + ", ".join(cells))
    wrong = [f"{r['layer']} M={r['m']}: {r['wrong']}" for r in rows if r.get("wrong")]
    return lines + ([f"WRONG RESULTS (excluded): {wrong}"] if wrong else [])


def quantized_shape_folder(shape: str, max_model_len: int) -> Path:
    """``shapes.shape_folder`` with a GPTQ-style 4-bit ``quantization_config`` (group 128, asymmetric)."""
    from loadtest.shapes import shape_folder

    folder = shape_folder(shape, max_position_embeddings=max_model_len)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = dict(
        quant_method="gptq", bits=4, group_size=GROUP_SIZE, desc_act=False, sym=False, checkpoint_format="gptq_v2"
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _weight_bytes_read(engine: Any) -> int:
    """Bytes of every parameter and buffer a decode step reads: all but the embedding table (a lookup)."""
    model = engine.executor.runner.model
    tensors = [t for n, t in model.named_parameters() if "embed_tokens" not in n]
    tensors += [t for n, t in model.named_buffers() if "rotary" not in n]
    if getattr(model, "tie_word_embeddings", False):
        tensors.append(model.lm_head.weight)
    return sum(t.numel() * t.element_size() for t in tensors)


def bench_model(args: argparse.Namespace, device: torch.device, quantized: bool) -> dict[str, Any]:
    from engine.args import EngineArgs
    from engine.engine import Engine
    from loadtest.shapes import shape_folder
    from loadtest.throughput import run_engine, run_latency
    from loadtest.workloads import BenchRequest, make_workload

    shape = "tiny" if args.tiny else args.shape
    folder = quantized_shape_folder(shape, args.max_model_len) if quantized else shape_folder(shape, args.max_model_len)
    engine_args = EngineArgs(
        model=str(folder),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        device="cpu" if args.tiny else "auto",
        dtype="float32" if args.tiny else "bfloat16",
        enforce_eager=args.enforce_eager,
        num_gpu_blocks_override=256 if args.tiny else None,
    )
    engine = Engine(engine_args.create_engine_config())
    vocab = engine.vocab_size
    latency_req = make_workload("latency", vocab)[0]
    if args.tiny:
        latency_req = BenchRequest(latency_req.prompt_token_ids[:16], 8)
    res: dict[str, Any] = {"model": "int4" if quantized else "bf16", "weight_gb": _weight_bytes_read(engine) / 1e9}
    res["latency"] = run_latency(engine, latency_req)
    if args.mixed and not args.tiny:
        res["mixed"] = run_engine(engine, make_workload("mixed", vocab), "mixed")
    res["weight_gb"] = round(res["weight_gb"], 3)
    print(json.dumps(res), flush=True)
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def add_floors(results: dict[str, Any], copy_tb_s: float | None) -> None:
    """Floor = weight bytes / copy bandwidth (bytes read + written per second, as ``shapes`` measures it)."""
    if copy_tb_s is None:
        return
    for key in ("int4", "bf16"):
        lat = results[key]["latency"]
        floor_ms = results[key]["weight_gb"] * 1e9 / (copy_tb_s * 1e12) * 1e3
        lat["floor_ms"] = round(floor_ms, 3)
        lat["ratio_to_floor"] = round(lat["tpot_ms"] / floor_ms, 3)
    results["int4_tpot_vs_bf16"] = round(
        results["int4"]["latency"]["tpot_ms"] / results["bf16"]["latency"]["tpot_ms"], 3
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.int4_bench", description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (correctness of the script)")
    parser.add_argument("--shape", default="8b", help="model shape of loadtest.shapes for the model part")
    parser.add_argument("--only", choices=("gemm", "model", "all"), default="all")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--mixed", action="store_true", help="also the mixed workload's throughput, int4 vs bf16")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print("int4_bench needs CUDA (or --tiny on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    if args.only in ("gemm", "all"):
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
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "gemm"}))
    if "gemm" in results and device.type == "cuda":
        print("\n".join(gemm_summary(results["gemm"])))
        bad = {case: err for case, err in results["graph_replay_err"].items() if not err < 1e-2}
        print(f"CUDA-graph replays WRONG: {bad}" if bad else "CUDA-graph replays: all match the reference")
    return 0


def bench_models(args: argparse.Namespace, device: torch.device, results: dict[str, Any]) -> None:
    copy_tb_s = None
    if device.type == "cuda":
        from loadtest.shapes import measure_copy_bandwidth

        copy_tb_s = measure_copy_bandwidth()
        results["copy_tb_s"] = round(copy_tb_s, 3)
    results["int4"] = bench_model(args, device, quantized=True)
    results["bf16"] = bench_model(args, device, quantized=False)
    add_floors(results, copy_tb_s)


if __name__ == "__main__":
    raise SystemExit(main())
