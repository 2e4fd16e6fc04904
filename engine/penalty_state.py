"""Per-request token counts for the sampler's penalties, kept on the device between steps.

Counting every penalised row's whole history each step costs host time and a host-to-device copy in
proportion to all the tokens of those requests. Here a row is counted in full once, when its request
first samples with a penalty, and then only the tokens its output list gained since the step before.
"""

from __future__ import annotations

import torch


class PenaltyState:
    """Rows of output token counts and prompt presence, one per request (keyed by request id).

    A row also holds the request's prompt and output lists: other lists under the same id (the id used again
    by a later request) start the row afresh. Rows of requests absent from a step are reclaimed only when
    rows run short, so a request that pauses (preempted, out of budget) usually keeps its row."""

    def __init__(self) -> None:
        self._output_counts = torch.zeros(0, 0)  # [rows, vocab] float32
        self._prompt_seen = torch.zeros(0, 0, dtype=torch.bool)  # [rows, vocab]
        self._row_of: dict[str, int] = {}
        self._lists: list[tuple[list[int], list[int]] | None] = []  # the (prompt, output) lists each row counts
        self._num_counted: list[int] = []  # output tokens already in each row's counts
        self._free_rows: list[int] = []

    @property
    def num_rows(self) -> int:
        """Rows held by requests (in a recent step; idle rows are reclaimed when rows run short)."""
        return len(self._row_of)

    def counts(
        self,
        request_ids: list[str],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        vocab_size: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Output token counts ``[n, vocab]`` float32 and prompt presence ``[n, vocab]`` bool of these rows."""
        if self._output_counts.shape[1] != vocab_size or self._output_counts.device != device:
            self._start_over(vocab_size, device)  # another model or device
        rows: list[int] = []
        fresh_rows: list[int] = []
        fresh_prompts: list[list[int]] = []
        add_rows: list[int] = []  # (row, token id) pairs to count, over all rows
        add_ids: list[int] = []
        for key, prompt, output in zip(request_ids, prompt_token_ids, output_token_ids, strict=True):
            row = self._row_of.get(key)
            held = None if row is None else self._lists[row]
            if row is None or held is None or held[0] is not prompt or held[1] is not output:
                row = self._take_row(key, request_ids)
                self._lists[row] = (prompt, output)
                self._num_counted[row] = 0
                fresh_rows.append(row)
                fresh_prompts.append(prompt)
            new_ids = output[self._num_counted[row] :]  # the lists only grow: the tokens since the last step
            add_rows.extend([row] * len(new_ids))
            add_ids.extend(new_ids)
            self._num_counted[row] = len(output)
            rows.append(row)
        if fresh_rows:
            self._reset_rows(fresh_rows, fresh_prompts, device)
        if add_ids:
            index = (_to_device(add_rows, device), _to_device(add_ids, device))
            self._output_counts.index_put_(index, torch.ones(len(add_ids), device=device), accumulate=True)
        row_index = _to_device(rows, device)
        return self._output_counts.index_select(0, row_index), self._prompt_seen.index_select(0, row_index)

    def _reset_rows(self, rows: list[int], prompts: list[list[int]], device: torch.device) -> None:
        row_index = _to_device(rows, device)
        self._output_counts.index_fill_(0, row_index, 0.0)
        self._prompt_seen.index_fill_(0, row_index, False)
        prompt_rows = [row for row, prompt in zip(rows, prompts, strict=True) for _ in prompt]
        prompt_ids = [t for prompt in prompts for t in prompt]
        if prompt_ids:
            index = (_to_device(prompt_rows, device), _to_device(prompt_ids, device))
            self._prompt_seen.index_put_(index, torch.ones(len(prompt_ids), dtype=torch.bool, device=device))

    def _take_row(self, key: str, keep: list[str]) -> int:
        """A row for ``key`` (its old row, if any, is given up); rows of requests not in ``keep`` are
        reclaimed when none is free, and the rows double when that frees none either."""
        old = self._row_of.pop(key, None)
        if old is not None:
            self._free_rows.append(old)
        if not self._free_rows:
            wanted = set(keep)
            for stale in [k for k in self._row_of if k not in wanted]:
                row = self._row_of.pop(stale)
                self._lists[row] = None  # lets the finished request's lists go
                self._free_rows.append(row)
        if not self._free_rows:
            self._grow(max(4, 2 * len(self._lists)))
        row = self._free_rows.pop()
        self._row_of[key] = row
        return row

    def _start_over(self, vocab_size: int, device: torch.device) -> None:
        self._row_of.clear()
        self._lists, self._num_counted, self._free_rows = [], [], []
        self._output_counts = torch.zeros(0, vocab_size, device=device)
        self._prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def _grow(self, num_rows: int) -> None:
        old = len(self._lists)
        counts, seen = self._output_counts, self._prompt_seen
        self._output_counts = torch.cat([counts, counts.new_zeros(num_rows - old, counts.shape[1])])
        self._prompt_seen = torch.cat([seen, seen.new_zeros(num_rows - old, seen.shape[1])])
        self._lists.extend([None] * (num_rows - old))
        self._num_counted.extend([0] * (num_rows - old))
        self._free_rows.extend(range(num_rows - 1, old - 1, -1))


def _to_device(ids: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on ``device``, copied without waiting for queued device work."""
    return torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True)
