"""Offline batch inference with vLLM's ``LLM`` interface, so vLLM scripts port with an import change."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from tqdm import tqdm

from deploy.gc_heap import freeze_heap, thaw_heap
from engine.args import EngineArgs
from engine.engine import Engine
from engine.output_processor import OutputProcessor
from engine.request import RequestOutput
from engine.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """``LLM(model=DIR).generate(prompts, params)`` runs every prompt as one continuous batch.

    Its tensor-parallel ranks stop on ``shutdown()``, at the end of ``with LLM(...) as llm:``, when the ``LLM``
    is garbage-collected, or at interpreter exit, whichever comes first."""

    def __init__(self, model: str = "", **kwargs: Any) -> None:
        """``kwargs`` are ``EngineArgs`` fields (vLLM's names: ``max_num_seqs``, ``tensor_parallel_size``...);
        an unknown one raises ``TypeError``, a bad value ``ValueError``, both before anything loads."""
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s): {', '.join(unknown)}")
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        offline = dataclasses.replace(config.scheduler, offline=True)  # vLLM's LLM-class defaults (the budget)
        self.engine = Engine(dataclasses.replace(config, scheduler=offline))
        self._finalizer = weakref.finalize(self, _close, self.engine)  # references the engine, not self
        freeze_heap()  # the loaded engine out of the collector's reach, as vLLM's engine core does (deploy.gc_heap)

    def __enter__(self) -> LLM:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    _processor: OutputProcessor | None = None

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. Bad prompts raise ``ValueError`` before anything runs."""
        if not self._finalizer.alive:
            raise RuntimeError("this LLM was shut down")
        items = [prompts] if isinstance(prompts, str | dict) else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(items) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(items):
            raise ValueError(f"got {len(items)} prompts but {len(params)} sampling params")
        encoded = [self._encode(item) for item in items]
        for (token_ids, _), p in zip(encoded, params, strict=True):
            self.engine.validate(token_ids, p)
            if p.stop and self.engine.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; this engine runs with skip_tokenizer_init")
        ids = []
        for i, ((token_ids, text), p) in enumerate(zip(encoded, params, strict=True)):
            prio = priority[i] if priority is not None else 0
            request_id = self.engine.add_request(None, token_ids, p, prompt=text, priority=prio)
            self.processor.add(request_id, token_ids, p, prompt=text)
            ids.append(request_id)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conv in conversations:
            text = self.engine.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            prompts.append({"prompt": text, "prompt_token_ids": self._tokenize(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.engine.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _encode(self, item: PromptType) -> tuple[list[int], str | None]:
        if isinstance(item, str):
            return self._tokenize(item), item
        if "prompt_token_ids" in item:
            return list(item["prompt_token_ids"]), item.get("prompt")
        if "prompt" in item:
            return self._tokenize(item["prompt"]), item["prompt"]
        raise ValueError("a prompt must be a string or a dict with 'prompt' or 'prompt_token_ids'")

    @property
    def processor(self) -> OutputProcessor:
        """Text, stop strings and n > 1 grouping of the engine's per-step tokens."""
        if self._processor is None:
            self._processor = OutputProcessor(self.engine.tokenizer)
        return self._processor

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it finished (a stop string ends one here)."""
        processor = self.processor
        step = processor.process(self.engine.step())
        for request_id, index in step.aborts:  # the core need not compute them any further
            processor.process(self.engine.abort_request(request_id, [index]))
        return [processor.pop(request_id) for request_id in step.finished]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        while self.engine.has_unfinished_requests():
            for out in self.step():
                results[out.request_id] = out
                bar.update(1)
        bar.close()
        return [results[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the engine (its tensor-parallel ranks); idempotent. The ``LLM`` cannot generate afterwards."""
        self._finalizer()


def _close(engine: Engine) -> None:
    """The finalizer: stop the engine and give the frozen heap back to the collector."""
    engine.shutdown()
    thaw_heap()
