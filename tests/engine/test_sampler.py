"""Sampler: greedy, penalties, min_tokens, seeded reproducibility, filtered distributions, logprobs."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

import engine.sampler as sampler_module
from engine.sampler import Sampler, SamplingBatch, make_generator
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def make_batch(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    eos: list[tuple[int, ...]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(
        params=params,
        prompt_token_ids=prompts if prompts is not None else [[] for _ in range(n)],
        output_token_ids=outputs if outputs is not None else [[] for _ in range(n)],
        generators=[make_generator(p.seed, CPU) if p.seed is not None else None for p in params],
        eos_token_ids=eos if eos is not None else [() for _ in range(n)],
    )


def draw_counts(logits_row: list[float], params: SamplingParams, num_draws: int = 20_000) -> torch.Tensor:
    """Sample ``num_draws`` times from one row (replicated into one batch) and count each token."""
    torch.manual_seed(1234)
    logits = torch.tensor([logits_row], dtype=torch.float32).expand(num_draws, -1).contiguous()
    out = Sampler(CPU)(logits, make_batch([params] * num_draws))
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(logits_row)).double()


def assert_fits(counts: torch.Tensor, expected_probs: torch.Tensor) -> None:
    """Filtered tokens (prob 0) never drawn; the rest fit the expected distribution (chi-square)."""
    zero = expected_probs == 0
    assert counts[zero].sum() == 0, f"filtered-out tokens drawn: {counts.tolist()}"
    observed = counts[~zero]
    expected = expected_probs[~zero] / expected_probs[~zero].sum() * counts.sum()
    result = chisquare(observed.numpy(), expected.numpy())
    assert result.pvalue > 1e-3, (observed.tolist(), expected.tolist())


LOGITS = [2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.0]


def test_greedy_is_argmax() -> None:
    logits = torch.randn(7, 50)
    out = Sampler(CPU)(logits, make_batch([SamplingParams(temperature=0.0)] * 7))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 7


def test_greedy_rows_stay_greedy_in_mixed_batch() -> None:
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0, top_k=5) for i in range(6)]
    out = Sampler(CPU)(logits, make_batch(params))
    for i in range(0, 6, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_repetition_penalty_matches_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.2, 1.0]])
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, logprobs=4)
    out = Sampler(CPU)(logits, make_batch([params], prompts=[[0, 1]], outputs=[[2, 2]]))
    expected = torch.tensor([[1.0, -2.0, 0.25, -0.2, 1.0]])  # seen: 0, 1 (prompt), 2 (output)
    want = torch.log_softmax(expected, dim=-1)[0]
    assert out.logprobs[0] is not None
    for token, lp in out.logprobs[0].items():
        assert lp == pytest.approx(float(want[token]), abs=1e-5)
    assert out.token_ids == [0]


def test_frequency_and_presence_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.3, logprobs=3)
    # output counts: token 0 three times, token 1 once; the prompt does not count
    out = Sampler(CPU)(logits, make_batch([params], prompts=[[2, 2, 2]], outputs=[[0, 1, 0, 0]]))
    expected = torch.tensor([[3.0 - 1.5 - 0.3, 2.9 - 0.5 - 0.3, 1.0, 0.0]])
    want = torch.log_softmax(expected, dim=-1)[0]
    assert out.token_ids == [1]
    assert out.logprobs[0] is not None
    assert set(out.logprobs[0]) == {0, 1, 2}
    for token, lp in out.logprobs[0].items():
        assert lp == pytest.approx(float(want[token]), abs=1e-5)


def test_penalties_only_touch_their_rows() -> None:
    logits = torch.tensor([[1.0, 0.9, 0.0], [1.0, 0.9, 0.0]])
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0), SamplingParams(temperature=0.0)]
    out = Sampler(CPU)(logits, make_batch(params, outputs=[[0], [0]]))
    assert out.token_ids == [1, 0]


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[1]),
    ]
    outputs: list[list[int]] = [[], [3], [3, 3]]  # the last row has reached min_tokens
    out = Sampler(CPU)(logits, make_batch(params, outputs=outputs, eos=[(0,), (0,), (0,)]))
    assert out.token_ids == [2, 2, 0]


def test_min_tokens_when_sampling() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[5.0, 0.0, 0.0]]).expand(2000, -1).contiguous()
    params = [SamplingParams(temperature=1.0, min_tokens=1)] * 2000
    out = Sampler(CPU)(logits, make_batch(params, eos=[(0,)] * 2000))
    assert 0 not in out.token_ids


def test_seeded_rows_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(1, vocab).expand(8, -1).contiguous()
    seeded = SamplingParams(temperature=1.0, seed=42)

    def run_steps(params: list[SamplingParams], seeded_row: int, num_steps: int = 5) -> list[int]:
        batch = make_batch(params)  # generators made once, advanced across steps
        return [Sampler(CPU)(logits[: len(params)], batch).token_ids[seeded_row] for _ in range(num_steps)]

    alone = run_steps([seeded], 0)
    torch.manual_seed(99)  # other rows' randomness differs
    mixed = run_steps([SamplingParams(), seeded, SamplingParams(top_p=0.5), SamplingParams(seed=7)], 1)
    assert alone == mixed
    other_seed = run_steps([SamplingParams(temperature=1.0, seed=43)], 0)
    assert other_seed != alone
    assert len(set(alone)) > 1  # generator state advances between steps


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature: float) -> None:
    counts = draw_counts(LOGITS, SamplingParams(temperature=temperature))
    assert_fits(counts, torch.softmax(torch.tensor(LOGITS) / temperature, dim=-1).double())


def test_top_k_distribution() -> None:
    counts = draw_counts(LOGITS, SamplingParams(temperature=0.8, top_k=3))
    probs = torch.softmax(torch.tensor(LOGITS) / 0.8, dim=-1).double()
    probs[3:] = 0
    assert_fits(counts, probs)


def test_top_p_distribution() -> None:
    probs = torch.softmax(torch.tensor(LOGITS), dim=-1).double()
    # smallest prefix with cumulative mass >= 0.7
    cumulative = probs.cumsum(0)
    keep = int((cumulative < 0.7).sum()) + 1
    assert 1 < keep < len(LOGITS)  # guard on the fixture: the cut must keep some tokens and drop others
    counts = draw_counts(LOGITS, SamplingParams(temperature=1.0, top_p=0.7))
    probs[keep:] = 0
    assert_fits(counts, probs)


def test_min_p_distribution() -> None:
    probs = torch.softmax(torch.tensor(LOGITS), dim=-1).double()
    counts = draw_counts(LOGITS, SamplingParams(temperature=1.0, min_p=0.2))
    probs[probs < 0.2 * probs.max()] = 0
    assert 2 < int((probs > 0).sum()) < len(LOGITS)
    assert_fits(counts, probs)


@pytest.mark.parametrize("full_sort", [False, True])
def test_combined_filters_distribution(full_sort: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if full_sort:  # the path taken when some row has no top-k or a large one
        monkeypatch.setattr(sampler_module, "_MAX_PARTIAL_TOP_K", 0)
    # top-k 6, then top-p 0.8 of the renormalised top 6, at temperature 1.5
    probs = torch.softmax(torch.tensor(LOGITS) / 1.5, dim=-1).double()
    probs[6:] = 0
    probs /= probs.sum()
    keep = int((probs.cumsum(0) < 0.8).sum()) + 1
    probs[keep:] = 0
    counts = draw_counts(LOGITS, SamplingParams(temperature=1.5, top_k=6, top_p=0.8))
    assert_fits(counts, probs)


def test_top_p_always_keeps_top_token() -> None:
    counts = draw_counts(LOGITS, SamplingParams(temperature=1.0, top_p=0.01), num_draws=500)
    assert counts[0] == 500


def test_logprobs_content() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 40)
    params = [
        SamplingParams(temperature=1.0, logprobs=5),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = Sampler(CPU)(logits, make_batch(params))
    want = torch.log_softmax(logits, dim=-1)  # before temperature and filters
    first = out.logprobs[0]
    assert first is not None
    top5 = want[0].topk(5).indices.tolist()
    assert out.token_ids[0] in first and set(top5) <= set(first)
    assert len(first) == (5 if out.token_ids[0] in top5 else 6)
    for token, lp in first.items():
        assert lp == pytest.approx(float(want[0, token]), abs=1e-5)
    assert out.logprobs[1] is None
    third = out.logprobs[2]
    assert third is not None and list(third) == [out.token_ids[2]]
    assert math.isclose(third[out.token_ids[2]], float(want[2].max()), abs_tol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_matches_cpu_for_greedy_and_seeded_is_stable() -> None:
    cuda = torch.device("cuda")
    logits = torch.randn(4, 300)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3), SamplingParams(seed=3, top_p=0.9, top_k=50)]
    cpu_out = Sampler(CPU)(logits[:2], make_batch(params, prompts=[[1, 2], [3]]))
    batch = make_batch(params, prompts=[[1, 2], [3]])
    batch.generators = [None, make_generator(3, cuda)]
    cuda_out = Sampler(cuda)(logits[:2].to(cuda), batch)
    assert cuda_out.token_ids[0] == cpu_out.token_ids[0]
    batch.generators = [None, make_generator(3, cuda)]
    again = Sampler(cuda)(logits[:2].to(cuda), batch)
    assert again.token_ids == cuda_out.token_ids


def test_rows_with_different_filters_in_one_batch() -> None:
    """Each row gets its own filter when rows with and without top-k / top-p share the batch."""
    torch.manual_seed(5)
    num_draws = 10_000
    rows = [SamplingParams(top_k=3), SamplingParams(top_p=0.7), SamplingParams(top_k=50), SamplingParams(temperature=0)]
    logits = torch.tensor([LOGITS] * (len(rows) * num_draws))
    out = Sampler(CPU)(logits, make_batch(rows * num_draws))
    tokens = torch.tensor(out.token_ids).view(num_draws, len(rows))
    probs = torch.softmax(torch.tensor(LOGITS), dim=-1).double()
    top3 = probs.clone()
    top3[3:] = 0
    top_p = probs.clone()
    top_p[int((probs.cumsum(0) < 0.7).sum()) + 1 :] = 0
    for column, expected in enumerate([top3, top_p, probs]):
        assert_fits(torch.bincount(tokens[:, column], minlength=len(LOGITS)).double(), expected)
    assert (tokens[:, 3] == 0).all()


def test_logit_bias_moves_only_its_rows() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, logit_bias={"2": 5.0}),  # JSON-style string keys are accepted
        SamplingParams(temperature=0.0, logit_bias={1: -100.0}),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler(CPU)(logits.clone(), make_batch(params))
    assert out.token_ids == [2, 3, 1]
    # biased distribution: the logprob of a boosted token is that of the biased logits
    lp = Sampler(CPU)(
        logits[:1].clone(), make_batch([SamplingParams(temperature=0.0, logprobs=0, logit_bias={0: 4.0})])
    )
    expected = torch.log_softmax(torch.tensor([4.0, 3.0, 1.0, 2.0]), -1)[0].item()
    assert lp.logprobs[0] is not None and math.isclose(lp.logprobs[0][0], expected, rel_tol=1e-5)


def test_logit_bias_distribution() -> None:
    row = [0.0, 1.0, 2.0]
    params = SamplingParams(temperature=1.0, logit_bias={0: 2.0})
    assert_fits(draw_counts(row, params), torch.softmax(torch.tensor([2.0, 1.0, 2.0]), -1))


@pytest.mark.parametrize("bias", [{"x": 1.0}, {-1: 1.0}, {3: 101.0}])
def test_logit_bias_validation(bias: dict) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
