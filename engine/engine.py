"""The synchronous engine: add requests, call ``step()``, get each sample's new tokens back (``SeqOutput``).

Detokenization, stop strings and grouping are not here: ``engine.output_processor`` does them, in the
offline ``LLM`` and in the worker front (which runs this engine in its own process, ``engine.core``)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

import modelfiles
from cache.kv import KVCacheManager
from cache.swap import SwapKVCacheManager
from engine.config import EngineConfig
from engine.core_messages import CoreStats, SeqOutput
from engine.executor import Executor, make_executor
from engine.input_batch import InputBatch
from engine.inputs import StepInputs, TokenFill
from engine.model_runner import effective_max_model_len, with_batch_defaults
from engine.request import Request, RequestStatus, validate_request
from engine.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose sampled ids are still on the device."""

    out: SchedulerOutput
    rows: list[Request]  # the request of each sampling row
    token_ids: torch.Tensor  # [num_sampling_rows] on the device
    host_ids: torch.Tensor  # the same, being copied to pinned host memory (CPU: the ids themselves)
    copied: torch.cuda.Event | None  # recorded after that copy (None on CPU)

    @classmethod
    def launch(cls, out: SchedulerOutput, rows: list[Request], token_ids: torch.Tensor) -> _InFlight:
        """Start copying the step's ids to the host now, behind this step's kernels only: a copy issued when
        the step is resolved would queue behind the next step's kernels and wait for them as well."""
        if token_ids.device.type != "cuda":
            return cls(out, rows, token_ids, token_ids, None)
        host_ids = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
        host_ids.copy_(token_ids, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(out, rows, token_ids, host_ids, copied)

    def resolved_ids(self) -> list[int]:
        """The step's ids on the host, waiting for that step (and its copy) only."""
        if self.copied is not None:
            self.copied.synchronize()
        ids: list[int] = self.host_ids.tolist()
        return ids


class Engine:
    """Scheduler + executor + sampler. ``step()`` is the whole loop body."""

    def __init__(self, config: EngineConfig) -> None:
        config = with_batch_defaults(config)
        self.config = config
        self.files = modelfiles.resolve(config.model.model)
        self.tokenizer: Any = None
        if not config.model.skip_tokenizer_init:
            self.tokenizer = AutoTokenizer.from_pretrained(config.model.tokenizer or self.files.folder)
        self.executor: Executor = make_executor(config, self.files)
        spec = self.executor.kv_spec
        hf_config = self.executor.hf_config
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = effective_max_model_len(config, hf_config, spec)
        if config.model.max_model_len and config.model.max_model_len > self.max_model_len:
            logger.warning(
                "max_model_len %d exceeds the KV cache (%d tokens): capped", config.model.max_model_len, spec.num_tokens
            )
        self.kv: KVCacheManager = (
            SwapKVCacheManager(
                spec.num_blocks, spec.block_size, spec.num_cpu_blocks, config.cache.enable_prefix_caching
            )
            if spec.num_cpu_blocks
            else KVCacheManager(spec.num_blocks, spec.block_size, config.cache.enable_prefix_caching)
        )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        # block tables kept between steps (rank 0 builds each step's inputs once, also under tensor parallelism)
        self.input_batch = InputBatch(
            spec.block_size, config.scheduler.max_num_seqs, -(-self.max_model_len // spec.block_size)
        )
        self.sampler = Sampler(self.executor.device)
        self.eos_token_ids = self._eos_token_ids()
        self._generators: dict[str, torch.Generator] = {}
        self._counter = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.computed_tokens_total = 0  # tokens run through the model (prefix-cache hits excluded)
        self._inflight: _InFlight | None = None
        self._num_history_requests = 0  # running requests whose sampling reads past tokens on the host
        uses_ranks = config.parallel.tensor_parallel_size > 1 or config.parallel.distributed_executor_backend == "mp"
        self.async_scheduling = config.async_scheduling and not uses_ranks  # other ranks cannot see device-side ids

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids: set[int] = set()
        try:
            gen = GenerationConfig.from_pretrained(self.files.folder)
            eos = gen.eos_token_id
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        except OSError:
            pass
        if not ids:
            eos = getattr(self.executor.hf_config, "eos_token_id", None)
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if not ids and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    # ---- requests ---------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` for anything that could never be served."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)

    def add_request(
        self,
        request_id: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue one caller request (n samples). Returns its id. Raises ``ValueError`` on bad input."""
        self.validate(prompt_token_ids, params)
        group_id = request_id if request_id is not None else str(next(self._counter))
        if group_id in self.scheduler.groups:
            raise ValueError(f"request id {group_id!r} is already in use")
        now = time.monotonic()
        for i in range(params.n):
            request = Request(
                request_id=group_id if params.n == 1 else f"{group_id}#{i}",
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=params,
                eos_token_ids=self.eos_token_ids,
                arrival_time=now,
                priority=priority,
                group_id=group_id,
                sample_index=i,
                prompt=prompt,
                waiting_for_fork=i > 0,
            )
            if params.needs_history:
                self._num_history_requests += 1
            if params.seed is not None:
                self._generators[request.request_id] = make_generator(params.seed + i, self.executor.device)
            self.scheduler.add_request(request)
        self.prompt_tokens_total += len(prompt_token_ids)
        return group_id

    def abort_request(self, request_id: str, sample_indices: list[int] | None = None) -> list[SeqOutput]:
        """Abort a caller request (or some of its samples): their KV blocks are freed now. Returns the final
        outputs of the samples that were still running."""
        group = self.scheduler.groups.get(request_id)
        if group is None:
            return []
        chosen = [r for r in group if sample_indices is None or r.sample_index in sample_indices]
        aborted = [r for r in chosen if not r.is_finished]
        for r in aborted:
            self.scheduler.finish(r, RequestStatus.FINISHED_ABORTED)
        outputs = [self._seq_output(r) for r in aborted]
        self._release_if_done(request_id)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    # ---- the loop body ----------------------------------------------------------------------------
    def step(self) -> list[SeqOutput]:
        """Schedule, execute, update; the samples that advanced and what they got.

        With asynchronous scheduling the step launched here is only resolved by the next call: the host
        schedules and prepares step N+1 while the device runs step N, and step N's sampled ids reach
        step N+1's input on the device. Requests whose sampling needs the token history (penalties,
        logprobs) switch the engine back to synchronous steps while they run."""
        overlap = self.async_scheduling and self._num_history_requests == 0
        if self._inflight is not None and not overlap:
            return self._resolve_inflight()
        out = self.scheduler.schedule()
        if out.is_empty:
            return self._resolve_inflight() if self._inflight is not None else []
        logits = self._execute(out)
        batch = self._sampling_batch(out)
        if not overlap:
            result = self.sampler(logits, batch) if len(batch) else SamplerOutput([], [])
            rows = self.scheduler.advance(out)
            return self._outputs(self.scheduler.resolve(out, rows, result.token_ids, result.logprobs))
        token_ids = self.sampler.sample_ids(logits, batch) if len(batch) else logits.new_empty(0)
        launched = _InFlight.launch(out, self.scheduler.advance(out), token_ids)
        outputs = self._resolve_inflight() if self._inflight is not None else []
        self._inflight = launched
        return outputs

    def _execute(self, out: SchedulerOutput) -> torch.Tensor:
        self.computed_tokens_total += out.num_tokens
        inputs = self.input_batch.build(out)
        return self.executor.execute_model(inputs, self._token_fill(out, inputs))

    def _resolve_inflight(self) -> list[SeqOutput]:
        inflight, self._inflight = self._inflight, None
        assert inflight is not None
        token_ids = inflight.resolved_ids()
        changed = self.scheduler.resolve(inflight.out, inflight.rows, token_ids, [None] * len(token_ids))
        return self._outputs(changed)

    def _token_fill(self, out: SchedulerOutput, inputs: StepInputs) -> TokenFill | None:
        """Input positions whose token is still on the device (sampled by the step in flight). A request with
        a placeholder decodes exactly that token, so it is the last input of its chunk."""
        if self._inflight is None:
            return None
        row_of = {r.request_id: i for i, r in enumerate(self._inflight.rows)}
        dst: list[int] = []
        src: list[int] = []
        ends = inputs.query_start_loc.tolist()[1:]
        for chunk, end in zip(out.chunks, ends, strict=True):
            if chunk.request.num_output_placeholders:
                dst.append(end - 1)
                src.append(row_of[chunk.request.request_id])
        if not dst:
            return None
        return TokenFill(self._inflight.token_ids, torch.tensor(dst), torch.tensor(src))

    def _sampling_batch(self, out: SchedulerOutput) -> SamplingBatch:
        rows = [c.request for c in out.chunks if c.samples]
        return SamplingBatch(
            params=[_params_counting_placeholders(r) for r in rows],
            prompt_token_ids=[r.prompt_token_ids for r in rows],
            output_token_ids=[r.output_token_ids for r in rows],
            generators=[self._generators.get(r.request_id) for r in rows],
            eos_token_ids=[r.eos_token_ids for r in rows],
            request_ids=[r.request_id for r in rows],
        )

    def _outputs(self, changed: list[Request]) -> list[SeqOutput]:
        self.generation_tokens_total += len(changed)
        outputs = [self._seq_output(r) for r in changed]
        for group_id in {r.group_id for r in changed if r.is_finished}:
            self._release_if_done(group_id)
        return outputs

    def _seq_output(self, r: Request) -> SeqOutput:
        """The tokens ``r`` got since its last output (known ones only: the one in flight is not in the list)."""
        token_ids = r.output_token_ids
        end = len(token_ids)
        start, r.num_emitted_tokens = r.num_emitted_tokens, end
        logprobs = r.output_logprobs[start:end] if r.sampling_params.logprobs is not None else None
        stop = r.stop_reason if isinstance(r.stop_reason, int) else None
        cached = r.num_cached_tokens if start == 0 else 0
        return SeqOutput(
            r.group_id, r.sample_index, token_ids[start:end], logprobs, r.status.finish_reason, stop, cached
        )

    def _release_if_done(self, group_id: str) -> None:
        requests = self.scheduler.groups.get(group_id)
        if requests is None or not all(r.is_finished for r in requests):
            return
        for r in requests:
            if r.sampling_params.needs_history:
                self._num_history_requests -= 1
            self._generators.pop(r.request_id, None)
        self.scheduler.release_group(group_id)

    def stats(self) -> CoreStats:
        kv_stats = self.kv.stats
        swap = self.kv if isinstance(self.kv, SwapKVCacheManager) else None
        return CoreStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=kv_stats.num_query_tokens,
            prefix_cache_hits=kv_stats.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_swap_preemptions=self.scheduler.num_swap_preemptions,
            num_recompute_preemptions=self.scheduler.num_recompute_preemptions,
            num_blocks_swapped_out=swap.swap_stats.num_blocks_swapped_out if swap else 0,
            num_blocks_swapped_in=swap.swap_stats.num_blocks_swapped_in if swap else 0,
            cpu_kv_cache_usage=swap.host_usage() if swap else 0.0,
            num_swapped=swap.num_swapped_requests if swap else 0,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()


def _params_counting_placeholders(r: Request) -> SamplingParams:
    """``r``'s params for the sampler, which applies min_tokens by ``len(output_token_ids)``: that list lacks
    the token still on the device, so while min_tokens is not yet reached the bound is lowered by the
    placeholders (a copy; only in those first steps)."""
    params = r.sampling_params
    if r.num_output_placeholders and params.min_tokens > len(r.output_token_ids):
        return dataclasses.replace(params, min_tokens=params.min_tokens - r.num_output_placeholders)
    return params
