"""The printed summary of ``loadtest.int4_bench``'s GEMM rows: per shape and M the two paths of the int4 linear
layer (``fused``: ``int4_gemm``'s default launch; ``dequant+matmul``: ``int4_dequant`` into a scratch, then
cuBLAS) against bf16 cuBLAS, the best variant, per M each variant's time over the best, and where the paths
cross (what ``kernels.int4_dequant.DEQUANT_MIN_M`` should be)."""

from __future__ import annotations

import math
from typing import Any

import torch

from kernels import int4_plan
from kernels.int4_dequant import DEQUANT_MIN_M
from kernels.int4_gemm_wgmma import on_hopper

FUSED, DEQUANT = "fused", "dequant+matmul"  # the two paths' default variants in a row's "us"


def engine_path(m: int) -> str:
    """The path ``engine.quantization.int4_linear`` takes at M rows on this machine's GPU: the fused GEMM below
    DEQUANT_MIN_M rows, and at ``int4_plan.WGMMA_M`` rows on an sm_90 GPU (the wgmma GEMM)."""
    wgmma = torch.cuda.is_available() and on_hopper(torch.device("cuda")) and int4_plan.default_kernel(m) == "wgmma"
    return DEQUANT if m >= DEQUANT_MIN_M and not wgmma else FUSED


def _case_line(r: dict[str, Any]) -> str:
    us, cublas = r["us"], r["cublas_us"]
    deq = us.get(DEQUANT, math.nan)
    deq_only = r.get("dequant_us", {}).get(DEQUANT, math.nan)
    return (
        f"{r['layer']:8s} {r['m']:<4d} | {us[FUSED]:8.1f} {r['fused_gb_s']:6.0f} {r['fused_tflops']:6.1f} "
        f"{cublas / us[FUSED]:5.2f} | {deq:8.1f} {cublas / deq:5.2f} {deq_only:7.1f} {r.get('dequant_gb_s', 0):5.0f} "
        f"| {r['best']:22s} {us[r['best']]:7.1f} {cublas / us[r['best']]:5.2f} | {cublas:8.1f} "
        f"{r['cublas_tflops']:6.1f} | {engine_path(r['m'])}"
    )


def _ranking_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Per M: each variant's time over the case's best, geometric mean over the shapes that ran it."""
    lines = []
    for m in sorted({r["m"] for r in rows}):
        cases = [r for r in rows if r["m"] == m]
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
    return lines


def _faster_from(times: list[tuple[int, float, float]]) -> int | None:
    """Smallest M from which dequant+matmul is faster than fused at it and at every larger M measured."""
    start = None
    for m, fused, deq in times:
        start = (m if start is None else start) if deq < fused else None
    return start


def crossover_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where dequant+matmul starts to beat the fused GEMM: per projection and for the sum of a layer's
    projections (what one threshold for every layer should follow), and the engine's path against cuBLAS."""
    timed = {(r["layer"], r["m"]): r for r in rows if FUSED in r["us"] and DEQUANT in r["us"]}
    layers = list(dict.fromkeys(layer for layer, _ in timed))
    ms = sorted({m for _, m in timed if all((layer, m) in timed for layer in layers)})
    if not ms:
        return []

    def total(m: int, key: str) -> float:
        return sum(timed[layer, m]["us"][key] if key != "cublas" else timed[layer, m]["cublas_us"] for layer in layers)

    per_layer = {
        layer: _faster_from([(m, timed[layer, m]["us"][FUSED], timed[layer, m]["us"][DEQUANT]) for m in ms])
        for layer in layers
    }
    summed = _faster_from([(m, total(m, FUSED), total(m, DEQUANT)) for m in ms])
    below = [m for m in ms if summed is not None and m < summed]
    advice = f"set it in ({below[-1] if below else 0}, {summed}]" if summed is not None else "fused wins at every M"
    engine = [total(m, "cublas") / total(m, engine_path(m)) for m in ms]
    return [
        "fused / dequant+matmul time (sum over "
        + "+".join(layers)
        + ") by M: "
        + ", ".join(f"{m}: {total(m, FUSED) / total(m, DEQUANT):.2f}" for m in ms),
        f"crossover: dequant+matmul faster than fused from M = {summed} (layer sum); per projection: "
        + ", ".join(f"{layer} {per_layer[layer]}" for layer in layers)
        + f" | DEQUANT_MIN_M = {DEQUANT_MIN_M} (kernels/int4_dequant.py): {advice}",
        f"engine path (DEQUANT_MIN_M = {DEQUANT_MIN_M}, past WGMMA_M on sm_90) speed x-cublas, layer sum, by M: "
        + ", ".join(f"{m}: {e:.2f}" for m, e in zip(ms, engine, strict=True)),
    ]


def gemm_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The table (one line per shape and M), the per-M ranking, the crossover and any wrong results."""
    timed = [r for r in rows if "best" in r]
    lines = [
        "layer    M    | fused us  GB/s TFLOP/s x-cublas | dequant+matmul us x-cublas (dequant alone us GB/s)"
        " | best variant               us x-cublas | cublas us TFLOP/s | engine path"
    ]
    lines += [_case_line(r) for r in timed]
    lines += _ranking_lines(timed)
    lines += crossover_lines(timed)
    wrong = [f"{r['layer']} M={r['m']}: {r['wrong']}" for r in rows if r.get("wrong")]
    inexact = sorted(
        {f"{r['layer']}: {name}" for r in rows for name, ok in r.get("dequant_exact", {}).items() if not ok}
    )
    lines.append(f"int4_dequant != dequantize_int4 (bit for bit): {inexact}" if inexact else "int4_dequant: exact")
    return lines + ([f"WRONG RESULTS (excluded): {wrong}"] if wrong else [])
