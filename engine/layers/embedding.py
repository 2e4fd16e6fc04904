"""Vocab-parallel token embedding and LM head: rows of the ``[vocab, hidden]`` table are split over ranks
(the vocab padded up to a multiple of the world size; padded rows are zero and their logits dropped)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.weights import WeightSource, set_weight_loader
from engine.parallel import ParallelState


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows ``[rank * rows_per_rank, (rank + 1) * rows_per_rank)``; a token id outside the
    rank's range looks up zeros, and the all-reduce sums the one rank that had it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelState) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // parallel.world_size)
        self.vocab_start = parallel.rank * self.rows_per_rank
        # rows of the real vocab this rank holds (the last rank may hold fewer, or none)
        self.num_real_rows = max(0, min(self.rows_per_rank, num_embeddings - self.vocab_start))
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, embedding_dim), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, source: WeightSource) -> None:
        if source.shape[0] != self.num_embeddings:
            raise ValueError(f"embedding has {source.shape[0]} rows, config vocab_size is {self.num_embeddings}")
        with torch.no_grad():
            param.zero_()
            if self.num_real_rows:
                param[: self.num_real_rows].copy_(source.narrow(0, self.vocab_start, self.num_real_rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        out = out.masked_fill(outside[:, None], 0.0)
        return self.parallel.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; with tied embeddings the model points ``weight`` at the embedding's."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, the full vocabulary on every rank."""
        logits = F.linear(hidden, self.weight)  # [N, rows_per_rank]
        logits = self.parallel.all_gather(logits, dim=-1)  # [N, padded vocab]
        return logits[:, : self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding lookup; call compute_logits")
