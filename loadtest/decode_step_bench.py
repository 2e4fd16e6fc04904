"""The one-launch int4 decode step (``kernels.int4_decode_step``) on an engine's own int4 model (8B shape, random
weights, GPTQ group 128): first equal to its layer-by-layer reference on the same weights, KV cache and position,
then its time for every layer of one batch-1 step against those layers' 4-bit floor (their bytes / the measured copy
bandwidth), beside the LM head alone and, in the same process, the engine's batch-1 time per output token; then a
traced launch, where its programs' time went (``loadtest.decode_step_trace``).

    python -m loadtest.decode_step_bench --contexts 128 1024 4096 --tiles '{}' '{"programs_per_sm": 2}'
    python -m loadtest.decode_step_bench --tiny                      # CPU: 2 tiny layers under the interpreter

Each timed replay copies the embedding into the residual stream first (one small copy), so every replay starts
from the same input.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from engine.models.decode_step import step_layers
from kernels.int4_decode_plan import StepShape, StepTiles
from kernels.int4_decode_step import ATTN, DOWN, GATE_UP, O_PROJ, QKV, TRACE_FIELDS
from kernels.int4_decode_tasks import Int4DecodeStep, StepLayer, int4_decode_step_ref
from loadtest.decode_step_trace import lines, summarize
from loadtest.kernel_bench_common import rel_err, time_graph

TINY_TILES = StepTiles(tn=16, bk=32, num_stages=1, parts=3, bt=16, splits=(1, 2, 1, 2))


def filled_table(layers: list[StepLayer], context: int, gen: torch.Generator) -> torch.Tensor:
    """A block table over the first blocks of the caches, wide enough for ``context`` positions, every cached
    position before the last one holding random keys and values."""
    block_size = layers[0].kv_cache.shape[2]
    blocks = -(-context // block_size)
    for layer in layers:
        kv = layer.kv_cache[:, :blocks]
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))
    return torch.arange(blocks, dtype=torch.int32, device=layers[0].kv_cache.device)


def check(step: Int4DecodeStep, layers: list[StepLayer], shape: StepShape, table: torch.Tensor, context: int,
          cos_sin: torch.Tensor, embedding: torch.Tensor) -> float:  # fmt: skip
    """The kernel's residual stream against the reference's after every layer (caches restored in between)."""
    saved = [layer.kv_cache.clone() for layer in layers]
    want = int4_decode_step_ref(layers, shape, embedding.clone(), context, table, cos_sin)
    for layer, kv in zip(layers, saved, strict=True):
        layer.kv_cache.copy_(kv)
    out = embedding.clone()
    step(out, torch.tensor([context], dtype=torch.int32, device=out.device), table, cos_sin)
    return rel_err(out, want)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.args import EngineArgs
    from engine.engine import Engine
    from loadtest.int4_model import quantized_shape_folder
    from loadtest.shapes import measure_copy_bandwidth
    from loadtest.throughput import run_latency
    from loadtest.workloads import make_workload

    folder = quantized_shape_folder("tiny" if args.tiny else args.shape, args.max_model_len)
    engine = Engine(EngineArgs(
        model=str(folder), load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len,
        device="cpu" if args.tiny else "auto", dtype="float32" if args.tiny else "bfloat16",
        num_gpu_blocks_override=64 if args.tiny else 2 * -(-args.max_model_len // 16),  # room for the check's copies
    ).create_engine_config())  # fmt: skip
    res: dict[str, Any] = {"shape": "tiny" if args.tiny else args.shape}
    if not args.tiny:
        res["copy_tb_s"] = round(measure_copy_bandwidth(), 3)
        res["engine_tpot_ms"] = run_latency(engine, make_workload("latency", engine.vocab_size)[0])["tpot_ms"]
    model = engine.executor.runner.model  # type: ignore[attr-defined]  # the in-process executor's
    layers, shape = step_layers(model.model)
    layer_bytes = sum(t.numel() * t.element_size() for layer in layers for p in (layer.qkv, layer.o, layer.gate_up,
                      layer.down) for t in vars(p).values())  # fmt: skip
    res["layer_gb"] = round(layer_bytes / 1e9, 3)
    cos_sin = model.model.rotary_emb.cos_sin_cache
    gen = torch.Generator().manual_seed(0)
    width = -(-args.max_model_len // layers[0].kv_cache.shape[2])
    embedding = torch.randn(layers[0].in_norm.numel(), generator=gen).to(layers[0].in_norm.dtype).to(cos_sin.device)
    res["rows"] = []
    for tiles in [TINY_TILES] if args.tiny else [StepTiles(**json.loads(t)) for t in args.tiles]:
        step: Int4DecodeStep | None = None
        for context in args.contexts if not args.tiny else [40]:
            row: dict[str, Any] = {"tiles": vars(tiles), "context": context}
            try:  # a setting that fails (a new path's first GPU run) is reported, and the next ones still run
                step = step or Int4DecodeStep(layers, shape, tiles)
                table = torch.zeros(width, dtype=torch.int32, device=cos_sin.device)
                table[: -(-context // layers[0].kv_cache.shape[2])] = filled_table(layers, context, gen)
                row["rel_err"] = check(step, layers, shape, table, context, cos_sin, embedding)
                if not args.tiny:
                    row.update(_timings(step, model, table, context, cos_sin, embedding, layer_bytes,
                                        res["copy_tb_s"]))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - any failure of one setting is that setting's result
                if args.tiny:
                    raise
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)  # its lines came first
    engine.shutdown()
    return res


def _timings(step: Int4DecodeStep, model: Any, table: torch.Tensor, context: int, cos_sin: torch.Tensor,
             embedding: torch.Tensor, layer_bytes: int, copy_tb_s: float) -> dict[str, Any]:  # fmt: skip
    hidden = torch.empty_like(embedding)
    seq_len = torch.tensor([context], dtype=torch.int32, device=hidden.device)

    def one_step() -> None:
        hidden.copy_(embedding)
        step(hidden, seq_len, table, cos_sin)

    layers_ms = time_graph([one_step], 20) * 1e3
    head = model.lm_head.weight
    lm_head_ms = time_graph([lambda: torch.nn.functional.linear(embedding[None], head)], 20) * 1e3
    floor_ms = layer_bytes / (copy_tb_s * 1e12) * 1e3
    trace = torch.zeros(len(step.plan.rows), TRACE_FIELDS, dtype=torch.int64, device=hidden.device)
    for _ in range(2):  # the second: compiled, caches as in the timed replays
        hidden.copy_(embedding)
        step(hidden, seq_len, table, cos_sin, trace=trace)
    summary = summarize(trace.tolist(), step.plan.rows, step.grid, _kind_bytes(step, context))
    print("\n".join(lines(summary)), flush=True)
    return {"layers_ms": round(layers_ms, 4), "layers_floor_ms": round(floor_ms, 4),
            "layers_x_floor": round(layers_ms / floor_ms, 3), "lm_head_ms": round(lm_head_ms, 4),
            "trace": summary}  # fmt: skip


def _kind_bytes(step: Int4DecodeStep, context: int) -> dict[int, int]:
    """A layer's bytes by kind of task: its projections' packed weights, scales and zeros; the KV cache read."""
    layer = step.layers[0]
    out = {kind: sum(t.numel() * t.element_size() for t in vars(proj).values())
           for kind, proj in ((QKV, layer.qkv), (O_PROJ, layer.o), (GATE_UP, layer.gate_up), (DOWN, layer.down))}  # fmt: skip
    cache = layer.kv_cache
    return out | {ATTN: 2 * context * cache.shape[3] * cache.shape[4] * cache.element_size()}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument(
        "--tiles",
        nargs="+",
        default=["{}"],
        help="StepTiles fields as JSON, one launch each, e.g. '{}' '{\"tn\": 64, \"programs_per_sm\": 2}'",
    )
    ap.add_argument("--tiny", action="store_true", help="2 tiny layers on CPU under the interpreter (tests)")
    ap.add_argument("--out", type=Path)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    res = run(args)
    print(json.dumps(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
