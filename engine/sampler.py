"""Batched token sampling with per-request parameters.

One call picks the next token for every sequence that samples this step. All per-row settings
(temperature, top-k, top-p, min-p, penalties) become per-row tensors, so the work is a handful of
batched kernels whatever the mix of requests; the only Python loops fill a seeded row's random
noise from that request's own generator and gather the penalised rows' tokens (only the new ones when
the batch names its requests: ``engine.penalty_state`` keeps each request's counts on the device).

Order of operations (vLLM's): penalties (repetition, frequency, presence) -> logit_bias -> min_tokens
masking of EOS / stop tokens -> [logprobs taken here] -> greedy argmax, or temperature -> top-k -> top-p ->
min-p -> sample.

Sampling uses the exponential race (equivalent to Gumbel-max): ``argmax(probs / E)`` with
``E ~ Exp(1)`` i.i.d. per token picks token ``i`` with probability ``probs[i]``. Because each row's
draw depends only on its own noise, a seeded row draws its noise from its own generator and gets
the same tokens whatever else shares the batch.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from engine.penalty_state import PenaltyState
from engine.sampling_params import SamplingParams
from kernels.argmax import greedy_ids as greedy_argmax

# When every sampling row has a top-k at most this, a partial top-k replaces the full vocabulary sort.
_MAX_PARTIAL_TOP_K = 1024


@dataclass
class SamplingBatch:
    """The rows that sample this step, in the order of the logits' rows."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # tokens generated so far (penalties, min_tokens)
    generators: list[torch.Generator | None]  # the request's own generator if seeded, else None
    # per row; while len(output) < min_tokens these and params.stop_token_ids are masked out
    # (ignore_eos does not change that: min_tokens always suppresses them)
    eos_token_ids: list[tuple[int, ...]]
    # per row, the request it samples for: penalised rows keep their token counts in the sampler's
    # ``PenaltyState`` between steps. None: counted from the lists above every step.
    request_ids: list[str] | None = None

    def __len__(self) -> int:
        return len(self.params)


