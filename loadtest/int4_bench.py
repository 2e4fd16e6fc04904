"""W4A16 benchmarks (issue 13): ``python -m loadtest.int4_bench [--tiny]``.

1. GEMM: the Triton int4 GEMM (group 128) against bf16 cuBLAS (``x @ W^T``) on the Llama-3-8B layer shapes
   at M = 1, 16, 64, 256, 4096: TFLOP/s (2 M N K) and GB/s (weights + scales + zeros + activations + output,
   each read or written once). Each shape is checked against the torch reference first, then timed in CUDA
   graphs that cycle through enough weight copies to overflow the L2 (``kernels_bench.time_graph``), for
   the default launch and a few variants, so the best tile/split can be read off.
2. Model: batch-1 time per output token of an 8B-shape random int4 model (dummy weights, same layers)
   against its own 4-bit floor (bytes of every weight read per token / measured copy bandwidth) and against
   the bf16 model in the same run; with ``--mixed``, the ``mixed`` workload's throughput for both.

``--tiny`` runs everything on CPU at tiny shapes (the reference GEMM, the Triton kernel under the interpreter
for correctness, the engine on the ``tiny`` shape), so the script is tested without a GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

if "--tiny" in sys.argv and not torch.cuda.is_available():
    # the Triton kernel runs under the interpreter; the flag is read when ``@triton.jit`` decorates
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.int4_gemm import Int4GemmConfig, int4_gemm, int4_gemm_ref, pack_int4  # noqa: E402

GROUP_SIZE = 128
ROTATE_BYTES = 512 << 20  # weight copies cycled per graph: ~10x the H200's L2
M_VALUES = (1, 16, 64, 256, 4096)
# Llama-3-8B: (name, N, K) of each projection, fused as the engine runs them
LAYER_SHAPES_8B = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LAYER_SHAPES_TINY = (("qkv", 256, 128), ("down", 128, 256))
VARIANTS: list[dict[str, Any]] = [
    {},
    {"split_k": 1},
    {"split_k": 4},
    {"block_n": 128},
    {"block_n": 32},
    {"block_k": 64},
    {"num_stages": 2},
    {"num_warps": 8},
    {"unpack_in_registers": True},
    {"unpack_in_registers": True, "block_n": 128},
    {"unpack_in_registers": True, "block_k": 128},
]


def random_int4(n: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    groups = k // GROUP_SIZE
    return {
        "qweight": pack_int4(codes).to(device),
        "scales": (0.002 + 0.004 * torch.rand(groups, n, generator=gen)).to(dtype).to(device),
        "zeros": torch.randint(6, 10, (groups, n), generator=gen).to(torch.uint8).to(device),
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


def bench_gemm_shape(
    name: str, n: int, k: int, m: int, dtype: torch.dtype, device: torch.device, reps: int
) -> dict[str, Any]:
    timer = _timer(device)
    copies = max(1, min(16, ROTATE_BYTES // (n * k // 2))) if device.type == "cuda" else 1
    weights = [random_int4(n, k, dtype, device, seed=i) for i in range(copies)]
    x = torch.randn(m, k, dtype=dtype, device=device)
    w0 = weights[0]
    ref = int4_gemm_ref(x, w0["qweight"], w0["scales"], w0["zeros"], GROUP_SIZE)
    out = int4_gemm(x, w0["qweight"], w0["scales"], w0["zeros"], GROUP_SIZE)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    row: dict[str, Any] = {"layer": name, "m": m, "n": n, "k": k, "rel_err": f"{err:.1e}"}
    if device.type == "cpu":  # interpreter: correctness only; the reference is what the CPU engine runs
        row["ref_ms"] = round(1e3 * timer([lambda: int4_gemm_ref(x, **w0, group_size=GROUP_SIZE)], reps), 3)
        return row
    flops = 2 * m * n * k
    variants = {}
    for variant in VARIANTS:
        cfg = Int4GemmConfig(**variant)
        calls: list[Callable[[], object]] = [
            partial(int4_gemm, x, **w, group_size=GROUP_SIZE, config=cfg) for w in weights
        ]
        try:
            t = timer(calls, reps)
        except Exception as exc:  # a variant past the shared-memory limit (OutOfResources): skip it
            if not variant:
                raise
            row.setdefault("skipped", []).append(f"{json.dumps(variant)}: {type(exc).__name__}")
            continue
        variants[json.dumps(variant) if variant else "default"] = t
    best_name = min(variants, key=variants.__getitem__)
    t_default, t_best = variants["default"], variants[best_name]
    dense = [torch.randn(n, k, dtype=dtype, device=device) for _ in range(max(1, min(8, ROTATE_BYTES // (2 * n * k))))]
    t_bf16 = timer([partial(torch.matmul, x, w.t()) for w in dense], reps)
    row.update(
        int4_ms=round(t_default * 1e3, 4),
        int4_tflops=round(flops / t_default / 1e12, 2),
        int4_gb_s=round(int4_bytes(m, n, k) / t_default / 1e9, 1),
        best=best_name,
        best_ms=round(t_best * 1e3, 4),
        best_gb_s=round(int4_bytes(m, n, k) / t_best / 1e9, 1),
        bf16_ms=round(t_bf16 * 1e3, 4),
        bf16_tflops=round(flops / t_bf16 / 1e12, 2),
        bf16_gb_s=round((2 * n * k + 2 * m * (n + k)) / t_bf16 / 1e9, 1),
        speedup_vs_bf16=round(t_bf16 / t_default, 2),
    )
    del weights, dense
    return row


def bench_gemm(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    shapes = LAYER_SHAPES_TINY if args.tiny else LAYER_SHAPES_8B
    m_values = (1, 16, 33) if args.tiny else M_VALUES
    dtype = torch.float32 if args.tiny else torch.bfloat16
    rows = []
    for name, n, k in shapes:
        for m in m_values:
            row = bench_gemm_shape(name, n, k, m, dtype, device, args.reps)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def quantized_shape_folder(shape: str, max_model_len: int) -> Path:
    """``shapes.shape_folder`` with a GPTQ-style 4-bit ``quantization_config`` (group 128, asymmetric)."""
    from loadtest.shapes import shape_folder

    folder = shape_folder(shape, max_position_embeddings=max_model_len)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": GROUP_SIZE,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": "gptq_v2",
    }
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
    if args.only in ("model", "all"):
        copy_tb_s = None
        if device.type == "cuda":
            from loadtest.shapes import measure_copy_bandwidth

            copy_tb_s = measure_copy_bandwidth()
            results["copy_tb_s"] = round(copy_tb_s, 3)
        results["int4"] = bench_model(args, device, quantized=True)
        results["bf16"] = bench_model(args, device, quantized=False)
        add_floors(results, copy_tb_s)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "gemm"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
