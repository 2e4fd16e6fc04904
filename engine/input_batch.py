"""The persistent input batch: each running request's block table kept in one numpy row between steps.

``build_step_inputs`` (``engine.inputs``, kept as the reference) rebuilds every row from Python lists each
step; padding the block tables alone costs one Python int per block of every request. Here a request's row
is written when it joins and then only where it changed, and the flat tensors of a step are numpy gathers
over the scheduled rows. Adapted from vLLM v1's ``InputBatch``, with two differences: the input token ids are
still read from the ``Request`` lists (``Scheduler.resolve`` appends to them; mirroring them in an array costs
the same reads), and rows are not reordered: a step's rows are gathered in chunk order, which is the order of
the sampler's rows.

How a row learns that its request's blocks changed, without being told by the scheduler:
- ``KVCacheManager`` appends to ``request.block_ids`` in place and replaces the whole list when the request
  gets other blocks (freed by a recompute preemption, swapped out or in, a prefix-cache hit, a fork). The row
  holds the list it mirrors: another list object means a full rewrite, a longer one means writing the tail.
- The one change in place, copy-on-write, always comes with that step's ``blocks_to_copy`` (the scheduler
  takes the pending copies in the ``schedule()`` that made them): a step with copies rewrites its rows.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.inputs import IN_FLIGHT_INPUT, StepInputs, extend_token_ids, fresh_suffix, leading_decode_rows, table_width
from engine.request import Request
from engine.scheduler import ScheduledChunk, SchedulerOutput


class InputBatch:
    """Rows of block tables that persist across steps; ``build`` gives the same ``StepInputs`` as
    ``build_step_inputs`` for the same ``SchedulerOutput``. Rows grow on demand: the sizes are hints."""

    def __init__(self, block_size: int, max_num_reqs: int = 256, max_blocks_per_req: int = 64) -> None:
        self.block_size = block_size
        self._table = np.zeros((max(1, max_num_reqs), max(1, max_blocks_per_req)), dtype=np.int32)
        self.max_width = max(1, max_blocks_per_req)  # a step's table is never padded past it (table_width)
        self._lens = np.zeros(self._table.shape[0], dtype=np.int64)  # [rows] block ids written per row
        # Python mirrors of the row state, compared per chunk (reading numpy scalars is slower)
        self._synced: list[int] = [0] * self._table.shape[0]
        self._lists: list[list[int] | None] = [None] * self._table.shape[0]  # the block_ids each row mirrors
        self._row_of: dict[Request, int] = {}
        self._free_rows = list(range(self._table.shape[0] - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        """Rows held by requests (scheduled now or lately; idle rows are reclaimed when rows run short)."""
        return len(self._row_of)

    def build(self, out: SchedulerOutput) -> StepInputs:
        rows, starts, nums, is_sampling, input_ids = self._collect(out.chunks, rewrite=bool(out.blocks_to_copy))
        return self._assemble(out, rows, starts, nums, is_sampling, input_ids)

    # ---- rows ---------------------------------------------------------------------------------------
    def _collect(
        self, chunks: list[ScheduledChunk], rewrite: bool
    ) -> tuple[list[int], list[int], list[int], list[bool], list[int]]:
        """One pass over the chunks: sync the rows that changed, gather each chunk's numbers and input ids."""
        row_of, lists, synced = self._row_of, self._lists, self._synced
        rows: list[int] = []
        starts: list[int] = []
        nums: list[int] = []
        is_sampling: list[bool] = []
        input_ids: list[int] = []
        for chunk in chunks:
            request = chunk.request
            row = row_of.get(request)
            if row is None:
                row = self._add_row(request, chunks)
            blocks = request.block_ids
            if rewrite or blocks is not lists[row] or len(blocks) != synced[row]:
                self._sync_row(row, blocks, rewrite)
            start = request.num_computed_tokens
            num_new = chunk.num_new_tokens
            end = start + num_new
            num_prompt = len(request.prompt_token_ids)
            output_ids = request.output_token_ids
            if num_new == 1 and start >= num_prompt:  # a decode: the token at ``start`` (maybe still in flight)
                index = start - num_prompt
                input_ids.append(output_ids[index] if index < len(output_ids) else IN_FLIGHT_INPUT)
            else:
                extend_token_ids(input_ids, request, start, end)
            rows.append(row)
            starts.append(start)
            nums.append(num_new)
            is_sampling.append(end == num_prompt + len(output_ids) + request.num_output_placeholders)
        return rows, starts, nums, is_sampling, input_ids

    def _sync_row(self, row: int, blocks: list[int], rewrite: bool) -> None:
        """Write ``blocks`` into ``row``: the tail if it is the same list grown, else all of it."""
        num_blocks = len(blocks)
        if num_blocks > self._table.shape[1]:
            self._grow_columns(num_blocks)
        old = self._synced[row]
        if not rewrite and blocks is self._lists[row] and num_blocks > old:
            self._table[row, old:num_blocks] = blocks[old:]
        else:
            self._table[row, :num_blocks] = blocks
            if old > num_blocks:
                self._table[row, num_blocks:old] = 0  # padding stays 0, as the reference pads
        self._lists[row] = blocks
        self._synced[row] = num_blocks
        self._lens[row] = num_blocks

    def _add_row(self, request: Request, chunks: list[ScheduledChunk]) -> int:
        if not self._free_rows:
            self._reclaim(chunks)
        row = self._free_rows.pop()
        self._row_of[request] = row
        return row

    def _reclaim(self, chunks: list[ScheduledChunk]) -> None:
        """Free the rows of requests not in this step (finished, preempted or waiting for budget: one that
        comes back is written again); grow if the step needs more rows than that leaves."""
        scheduled = {c.request for c in chunks}
        for request in [r for r in self._row_of if r not in scheduled]:
            row = self._row_of.pop(request)
            self._lists[row] = None  # drops the reference; the row's entries stay until it is rewritten
            self._free_rows.append(row)
        num_needed = sum(1 for r in scheduled if r not in self._row_of)
        if num_needed > len(self._free_rows):
            self._grow_rows(self._table.shape[0] + num_needed - len(self._free_rows))

    def _grow_rows(self, num_rows: int) -> None:
        old = self._table.shape[0]
        num_rows = max(num_rows, 2 * old)
        self._table = np.concatenate([self._table, np.zeros((num_rows - old, self._table.shape[1]), np.int32)])
        self._lens = np.concatenate([self._lens, np.zeros(num_rows - old, np.int64)])
        self._synced.extend([0] * (num_rows - old))
        self._lists.extend([None] * (num_rows - old))
        self._free_rows.extend(range(num_rows - 1, old - 1, -1))

    def _grow_columns(self, num_blocks: int) -> None:
        old = self._table.shape[1]
        width = max(num_blocks, 2 * old)
        self._table = np.concatenate([self._table, np.zeros((self._table.shape[0], width - old), np.int32)], axis=1)

    # ---- the step's tensors -------------------------------------------------------------------------
    def _assemble(
        self,
        out: SchedulerOutput,
        rows: list[int],
        starts: list[int],
        nums: list[int],
        is_sampling: list[bool],
        input_ids: list[int],
    ) -> StepInputs:
        bs = self.block_size
        row_idx = np.array(rows, dtype=np.intp)  # [num_seqs]
        start_pos = np.array(starts, dtype=np.int64)  # [num_seqs]
        num_new = np.array(nums, dtype=np.int64)  # [num_seqs]
        num_seqs = len(rows)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(num_new, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        if num_tokens == num_seqs:  # every chunk is one token (all decodes)
            token_rows, positions = row_idx, start_pos
        else:
            token_rows = np.repeat(row_idx, num_new)  # [num_tokens]
            # position of each token: its offset in the flat batch, shifted by its chunk's start
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(start_pos - query_start_loc[:-1], num_new)
        slot_mapping = self._table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = start_pos + num_new
        max_blocks = int(self._lens[row_idx].max()) if num_seqs else 1
        if num_tokens > num_seqs:
            max_blocks = table_width(max_blocks, self.max_width)
        logits_indices = query_start_loc[1:][np.array(is_sampling, dtype=bool)].astype(np.int64) - 1
        return StepInputs(
            input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)),
            positions=torch.from_numpy(positions),
            slot_mapping=torch.from_numpy(slot_mapping),
            query_start_loc=torch.from_numpy(query_start_loc),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            block_tables=torch.from_numpy(self._table[row_idx, :max_blocks]),  # a copy: rows change later
            logits_indices=torch.from_numpy(logits_indices),
            max_query_len=int(num_new.max()) if num_seqs else 0,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
            blocks_to_copy=out.blocks_to_copy,
            fresh=fresh_suffix(query_start_loc, seq_lens) if num_tokens > num_seqs else None,
            decode_rows=leading_decode_rows(query_start_loc) if num_tokens > num_seqs else 0,
            blocks_to_swap_out=out.blocks_to_swap_out,
            blocks_to_swap_in=out.blocks_to_swap_in,
        )
