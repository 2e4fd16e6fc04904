"""Turn a ``SchedulerOutput`` into the flat tensors of one model step (CPU side of the hot path).

Kept free of the model so that tensor-parallel rank 0 can build ``StepInputs`` once and send the same
typed message to every rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.request import Request
from engine.scheduler import SchedulerOutput


@dataclass
class StepInputs:
    """Everything a rank needs to run one forward pass. CPU tensors; the runner moves them."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    logits_indices: torch.Tensor  # [num_sampling] int64: flat row of each sampling sequence's last token
    max_query_len: int
    max_seq_len: int
    blocks_to_copy: list[tuple[int, int]]
    fresh: tuple[int, int] | None = None  # (first sequence, first token) of the fresh_suffix, None: none
    decode_rows: int = 0  # a step that is not decode-only: its leading one-token sequences (leading_decode_rows)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host), run first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), then these

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class TokenFill:
    """Input tokens that exist only on the device: ``input_ids[dst] = tokens[src]`` before the forward."""

    tokens: torch.Tensor  # [num_rows] the sampled ids of the step still in flight, on the device
    dst: torch.Tensor  # [k] int64: positions in the flat input_ids
    src: torch.Tensor  # [k] int64: rows of ``tokens``


# Host-side stand-in for an input token that is known only on the device (``TokenFill`` overwrites it before
# the forward pass). Any valid id works; no request ever holds it.
IN_FLIGHT_INPUT = 0


# The block tables of a step that is not decode-only are this many columns wide, or a multiple (zeros past each
# row's blocks): the Triton kernels specialize on the table's row stride being a multiple of 16, so a step of any
# width runs the variants the decode graphs' warm-up compiled (their tables are max-model-len wide).
TABLE_WIDTH_ALIGN = 16


def table_width(max_blocks: int, cap: int | None = None) -> int:
    """``max_blocks`` rounded up to TABLE_WIDTH_ALIGN, unless that passes ``cap`` (the widest table allowed)."""
    width = -(-max(max_blocks, 1) // TABLE_WIDTH_ALIGN) * TABLE_WIDTH_ALIGN
    return max_blocks if cap is not None and width > cap else width


def leading_decode_rows(query_start_loc: np.ndarray) -> int:
    """How many sequences at the start of a step have one new token: a mixed step's decode rows (the scheduler
    puts running requests first), which ``engine.attention`` can hand to the decode kernel as a slice."""
    longer = np.flatnonzero(np.diff(query_start_loc) > 1)
    return int(longer[0]) if len(longer) else len(query_start_loc) - 1


def fresh_suffix(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> tuple[int, int] | None:
    """``(first sequence, first token)`` of the step's last run of fresh prompts (more than one new token, no
    cached prefix), which the attention can hand to ``kernels.prefill_gluon`` whole; ``None`` if the step ends
    with any other sequence (a decode row, a chunk after a cached prefix, a one-token prompt). New requests come
    after the running ones in a step, so this is usually all of its new prompts."""
    q_lens = np.diff(query_start_loc)
    fresh = (q_lens > 1) & (seq_lens == q_lens)
    if len(fresh) == 0 or not fresh[-1]:
        return None
    stale = np.flatnonzero(~fresh)
    first = int(stale[-1]) + 1 if len(stale) else 0
    return first, int(query_start_loc[first])


def extend_token_ids(input_ids: list[int], request: Request, start: int, end: int) -> None:
    """Append the ids of ``request``'s tokens ``[start, end)``; one still on the device as ``IN_FLIGHT_INPUT``."""
    num_prompt = len(request.prompt_token_ids)
    output_ids = request.output_token_ids
    # Slice prompt and output separately: concatenating them per request per step is O(length).
    if start >= num_prompt:
        input_ids.extend(output_ids[start - num_prompt : end - num_prompt])
    elif end <= num_prompt:
        input_ids.extend(request.prompt_token_ids[start:end])
    else:
        input_ids.extend(request.prompt_token_ids[start:])
        input_ids.extend(output_ids[: end - num_prompt])
    # Asynchronous scheduling: the chunk may end on the token of the step in flight, which the output
    # slices above do not have (the request holds a count for it, no id).
    num_missing = end - num_prompt - len(output_ids)
    if num_missing > 0:
        input_ids.extend([IN_FLIGHT_INPUT] * num_missing)


def build_step_inputs(out: SchedulerOutput, block_size: int, max_width: int | None = None) -> StepInputs:
    """The step's tensors rebuilt from the requests' lists: the reference ``engine.input_batch.InputBatch``
    must equal (it keeps the block tables between steps, which is what the engine runs); ``max_width``: its
    ``max_width`` (tables are not padded past it, :func:`table_width`)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    max_query_len = 0
    for chunk in out.chunks:
        request = chunk.request
        start = request.num_computed_tokens
        end = start + chunk.num_new_tokens
        extend_token_ids(input_ids, request, start, end)
        blocks = request.block_ids
        if end - start == 1:
            positions.append(start)
            slots.append(blocks[start // block_size] * block_size + start % block_size)
        else:
            positions.extend(range(start, end))
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(query_start_loc[-1] + end - start)
        seq_lens.append(end)
        tables.append(blocks)
        max_query_len = max(max_query_len, end - start)
        if chunk.samples:
            logits_indices.append(query_start_loc[-1] - 1)
    # Block tables padded with 0, filled in one vectorized write (a nested-list torch.tensor is slow).
    lens = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
    max_blocks = int(lens.max()) if len(tables) else 1
    if max_query_len > 1:
        max_blocks = table_width(max_blocks, max_width)
    padded = np.zeros((len(tables), max_blocks), dtype=np.int32)
    padded[np.arange(max_blocks)[None, :] < lens[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lens.sum())
    )
    return StepInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.from_numpy(padded),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long),
        max_query_len=max_query_len,
        max_seq_len=max(seq_lens, default=0),
        blocks_to_copy=out.blocks_to_copy,
        fresh=fresh_suffix(np.array(query_start_loc), np.array(seq_lens)) if max_query_len > 1 else None,
        decode_rows=leading_decode_rows(np.array(query_start_loc)) if max_query_len > 1 else 0,
        blocks_to_swap_out=out.blocks_to_swap_out,
        blocks_to_swap_in=out.blocks_to_swap_in,
    )
