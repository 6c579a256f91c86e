"""Verification rules on hand-made tensors: exact greedy tables and a distribution test."""

import pytest
import torch

from specdecode.engine.verify import PAD_TOKEN, greedy_verify, rejection_verify


def one_hot_logits(argmax_rows: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """(B, T, V) logits whose argmax at [b, t] is argmax_rows[b][t]."""
    ids = torch.tensor(argmax_rows)
    return torch.nn.functional.one_hot(ids, vocab).float() * 5.0


def test_greedy_all_accepted_gets_bonus_token() -> None:
    result = greedy_verify(torch.tensor([[1, 2, 3]]), one_hot_logits([[1, 2, 3, 4]]))
    assert result.accepted_len.tolist() == [3]
    assert result.tokens.tolist() == [[1, 2, 3, 4]]


def test_greedy_early_mismatch_emits_target_token() -> None:
    result = greedy_verify(torch.tensor([[1, 5, 3]]), one_hot_logits([[1, 2, 3, 4]]))
    assert result.accepted_len.tolist() == [1]
    assert result.tokens.tolist() == [[1, 2, PAD_TOKEN, PAD_TOKEN]]


def test_greedy_first_mismatch_and_batch_rows_independent() -> None:
    drafts = torch.tensor([[7, 2, 3], [1, 2, 3]])
    result = greedy_verify(drafts, one_hot_logits([[1, 2, 3, 4], [1, 2, 6, 4]]))
    assert result.accepted_len.tolist() == [0, 2]
    assert result.tokens.tolist() == [[1, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN], [1, 2, 6, PAD_TOKEN]]


def test_greedy_later_match_after_mismatch_is_not_accepted() -> None:
    # Position 2 matches, but acceptance is a prefix: it must stop at the first mismatch.
    result = greedy_verify(torch.tensor([[1, 0, 3]]), one_hot_logits([[1, 2, 3, 4]]))
    assert result.accepted_len.tolist() == [1]


def test_greedy_with_no_drafts_is_plain_argmax() -> None:
    result = greedy_verify(torch.empty((1, 0), dtype=torch.long), one_hot_logits([[6]]))
    assert result.accepted_len.tolist() == [0]
    assert result.tokens.tolist() == [[6]]


def test_rejection_accepts_when_target_agrees_and_rejects_impossible_tokens() -> None:
    vocab = 4
    target = torch.zeros(1, 3, vocab)
    target[0, 0, 1] = 1.0  # target certain of token 1, then of token 2, then of 3
    target[0, 1, 2] = 1.0
    target[0, 2, 3] = 1.0
    draft_probs = torch.full((1, 2, vocab), 0.25)
    gen = torch.Generator().manual_seed(0)
    result = rejection_verify(torch.tensor([[1, 0]]), draft_probs, target, gen)
    # p(1) = 1 >= q(1): always accepted; p(0) = 0: always rejected, recovered token must be 2.
    assert result.accepted_len.tolist() == [1]
    assert result.tokens.tolist() == [[1, 2, PAD_TOKEN]]


def test_rejection_bonus_token_drawn_from_last_row() -> None:
    target = torch.zeros(1, 2, 4)
    target[0, 0, 3] = 1.0
    target[0, 1, 0] = 1.0
    result = rejection_verify(torch.tensor([[3]]), None, target, torch.Generator().manual_seed(1))
    assert result.tokens.tolist() == [[3, 0]]


def test_deterministic_draft_residual_excludes_rejected_token() -> None:
    # One-hot q on token 0; p gives it 0.5. Whenever rejected, the replacement is never token 0.
    batch = 2000
    target = torch.tensor([[0.5, 0.3, 0.2]]).expand(batch, 2, 3).contiguous()
    result = rejection_verify(torch.zeros((batch, 1), dtype=torch.long), None, target, torch.Generator().manual_seed(2))
    rejected = result.accepted_len == 0
    assert 0.4 < rejected.float().mean().item() < 0.6
    assert (result.tokens[rejected, 0] != 0).all()


# --- distribution test -------------------------------------------------------------------
# Statistic: total-variation distance between the empirical distribution of the token emitted
# at each output position and the target's row for that position. Draws: 200,000 rows per
# table, and every output position reached by at least 20,000 of them is judged (standard
# error of TV with 6 categories at 20,000 draws ~0.005). Threshold: 0.01. A verifier that
# resamples from p instead of norm(max(0, p - q)) lands at TV ~0.1 here (checked below).

DRAWS = 200_000
TV_THRESHOLD = 0.01
MIN_DRAWS_PER_POSITION = 20_000  # positions reached fewer times are too noisy to judge


def _tables(seed: int, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(k + 1, vocab, generator=gen).pow(3)
    p = p / p.sum(-1, keepdim=True)
    # A draft that half agrees with the target, like a real small model: enough draws reach
    # every position, and p - q has both signs so the residual matters.
    noise = torch.rand(k, vocab, generator=gen).pow(3)
    q = 0.5 * p[:k] + 0.5 * noise / noise.sum(-1, keepdim=True)
    return p, q


def _emitted_tv(verify_fn, deterministic: bool, seed: int = 0, k: int = 3, vocab: int = 6) -> float:
    p, q = _tables(seed, k, vocab)
    gen = torch.Generator().manual_seed(seed + 100)
    if deterministic:
        # A deterministic drafter that guesses well: the target's likeliest token everywhere.
        drafts = p[:k].argmax(-1).expand(DRAWS, k).contiguous()
        draft_probs = None
    else:
        drafts = torch.multinomial(q, DRAWS, replacement=True, generator=gen).T.contiguous()
        draft_probs = q.expand(DRAWS, k, vocab)
    result = verify_fn(drafts, draft_probs, p.expand(DRAWS, k + 1, vocab), gen)
    worst = 0.0
    for pos in range(k + 1):
        reached = result.accepted_len >= pos
        emitted = result.tokens[reached, pos]
        if pos <= 1:
            assert emitted.numel() >= MIN_DRAWS_PER_POSITION, "the tables must exercise position 1"
        if emitted.numel() < MIN_DRAWS_PER_POSITION:
            continue
        empirical = torch.bincount(emitted, minlength=vocab).float() / emitted.numel()
        worst = max(worst, 0.5 * (empirical - p[pos]).abs().sum().item())
    return worst


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_sampling_reproduces_target_distribution(deterministic: bool, seed: int) -> None:
    assert _emitted_tv(rejection_verify, deterministic, seed) < TV_THRESHOLD


def _broken_verify(drafts, draft_probs, target_probs, gen):
    """Rejection sampling whose recovery step samples from p instead of the residual."""
    batch, k = drafts.shape
    p_tok = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(2)
    q_tok = draft_probs.gather(2, drafts[..., None]).squeeze(2)
    accepted = (torch.rand(batch, k, generator=gen) * q_tok < p_tok).long().cumprod(1).sum(1)
    final = torch.multinomial(target_probs[torch.arange(batch), accepted], 1, generator=gen).squeeze(1)
    tokens = torch.cat([drafts, drafts[:, :1]], 1)
    tokens[torch.arange(batch), accepted] = final
    from specdecode.engine.verify import VerifyResult

    return VerifyResult(accepted, tokens)


def test_distribution_test_detects_wrong_resampling() -> None:
    assert _emitted_tv(_broken_verify, deterministic=False, seed=0) > 5 * TV_THRESHOLD
