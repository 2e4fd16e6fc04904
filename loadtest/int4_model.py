"""The model part of ``loadtest.int4_bench``: batch-1 time per output token of an 8B-shape random int4 model
(dummy weights, GPTQ config) against its own 4-bit floor (bytes of every weight read per token / measured
copy bandwidth) and against the bf16 model in the same run; with ``--mixed``, the ``mixed`` workload's
throughput for both (the int4 model's large steps take the dequant+matmul path from ``DEQUANT_MIN_M`` rows).
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

import torch

from deploy.gc_heap import freeze_heap, thaw_heap

GROUP_SIZE = 128  # of the random int4 model, and of int4_bench's GEMM sweep


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
    from loadtest.sweep import run_sweep
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
        # room for the largest batch asked for (the engine's default of 256 refused 512)
        max_num_seqs=max(256, *(getattr(args, "batches", None) or [0])),
    )
    engine = Engine(engine_args.create_engine_config())
    freeze_heap()  # as engine.LLM does (deploy.gc_heap); thawed below, before the next model
    vocab = engine.vocab_size
    latency_req = make_workload("latency", vocab)[0]
    if args.tiny:
        latency_req = BenchRequest(latency_req.prompt_token_ids[:16], 8)
    res: dict[str, Any] = {"model": "int4" if quantized else "bf16", "weight_gb": _weight_bytes_read(engine) / 1e9}
    res["latency"] = run_latency(engine, latency_req)
    if getattr(args, "batches", None) and not args.tiny:  # time per output token at a few decode batch sizes
        res["batches"] = run_sweep(engine, args.batches, 128, 128)
    if args.mixed and not args.tiny:
        res["mixed"] = run_engine(engine, make_workload("mixed", vocab), "mixed")
    res["weight_gb"] = round(res["weight_gb"], 3)
    print(json.dumps(res), flush=True)
    engine.shutdown()
    del engine
    thaw_heap()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def add_floors(results: dict[str, Any], copy_tb_s: float | None) -> None:
    """Floor = weight bytes / copy bandwidth (bytes read + written per second, as ``shapes`` measures it)."""
    if copy_tb_s is None:
        return
    runs = [k for k, v in results.items() if k.startswith(("int4", "bf16 ")) and isinstance(v, dict) and "latency" in v]
    for key in ["bf16", *runs]:
        lat = results[key]["latency"]
        floor_ms = results[key]["weight_gb"] * 1e9 / (copy_tb_s * 1e12) * 1e3
        lat["floor_ms"] = round(floor_ms, 3)
        lat["ratio_to_floor"] = round(lat["tpot_ms"] / floor_ms, 3)
        lat["vs_bf16"] = round(lat["tpot_ms"] / results["bf16"]["latency"]["tpot_ms"], 3)
    results["int4_tpot_vs_bf16"] = round(
        results["int4"]["latency"]["tpot_ms"] / results["bf16"]["latency"]["tpot_ms"], 3
    )


class NoLaunch:
    """A Triton kernel's stand-in that launches nothing: the ``bound_*`` variants time the model as if that kernel
    took no time (an upper bound on what fusing it away could give). Their tokens are wrong; only their time
    means anything."""

    def __getitem__(self, grid: object) -> Any:
        return lambda *args, **kwargs: None


# The int4 model again with other defaults (``--gemv-variants``): module constants ("module:NAME") set for the
# engine's life, so its CUDA graphs capture them; the same process and copy bandwidth as the default's run.
GEMV_VARIANTS: dict[str, dict[str, Any]] = {
    # the defaults again, in a later place of the same process: how much the order alone moves a variant's time
    "base": {},
    "sub": {"kernels.int4_plan:GEMV_SUBNORMAL": True},  # subnormal codes on every layer
    # the M = 1 GEMVs as split-K grids (no stream-K), then also with bf16 loads of x: the defaults before Session 37
    "nostream": {"kernels.int4_plan:GEMV_STREAM": False},
    "split": {"kernels.int4_plan:GEMV_STREAM": False, "kernels.int4_plan:GEMV_X_WORDS": False},
    # stream-K on down only: gate_up keeps the one-warp wide split tile, with pairs
    "widesplit": {"kernels.int4_plan:GEMV_STREAM_WIDE": False},
    # the stream launches (gate_up, down) at 1024 columns, 3 programs an SM (loadtest.layout_bench's row
    # stream_xw_sub_bn1024: 8 columns a thread share each x value's work)
    "bn1024": {"kernels.int4_plan:GEMV_STREAM_BLOCK_N": 1024, "kernels.int4_plan:GEMV_STREAM_PPS": 3},
    "narrow": {"kernels.int4_plan:GEMV_WIDE_N": 1 << 30},  # no wide-layer tile: the default before 2026-12-03
    "ungated": {"kernels.gemv:GEMV_GATED": False},  # the activation, then the down projection's GEMV
    # kernels.int4_gemv_mma at M = 1 too (its norm, activation and residual as their own launches: it fuses none)
    "mma1": {"kernels.int4_plan:MMA_M": (1, 8)},
    "nomma": {"kernels.int4_plan:MMA_M": (1 << 30, 1 << 30)},  # the GEMV and tl.dot at M = 2-8, as before 6b4189b
    # the MMA kernel to 8 rows, tl.dot to 64, dequantization + cuBLAS above: the defaults before 2026-12-04 night
    "mma8": {"kernels.int4_plan:MMA_M": (2, 8), "kernels.int4_plan:WGMMA_M": (1 << 30, 1 << 30)},
    # the wgmma GEMM to 512 rows (no dequantization + cuBLAS below 513), its default tile. H200, Session 33: TPOT
    # 15.85 / 29.70 ms against the defaults' 13.86 / 20.86 at batches 256 / 512, `mixed` 17.12 against 15.39 s. (With
    # the async K loop and two warpgroups, Session 28's "wg512async", 1.43x / 1.76x; that loop is removed.)
    "wg512": {"kernels.int4_plan:WGMMA_M": (17, 512)},
    # batch-1 decode attention's kernels load the step's inputs after their PDL wait: the defaults before Session 40
    "noearly": {"kernels.paged_attention:DECODE_EARLY_INPUTS": False},
    # bounds, not candidates (NoLaunch): the decode step without the attention merge's launch, without the
    # RMSNorm launches, without decode attention (partitions and merge, with the rotary and cache write they carry)
    "bound_nomerge": {"kernels.paged_attention:_decode_reduce_kernel": NoLaunch()},
    "bound_nonorm": {"kernels.norm:_rms_norm_kernel": NoLaunch()},
    "bound_noattn": {
        "kernels.paged_attention:_decode_partition_kernel": NoLaunch(),
        "kernels.paged_attention:_decode_reduce_kernel": NoLaunch(),
    },
    # no programmatic dependent launch (kernels.pdl) anywhere: the defaults before 2026-12-04 evening
    "nopdl": {
        "kernels.int4_plan:GEMV_PDL": False,
        "kernels.norm:RMS_NORM_PDL": False,
        "kernels.paged_attention:DECODE_PDL": False,
    },  # fmt: skip
}


def _bench_variant(args: argparse.Namespace, device: torch.device, name: str, quantized: bool) -> dict[str, Any]:
    import importlib

    targets = {key: (importlib.import_module(key.split(":")[0]), key.split(":")[1]) for key in GEMV_VARIANTS[name]}
    saved = {key: getattr(module, attr) for key, (module, attr) in targets.items()}
    try:
        for key, (module, attr) in targets.items():
            setattr(module, attr, GEMV_VARIANTS[name][key])
        return bench_model(args, device, quantized=quantized)
    finally:
        for key, (module, attr) in targets.items():
            setattr(module, attr, saved[key])


def bench_models(args: argparse.Namespace, device: torch.device, results: dict[str, Any]) -> None:
    copy_tb_s = None
    if device.type == "cuda":
        from loadtest.shapes import measure_copy_bandwidth

        copy_tb_s = measure_copy_bandwidth()
        results["copy_tb_s"] = round(copy_tb_s, 3)
    results["int4"] = bench_model(args, device, quantized=True)
    _bench_variants(args, device, results, "int4", getattr(args, "gemv_variants", None) or [])
    results["bf16"] = bench_model(args, device, quantized=False)
    _bench_variants(args, device, results, "bf16", getattr(args, "bf16_variants", None) or [])
    add_floors(results, copy_tb_s)


def _bench_variants(
    args: argparse.Namespace, device: torch.device, results: dict[str, Any], model: str, names: list[str]
) -> None:
    """Each variant's run as ``results["<model> <name>"]`` (a name given twice: ``<name>#2``)."""
    for name in names:
        key = f"{model} {name}"
        key = key if key not in results else f"{key}#{sum(k.split('#')[0] == key for k in results) + 1}"
        try:
            results[key] = _bench_variant(args, device, name, quantized=model == "int4")
        except Exception as exc:  # noqa: BLE001 - on the GPU a variant's failure is its result; the rest still run
            if device.type != "cuda":
                raise
            results[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            gc.collect()  # the failed engine's memory, before the next one
            torch.cuda.empty_cache()
