"""Runs the model on one step's flat batch and owns the paged KV cache tensors of this rank."""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass
from typing import Any

import torch

import modelfiles
from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.host_kv import HostKVCache
from engine.inputs import StepInputs, TokenFill
from engine.loader import load_hf_config, load_model, resolve_dtype
from engine.parallel import ParallelState
from engine.prefill_graphs import PrefillGraphs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """Measured at start-up, never written back into the config."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    dtype: torch.dtype
    num_cpu_blocks: int = 0  # the host pool for swapped-out blocks (--swap-space); 0 = none

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def model_max_len(config: EngineConfig, hf_config: Any) -> int:
    """The configured context length, or the model's; longer than the model's positions is refused (as vLLM
    does): the rotary table has a row per position, and a position past it would be read out of bounds."""
    positions = int(getattr(hf_config, "max_position_embeddings", 2048))
    if config.model.max_model_len and config.model.max_model_len > positions:
        raise ValueError(
            f"max_model_len {config.model.max_model_len} is longer than the model's {positions} positions "
            "(max_position_embeddings in its config): lower --max-model-len"
        )
    return config.model.max_model_len or positions


def effective_max_model_len(config: EngineConfig, hf_config: Any, kv_spec: KVCacheSpec) -> int:
    """The configured (or the model's) context length, capped by what the KV cache can hold."""
    return min(model_max_len(config, hf_config), kv_spec.num_tokens)


def pick_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# vLLM's defaults (``EngineArgs.get_batch_defaults``): a larger budget on large GPUs, but not on an A100, where it
# measured lower throughput; its offline ``LLM`` class (usage context LLM_CLASS, what ``vllm bench throughput``
# runs) twice its OpenAI server's. Off a GPU, 2048 either way.
LARGE_GPU_BYTES = 70 * (1 << 30)
LARGE_GPU_BATCHED_TOKENS = 8192
BATCHED_TOKENS = 2048
OFFLINE_FACTOR = 2


def batch_default(total_memory: int, name: str, offline: bool = False) -> int:
    """The token budget per step vLLM picks for a GPU with ``total_memory`` bytes named ``name``."""
    large = total_memory >= LARGE_GPU_BYTES and "a100" not in name.lower()
    tokens = LARGE_GPU_BATCHED_TOKENS if large else BATCHED_TOKENS
    return tokens * OFFLINE_FACTOR if offline else tokens


def default_batched_tokens(device: torch.device, offline: bool = False) -> int:
    """The token budget per step when none is configured, for ``device`` (``offline``: the ``LLM`` class's)."""
    if device.type != "cuda":
        return BATCHED_TOKENS
    props = torch.cuda.get_device_properties(device)
    return batch_default(props.total_memory, props.name, offline)


def with_batch_defaults(config: EngineConfig) -> EngineConfig:
    """``config`` with its unset token budget filled in for the device it runs on (every rank gets the same)."""
    if config.scheduler.max_num_batched_tokens is not None:
        return config
    tokens = default_batched_tokens(pick_device(config), config.scheduler.offline)
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_batched_tokens=tokens))


def pick_backend(config: EngineConfig, device: torch.device) -> str:
    if config.attention_backend != "auto":
        return config.attention_backend
    return "triton" if device.type == "cuda" else "torch"


def release_dropped_engines(device: torch.device) -> None:
    """Collect before this engine loads and measures: an engine dropped earlier in this process (an ``LLM`` without
    ``shutdown()``) keeps its weights and KV cache until the collector finds its cycles, and on CUDA the memory
    profile would count them against this one ("no memory left for the KV cache", the likely cause of four GPU tests
    failing that way on an H100 in Session 32; not yet re-run there). vLLM's memory profile collects first too."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class ModelRunner:
    """One per rank: loads the weights of its shard, allocates its KV cache, executes steps."""

    def __init__(self, config: EngineConfig, files: modelfiles.ModelFiles, parallel: ParallelState) -> None:
        config = with_batch_defaults(config)
        self.config = config
        self.parallel = parallel
        self.device = pick_device(config)
        self.backend = pick_backend(config, self.device)
        self.hf_config: Any = load_hf_config(files)
        model_max_len(config, self.hf_config)  # a length the model cannot take fails before its weights load
        self.dtype = resolve_dtype(config.model.dtype, self.hf_config, self.device)
        torch.manual_seed(config.model.seed)
        release_dropped_engines(self.device)
        self.model = load_model(
            files,
            self.hf_config,
            parallel,
            self.dtype,
            self.device,
            config.model.load_format,
            config.model.seed,
            quantization=config.model.quantization,
        )
        self.model.eval()
        self.graphs: DecodeGraphs | None = None  # captured after the KV cache exists
        self.prefill_graphs: PrefillGraphs | None = None
        self.kv_spec = self._size_kv_cache()
        layers = self.model.attention_layers()
        spec = self.kv_spec
        # One allocation for all layers: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        # Zeroed, because masked-out slots still enter the P·V product as 0 · value.
        self.kv_cache = torch.zeros(
            (spec.num_layers, 2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype,
            device=self.device,
        )
        for i, layer in enumerate(layers):
            layer.kv_cache = self.kv_cache[i]
        self.host_kv = HostKVCache(self.kv_cache, spec.num_cpu_blocks) if spec.num_cpu_blocks else None
        if self.host_kv is not None:
            logger.info("KV swap space: %d host blocks (%.2f GiB)", spec.num_cpu_blocks, self.host_kv.num_bytes / 2**30)
        max_len = effective_max_model_len(config, self.hf_config, spec)
        if self.device.type == "cuda" and not config.enforce_eager:
            max_blocks = -(-max_len // spec.block_size)
            max_seqs = config.scheduler.max_num_seqs
            self.graphs = DecodeGraphs(self.model, self.backend, max_seqs, max_blocks, self.device)
            self.graphs.capture(parallel)
            self.prefill_graphs = PrefillGraphs(self.model, self.backend, max_seqs, max_blocks, self.device)
            self.prefill_graphs.capture(self.graphs.logits, self.graphs.pool)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB) on %s: %.1f requests of %d tokens at once",
            spec.num_blocks,
            spec.block_size,
            spec.num_tokens,
            spec.num_blocks * spec.bytes_per_block / 2**30,
            self.device,
            spec.num_tokens / max_len,
            max_len,
        )

    def _size_kv_cache(self) -> KVCacheSpec:
        layers = self.model.attention_layers()
        block_size = self.config.cache.block_size
        probe = KVCacheSpec(1, block_size, len(layers), layers[0].num_kv_heads, layers[0].head_dim, self.dtype)
        override = self.config.cache.num_gpu_blocks_override
        if override is not None:
            num_blocks = override
        elif self.device.type == "cuda":
            num_blocks = self._profile_free_blocks(probe)
        else:
            num_blocks = int(self.config.cache.cpu_kv_cache_gib * 2**30 // probe.bytes_per_block)
        if self.parallel.world_size > 1:  # every rank must agree on the block count: take the smallest
            count = torch.tensor([num_blocks], dtype=torch.long, device=self.device)
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN, group=self.parallel.group)
            num_blocks = int(count.item())
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache: lower the model size or raise --gpu-memory-utilization")
        num_cpu_blocks = int(self.config.cache.swap_space_gib * 2**30 // probe.bytes_per_block)
        if self.config.cache.swap_space_gib > 0 and num_cpu_blocks < 1:
            raise ValueError(f"--swap-space holds no KV block ({probe.bytes_per_block} bytes): raise it or set 0")
        return KVCacheSpec(
            num_blocks, block_size, probe.num_layers, probe.num_kv_heads, probe.head_dim, self.dtype, num_cpu_blocks
        )

    def _profile_free_blocks(self, probe: KVCacheSpec) -> int:
        """Run a forward pass at the full token budget, then give the KV cache what is left."""
        num_tokens = self.config.scheduler.token_budget
        num_blocks = -(-num_tokens // probe.block_size)
        scratch = torch.zeros(
            (probe.num_layers, 2, num_blocks, probe.block_size, probe.num_kv_heads, probe.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        for i, layer in enumerate(self.model.attention_layers()):
            layer.kv_cache = scratch[i]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        inputs = _dummy_prefill(profile_lens(num_tokens, model_max_len(self.config, self.hf_config)), probe.block_size)
        self.execute_model(inputs)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del scratch
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = total * self.config.cache.gpu_memory_utilization - peak
        return int(budget // probe.bytes_per_block)

    # ---- execution --------------------------------------------------------------------------------
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # non_blocking from pageable memory: the driver stages small copies without waiting for the device
        return t.to(self.device, non_blocking=True)

    def _metadata(self, inputs: StepInputs) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._to_device(inputs.slot_mapping),
            query_start_loc=self._to_device(inputs.query_start_loc),
            seq_lens=self._to_device(inputs.seq_lens),
            block_tables=self._to_device(inputs.block_tables),
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            backend=self.backend,
            fresh=inputs.fresh,
            decode_rows=inputs.decode_rows,
        )

    @torch.inference_mode()
    def execute_model(self, inputs: StepInputs, fill: TokenFill | None = None) -> torch.Tensor:
        """Forward one step; returns float32 logits ``[num_sampling, vocab]`` (full vocab on every rank),
        valid until the next call (a decode graph's are a view of its static buffer). ``fill`` supplies
        input tokens that are still on the device (asynchronous scheduling)."""
        if inputs.blocks_to_swap_out or inputs.blocks_to_swap_in:  # before the copy-on-writes (cache.swap)
            if self.host_kv is None:
                raise RuntimeError("the scheduler swapped blocks but this rank has no swap space")
            self.host_kv.swap(self.kv_cache, inputs.blocks_to_swap_out, inputs.blocks_to_swap_in)
        if inputs.blocks_to_copy:
            src = torch.tensor([s for s, _ in inputs.blocks_to_copy], device=self.device)
            dst = torch.tensor([d for _, d in inputs.blocks_to_copy], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        input_ids = self._to_device(inputs.input_ids)
        if fill is not None:
            input_ids[self._to_device(fill.dst)] = fill.tokens[self._to_device(fill.src)]
        if self.graphs is not None and self.graphs.can_run(inputs):
            return self.graphs.run(inputs, input_ids)  # logits computed inside the graph
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(inputs):
            return self.prefill_graphs.run(inputs, input_ids)
        hidden = self.model(input_ids, self._to_device(inputs.positions), self._metadata(inputs))
        logits_indices = self._to_device(inputs.logits_indices)
        return self.model.compute_logits(hidden[logits_indices])  # [num_sampling, vocab]


def profile_lens(num_tokens: int, max_len: int, seq_len: int = 512) -> list[int]:
    """The memory profile's prefill: ``num_tokens`` in sequences of about ``seq_len`` tokens, none longer than
    ``max_len``: positions past the model's length would read past its rotary table (the Triton kernel does not
    check them), as 512-token sequences did with the 256-position model of ``tests/engine/test_gpu.py``."""
    cap = max(1, min(seq_len, max_len))
    seqs = -(-num_tokens // cap)
    lens = [num_tokens // seqs] * seqs
    for i in range(num_tokens - sum(lens)):
        lens[i] += 1
    return lens


def _dummy_prefill(lens: list[int], block_size: int) -> StepInputs:
    """Prefill of sequences of the given lengths over consecutive blocks (for memory profiling)."""
    tables: list[list[int]] = []
    next_block = 0
    for n in lens:
        nb = -(-n // block_size)
        tables.append(list(range(next_block, next_block + nb)))
        next_block += nb
    max_blocks = max(len(t) for t in tables)
    total = sum(lens)
    slots = torch.cat([torch.arange(n) + t[0] * block_size for n, t in zip(lens, tables, strict=True)])
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return StepInputs(
        input_ids=torch.zeros(total, dtype=torch.long),
        positions=torch.cat([torch.arange(n) for n in lens]),
        slot_mapping=slots,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
        logits_indices=torch.tensor([s - 1 for s in starts[1:]], dtype=torch.long),
        max_query_len=max(lens),
        max_seq_len=max(lens),
        blocks_to_copy=[],
        fresh=(0, 0) if min(lens) > 1 else None,  # fresh prompts: the profile compiles the Gluon prefill too
    )
