"""Prefill attention in ``pagedserve bench kernels`` (``loadtest.kernels_bench``): one sequence's new tokens after
a cached prefix, SDPA on dense K/V against each kernel variant on a paged cache, TFLOP/s and each variant's output
against the torch reference at that size."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from loadtest.kernel_bench_common import BLOCK_SIZE, DTYPE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, rel_err, time_graph

# (name, kernel, knobs): "engine" is the engine's prefill attention (engine.attention.paged_attention), "gluon"
# kernels.prefill_gluon (fresh prompts only), "new_kv" kernels.prefill_new_kv._prefill_attention_new_kv (this
# step's K/V from the contiguous tensors; "tma": host tensor descriptors, "ptr": pointer loads), "paged"
# kernels.prefill_attention._paged_prefill_attention. The first row is the engine's default;
# "lf": longest causal tiles launched first; "fma": the tutorial's softmax step below the diagonal (scale in the
# exponent's FMA, PV accumulated in place); m/bn/w/s: rows, KV tile, warps, stages. The sweep decides the
# defaults. Compiled for sm_90 with Triton 3.6 (offline, ptxas): no entry below spills. Left out for spilling:
# the paged kernel at block_n 128 (255 regs + 40 B stack) and 128 rows on 4 warps (either kernel).
PREFILL_VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("default", "engine", {}),  # engine.attention.paged_attention: Gluon for fresh prompts on sm_90, new_kv the rest
    ("new_kv", "new_kv", {}),
    ("new_kv_hm", "new_kv", {"head_major": True}),  # the grid by KV head: one head's K/V in L2 at a time
    # kernels.prefill_gluon (Hopper, fresh prompts only: the cases without a cached prefix); its defaults are
    # warp-specialized (kernels.prefill_gluon_ws) with the grid by KV head
    ("gluon", "gluon", {}),
    ("gluon_kvh", "gluon", {"head_major": False}),
    ("gluon_bn64", "gluon", {"block_n": 64}),
    ("gluon_s2", "gluon", {"num_stages": 2}),
    ("gluon_1p", "gluon", {"warp_specialize": False}),  # one partition of two warpgroups, no producer warp
    ("gluon_1p_m64_bn64", "gluon", {"warp_specialize": False, "rows": 64, "block_n": 64}),  # two CTAs per SM
    ("paged", "paged", {}),
    ("paged_lf", "paged", {"largest_first": True}),
    ("paged_fma_lf", "paged", {"fma_softmax": True, "largest_first": True}),
    ("paged_s3_lf", "paged", {"num_stages": 3, "largest_first": True}),
    ("paged_m128_w8_s2_lf", "paged", {"block_m": 128, "num_warps": 8, "num_stages": 2, "largest_first": True}),
    ("paged_m128_w8_s3_lf", "paged", {"block_m": 128, "num_warps": 8, "num_stages": 3, "largest_first": True}),
    (
        "paged_fma_m128_w8_s3_lf",
        "paged",
        {"block_m": 128, "num_warps": 8, "num_stages": 3, "largest_first": True, "fma_softmax": True},
    ),  # fmt: skip
    ("new_kv_tma_m128_w8_s3", "new_kv", {"use_tma": True, "block_n": 64}),  # the Triton tutorial's Hopper tile
    ("new_kv_tma_m128_w8_s2", "new_kv", {"use_tma": True, "block_n": 64, "num_stages": 2}),
    ("new_kv_tma_m128_w8_s4", "new_kv", {"use_tma": True, "block_n": 64, "num_stages": 4}),
    ("new_kv_tma_m128_bn128_w8_s2", "new_kv", {"use_tma": True, "block_n": 128, "num_stages": 2}),
    ("new_kv_tma_m64_w4_s3", "new_kv", {"use_tma": True, "block_m": 64, "block_n": 64, "num_warps": 4}),
    (
        "new_kv_tma_m64_w4_s2",
        "new_kv",
        {"use_tma": True, "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    ),
    ("new_kv_ptr_m128_w8_s3", "new_kv", {"use_tma": False, "block_n": 64}),
    ("new_kv_ptr_m64_w4_s3", "new_kv", {"use_tma": False, "block_m": 64, "block_n": 64, "num_warps": 4}),
]
# (name, cached prefix, new tokens) of one sequence: the dense causal prefills SDPA is measured on, and a
# chunk of a chunked prefill (SDPA with a lower-right causal mask over prefix + chunk)
# SDPA's backends, each timed alone on the dense causal cases: the default's ratio is against the fastest
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
PREFILL_CASES: list[tuple[str, int, int]] = [("4k", 0, 4096), ("8k", 0, 8192), ("2k+2k", 2048, 2048)]


def new_kv_from_cache(
    cache: torch.Tensor, tables: torch.Tensor, rows: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new tokens' K and V ``[num_tokens, num_kv_heads, head_dim]`` as the layer would hold them: the
    values of their cache slots (sequence i's rows ``(cached prefix, new tokens)`` of ``rows``)."""
    parts = []
    for i, (context_len, q_len) in enumerate(rows):
        pos = torch.arange(context_len, context_len + q_len, device=cache.device)
        parts.append(cache[:, tables[i].long()[pos // BLOCK_SIZE], pos % BLOCK_SIZE])  # [2, q_len, Hkv, D]
    kv = torch.cat(parts, dim=1)
    return kv[0], kv[1]


def bench_prefill(
    name: str, context_len: int, q_len: int, reps: int, variants: list[tuple[str, str, dict[str, Any]]]
) -> dict[str, Any]:
    """One sequence of ``q_len`` new tokens after ``context_len`` cached ones: SDPA on dense K/V, then each
    variant on a paged cache (shuffled block table), TFLOP/s of the causal QK^T and PV, and each variant's
    output against the torch reference at this size."""
    from kernels.prefill_attention import paged_prefill_attention_ref

    seq_len = context_len + q_len
    # every query sees its prefix and the new tokens up to itself
    flops = 4 * NUM_HEADS * HEAD_DIM * q_len * (context_len + (q_len + 1) / 2)
    scale = HEAD_DIM**-0.5
    result: dict[str, Any] = {"case": name, "context_len": context_len, "num_tokens": q_len, "variants": []}
    try:
        result["sdpa_s"] = t = _time_sdpa_prefill(context_len, q_len, scale, reps)
    except Exception as exc:  # the variants' timings still count
        print(f"  prefill {name}: SDPA failed: {exc!r:.300}", flush=True)
        result["sdpa_s"] = t = float("nan")
    result["sdpa_tflops"] = flops / t / 1e12
    if context_len == 0:  # which backend the default SDPA is: each one forced, TFLOP/s (nan: not available)
        result["sdpa_backend_tflops"] = {
            backend: flops / _time_sdpa_prefill(context_len, q_len, scale, reps, backend) / 1e12
            for backend in SDPA_BACKENDS
        }
        forced = ", ".join(f"{b} {x:.0f}" for b, x in result["sdpa_backend_tflops"].items())
        print(f"  SDPA {name}: default {result['sdpa_tflops']:.0f} TFLOP/s; each backend forced: {forced}", flush=True)
    num_blocks = -(-seq_len // BLOCK_SIZE)
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(1, num_blocks)
    query = torch.randn(q_len, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    qsl = torch.tensor([0, q_len], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    key, value = new_kv_from_cache(cache, tables, [(context_len, q_len)])
    ref = paged_prefill_attention_ref(query, cache, tables, qsl, seq_lens, scale)
    for vname, kernel, knobs in variants:
        if kernel == "gluon" and context_len:
            continue
        call = _prefill_call(kernel, knobs, query, key, value, cache, tables, qsl, seq_lens, scale)
        try:
            err = rel_err(call(), ref)
            t = time_graph([call] * 8, reps)
        except Exception as exc:  # a variant that fails to compile (resources) must not end the run
            print(f"  prefill {name} variant {vname} failed: {exc!r:.300}", flush=True)
            continue
        tflops = flops / t / 1e12
        result["variants"].append(
            {"name": vname, "kernel": kernel, "knobs": knobs, "s": t, "tflops": tflops,
             "ratio": tflops / result["sdpa_tflops"], "rel_err": err}
        )  # fmt: skip
    del cache, key, value, ref
    torch.cuda.empty_cache()
    ok = [v for v in result["variants"] if v["rel_err"] < 1e-2] or [{"name": None, "tflops": float("nan")}]
    best = max(ok, key=lambda r: r["tflops"])
    default_name = variants[0][0] if variants else None
    default = next((v for v in result["variants"] if v["name"] == default_name), {"tflops": float("nan")})
    result.update(triton_tflops=default["tflops"], best_tflops=best["tflops"], best_variant=best["name"])
    return result


def _time_sdpa_prefill(context_len: int, q_len: int, scale: float, reps: int, backend: str | None = None) -> float:
    """SDPA's seconds per call on dense K/V of the same shape: causal (flash) when there is no prefix, else
    a lower-right causal mask (the new queries are the last positions), which SDPA serves without flash.
    ``backend``: one of :data:`SDPA_BACKENDS` forced (``nan`` where it cannot run the shape)."""
    if backend is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        try:
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return _time_sdpa_prefill(context_len, q_len, scale, reps)
        except RuntimeError as exc:
            print(f"  SDPA {backend}: {exc!r:.200}", flush=True)
            return float("nan")
    seq_len = context_len + q_len
    q = torch.randn(1, NUM_HEADS, q_len, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(1, NUM_KV_HEADS, seq_len, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    if context_len == 0:
        sdpa = partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        from torch.nn.attention.bias import causal_lower_right

        group = NUM_HEADS // NUM_KV_HEADS  # heads expanded: the masked path takes no enable_gqa
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        mask = causal_lower_right(q_len, seq_len)
        sdpa = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, scale=scale)
    return time_graph([sdpa] * 8, reps)


def _prefill_call(
    kernel: str,
    knobs: dict[str, Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    tables: torch.Tensor,
    qsl: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> Callable[[], torch.Tensor]:
    from kernels.prefill_attention import _paged_prefill_attention
    from kernels.prefill_new_kv import _prefill_attention_new_kv

    if kernel == "paged":
        return partial(_paged_prefill_attention, query, cache, tables, qsl, seq_lens, scale, None, **knobs)
    if kernel == "gluon":
        from kernels.prefill_gluon import prefill_attention_gluon

        return partial(prefill_attention_gluon, query, key, value, qsl, scale, **knobs)
    if kernel == "engine":
        from engine.attention import AttentionMetadata, paged_attention
        from engine.inputs import fresh_suffix

        lens, starts = seq_lens.cpu().numpy(), qsl.cpu().numpy()
        fresh = fresh_suffix(starts, lens)  # as the step's inputs would carry it
        meta = AttentionMetadata(
            torch.zeros(0), qsl, seq_lens, tables, int(qsl.diff().max()), int(lens.max()), "triton", fresh
        )
        return partial(paged_attention, query, cache, meta, scale, None, torch.stack([key, value]))
    return partial(_prefill_attention_new_kv, query, key, value, cache, tables, qsl, seq_lens, scale, None, **knobs)


def print_prefill_variants(prefill: list[dict[str, Any]]) -> None:
    """One row per prefill variant: TFLOP/s and ratio to SDPA at every case, * the best correct one of the
    case, ! a rel err of 1e-2 or more against the reference (never a winner)."""
    names = list(dict.fromkeys(v["name"] for r in prefill for v in r["variants"]))
    print("\nprefill variants: TFLOP/s (ratio to SDPA), * best of the case, ! wrong (rel err >= 1e-2), n/a not run")
    print("| variant | " + " | ".join(f"{r['case']} (SDPA {r['sdpa_tflops']:.0f})" for r in prefill) + " |")
    print("|---" * (len(prefill) + 1) + "|")
    for name in names:
        cells = []
        for r in prefill:
            v = next((v for v in r["variants"] if v["name"] == name), None)
            if v is None:  # the Gluon kernel takes no cached prefix: not run there
                cells.append("n/a" if r["context_len"] and name.startswith("gluon") else "failed")
                continue
            mark = "!" if not v["rel_err"] < 1e-2 else "*" if name == r["best_variant"] else ""
            cells.append(f"{v['tflops']:.0f} ({v['ratio']:.2f}){mark}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    errs = [v["rel_err"] for r in prefill for v in r["variants"]]
    if errs:
        print(f"prefill variants' rel err against the reference: max {max(errs):.2e}")
