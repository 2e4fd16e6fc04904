"""``pagedserve bench throughput | latency | suite | overhead``: the engine on the workloads of
../shared/BENCHMARKS.md, with HF transformers static batching measured in the same process.

Requests count their requested lengths (``ignore_eos``); random weights (``--load-format dummy``) give
the same speed as real ones. Results print as JSON lines and go to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from datetime import date
from typing import Any

import torch

from deploy.gc_heap import freeze_heap, thaw_heap
from engine.args import EngineArgs
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from loadtest.shapes import measure_copy_bandwidth, measure_matmul_tflops, num_params, shape_folder, weight_bytes
from loadtest.workloads import WORKLOADS, BenchRequest, make_workload


def build_engine(args: argparse.Namespace) -> Engine:
    """The bench's own flags (its defaults differ from the server's) -> ``EngineArgs`` -> ``Engine``."""
    engine_args = EngineArgs(
        model=args.model or str(shape_folder(args.shape, max_position_embeddings=args.max_model_len)),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        load_format="dummy" if not args.model else args.load_format,
        skip_tokenizer_init=not args.model,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        device=args.device,
        async_scheduling=args.async_scheduling,
    )
    engine = Engine(engine_args.create_engine_config())
    freeze_heap()  # as engine.LLM does: its start-up heap out of the collector's reach (deploy.gc_heap)
    return engine


def close_engine(engine: Engine) -> None:
    """Shut ``engine`` down and give the frozen heap back to the collector (the next engine can then free it)."""
    engine.shutdown()
    thaw_heap()


def sync(engine: Engine) -> None:
    if engine.executor.device.type == "cuda":
        torch.cuda.synchronize()


def run_engine(engine: Engine, reqs: list[BenchRequest], tag: str) -> dict[str, Any]:
    """All requests at t=0; returns throughput, KV occupancy at steady state and prefix-cache hit rate."""
    hits0, queries0 = engine.kv.stats.num_hit_tokens, engine.kv.stats.num_query_tokens
    for i, r in enumerate(reqs):
        params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
        engine.add_request(f"{tag}-{i}", r.prompt_token_ids, params)
    sync(engine)
    start = time.perf_counter()
    steps, first_token_s, occupancy = 0, None, []
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if first_token_s is None and steps == 1:
            sync(engine)
            first_token_s = time.perf_counter() - start
        if steps % 8 == 0:
            used_blocks = round(engine.kv.usage() * engine.kv.num_blocks)
            live = sum(r.num_computed_tokens for r in engine.scheduler.running)
            if used_blocks:
                occupancy.append(live / (used_blocks * engine.kv.block_size))
    sync(engine)
    elapsed = time.perf_counter() - start
    out_tokens = sum(r.max_tokens for r in reqs)
    in_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    queries = engine.kv.stats.num_query_tokens - queries0
    return {
        "requests": len(reqs),
        "elapsed_s": round(elapsed, 3),
        "steps": steps,
        "output_tok_s": round(out_tokens / elapsed, 1),
        "total_tok_s": round((out_tokens + in_tokens) / elapsed, 1),
        "first_token_s": round(first_token_s or 0.0, 4),
        "kv_slots_live_fraction": round(sum(occupancy) / len(occupancy), 4) if occupancy else None,
        "prefix_cache_hit_rate": round((engine.kv.stats.num_hit_tokens - hits0) / queries, 4) if queries else 0.0,
        "preemptions": engine.scheduler.num_preemptions,
    }


def run_latency(engine: Engine, req: BenchRequest) -> dict[str, Any]:
    params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
    best: dict[str, Any] = {}
    for rep in range(2):  # the first run warms up shapes not seen before
        engine.add_request(f"lat-{rep}", req.prompt_token_ids, params)
        sync(engine)
        start = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            if first is None:
                sync(engine)
                first = time.perf_counter()
        sync(engine)
        end = time.perf_counter()
        assert first is not None
        best = {"ttft_s": round(first - start, 4), "tpot_ms": round((end - first) / (req.max_tokens - 1) * 1e3, 3)}
    return best


def run_hf_baseline(folder: str, reqs: list[BenchRequest], batch_size: int = 32) -> dict[str, Any]:
    """HF transformers ``generate``, static batches of ``batch_size`` in arrival order, left-padded;
    each batch runs to its longest request; only requested tokens count."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    for p in model.parameters():
        p.data.normal_(0.0, 0.02)

    def batch_generate(batch: list[BenchRequest], model: Any = model) -> None:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids) :] = 1
        n_out = max(r.max_tokens for r in batch)
        with torch.no_grad():
            model.generate(
                ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=n_out, min_new_tokens=n_out,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip

    batch_generate([BenchRequest([1, 2, 3], 4)])  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch_generate(reqs[i : i + batch_size])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    out_tokens = sum(r.max_tokens for r in reqs)
    return {"requests": len(reqs), "elapsed_s": round(elapsed, 2), "output_tok_s": round(out_tokens / elapsed, 1)}


def profile_steps(engine: Engine, reqs: list[BenchRequest], path: str, num_steps: int = 40) -> str:
    """torch.profiler over steps of a full batch (mixed prefill + decode), table written to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    engine.kv.reset_prefix_cache()
    for i, r in enumerate(reqs):
        engine.add_request(f"prof-{i}", r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    for _ in range(20):
        engine.step()
    sync(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            engine.step()
        sync(engine)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30)
    cpu_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    with open(path, "w") as f:
        f.write(table + "\n\n" + cpu_table)
    for rid in list(engine.scheduler.groups):
        engine.abort_request(rid)
    return path


def cprofile_decode(args: argparse.Namespace) -> dict[str, Any]:
    """Python-side cost of decode steps at a few batch sizes (cProfile, top functions by own time)."""
    import cProfile
    import io
    import pstats

    engine = build_engine(args)
    res: dict[str, Any] = {}
    for batch in (1, 64, 256):
        reqs = [BenchRequest(r.prompt_token_ids, 200) for r in make_workload("mixed", engine.vocab_size, batch)]
        for i, r in enumerate(reqs):
            engine.add_request(f"cp{batch}-{i}", r.prompt_token_ids, SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(20):
            engine.step()
        sync(engine)
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        for _ in range(50):
            engine.step()
        sync(engine)
        prof.disable()
        res[f"b{batch}_step_ms"] = round((time.perf_counter() - start) / 50 * 1e3, 3)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
        res[f"b{batch}_profile"] = buf.getvalue()[-4000:]
        for rid in list(engine.scheduler.groups):
            engine.abort_request(rid)
    close_engine(engine)
    return res


def git_commit() -> str:
    """The checkout's short commit, or "unknown" outside a git checkout (the device machine's copy may be one)."""
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    except OSError:
        return "unknown"
    return git.stdout.strip() or "unknown"


def moved_graph_route(engine: Engine) -> dict[int, int] | None:
    """The decode batch sizes that replay a larger graph (``engine.cuda_graphs.route_batches``), or None
    without graphs (CPU, eager, the multi-process executor)."""
    graphs = getattr(getattr(engine.executor, "runner", None), "graphs", None)
    return None if graphs is None else {s: r for s, r in graphs.route.items() if r != s}


def suite(args: argparse.Namespace) -> dict[str, Any]:
    """Everything issue 5 asks for, on one engine: ceilings, latency, mixed-128, mixed, shared-prefix on/off,
    then the HF baseline on mixed-128 after the engine is freed."""
    res: dict[str, Any] = {"date": str(date.today()), "commit": args.commit or git_commit(), "shape": args.shape}
    res["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if torch.cuda.is_available():
        res["matmul_tflops"] = round(measure_matmul_tflops(), 1)
        res["copy_tb_s"] = round(measure_copy_bandwidth(), 3)
    t = time.perf_counter()
    engine = build_engine(args)
    res["engine_start_s"] = round(time.perf_counter() - t, 1)
    res["kv_blocks"] = engine.kv.num_blocks
    res["decode_graph_route"] = moved_graph_route(engine)
    vocab = engine.vocab_size
    warm = [BenchRequest(r.prompt_token_ids[::-1], r.max_tokens) for r in make_workload("mixed", vocab, 16)]
    run_engine(engine, warm, "warm")
    res["latency"] = run_latency(engine, make_workload("latency", vocab)[0])
    if torch.cuda.is_available():
        floor_ms = weight_bytes(args.shape) / (res["copy_tb_s"] * 1e12) * 1e3
        res["latency"]["floor_ms"] = round(floor_ms, 3)
        res["latency"]["ratio_to_floor"] = round(res["latency"]["tpot_ms"] / floor_ms, 3)
    if args.compare_async:  # the same engine, host scheduling overlapped with the device or not
        configured = engine.async_scheduling
        for mode in (False, True):
            engine.async_scheduling = mode
            engine.kv.reset_prefix_cache()
            key = "async" if mode else "sync"
            res[f"latency_{key}"] = run_latency(engine, make_workload("latency", vocab)[0])
            res[f"mixed_{key}"] = run_engine(engine, make_workload("mixed", vocab), f"cmp-{key}")
            print(json.dumps({key: [res[f"latency_{key}"], res[f"mixed_{key}"]]}), flush=True)
        engine.async_scheduling = configured
    for name in args.workloads:
        if name == "shared-prefix":
            engine.kv.enable_prefix_caching = True
            engine.kv.reset_prefix_cache()
            on = run_engine(engine, make_workload(name, vocab), "sp-on")
            engine.kv.enable_prefix_caching = False
            engine.kv.reset_prefix_cache()
            off = run_engine(engine, make_workload(name, vocab), "sp-off")
            engine.kv.enable_prefix_caching = True
            res[name] = {"on": on, "off": off, "speedup": round(off["elapsed_s"] / on["elapsed_s"], 2)}
        else:
            engine.kv.reset_prefix_cache()  # mixed-128 is the head of mixed: no reuse across workloads
            res[name] = run_engine(engine, make_workload(name, vocab), name)
            if "matmul_tflops" in res:
                flops = res[name]["total_tok_s"] * 2 * num_params(args.shape)
                res[name]["mfu"] = round(flops / (res["matmul_tflops"] * 1e12), 4)
        print(json.dumps({name: res[name]}), flush=True)
    if args.profile:
        res["profile"] = profile_steps(engine, make_workload("mixed", vocab), args.profile)
    close_engine(engine)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    if args.baseline == "hf" and "mixed-128" in res:
        folder = str(shape_folder(args.shape))
        res["hf_mixed-128"] = run_hf_baseline(folder, make_workload("mixed-128", int(res.get("vocab", vocab))))
        res["speedup_vs_hf"] = round(res["mixed-128"]["output_tok_s"] / res["hf_mixed-128"]["output_tok_s"], 1)
    return res


def sweep(args: argparse.Namespace) -> dict[str, Any]:
    """Throughput and time per output token at each concurrency level, on one engine; PNG if ``--plot``."""
    from loadtest.sweep import plot_sweep, run_sweep

    res: dict[str, Any] = {"date": str(date.today()), "commit": args.commit or git_commit(), "shape": args.shape}
    res["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    floor_ms = None
    if torch.cuda.is_available() and not args.model:
        floor_ms = weight_bytes(args.shape) / (measure_copy_bandwidth() * 1e12) * 1e3
        res["floor_ms"] = round(floor_ms, 3)
    engine = build_engine(args)
    res["levels"] = run_sweep(engine, args.concurrency, args.prompt_len, args.output_len)
    close_engine(engine)
    if args.plot:
        title = f"{args.model or args.shape + ' shape'}, {res['gpu']}, {args.prompt_len} in / {args.output_len} out"
        res["plot"] = plot_sweep(res["levels"], args.plot, f"{title} ({res['commit']}, {res['date']})", floor_ms)
    return res


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedserve bench", description=__doc__)
    p.add_argument(
        "mode",
        nargs="?",
        default="throughput",
        choices=["throughput", "latency", "suite", "overhead", "cprofile", "sweep"],
    )
    p.add_argument("--workload", default="mixed", choices=WORKLOADS)
    p.add_argument("--workloads", nargs="+", default=["mixed-128", "mixed", "shared-prefix"])
    p.add_argument("--model", default="", help="a model folder; default: a random-weight --shape")
    p.add_argument("--shape", default="8b", help="8b | 2b | 70b | tiny (random weights)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--num-running", type=int, default=256, help="overhead mode: running requests")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--profile", default=None, help="suite: write a torch.profiler table of 40 steps here")
    p.add_argument("--compare-async", action="store_true", help="suite: latency and mixed with and without")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="overlap host scheduling with the device",
    )
    p.add_argument("--commit", default=None, help="git commit to record (when .git is not at hand)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--prompt-len", type=int, default=128, help="sweep: prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="sweep: output tokens per request")
    p.add_argument("--plot", default=None, help="sweep: write a PNG of throughput and latency vs concurrency")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.mode == "overhead":
        from loadtest.overhead import measure_overhead

        result: dict[str, Any] = measure_overhead(args.num_running)
    elif args.mode == "cprofile":
        result = cprofile_decode(args)
        for key, value in result.items():
            print(key, value if isinstance(value, str) else json.dumps(value))
    elif args.mode == "suite":
        result = suite(args)
    elif args.mode == "sweep":
        result = sweep(args)
    else:
        engine = build_engine(args)
        vocab = engine.vocab_size
        if args.mode == "latency":
            result = run_latency(engine, make_workload("latency", vocab)[0])
        else:
            result = run_engine(engine, make_workload(args.workload, vocab, args.num_requests), args.workload)
        close_engine(engine)
        if args.baseline == "hf" and args.mode == "throughput":
            folder = args.model or str(shape_folder(args.shape))
            result["hf"] = run_hf_baseline(folder, make_workload(args.workload, vocab, args.num_requests))
    result["command"] = "pagedserve bench " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