@dataclass
class SamplerOutput:
    """The chosen token of each row and, for rows that asked, its logprob and the top alternatives."""

    token_ids: list[int]
    # per row: None unless params.logprobs is not None; then {chosen: lp, top-k alternatives: lp}
    logprobs: list[dict[int, float] | None]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An asynchronous host-to-device copy (``torch.tensor(..., device=cuda)`` would wait for queued GPU work)."""
    return t.to(device, non_blocking=True)


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator for one seeded request, on the device its noise is drawn on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Turns a step's logits into tokens, honouring every row's ``SamplingParams``.

    Unseeded rows draw noise from torch's default generator for ``device`` (so ``torch.manual_seed``
    makes a run repeatable); seeded rows from the generator in ``SamplingBatch.generators``.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.penalty_state = PenaltyState()

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample one token per row of ``logits`` (``[num_rows, vocab_size]``, float32).

        Logprobs are ``log_softmax`` of the logits after penalties and min_tokens masking, before
        temperature and the top-k / top-p / min-p filters (the model's distribution as penalised).
        """
        logits = self._process(logits, batch)
        token_ids = self._choose(logits, batch)
        token_id_list: list[int] = token_ids.tolist()
        return SamplerOutput(token_id_list, self._logprobs(logits, token_ids, batch))

    def sample_ids(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The chosen ids as a device tensor ``[num_rows]``, with no host sync (asynchronous scheduling;
        no logprobs)."""
        return self._choose(self._process(logits, batch), batch)

    def _process(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        num_rows = logits.shape[0]
        if num_rows != len(batch):
            raise ValueError(f"logits have {num_rows} rows but the batch has {len(batch)}")
        logits = logits.float()
        logits = self._apply_penalties(logits, batch)
        logits = self._apply_logit_bias(logits, batch)
        return self._apply_min_tokens(logits, batch)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        greedy_ids = greedy_argmax(logits)  # [num_rows]; the Triton argmax on CUDA (kernels.argmax)
        is_greedy = [p.is_greedy for p in batch.params]
        if all(is_greedy):
            return greedy_ids
        sampled_ids = self._sample(logits, batch)
        if any(is_greedy):
            greedy_mask = _to_device(torch.tensor(is_greedy), logits.device)
            return torch.where(greedy_mask, greedy_ids, sampled_ids)
        return sampled_ids

    # ---- penalties -------------------------------------------------------------------------------

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Repetition (prompt + output), frequency and presence (output only) penalties, on the rows
        that have any; other rows are left alone and cost nothing."""
        rows = [
            i
            for i, p in enumerate(batch.params)
            if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        if not rows:
            return logits
        device = logits.device
        vocab_size = logits.shape[1]
        params = [batch.params[i] for i in rows]
        row_index = torch.tensor(rows, device=device)
        sub = logits.index_select(0, row_index)  # [num_penalised, vocab]

        prompt_seen: torch.Tensor | None = None  # [num_penalised, vocab] bool
        if batch.request_ids is not None:
            output_counts, prompt_seen = self.penalty_state.counts(
                [batch.request_ids[i] for i in rows],
                [batch.prompt_token_ids[i] for i in rows],
                [batch.output_token_ids[i] for i in rows],
                vocab_size,
                device,
            )
        else:
            output_counts = _token_counts([batch.output_token_ids[i] for i in rows], vocab_size, device)
        penalties = torch.tensor(
            [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
            dtype=torch.float32,
            device=device,
        )  # [num_penalised, 3]
        repetition, frequency, presence = (penalties[:, j : j + 1] for j in range(3))  # each [num_penalised, 1]

        if any(p.repetition_penalty != 1.0 for p in params):
            if prompt_seen is None:
                prompt_seen = _token_counts([batch.prompt_token_ids[i] for i in rows], vocab_size, device) > 0
            seen = prompt_seen | (output_counts > 0)
            penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
            sub = torch.where(seen, penalised, sub)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            sub = sub - frequency * output_counts - presence * (output_counts > 0).float()

        return logits.index_copy(0, row_index, sub)

    def _apply_logit_bias(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Add each row's ``logit_bias`` to the logits of its tokens (one scatter-add for the whole batch)."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, p in enumerate(batch.params):
            for token_id, bias in (p.logit_bias or {}).items():
                if token_id < logits.shape[1]:
                    rows.append(i)
                    cols.append(token_id)
                    values.append(bias)
        if not rows:
            return logits
        flat = torch.tensor(rows, dtype=torch.long) * logits.shape[1] + torch.tensor(cols, dtype=torch.long)
        bias_t = torch.tensor(values, dtype=logits.dtype)
        out = logits.flatten().index_add(0, _to_device(flat, logits.device), _to_device(bias_t, logits.device))
        return out.view_as(logits)

    def _apply_min_tokens(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Mask EOS and stop_token_ids for rows that have not yet produced ``min_tokens`` tokens."""
        vocab_size = logits.shape[1]
        row_ids: list[int] = []
        col_ids: list[int] = []
        for i, p in enumerate(batch.params):
            if len(batch.output_token_ids[i]) < p.min_tokens:
                blocked = {t for t in (*batch.eos_token_ids[i], *p.stop_token_ids) if t < vocab_size}
                row_ids.extend([i] * len(blocked))
                col_ids.extend(blocked)
        if not row_ids:
            return logits
        logits = logits.clone()
        index = _to_device(torch.tensor([row_ids, col_ids]), logits.device)  # [2, num_blocked]
        logits[index[0], index[1]] = float("-inf")
        return logits

    # ---- sampling --------------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then one draw per row. Greedy rows get neutral settings
        here (their answer is the caller's argmax). Returns ``[num_rows]`` token ids."""
        num_rows, vocab_size = logits.shape
        device = logits.device
        # greedy rows: neutral settings (top_k 1 suits both top-k paths; the caller ignores the draw)
        settings = [
            (1.0, 1, 1.0, 0.0) if p.is_greedy else (p.temperature, p.top_k, p.top_p, p.min_p) for p in batch.params
        ]
        sampled_top_ks = [p.top_k for p in batch.params if not p.is_greedy]
        table = _to_device(torch.tensor(settings, dtype=torch.float32), device)  # [num_rows, 4], one copy
        temperature, top_p, min_p = table[:, 0:1], table[:, 2:3], table[:, 3:4]  # each [num_rows, 1]

        logits = logits / temperature
        needs_top_k = any(0 < k < vocab_size for k in sampled_top_ks)
        needs_top_p = any(p < 1.0 for _, _, p, _ in settings)
        top_k = table[:, 1].long()  # [num_rows]
        if needs_top_k and all(0 < k <= _MAX_PARTIAL_TOP_K for k in sampled_top_ks):
            max_top_k = min(max(sampled_top_ks), vocab_size)
            logits = _apply_small_top_k_top_p(logits, top_k, top_p if needs_top_p else None, max_top_k)
        elif needs_top_k or needs_top_p:
            logits = _apply_top_k_top_p(logits, top_k if needs_top_k else None, top_p if needs_top_p else None)

        probs = torch.softmax(logits, dim=-1)  # [num_rows, vocab]
        if any(mp > 0.0 for _, _, _, mp in settings):
            max_probs = probs.amax(dim=-1, keepdim=True)  # [num_rows, 1]
            # no renormalisation needed: the race below is invariant to scaling a row
            probs = probs.masked_fill(probs < min_p * max_probs, 0.0)

        noise = torch.empty_like(probs)  # [num_rows, vocab], Exp(1)
        seeded_rows = [i for i, g in enumerate(batch.generators) if g is not None]
        if len(seeded_rows) < num_rows:
            noise.exponential_()
        for i in seeded_rows:
            noise[i].exponential_(generator=batch.generators[i])
        # Exp(1) can return exactly 0; 0/0 would be NaN, which argmax would pick
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return torch.argmax(probs / noise, dim=-1)

    # ---- logprobs --------------------------------------------------------------------------------

    def _logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, batch: SamplingBatch
    ) -> list[dict[int, float] | None]:
        rows = [i for i, p in enumerate(batch.params) if p.logprobs is not None]
        result: list[dict[int, float] | None] = [None] * len(batch)
        if not rows:
            return result
        row_index = torch.tensor(rows, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, row_index), dim=-1)  # [num_rows_lp, vocab]
        chosen = token_ids.index_select(0, row_index)  # [num_rows_lp]
        chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)  # [num_rows_lp]
        max_k = max(batch.params[i].logprobs or 0 for i in rows)
        top_lp, top_ids = logprobs.topk(max_k, dim=-1) if max_k > 0 else (chosen_lp[:, None], chosen[:, None])
        # one device -> host copy for everything
        chosen_list, chosen_lp_list = chosen.tolist(), chosen_lp.tolist()
        top_ids_list, top_lp_list = top_ids.tolist(), top_lp.tolist()
        for j, i in enumerate(rows):
            k = batch.params[i].logprobs or 0
            entry = {chosen_list[j]: chosen_lp_list[j]}
            entry.update(zip(top_ids_list[j][:k], top_lp_list[j][:k], strict=True))
            result[i] = entry
        return result


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row: ``[num_rows, vocab]`` float32."""
    num_rows = len(token_ids)
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    lengths = [len(ids) for ids in token_ids]
    num_tokens = sum(lengths)
    if num_tokens == 0:
        return counts
    # np.fromiter over the chained lists is ~10x faster than torch.tensor on nested lists
    flat_ids = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=num_tokens)
    row_ids = np.repeat(np.arange(num_rows, dtype=np.int64), lengths)
    flat_index = torch.from_numpy(row_ids * vocab_size + flat_ids).to(device)  # [num_tokens]
    counts.view(-1).scatter_add_(0, flat_index, torch.ones(num_tokens, dtype=torch.float32, device=device))
    return counts


def _apply_small_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor | None, max_top_k: int
) -> torch.Tensor:
    """Like ``_apply_top_k_top_p`` when every row has ``0 < top_k <= max_top_k``: only the top
    ``max_top_k`` logits are sorted, and top-p works inside them (top-k comes first anyway)."""
    values, ids = logits.topk(max_top_k, dim=-1)  # descending, [num_rows, max_top_k]
    position = torch.arange(max_top_k, device=logits.device)  # [max_top_k]
    values = values.masked_fill(position[None, :] >= top_k[:, None], float("-inf"))
    if top_p is not None:
        probs = torch.softmax(values, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # of the more likely tokens; 0 for the top one
        values = values.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, values)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. ``top_k``: ``[num_rows]`` (0 = off);
    ``top_p``: ``[num_rows, 1]`` (1.0 = off). Top-p keeps the smallest set of most likely tokens whose
    probability (after top-k) sums to at least p; the most likely token is always kept."""
    num_rows, vocab_size = logits.shape
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # ascending, [num_rows, vocab]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab_size), vocab_size)  # [num_rows]
        position = torch.arange(vocab_size, device=logits.device)  # [vocab]
        sorted_logits = sorted_logits.masked_fill(position[None, :] < (vocab_size - k)[:, None], float("-inf"))
    if top_p is not None:
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # ascending cumulative mass
        drop = cumulative <= 1.0 - top_p  # the least likely tokens holding at most 1 - p of the mass
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)
