"""Engine flags with vLLM's names, and the one function that turns them into an ``EngineConfig``
(used by ``pagedserve serve`` and ``pagedserve worker`` alike). Imports no torch."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine (vLLM's flag names)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | float16 | bfloat16")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch; also the jobs a worker takes")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per engine step")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument(
        "--swap-space",
        type=float,
        default=0.0,
        help="GiB of CPU swap for preempted requests (only 0: preemption recomputes)",
    )
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--cpu-kv-cache-gib", type=float, default=1.0, help="KV cache budget on CPU")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--async-scheduling", action="store_true", help="schedule step N+1 while the GPU runs step N")
    g.add_argument("--load-format", default="auto", help="auto | dummy (random weights)")
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--scheduling-policy", default="fcfs", help="fcfs | priority")
    g.add_argument("--seed", type=int, default=0)


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags back as argv, to hand to a worker subprocess unchanged."""
    out: list[str] = []
    for name in (
        "dtype",
        "max_model_len",
        "tensor_parallel_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
        "block_size",
        "swap_space",
        "num_gpu_blocks_override",
        "cpu_kv_cache_gib",
        "load_format",
        "device",
        "scheduling_policy",
        "seed",
    ):
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    out.append("--enable-prefix-caching" if args.enable_prefix_caching else "--no-enable-prefix-caching")
    if args.enforce_eager:
        out.append("--enforce-eager")
    if args.async_scheduling:
        out.append("--async-scheduling")
    return out


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """Flags → ``EngineConfig`` (its dataclasses validate the values and raise ``ValueError``)."""
    from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

    return EngineConfig(
        model=ModelConfig(
            model=model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            load_format=args.load_format,
            seed=args.seed,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            cpu_kv_cache_gib=args.cpu_kv_cache_gib,
            enable_prefix_caching=args.enable_prefix_caching,
            swap_space_gib=args.swap_space,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            policy=args.scheduling_policy,
        ),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
        device=args.device,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )
