"""Engine configuration: one dataclass per subsystem, gathered into ``EngineConfig``.

Values measured at start-up (the number of KV blocks) live in ``engine.model_runner.KVCacheSpec``,
never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.quantization.config import check_quantization_name


@dataclass
class ModelConfig:
    model: str = ""  # local HF folder (config.json + safetensors + tokenizer) or a .gguf file; "" = default
    tokenizer: str | None = None  # a tokenizer folder apart from the model's; None = the model's
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 ; auto follows the checkpoint (float32 on CPU)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    load_format: str = "auto"  # auto | dummy (random weights of the config's shape, for benchmarks)
    quantization: str = "auto"  # auto = the checkpoint's quantization_config; or awq | gptq | compressed-tensors
    # (awq_marlin / gptq_marlin: vLLM's kernel names for awq / gptq)
    seed: int = 0
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False  # token ids in, token ids out (benchmarks of configs without a tokenizer)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        check_quantization_name(self.quantization)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block; a power of two so kernels can mask with shifts
    gpu_memory_utilization: float = 0.9  # fraction of device memory the engine may take (CUDA only)
    num_gpu_blocks_override: int | None = None  # fixed block count (tests force preemption with few blocks)
    cpu_kv_cache_gib: float = 1.0  # KV budget when running on CPU
    enable_prefix_caching: bool = True
    swap_space_gib: float = 0.0  # host memory per rank for swapped-out KV blocks (pinned on CUDA); 0 = recompute only

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space_gib}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # running sequences per step
    # the one token budget per step (prefill chunks + decodes); None: vLLM's default for the device and the usage
    # (``engine.model_runner.default_batched_tokens``), set when the engine starts
    max_num_batched_tokens: int | None = None
    offline: bool = False  # the offline ``LLM`` class (vLLM's LLM_CLASS defaults), not a server's worker
    policy: str = "fcfs"  # fcfs | priority
    enable_chunked_prefill: bool = True
    # how a preempted request gives its blocks back: auto = swap to the host or recompute, whichever costs less
    # (recompute when the host pool is full or there is none); swap | recompute force one (vLLM v0's flag)
    preemption_mode: str = "auto"

    @property
    def token_budget(self) -> int:
        """``max_num_batched_tokens`` once the engine has filled in its default."""
        if self.max_num_batched_tokens is None:
            raise RuntimeError("max_num_batched_tokens is unset: the engine fills it in (with_batch_defaults)")
        return self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be fcfs or priority, got {self.policy!r}")
        if self.preemption_mode not in ("auto", "swap", "recompute"):
            raise ValueError(f"preemption_mode must be auto, swap or recompute, got {self.preemption_mode!r}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_init_method: str | None = None  # tcp://host:port; None = pick a free local port
    # "mp": one process per rank with a process group (forced at TP=1 too); "uni": TP=1 in-process, no group;
    # "auto": uni at TP=1, mp above
    distributed_executor_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in ("auto", "mp", "uni"):
            raise ValueError("distributed_executor_backend must be auto, mp or uni")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend 'uni' runs one rank: use 'mp' for tensor_parallel_size > 1")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere) | torch | triton
    enforce_eager: bool = False  # no CUDA graphs
    async_scheduling: bool = True  # overlap host scheduling with the device (see docs/benchmarks.md)

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        if self.scheduler.preemption_mode == "swap" and self.cache.swap_space_gib == 0:
            raise ValueError("preemption_mode swap needs host memory to swap to: set --swap-space (GiB) > 0")
