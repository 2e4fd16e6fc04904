"""Tensor parallelism on CPU with gloo: 2 and 4 rank processes each load their shard of tiny Llama and
Qwen2 checkpoints (KV heads split, and KV heads fewer than ranks so replicated; a vocab that does not
divide evenly) and must reproduce the single-process logits, holding only their share of the weights."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import modelfiles
from engine.loader import load_hf_config, load_model
from engine.parallel import ParallelState, init_distributed
from tests.helpers import allocate_kv_caches, build_tiny_model, one_seq_metadata

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-kv2": ("llama", {"num_key_value_heads": 2}),
    "qwen2-kv1-tied-vocab318": ("qwen2", {"num_key_value_heads": 1, "tie_word_embeddings": True, "vocab_size": 318}),
}
PROMPT_LEN, NUM_DECODE, BLOCK_SIZE = 20, 4, 4


@torch.no_grad()
def _run(model: Any) -> torch.Tensor:
    """Logits of a prefill then NUM_DECODE single-token steps through the paged cache."""
    n = PROMPT_LEN + NUM_DECODE
    ids = torch.randint(3, 318, (n,), generator=torch.Generator().manual_seed(7))
    table = [5, 1, 4, 0, 2, 3]
    allocate_kv_caches(model, num_blocks=len(table), block_size=BLOCK_SIZE)
    steps = [(0, PROMPT_LEN)] + [(p, 1) for p in range(PROMPT_LEN, n)]
    out = []
    for start, num_new in steps:
        meta = one_seq_metadata(table, start, num_new, BLOCK_SIZE)
        hidden = model(ids[start : start + num_new], torch.arange(start, start + num_new), meta)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def _load(folder: Path, parallel: ParallelState) -> Any:
    files = modelfiles.resolve(folder)
    return load_model(files, load_hf_config(files), parallel, torch.float32, torch.device("cpu"))


def expected_rank_params(config: Any, world: int) -> int:
    """Parameters one rank must hold: its 1/world of every sharded matrix (KV heads replicated when there
    are fewer than ranks; vocab rows padded up to a multiple of world) plus the full norms."""
    hidden, head_dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_heads = config.num_attention_heads // world
    kv_heads = max(1, config.num_key_value_heads // world)
    qkv_out = (q_heads + 2 * kv_heads) * head_dim
    qkv_bias = qkv_out if config.model_type == "qwen2" else 0
    per_layer = qkv_out * hidden + qkv_bias + hidden * q_heads * head_dim + 3 * hidden * (inter // world)
    norms = 2 * hidden * config.num_hidden_layers + hidden
    vocab_rows = -(-config.vocab_size // world)
    embeddings = vocab_rows * hidden * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_hidden_layers * per_layer + norms


def _worker(rank: int, world: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    parallel = init_distributed(rank, world, f"tcp://127.0.0.1:{port}", backend="gloo")
    try:
        for name in CASES:
            model = _load(Path(root) / name, parallel)
            expected = torch.load(Path(root) / f"{name}.pt")
            got = _run(model)
            assert (got - expected).abs().max().item() <= 1e-5, f"{name}: rank {rank}/{world} differs from TP=1"
            num_params = sum(p.numel() for p in model.parameters())
            assert num_params == expected_rank_params(model.config, world), (name, num_params)
            attn = model.attention_layers()[0]
            assert attn.num_kv_heads == max(1, model.config.num_key_value_heads // world)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tp")
    for name, (model_type, overrides) in CASES.items():
        folder = build_tiny_model(root / name, model_type, with_tokenizer=False, **overrides)
        torch.save(_run(_load(folder, ParallelState())), root / f"{name}.pt")
    return root


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_single_process(checkpoints: Path, world: int) -> None:
    # forkserver: torch and transformers are imported once in the server, not once per rank (2 CPU cores),
    # and the server never ran an OpenMP region, so forking it is safe.
    multiprocessing.set_forkserver_preload([__name__])
    ctx = mp.start_processes(
        _worker, args=(world, _free_port(), str(checkpoints)), nprocs=world, join=True, start_method="forkserver"
    )
    assert ctx is None


def test_single_rank_counts_match_formula(checkpoints: Path) -> None:
    for name in CASES:
        model = _load(checkpoints / name, ParallelState())
        assert sum(p.numel() for p in model.parameters()) == expected_rank_params(model.config, 1)


def test_parallel_state_is_a_no_op_alone() -> None:
    state = ParallelState()
    x = torch.ones(2, 3)
    assert state.all_reduce(x) is x and state.all_gather(x, dim=0) is x
    with pytest.raises(ValueError, match="rank"):
        ParallelState(rank=2, world_size=2)


def test_heads_that_do_not_split_are_rejected() -> None:
    from engine.layers.linear import QKVParallelLinear

    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(64, 16, 4, 2, False, ParallelState(rank=0, world_size=3))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(64, 16, 8, 3, False, ParallelState(rank=0, world_size=2))
