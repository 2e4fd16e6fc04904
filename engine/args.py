"""``EngineArgs``: every engine option, defined once, with vLLM's names.

The CLI flags (``pagedserve serve`` / ``worker``), the argv handed to a worker subprocess, the keyword
arguments of ``LLM(...)`` and the ``EngineConfig`` all come from this one dataclass. Imports no torch
(``deploy/`` and the API-only install use it).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

_GROUP_TITLE = "engine (vLLM's flag names)"


def _opt(default: Any, help: str, **extra: Any) -> Any:
    """A field with its default and CLI help (``aliases``: extra option strings, e.g. ``-tp``)."""
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineArgs:
    """The engine's options. Build an ``EngineConfig`` with ``create_engine_config()`` (validates, raises
    ``ValueError``); ``add_cli_args`` / ``from_cli_args`` / ``to_argv`` are the argparse side."""

    # model
    model: str = _opt("", "HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    tokenizer: str | None = _opt(None, "a tokenizer folder apart from the model's (vLLM's --tokenizer)")
    dtype: str = _opt("auto", "auto | float32 | float16 | bfloat16")
    max_model_len: int | None = _opt(None, "context length (default: the model's)")
    load_format: str = _opt("auto", "auto | dummy (random weights)")
    quantization: str = _opt(
        "auto",
        "auto (the checkpoint's quantization_config) | awq | gptq | compressed-tensors (awq_marlin, gptq_marlin: "
        "vLLM's kernel names, the same int4 kernels here)",
    )
    seed: int = _opt(0, "random seed of the engine")
    trust_remote_code: bool = _opt(
        False, "accepted for vLLM compatibility; no model code from the checkpoint is ever run"
    )
    skip_tokenizer_init: bool = _opt(False, "no tokenizer: token ids in, token ids out")
    # KV cache
    block_size: int = _opt(16, "tokens per KV block (a power of two)")
    gpu_memory_utilization: float = _opt(0.9, "fraction of GPU memory the engine may take")
    num_gpu_blocks_override: int | None = _opt(None, "fixed number of KV blocks (default: from free memory)")
    cpu_kv_cache_gib: float = _opt(1.0, "KV cache budget on CPU")
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of shared prompt prefixes")
    swap_space: float = _opt(0.0, "GiB of host memory per GPU for the KV blocks of preempted requests (0: recompute)")
    # scheduler
    max_num_seqs: int = _opt(256, "sequences per batch; also the jobs a worker takes")
    max_num_batched_tokens: int | None = _opt(
        None,
        "token budget per engine step (default as vLLM's: 8192 on a GPU of >= 70 GiB but an A100, else 2048; "
        "twice that in the offline LLM class)",
    )
    scheduling_policy: str = _opt("fcfs", "fcfs | priority")
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps to fit the token budget")
    preemption_mode: str = _opt("auto", "auto (swap or recompute, by cost) | swap | recompute")
    # parallelism and device
    tensor_parallel_size: int = _opt(1, "GPUs (ranks) the model is split over", aliases=["-tp"])
    distributed_executor_backend: str = _opt(
        "auto", "auto | mp (one process per rank) | uni (TP=1 in-process); auto: uni at TP=1, mp above"
    )
    device: str = _opt("auto", "auto | cpu | cuda")
    attention_backend: str = _opt("auto", "auto (triton on CUDA, torch elsewhere) | torch | triton")
    enforce_eager: bool = _opt(False, "no CUDA graphs")
    async_scheduling: bool = _opt(
        True,
        "schedule step N+1 while the GPU runs step N (falls back to synchronous steps for penalties, logprobs, TP > 1)",
    )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, with_model: bool = True) -> argparse.ArgumentParser:
        """Add one flag per field (``--max-num-seqs``...) to ``parser`` in its own group. Bools that default
        to True get ``--x / --no-x``, the others ``--x``. ``with_model=False`` leaves ``--model`` to the
        caller (``pagedserve``'s common flags define both, with ``--tokenizer``)."""
        group = parser.add_argument_group(_GROUP_TITLE)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in ("model", "tokenizer") and not with_model:
                continue
            names = [_flag(f.name), *f.metadata.get("aliases", [])]
            kind = _scalar_type(hints[f.name])
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata["help"]}
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            elif kind is not str:
                kwargs["type"] = kind
            group.add_argument(*names, **kwargs)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields found on ``args`` (parsed with ``add_cli_args``); missing ones keep their defaults."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def to_argv(self) -> list[str]:
        """The fields that differ from their defaults, as flags that ``add_cli_args`` parses back to ``self``."""
        out: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if isinstance(value, bool):
                out.append(_flag(f.name) if value else _flag(f"no_{f.name}"))
            elif value is None:
                raise ValueError(f"{f.name}=None cannot be passed as a flag (its default is {f.default!r})")
            else:
                out += [_flag(f.name), str(value)]
        return out

    def create_engine_config(self) -> EngineConfig:
        """The validated ``EngineConfig`` (its dataclasses raise ``ValueError`` on bad values)."""
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                load_format=self.load_format,
                quantization=self.quantization,
                seed=self.seed,
                trust_remote_code=self.trust_remote_code,
                skip_tokenizer_init=self.skip_tokenizer_init,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                cpu_kv_cache_gib=self.cpu_kv_cache_gib,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space_gib=self.swap_space,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                policy=self.scheduling_policy,
                enable_chunked_prefill=self.enable_chunked_prefill,
                preemption_mode=self.preemption_mode,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            device=self.device,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            async_scheduling=self.async_scheduling,
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar_type(hint: Any) -> type:
    """``int | None`` -> ``int``; plain ``int`` / ``float`` / ``str`` / ``bool`` as they are."""
    if isinstance(hint, types.UnionType):
        (kind,) = (a for a in typing.get_args(hint) if a is not type(None))
        return typing.cast(type, kind)
    return typing.cast(type, hint)
