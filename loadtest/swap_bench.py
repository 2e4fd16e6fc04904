"""Preemption by swap vs recompute on one engine, in the same run (#12).

The KV pool is cut to a fraction (``--block-fraction``, default a third) of what the workload needs with every
request running at its full length, so requests must be preempted. The same engine then runs the same requests
once per ``--modes`` entry (swap | recompute | auto), its prefix cache emptied in between; each run reports
throughput, request latency and TTFT percentiles (all requests arrive at t=0), preemptions by kind and blocks
swapped. Also measured: the host<->device copy bandwidth (pinned, one big copy) and the swap path's own
bandwidth (``HostKVCache.swap`` of 256 blocks, synchronized), to compare with the bytes the runs moved.

    python -m loadtest.swap_bench --shape 8b --workload mixed-128 --out swap.json        # on the GPU
    python -m loadtest.swap_bench --shape tiny --device cpu --workload random --num-requests 8 \\
        --input-len 16 64 --output-len 32 96 --swap-space 0.05                            # a quick CPU check
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

import torch

from engine.args import EngineArgs
from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from loadtest.shapes import shape_folder
from loadtest.throughput import sync
from loadtest.workloads import WORKLOADS, BenchRequest, make_workload


def workload(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    if args.workload != "random":
        return make_workload(args.workload, vocab_size, args.num_requests)
    rng = random.Random(0)
    reqs = []
    for _ in range(args.num_requests or 64):
        n_in, n_out = rng.randint(*args.input_len), rng.randint(*args.output_len)
        reqs.append(BenchRequest([rng.randrange(vocab_size) for _ in range(n_in)], n_out))
    return reqs


def blocks_needed(reqs: list[BenchRequest], block_size: int, max_num_seqs: int) -> int:
    """Blocks to hold the ``max_num_seqs`` largest requests at their full length at once."""
    sizes = sorted((-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in reqs), reverse=True)
    return sum(sizes[:max_num_seqs])


def build(args: argparse.Namespace, num_blocks: int) -> Engine:
    engine_args = EngineArgs(
        model=args.model or str(shape_folder(args.shape, max_position_embeddings=args.max_model_len)),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        load_format="dummy" if not args.model else "auto",
        skip_tokenizer_init=not args.model,
        block_size=args.block_size,
        num_gpu_blocks_override=num_blocks,
        swap_space=args.swap_space,
        enable_prefix_caching=True,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        device=args.device,
    )
    return Engine(engine_args.create_engine_config())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def run_mode(engine: Engine, reqs: list[BenchRequest], mode: str) -> tuple[dict[str, Any], list[list[int]]]:
    """One run of ``reqs`` preempting by ``mode``: its numbers, and every request's output tokens."""
    engine.scheduler.config.preemption_mode = mode
    engine.kv.reset_prefix_cache()
    before = engine.stats()
    computed_before = engine.computed_tokens_total
    for i, r in enumerate(reqs):
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(f"{mode}-{i}", r.prompt_token_ids, params)
    sync(engine)
    start = time.perf_counter()
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {f"{mode}-{i}": [] for i in range(len(reqs))}
    steps = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        now = time.perf_counter() - start
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)
            first.setdefault(out.request_id, now)
            if out.finish_reason is not None:
                done[out.request_id] = now
    sync(engine)
    elapsed = time.perf_counter() - start
    after = engine.stats()
    latencies, ttfts = list(done.values()), list(first.values())
    spec = engine.executor.kv_spec
    moved = after.num_blocks_swapped_out - before.num_blocks_swapped_out
    moved_in = after.num_blocks_swapped_in - before.num_blocks_swapped_in
    res = {
        "mode": mode,
        "elapsed_s": round(elapsed, 3),
        "steps": steps,
        "output_tok_s": round(sum(r.max_tokens for r in reqs) / elapsed, 1),
        "latency_p50_s": round(percentile(latencies, 0.5), 3),
        "latency_p99_s": round(percentile(latencies, 0.99), 3),
        "ttft_p50_s": round(percentile(ttfts, 0.5), 3),
        "ttft_p99_s": round(percentile(ttfts, 0.99), 3),
        "preemptions_swap": after.num_swap_preemptions - before.num_swap_preemptions,
        "preemptions_recompute": after.num_recompute_preemptions - before.num_recompute_preemptions,
        "blocks_swapped_out": moved,
        "blocks_swapped_in": moved_in,
        "swapped_mib": round((moved + moved_in) * spec.bytes_per_block / 2**20, 1),
        "computed_tokens": engine.computed_tokens_total - computed_before,  # recomputed ones included
    }
    return res, list(tokens.values())


def agreement(ref: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """How far ``other``'s greedy outputs follow ``ref``'s: requests identical, and the mean fraction of each
    output before the first differing token (bf16 rounds a recomputed prompt's KV differently from the KV
    it had when computed token by token, so a recompute may flip a near-tie; swap brings the same KV back)."""
    same = sum(a == b for a, b in zip(ref, other, strict=True))
    prefix = []
    for a, b in zip(ref, other, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefix.append(n / max(1, len(a)))
    return {"identical_requests": same, "requests": len(ref), "mean_common_prefix": round(sum(prefix) / len(ref), 4)}


def copy_bandwidth_gb_s(device: torch.device, num_bytes: int = 2**30, reps: int = 5) -> dict[str, float]:
    """Pinned host <-> device copy bandwidth, one big copy each way (GB/s)."""
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    res = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        res[f"{name}_gb_s"] = round(num_bytes * reps / (time.perf_counter() - t) / 1e9, 2)
    return res


def swap_path_bandwidth_gb_s(runner: ModelRunner, num_blocks: int = 256, reps: int = 5) -> dict[str, float]:
    """``HostKVCache.swap`` itself on ``num_blocks`` blocks each way, synchronized (GB/s)."""
    host_kv = runner.host_kv
    assert host_kv is not None
    k = min(num_blocks, runner.kv_spec.num_blocks, runner.kv_spec.num_cpu_blocks)
    pairs = [(i, i) for i in range(k)]
    nbytes = k * runner.kv_spec.bytes_per_block
    res = {}
    for name, out, inn in (("swap_out", pairs, []), ("swap_in", [], pairs)):
        host_kv.swap(runner.kv_cache, out, inn)
        sync_device(runner.device)
        t = time.perf_counter()
        for _ in range(reps):
            host_kv.swap(runner.kv_cache, out, inn)
        sync_device(runner.device)
        res[f"{name}_gb_s"] = round(nbytes * reps / (time.perf_counter() - t) / 1e9, 2)
    return res


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    reqs = workload(args, 1024)  # (token ids are taken modulo the model's vocabulary below)
    need = blocks_needed(reqs, args.block_size, args.max_num_seqs)
    num_blocks = max(1, need // args.block_fraction)
    engine = build(args, num_blocks)
    reqs = [BenchRequest([t % engine.vocab_size for t in r.prompt_token_ids], r.max_tokens) for r in reqs]
    spec = engine.executor.kv_spec
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if engine.executor.device.type == "cuda" else "cpu",
        "model": args.model or args.shape,
        "workload": args.workload,
        "requests": len(reqs),
        "blocks_needed": need,
        "gpu_blocks": spec.num_blocks,
        "cpu_blocks": spec.num_cpu_blocks,
        "bytes_per_block": spec.bytes_per_block,
    }
    runner = getattr(engine.executor, "runner", None)
    if engine.executor.device.type == "cuda":
        result["copy"] = copy_bandwidth_gb_s(engine.executor.device)
    if isinstance(runner, ModelRunner) and runner.host_kv is not None:
        result["swap_path"] = swap_path_bandwidth_gb_s(runner)
    for mode in dict.fromkeys(args.modes):  # warm-up: shapes, allocator, and each preemption path once
        run_mode(engine, reqs[: max(1, len(reqs) // args.warmup_fraction)], mode)
    result["runs"] = []
    outputs = []
    for mode in args.modes:
        res, tokens = run_mode(engine, reqs, mode)
        result["runs"].append(res)
        outputs.append(tokens)
        print(json.dumps(res), flush=True)
    # greedy: every mode must produce the same tokens (exact in fp32; bf16 differs through batch shapes)
    result["outputs_match"] = all(o == outputs[0] for o in outputs)
    result["agreement"] = {mode: agreement(outputs[0], o) for mode, o in zip(args.modes[1:], outputs[1:], strict=True)}
    engine.shutdown()
    result["command"] = "python -m loadtest.swap_bench " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.swap_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default="mixed-128", choices=[*WORKLOADS, "random"])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 1024], help="random: prompt length range")
    p.add_argument("--output-len", type=int, nargs=2, default=[16, 512], help="random: output length range")
    p.add_argument("--model", default="", help="a model folder; default: a random-weight --shape")
    p.add_argument("--shape", default="8b", help="8b | 2b | 70b | tiny (random weights)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-fraction", type=int, default=3, help="KV blocks = what the workload needs / this")
    p.add_argument("--swap-space", type=float, default=32.0, help="GiB of host memory for swapped blocks")
    p.add_argument("--modes", nargs="+", default=["swap", "recompute", "auto"])
    p.add_argument("--warmup-fraction", type=int, default=4, help="warm-up per mode: this fraction of the requests")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out", default=None, help="write the JSON result here")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
