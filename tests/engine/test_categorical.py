"""The two-level categorical sampler (core/categorical.py) draws each row's tokens with their
probabilities: Pearson's chi-square against the exact distribution at p = 0.001 (27 cells), on rows that
span several blocks, end inside a partial block and hold zero-probability tokens (never drawn);
a wrong sampler (the block chosen uniformly) fails the same test."""

from __future__ import annotations

import pytest
import torch
from helpers import CHI2_CRITICAL_P001

from specdecode.core import categorical
from specdecode.core.categorical import BLOCK, _inverse_cdf, sample_categorical

DRAWS = 20000
VOCAB = 3 * BLOCK + 37  # a partial last block


def distribution() -> torch.Tensor:  # (VOCAB,)
    """Mass in every block, most of it on a few tokens, a zero run, small tokens in the tail."""
    probs = torch.zeros(VOCAB)
    probs[[5, BLOCK + 17, 2 * BLOCK + 900, 3 * BLOCK + 36]] = torch.tensor([0.3, 0.25, 0.2, 0.1])
    probs[BLOCK + 100 : BLOCK + 300] = 0.1 / 200
    probs[3 * BLOCK : 3 * BLOCK + 30] = 0.05 / 30
    return probs


def cells() -> list[torch.Tensor]:
    """The test's cells: each heavy token alone, the runs of small tokens in groups of ten."""
    heavy = [torch.tensor([i]) for i in (5, BLOCK + 17, 2 * BLOCK + 900, 3 * BLOCK + 36)]
    runs = [torch.arange(start, start + 10) for start in range(BLOCK + 100, BLOCK + 300, 10)]
    runs += [torch.arange(start, start + 10) for start in range(3 * BLOCK, 3 * BLOCK + 30, 10)]
    return heavy + runs


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over ``cells()`` (expected counts 100 and more), degrees of freedom."""
    probs = probs / probs.sum()
    observed = torch.stack([counts[c].sum() for c in cells()])
    expected = torch.stack([probs[c].sum() for c in cells()]) * counts.sum()
    return float(((observed - expected) ** 2 / expected).sum()), len(cells()) - 1


def draw_counts(probs: torch.Tensor, seed: int) -> torch.Tensor:  # (VOCAB,) counts of DRAWS draws
    gen = torch.Generator().manual_seed(seed)
    rows = probs.expand(100, -1)  # 100 rows a call: the batched shape
    tokens = torch.cat([sample_categorical(rows, gen) for _ in range(DRAWS // 100)])
    return torch.bincount(tokens, minlength=VOCAB).float()


@pytest.mark.parametrize("seed", [0, 1])
def test_draws_follow_the_distribution_and_never_a_zero_probability_token(seed: int) -> None:
    probs = distribution()
    counts = draw_counts(probs * 3.0, seed)  # rows need not sum to one
    assert counts[probs == 0].sum() == 0
    stat, dof = chi_square(counts, probs)
    assert stat < CHI2_CRITICAL_P001[dof], (stat, dof)


def test_a_sampler_that_picks_blocks_uniformly_fails_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    real = categorical._inverse_cdf
    calls = iter(range(10**9))

    def uniform_blocks(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        if next(calls) % 2 == 0:  # the block level: every block with mass equally likely
            return real((weights > 0).double(), uniform)
        return real(weights, uniform)

    monkeypatch.setattr(categorical, "_inverse_cdf", uniform_blocks)
    probs = distribution()
    stat, dof = chi_square(draw_counts(probs, 0), probs)
    assert stat > CHI2_CRITICAL_P001[dof]


def test_a_uniform_draw_next_to_one_stays_on_the_last_positive_weight() -> None:
    weights = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 1e-300, 0.0, 0.0]], dtype=torch.float64)
    almost_one = torch.full((2, 1), 1.0 - 2.0**-53, dtype=torch.float64)
    assert _inverse_cdf(weights, almost_one).flatten().tolist() == [1, 1]
    assert _inverse_cdf(weights, torch.zeros(2, 1, dtype=torch.float64)).flatten().tolist() == [0, 1]


def test_bf16_rows_and_one_row_shapes() -> None:
    probs = distribution()
    gen = torch.Generator().manual_seed(0)
    token = sample_categorical(probs.to(torch.bfloat16)[None], gen)
    assert token.shape == (1,) and token.dtype == torch.long and probs[token] > 0


NEAR_TIE = 1e-4  # float32 softmax over 151,936 tokens: its normaliser is good to ~1e-5


@pytest.mark.parametrize(("scale", "top_p", "top_k", "within_first"),
                         [(8.0, 0.95, 0, True), (4.0, 0.9, 0, False), (0.5, 0.95, 0, False), (2.0, 0.8, 50, True)])
def test_top_p_keeps_the_nucleus(scale: float, top_p: float, top_k: int, within_first: bool) -> None:
    """The nucleus found among the top 512 tokens (peaked rows) or by a full sort (flatter
    rows) is the exact one: a token is kept iff the tokens ranked above it hold less than top_p
    (float64 reference on 151,936-token rows of random logits; tokens whose mass above is
    within NEAR_TIE of top_p are not compared: float32 probabilities, here and in transformers'
    TopPLogitsWarper, put tokens 1e-5 from the cut on either side)."""
    from specdecode.core.sampling import NUCLEUS_FIRST_CANDIDATES, LogitsProcessor

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(3, 151936, generator=gen) * scale
    ours = LogitsProcessor(temperature=1.0, top_k=top_k, top_p=top_p).probs(logits) > 0
    exact = logits.double()
    if top_k:
        exact = exact.masked_fill(exact < exact.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    probs, order = exact.softmax(-1).sort(dim=-1, descending=True)
    above = probs.cumsum(-1) - probs  # (3, V) float64: the mass ranked above each token
    keep = torch.zeros_like(ours).scatter(-1, order, above < top_p)
    compared = torch.zeros_like(ours).scatter(-1, order, (above - top_p).abs() >= NEAR_TIE)
    assert torch.equal(ours & compared, keep & compared)
    assert int((~compared).sum()) <= 0.01 * int(keep.sum())  # only near ties skipped
    kept = int(ours.sum(-1).max())
    assert (kept <= NUCLEUS_FIRST_CANDIDATES) == within_first  # both paths are exercised


def dense_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """HF's order over the whole row (the processor's dense path, written out)."""
    scaled = logits.double() / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k, dim=-1).values[..., -1:], float("-inf"))
    if top_p < 1.0:
        probs, order = scaled.softmax(-1).sort(dim=-1, descending=True)
        keep = probs.cumsum(-1) - probs < top_p
        keep[..., 0] = True
        scaled = scaled.masked_fill(~torch.zeros_like(keep).scatter(-1, order, keep), float("-inf"))
    probs = scaled.softmax(-1)
    if min_p:
        probs = probs * (probs >= min_p * probs.amax(-1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs.float()


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(40, 0.95, 0.05), (40, 1.0, 0.0), (8, 0.5, 0.0), (600, 0.9, 0.0)])
def test_a_small_top_k_is_worked_out_on_its_tokens_alone(top_k: int, top_p: float, min_p: float) -> None:
    """(B, T, V) rows, top-k of 40 or 8 (the sparse path) or 600 (dense): the same distribution
    as the whole-row computation."""
    from specdecode.core.sampling import LogitsProcessor

    logits = torch.randn(2, 3, 151936, generator=torch.Generator().manual_seed(3)) * 3
    ours = LogitsProcessor(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p).probs(logits)
    want = dense_reference(logits, 0.8, top_k, top_p, min_p)
    assert torch.equal(ours > 0, want > 0)
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=1e-5)


def test_a_tie_at_the_kth_token_keeps_every_tied_token() -> None:
    """HF keeps every token tied with the k-th: the sparse path would keep only k, so a tie sends
    the row down the whole-row path."""
    from specdecode.core.sampling import LogitsProcessor

    logits = torch.full((1, 2000), -5.0)
    logits[0, :3] = torch.tensor([4.0, 3.0, 2.0])
    logits[0, [10, 500, 1999]] = 1.0  # three tokens tied for 4th place
    probs = LogitsProcessor(temperature=1.0, top_k=4, top_p=1.0).probs(logits)
    assert (probs > 0).sum() == 6
    torch.testing.assert_close(probs, dense_reference(logits, 1.0, 4, 1.0, 0.0))


@pytest.mark.parametrize("shape", [(7,), (1, 151936), (2, 3, 1000), (3, 0, 5)])
def test_argmax_last_is_torchs_argmax(shape: tuple[int, ...]) -> None:
    """The numpy path picks what ``torch.argmax`` picks: the first maximum, a NaN first, any shape."""
    from specdecode.core.categorical import argmax_last

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax_last(x), x.argmax(-1))
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("nan"), 1.0, float("nan"), 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert argmax_last(ties).tolist() == ties.argmax(-1).tolist() == [1, 0, 0]
    strided = torch.randn(4, 10)[:, ::3]  # not contiguous
    assert torch.equal(argmax_last(strided), strided.argmax(-1))
    half = x.to(torch.bfloat16)  # other dtypes: torch's own
    assert torch.equal(argmax_last(half), half.argmax(-1))


def test_greedy_verify_of_a_plain_step_emits_the_argmax() -> None:
    from specdecode.engine.verify import greedy_verify

    logits = torch.randn(3, 1, 50, generator=torch.Generator().manual_seed(1))
    result = greedy_verify(torch.empty(3, 0, dtype=torch.long), logits, num_drafted=[0, 0, 0])
    assert result.accepted_len.tolist() == [0, 0, 0]
    assert result.tokens.tolist() == logits.argmax(-1).tolist() and result.tokens.dtype == torch.long
