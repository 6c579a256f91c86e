"""Prompt lookup (method ngram): the matcher on hand-made sequences, greedy equality with plain
decoding, and the end-to-end distribution test for a deterministic drafter."""

from pathlib import Path

import pytest
import torch
from helpers import CHI2_CRITICAL_P001, PROMPTS, chi_square, copyable_prompt, decoder, install_wrong_residual

from specdecode import SamplingParams, cli
from specdecode.core.sampling import LogitsProcessor
from specdecode.drafters.ngram import NgramDrafter
from specdecode.errors import InvalidRequestError

GREEDY = LogitsProcessor(temperature=0.0, top_k=0, top_p=1.0)


def propose(drafter: NgramDrafter, history: list[int], k: int) -> list[int]:
    proposal = drafter.propose(torch.tensor([history]), k, GREEDY, None)
    assert proposal.probs is None  # deterministic: verified as a one-hot q
    return proposal.tokens[0].tolist()


@pytest.mark.parametrize(
    "history, ngram_max, ngram_min, k, expected",
    [
        ([1, 2, 3, 9, 1, 2, 3], 3, 1, 2, [9, 1]),  # the tail 1 2 3 occurred at 0; 9 followed
        ([5, 7, 5, 8, 5], 1, 1, 3, [8, 5]),  # most recent match (index 2), cut at the end
        ([1, 2, 4, 7, 2, 5, 1, 2], 2, 1, 2, [4, 7]),  # the 2-gram wins over the later 1-gram "2 -> 5"
        ([1, 2, 4, 7, 2, 5, 1, 2], 1, 1, 2, [5, 1]),  # 1-grams only: latest "2" is followed by 5
        ([1, 2, 3, 4], 3, 1, 4, []),  # nothing repeats: no proposal, the step decodes plainly
        ([4, 4, 4, 4], 2, 2, 3, [4]),  # overlapping matches: the latest "4 4" with a continuation
    ],
)
def test_lookup_on_hand_made_sequences(history: list[int], ngram_max: int, ngram_min: int, k: int, expected: list[int]) -> None:
    drafter = NgramDrafter(ngram_max, ngram_min)
    drafter.start(len(history), 64)
    assert propose(drafter, history, k) == expected


def test_incremental_index_equals_a_fresh_one() -> None:
    sequence = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    growing = NgramDrafter(3, 1)
    growing.start(4, 64)
    for end in range(4, len(sequence) + 1):
        fresh = NgramDrafter(3, 1)
        fresh.start(end, 64)
        assert propose(growing, sequence[:end], 3) == propose(fresh, sequence[:end], 3)


def test_bad_ngram_sizes_are_clear_errors(capsys, tiny_qwen2_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="ngram_min <= ngram_max"):
        NgramDrafter(2, 3)
    code = cli.main(["generate", "hi", "--target", str(tiny_qwen2_dir), "--method", "ngram", "--ngram-max", "1",
                     "--ngram-min", "2", "--dtype", "fp32", "--quiet"])
    assert code == cli.EXIT_USER_ERROR and "ngram_min <= ngram_max" in capsys.readouterr().err


@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_ngram_equals_plain(k: int, tiny_qwen2_dir: Path) -> None:
    plain = decoder(tiny_qwen2_dir, None, "none")
    ngram = decoder(tiny_qwen2_dir, None, "ngram")
    proposed = accepted = 0
    for prompt in PROMPTS:
        params = SamplingParams(max_new_tokens=40)
        result = ngram.generate(prompt, params, k=k)
        assert result.token_ids == plain.generate(prompt, params).token_ids, prompt
        proposed += result.stats.draft_tokens_proposed
        accepted += result.stats.draft_tokens_accepted
    # The path was exercised both ways: proposals made, some accepted, some rejected.
    assert proposed > accepted > 0


def test_cli_ngram_needs_no_draft_model(capsys, tiny_qwen2_dir: Path) -> None:
    base = ["generate", "for i in range(10):\n    print(i)\n", "--target", str(tiny_qwen2_dir), "--dtype", "fp32",
            "--max-new-tokens", "16"]
    assert cli.main(base + ["--method", "ngram"]) == 0
    ngram_out, err = capsys.readouterr()
    assert "method=ngram" in err
    assert cli.main(base + ["--method", "none", "--quiet"]) == 0
    assert capsys.readouterr().out == ngram_out


# The distribution test of test_engine (chi-square at p = 0.001 over 1,500 seeded 3-token
# generations against the exact target distribution), with the deterministic n-gram drafter.
# A random tiny model does not copy its context, so a lookup's proposal is usually a token the
# target gives probability 0 (always rejected). The prompt is therefore built as P x P, with x
# chosen so that the target gives x a probability between 0.2 and 0.8 after it: the first
# lookup (P's tail matched at the first P) proposes x, which is then sometimes accepted and
# sometimes rejected, so both acceptance and the residual are exercised.


def test_ngram_sampling_matches_target_distribution(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, "ngram")
    prompt_ids = copyable_prompt(dec)
    proposed = accepted = 0
    for seed in range(40):
        params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, seed=seed, ignore_eos=True)
        stats = dec.generate(prompt_ids, params, k=2).stats
        proposed += stats.draft_tokens_proposed
        accepted += stats.draft_tokens_accepted
    assert proposed > accepted > 0
    stat, df = chi_square(dec, prompt_ids, "ngram")
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_ngram_distribution_test_has_power(tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recovering rejected n-gram proposals from p instead of p with the proposal removed must
    fail the same test (chi-square ~430 against the critical 54 when written)."""
    dec = decoder(tiny_qwen2_dir, None, "ngram")
    prompt_ids = copyable_prompt(dec)
    install_wrong_residual(monkeypatch)
    stat, df = chi_square(dec, prompt_ids, "ngram")
    assert stat > CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}: the test has no power"
