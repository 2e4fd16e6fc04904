"""CUDA graphs for small prefill and mixed steps: a ladder of padded token counts, each with room for as many
sequences as tokens (up to ``max_num_seqs``).

Run eagerly, a step that prefills a short prompt is host-bound: on the H200 (8B shape, bf16) a 20-token prefill
step took 16.4 ms against 4.96 ms for a batch-1 decode step, of which the device was busy ~4.5 ms: about 290
Triton launches and 130 cuBLAS calls from Python (``loadtest/step_profile.py``, 2026-12-01). Every first token at
low load and the first steps of a burst pay that. As for decode (``engine.cuda_graphs``), the step's tensors are
copied into static buffers and one graph replays.

Padding: tokens past the step's last one belong to no sequence (slot -1, never written to the cache); sequences
past the step's last one have no tokens and length 0, so the prefill kernel gives them no work. The padding
rows' hidden states are whatever the arithmetic makes of them: every op of the forward is row-wise except
attention, which never reads a padding row, so they reach no real row. The logits are computed inside the graph
for one row per sequence slot (the step's sampling rows, then row 0 as padding) into the decode graphs' shared
``[max_bs, vocab]`` buffer: only one graph replays at a time, and the sampler reads the rows before the next.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.inputs import StepInputs

logger = logging.getLogger(__name__)

# Padded token counts with a graph. Steps above the last run eagerly: from ~512 tokens the device time of the
# step (weights read + compute) covers the launches.
PREFILL_GRAPH_SIZES = (16, 32, 64, 128, 256, 512)


class PrefillGraphs:
    """Captured graphs for steps that are not decode-only; ``run`` replays the smallest one that fits."""

    def __init__(self, model: Any, backend: str, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.max_num_seqs = max_num_seqs
        self.sizes = list(PREFILL_GRAPH_SIZES)
        max_tokens, max_seqs = self.sizes[-1], self.num_seqs(self.sizes[-1])
        self.max_blocks = max_blocks_per_seq
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.long, device=device)
        self.query_start_loc = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.logits_rows = torch.zeros(max_seqs, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits = torch.empty(0, device=device)

    def num_seqs(self, num_tokens: int) -> int:
        """Sequence slots of the graph for ``num_tokens`` padded tokens."""
        return min(num_tokens, self.max_num_seqs)

    def _meta(self, num_tokens: int) -> AttentionMetadata:
        s = self.num_seqs(num_tokens)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: s + 1],
            seq_lens=self.seq_lens[:s],
            block_tables=self.block_tables[:s],
            max_query_len=num_tokens,  # > 1: the prefill kernel (which takes decode rows too)
            max_seq_len=self.max_blocks,
            backend=self.backend,
        )

    def _forward(self, num_tokens: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:num_tokens], self.positions[:num_tokens], self._meta(num_tokens))
        rows = self.logits_rows[: self.num_seqs(num_tokens)]
        return self.model.compute_logits(hidden[rows])  # type: ignore[no-any-return]  # [seqs, vocab] float32

    @torch.inference_mode()
    def capture(self, logits: torch.Tensor, pool: Any = None) -> None:
        """Capture every size, writing logits into ``logits`` (``[>= max seqs, vocab]`` float32, shared with the
        decode graphs) and allocating from ``pool`` (the decode graphs' memory pool) when given."""
        self.logits = logits
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory
            s = self.num_seqs(n)
            for _ in range(2):  # warm up: Triton compiles outside the capture
                self._forward(n)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:s].copy_(self._forward(n))
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()
        logger.info("captured %d prefill CUDA graphs (tokens %s)", len(self.graphs), self.sizes)

    def _size(self, inputs: StepInputs) -> int | None:
        """The smallest graph for this step, or None if it has none (decode-only steps have their own)."""
        if inputs.max_query_len <= 1 or inputs.block_tables.shape[1] > self.max_blocks:
            return None
        num_seqs = int(inputs.seq_lens.shape[0])
        for n in self.sizes:
            if n >= inputs.num_tokens and self.num_seqs(n) >= num_seqs:
                return n
        return None

    def can_run(self, inputs: StepInputs) -> bool:
        return bool(self.graphs) and self._size(inputs) is not None

    def run(self, inputs: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[num_sampling, vocab]`` of the step (``input_ids`` already on the device): a view of
        the shared static buffer, valid until the next replay."""
        size = self._size(inputs)
        assert size is not None, "can_run() first"
        n, k = inputs.num_tokens, int(inputs.seq_lens.shape[0])
        s, width, m = self.num_seqs(size), inputs.block_tables.shape[1], int(inputs.logits_indices.shape[0])
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.positions[n:size].zero_()
        self.slot_mapping[:n].copy_(inputs.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        self.query_start_loc[: k + 1].copy_(inputs.query_start_loc, non_blocking=True)
        self.query_start_loc[k + 1 : s + 1].fill_(n)  # padding sequences: no tokens
        self.seq_lens[:k].copy_(inputs.seq_lens, non_blocking=True)
        self.seq_lens[k:s].zero_()
        self.block_tables[:k, :width].copy_(inputs.block_tables, non_blocking=True)
        self.logits_rows[:m].copy_(inputs.logits_indices, non_blocking=True)
        self.logits_rows[m:s].zero_()
        self.graphs[size].replay()
        return self.logits[:m]
