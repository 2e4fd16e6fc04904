"""CUDA graphs for decode-only steps: one graph per batch size of a ladder, inputs padded up to it.

A decode step of a Python model is hundreds of small kernel launches; replaying a captured graph turns
them into one launch. Graphs read their inputs from static buffers, so each replay first copies the
step's tensors in. Padding rows write to slot -1 (skipped) and attend to one token of block 0.

Every row of a decode-only step is its sequence's last token, so the graph also computes the logits of
all its rows (LM head, the tensor-parallel gather, the float32 cast) into one static ``[max_bs, vocab]``
buffer that every graph shares: only one graph replays at a time, and the sampler reads the rows before
the next replay is queued on the same stream.

A larger graph is not always slower: cuBLAS picks its GEMM kernel by shape, and some batch sizes get a poor one.
On an H200 (8B layer GEMMs, ``loadtest.gemm_probe``, 2026-12-04) a layer's four GEMMs took 420 us at M = 448
against 302 at 464 and 307 at 512 (gate_up alone: 281 against 165 and 159 us), 305 at 400 against 275 at 432.
So after capturing, each graph's replay is timed on its dummy inputs (a few replays of each, at start-up), and a
batch replays the fastest graph that fits it when that one is faster than the smallest by more than ROUTE_MARGIN
(:func:`route_batches`). On the H200 that took batches of 385-448 to the 432 and 464 graphs: 1.12x the output
tokens/s at 448 streams, 0.4 % on `mixed` (docs/benchmarks.md, Session 20).
"""

from __future__ import annotations

import logging
import os
import statistics
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.inputs import StepInputs, table_width
from engine.parallel import ParallelState

logger = logging.getLogger(__name__)


# A batch replays a larger graph than the smallest that fits only when that graph's replay is at least this much
# faster (the timings are one start-up measurement; noise between equal graphs stays under it)
ROUTE_MARGIN = 0.03
ROUTE_REPLAYS = 3  # timed replays per graph (the median counts), after one untimed
# PAGEDSERVE_DECODE_GRAPH_ROUTE=0: every batch replays the smallest graph that fits (no timing at start)
ROUTE = os.environ.get("PAGEDSERVE_DECODE_GRAPH_ROUTE", "1") == "1"


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


def route_batches(times: dict[int, float], margin: float = ROUTE_MARGIN) -> dict[int, int]:
    """For each ladder size, the size whose graph a batch that fits it replays: the fastest of it and the larger
    sizes, if that one is more than ``margin`` faster than it; ties go to the smaller size."""
    sizes = sorted(times)
    route = {}
    for i, size in enumerate(sizes):
        best = min(sizes[i:], key=lambda s: (times[s], s))
        route[size] = best if times[best] < (1.0 - margin) * times[size] else size
    return route


class DecodeGraphs:
    """Captured decode graphs for one model; ``run`` replays the one ``route`` names for the smallest size that
    fits the batch."""

    def __init__(self, model: Any, backend: str, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.backend = backend
        self.device = device
        self.sizes = batch_size_ladder(max_num_seqs)
        max_bs = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        # as wide as a prefill step's tables get (engine.inputs.table_width): the decode kernel variants compiled
        # here are the ones a prefill step's decode rows run (engine.attention.DECODE_ROWS_MIN)
        width = table_width(max_blocks_per_seq)
        self.block_tables = torch.zeros((max_bs, width), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.row_ids = torch.arange(max_bs, dtype=torch.long)  # host side: logits_indices of a full decode step
        self.logits = torch.empty(0, device=device)  # [max_bs, vocab] float32, allocated before the first capture
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.route = {s: s for s in self.sizes}  # ladder size -> the graph its batches replay (route_batches)
        self.pool: Any = None  # the captures' memory pool (the prefill graphs share it)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_blocks,
            backend=self.backend,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))  # [bs, hidden]
        return self.model.compute_logits(hidden)  # type: ignore[no-any-return]  # [bs, vocab] float32

    @torch.inference_mode()
    def capture(self, parallel: ParallelState | None = None) -> None:
        """Capture every size of the ladder, then (ROUTE) time them and route batches (every rank of a
        tensor-parallel group takes the same route: the ranks' times are summed first)."""
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its memory pool
            for _ in range(2):  # warm up: Triton compiles and autotunes outside the capture
                logits = self._forward(bs)
            if self.logits.numel() == 0:  # outside the pool: it outlives every capture
                self.logits = torch.empty_like(logits)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                # the hidden states and the pre-cast logits are temporaries of the pool, reused by the next size
                self.logits[:bs].copy_(self._forward(bs))
            pool = graph.pool()
            self.graphs[bs] = graph
        self.pool = pool
        torch.cuda.synchronize()
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s) with logits [%d, %d] float32 (%.0f MiB)",
            len(self.graphs),
            self.sizes,
            *self.logits.shape,
            self.logits.numel() * 4 / 2**20,
        )
        if ROUTE:
            self.route = route_batches(self._replay_times(parallel or ParallelState()))
            moved = {s: r for s, r in self.route.items() if r != s}
            if moved:
                logger.info("decode batches replay a larger graph where it is faster (size: graph): %s", moved)

    def _replay_times(self, parallel: ParallelState) -> dict[int, float]:
        """Each graph's median replay time on its dummy inputs (padding rows only: slot -1, one token)."""
        times = torch.zeros(len(self.sizes), dtype=torch.float32, device=self.device)
        for i, bs in enumerate(self.sizes):
            self.graphs[bs].replay()  # untimed
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(ROUTE_REPLAYS)
            ]
            for start, end in events:
                start.record()
                self.graphs[bs].replay()
                end.record()
            torch.cuda.synchronize()
            times[i] = statistics.median(start.elapsed_time(end) for start, end in events)
        parallel.all_reduce(times)
        return dict(zip(self.sizes, times.tolist(), strict=True))

    def can_run(self, inputs: StepInputs) -> bool:
        return (
            inputs.max_query_len == 1
            and inputs.num_tokens <= self.sizes[-1]
            and inputs.block_tables.shape[1] <= self.max_blocks
        )

    def run(self, inputs: StepInputs, input_ids: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[num_sampling, vocab]`` of a decode-only step (``input_ids`` already on the
        device). Usually a view of the shared static buffer: valid until the next replay."""
        n = inputs.num_tokens
        bs = self.route[next(s for s in self.sizes if s >= n)]
        width = inputs.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(inputs.slot_mapping, non_blocking=True)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(inputs.seq_lens, non_blocking=True)
        self.seq_lens[n:bs].fill_(1)
        # Stale entries past a row's length, and stale padding rows, are valid block ids that are never
        # read for a result (padding rows attend to one token and write nowhere).
        self.block_tables[:n, :width].copy_(inputs.block_tables, non_blocking=True)
        self.graphs[bs].replay()
        rows = inputs.logits_indices
        if torch.equal(rows, self.row_ids[:n]):  # every row samples: the usual decode step
            return self.logits[:n]
        # Some rows do not sample (a 1-token prefill chunk that is not the prompt's end): pick the others.
        return self.logits[:n].index_select(0, rows.to(self.device, non_blocking=True))
