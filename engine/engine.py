"""The synchronous engine: add requests, call ``step()``, get ``RequestOutput``s back."""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer, GenerationConfig

import modelfiles
from cache.kv import KVCacheManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import Executor, make_executor
from engine.inputs import StepInputs, TokenFill, build_step_inputs
from engine.model_runner import effective_max_model_len
from engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from engine.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from engine.sampling_params import SamplingParams
from engine.scheduler import PLACEHOLDER, Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


def _resolved(token_ids: list[int]) -> list[int]:
    """Output tokens without the slot reserved for the step still in flight."""
    return token_ids[:-1] if token_ids and token_ids[-1] == PLACEHOLDER else list(token_ids)


@dataclass
class _InFlight:
    """A launched step whose sampled ids are still on the device."""

    out: SchedulerOutput
    rows: list[tuple[Request, int]]
    token_ids: torch.Tensor  # [num_sampling_rows] on the device


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by requests
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int


class Engine:
    """Scheduler + executor + sampler + detokenizer. ``step()`` is the whole loop body."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.files = modelfiles.resolve(config.model.model)
        self.tokenizer: Any = None
        if not config.model.skip_tokenizer_init:
            self.tokenizer = AutoTokenizer.from_pretrained(self.files.folder)
        self.executor: Executor = make_executor(config, self.files)
        spec = self.executor.kv_spec
        hf_config = self.executor.hf_config
        self.vocab_size = int(hf_config.vocab_size)
        self.max_model_len = effective_max_model_len(config, hf_config, spec)
        if config.model.max_model_len and config.model.max_model_len > self.max_model_len:
            logger.warning(
                "max_model_len %d exceeds the KV cache (%d tokens): capped", config.model.max_model_len, spec.num_tokens
            )
        self.kv = KVCacheManager(spec.num_blocks, spec.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.sampler = Sampler(self.executor.device)
        self.eos_token_ids = self._eos_token_ids()
        self._generators: dict[str, torch.Generator] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
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
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if any(not isinstance(t, int) or t < 0 or t >= self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens but max_model_len is {self.max_model_len}: "
                "shorten the prompt (at least one token must be left to generate)"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            unknown = [t for t in ids if t >= self.vocab_size]
            if unknown:
                raise ValueError(f"unknown token ids in {name} {unknown}: the vocabulary has {self.vocab_size} tokens")

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
            if self.tokenizer is not None:
                self._detok[request.request_id] = IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, params
                )
            if params.needs_history:
                self._num_history_requests += 1
            if params.seed is not None:
                self._generators[request.request_id] = make_generator(params.seed + i, self.executor.device)
            self.scheduler.add_request(request)
        self.prompt_tokens_total += len(prompt_token_ids)
        return group_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a caller request: its KV blocks are freed now. Returns its final output, if it existed."""
        if request_id not in self.scheduler.groups:
            return None
        self.scheduler.abort_group(request_id)
        return self._group_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    # ---- the loop body ----------------------------------------------------------------------------
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled batch. ``final_only`` (offline use) skips building outputs of unfinished
        requests, which costs a copy of every running request's tokens per step.

        With asynchronous scheduling the step launched here is only resolved by the next call: the host
        schedules and prepares step N+1 while the device runs step N, and step N's sampled ids reach
        step N+1's input on the device. Requests whose sampling needs the token history (penalties,
        logprobs) switch the engine back to synchronous steps while they run."""
        overlap = self._can_overlap()
        if self._inflight is not None and not overlap:
            return self._resolve_inflight(final_only)
        out = self.scheduler.schedule()
        if out.is_empty and self._inflight is None:
            return []
        launched: _InFlight | None = None
        if not out.is_empty:
            self.computed_tokens_total += out.num_tokens
            inputs = build_step_inputs(out, self.kv.block_size)
            logits = self.executor.execute_model(inputs, self._token_fill(out, inputs))
            batch = self._sampling_batch(out)
            if overlap:
                token_ids = self.sampler.sample_ids(logits, batch) if len(batch) else logits.new_empty(0)
                launched = _InFlight(out, self.scheduler.advance(out), token_ids)
            else:
                result = self.sampler(logits, batch) if len(batch) else SamplerOutput([], [])
                rows = self.scheduler.advance(out)
                changed = self.scheduler.resolve(out, rows, result.token_ids, result.logprobs)
                return self._outputs(changed, final_only)
        outputs = self._resolve_inflight(final_only) if self._inflight is not None else []
        self._inflight = launched
        return outputs

    def _can_overlap(self) -> bool:
        return self.async_scheduling and self._num_history_requests == 0

    def _resolve_inflight(self, final_only: bool) -> list[RequestOutput]:
        inflight, self._inflight = self._inflight, None
        assert inflight is not None
        token_ids: list[int] = inflight.token_ids.tolist()  # waits for that step only
        changed = self.scheduler.resolve(inflight.out, inflight.rows, token_ids, [None] * len(token_ids))
        return self._outputs(changed, final_only)

    def _token_fill(self, out: SchedulerOutput, inputs: StepInputs) -> TokenFill | None:
        """Input positions whose token is still on the device (sampled by the step in flight)."""
        if self._inflight is None:
            return None
        row_of = {r.request_id: i for i, (r, _) in enumerate(self._inflight.rows)}
        dst: list[int] = []
        src: list[int] = []
        ends = inputs.query_start_loc.tolist()[1:]
        for chunk, end in zip(out.chunks, ends, strict=True):
            outputs = chunk.request.output_token_ids
            if outputs and outputs[-1] == PLACEHOLDER:
                dst.append(end - 1)
                src.append(row_of[chunk.request.request_id])
        if not dst:
            return None
        return TokenFill(self._inflight.token_ids, torch.tensor(dst), torch.tensor(src))

    def _sampling_batch(self, out: SchedulerOutput) -> SamplingBatch:
        rows = [c.request for c in out.chunks if c.samples]
        return SamplingBatch(
            params=[r.sampling_params for r in rows],
            prompt_token_ids=[r.prompt_token_ids for r in rows],
            output_token_ids=[r.output_token_ids for r in rows],
            generators=[self._generators.get(r.request_id) for r in rows],
            eos_token_ids=[r.eos_token_ids for r in rows],
        )

    def _outputs(self, changed: list[Request], final_only: bool) -> list[RequestOutput]:
        self.generation_tokens_total += len(changed)
        groups: dict[str, None] = {}
        for request in changed:
            self._detokenize(request)
            if not final_only or request.is_finished:
                groups[request.group_id] = None
        outputs = []
        for group_id in groups:
            if final_only and not all(r.is_finished for r in self.scheduler.groups[group_id]):
                continue
            outputs.append(self._group_output(group_id))
        return outputs

    def _detokenize(self, request: Request) -> None:
        detok = self._detok.get(request.request_id)
        if detok is None:
            return
        stop = detok.add_tokens(_resolved(request.output_token_ids)[-1:])
        if stop is not None and not request.is_finished:
            request.stop_reason = stop
            self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            detok.finish()

    def _group_output(self, group_id: str) -> RequestOutput:
        requests = self.scheduler.groups[group_id]
        outputs = []
        for r in requests:
            want_lp = r.sampling_params.logprobs is not None
            cumulative = (
                sum(lp[t] for lp, t in zip(r.output_logprobs, r.output_token_ids, strict=False)) if want_lp else None
            )
            outputs.append(
                CompletionOutput(
                    index=r.sample_index,
                    text=self._detok[r.request_id].output_text if r.request_id in self._detok else "",
                    token_ids=_resolved(r.output_token_ids),
                    cumulative_logprob=cumulative,
                    logprobs=list(r.output_logprobs) if want_lp else None,
                    finish_reason=r.status.finish_reason,
                    stop_reason=r.stop_reason,
                )
            )
        finished = all(r.is_finished for r in requests)
        first = requests[0]
        result = RequestOutput(
            request_id=group_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=finished,
        )
        if finished:
            for r in requests:
                if r.sampling_params.needs_history:
                    self._num_history_requests -= 1
                self._detok.pop(r.request_id, None)
                self._generators.pop(r.request_id, None)
            self.scheduler.release_group(group_id)
        return result

    def stats(self) -> EngineStats:
        kv_stats = self.kv.stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=kv_stats.num_query_tokens,
            prefix_cache_hits=kv_stats.num_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
