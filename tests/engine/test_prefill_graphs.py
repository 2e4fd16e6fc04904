"""Which prefill graph a step gets (the capture and the replay are GPU tests: tests/engine/test_gpu.py)."""

from __future__ import annotations

import torch

from engine.inputs import StepInputs
from engine.prefill_graphs import PrefillGraphs


def _step(q_lens: list[int], width: int = 2) -> StepInputs:
    n = sum(q_lens)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return StepInputs(
        input_ids=torch.zeros(n, dtype=torch.long),
        positions=torch.zeros(n, dtype=torch.long),
        slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(q_lens, dtype=torch.int32),
        block_tables=torch.zeros((len(q_lens), width), dtype=torch.int32),
        logits_indices=torch.tensor(starts[1:]) - 1,
        max_query_len=max(q_lens),
        max_seq_len=max(q_lens),
        blocks_to_copy=[],
    )


def test_a_step_gets_the_smallest_graph_with_room_for_its_tokens_and_sequences() -> None:
    graphs = PrefillGraphs(None, "torch", max_num_seqs=24, max_blocks_per_seq=4, device=torch.device("cpu"))
    assert [graphs.num_seqs(n) for n in graphs.sizes] == [16, 24, 24, 24, 24, 24]
    assert graphs._size(_step([5])) == 16
    assert graphs._size(_step([16])) == 16
    assert graphs._size(_step([17])) == 32
    assert graphs._size(_step([2] + [1] * 16)) == 32  # 17 sequences: more than the 16-token graph's slots
    assert graphs._size(_step([300, 200])) == 512
    assert graphs._size(_step([2] * 25)) is None  # more sequences than max_num_seqs
    assert graphs._size(_step([400, 200])) is None  # past the largest graph: eager
    assert graphs._size(_step([1, 1])) is None  # decode-only: the decode graphs
    assert graphs._size(_step([5], width=5)) is None  # a block table wider than the captured one
    assert not graphs.can_run(_step([5]))  # nothing captured (no CUDA here)
