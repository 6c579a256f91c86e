"""Penalties, logit bias and min-p (engine/penalties.py, core/sampling.py) under speculation.

- the verify rows are penalised as plain decoding would penalise each position: row i of a
  chain with the committed tokens plus drafts 0..i-1, node i of a tree with its path (checked
  against a per-row reference written from the definitions);
- greedy speculative output with penalties and bias equals penalised plain greedy output,
  token for token, for draft, ngram, suffix and medusa on the single path and draft, ngram in
  the batch engine (fp32 torch: exact), and the penalties do change the output (power);
- sampled output with penalties and with logit bias + min-p passes the chi-square test against
  the penalised/biased target enumerated exactly (``helpers.pearson``: 1,500 draws, p = 0.001),
  for draft and ngram, and in the batch engine; a verifier that penalises every row with the
  committed tokens only (ignoring the drafts before it), or whose rows miss the bias, fails it
  (the test's power);
- out-of-range values are InvalidRequestError naming the field.
"""

from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import (
    CHI2_CRITICAL_P001,
    DRAWS,
    NEW_TOKENS,
    PROMPTS,
    TOP_K,
    copyable_prompt,
    decoder,
    last_logits,
    pearson,
)

from specdecode import SamplingParams
from specdecode.core.sampling import LogitsProcessor
from specdecode.core.tree import TokenTree
from specdecode.engine.penalties import TokenPenalties
from specdecode.errors import InvalidRequestError

PENALTIES = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.5}
# Milder, for the greedy tests: strong penalties leave prompt lookup nothing it may copy.
MILD = {"frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.1}


def reference_row(logits: torch.Tensor, prompt: list[int], generated: list[int], params: SamplingParams) -> torch.Tensor:
    """One position's logits (V,) processed from the definitions, token by token."""
    out = logits.float().clone()
    for token, value in (params.logit_bias or {}).items():
        out[token] += value
    for token in set(prompt) | set(generated):
        if params.repetition_penalty != 1.0:
            value = out[token]
            out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(generated).items():
        out[token] -= params.frequency_penalty * count + params.presence_penalty
    return out


def test_rows_are_penalised_with_the_drafts_before_them() -> None:
    vocab = 11
    params = SamplingParams(logit_bias={3: 2.0, 7: -1.0}, **PENALTIES)
    prompt, generated, drafts = [1, 2, 2], [4, 5, 4], [4, 9, 1]
    penalties = TokenPenalties(params, prompt, vocab, torch.device("cpu"))
    penalties.advance(torch.tensor(generated))
    logits = torch.randn(len(drafts) + 1, vocab) * 3
    rows = penalties.chain_rows(logits, torch.tensor(drafts))
    for i in range(len(drafts) + 1):
        torch.testing.assert_close(rows[i], reference_row(logits[i], prompt, generated + drafts[:i], params))
    # A tree: root -> 4 -> 9, root -> 1 -> 4; each node's row follows its own path.
    tree = TokenTree([-1, 0, 1, 0, 3], torch.tensor([5, 4, 9, 1, 4]), [False] * 5)
    tree_logits = torch.randn(5, vocab)
    paths = {0: [], 1: [4], 2: [4, 9], 3: [1], 4: [1, 4]}
    tree_rows = penalties.tree_rows(tree_logits, tree)
    for node, path in paths.items():
        torch.testing.assert_close(tree_rows[node], reference_row(tree_logits[node], prompt, generated + path, params))
    # A draft walk sees its own drafts, and ends where it began.
    penalties.begin_draft()
    first = penalties.draft_row(logits[:1])
    penalties.push_draft(torch.tensor([9]))
    second = penalties.draft_row(logits[1:2])
    penalties.end_draft()
    torch.testing.assert_close(first[0], reference_row(logits[0], prompt, generated, params))
    torch.testing.assert_close(second[0], reference_row(logits[1], prompt, generated + [9], params))
    torch.testing.assert_close(penalties.draft_row(logits[:1]), first)


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = LogitsProcessor(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2).probs(logits)
    # 0.2 * 0.5 = 0.1: the last token (0.05) goes, the rest are renormalised.
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_bad_values_name_the_field() -> None:
    for field, value in [("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0),
                         ("min_p", 1.5), ("logprobs", 21), ("logprobs_mode", "final")]:
        with pytest.raises(InvalidRequestError, match=field):
            SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101.0})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={"5": 1.0})


def penalised(max_new_tokens: int = 24, **sampling) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, logit_bias={17: 1.5}, **MILD, **sampling)


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_greedy_penalised_speculation_equals_penalised_plain(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path,
                                                            method: str) -> None:
    # Both engines: the default (the batch engine holding one request) and the single-request one.
    dec, single = decoder(tiny_qwen2_dir, tiny_close_draft_dir), decoder(tiny_qwen2_dir, tiny_close_draft_dir,
                                                                          engine="single")
    changed, accepted = 0, {"auto": 0, "single": 0}
    for prompt in PROMPTS[:4] + [copyable_prompt(dec)]:
        plain = dec.generate(prompt, penalised(), method="none")
        changed += plain.token_ids != dec.generate(prompt, SamplingParams(max_new_tokens=24), method="none").token_ids
        for engine, on in (("auto", dec), ("single", single)):
            run = on.generate(prompt, penalised(), method=method, k=4)
            assert run.token_ids == plain.token_ids, f"{method} on {prompt!r} ({engine})"
            accepted[engine] += run.stats.draft_tokens_accepted
    assert changed >= 3  # the penalties change what greedy decoding writes
    # ... and speculation had drafts to verify under them.
    assert accepted["single"] > 0 and accepted["auto"] > 0
    if method == "suffix":
        return  # suffix in the batch engine: covered by the other two
    prompts = PROMPTS[:4]
    batch = dec.generate_batch(prompts, [penalised()] * len(prompts), method=method)
    for prompt, result in zip(prompts, batch, strict=True):
        assert result.token_ids == dec.generate(prompt, penalised(), method="none").token_ids


def test_greedy_penalised_tree_speculation_equals_penalised_plain(tiny_qwen2_dir: Path, medusa_dir: Path) -> None:
    from specdecode import SpecDecoder

    dec = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="medusa", heads=str(medusa_dir), dtype="fp32",
                                      device="cpu", show_progress=False)
    plain_dec = decoder(tiny_qwen2_dir, None, "none")
    # generate (whatever its engine's costs make it draft), and a batch engine that drafts each
    # row's tree every step (cost_aware off: a tree row's drafting is then not a timing's verdict).
    every_step = dec.batch_engine(max_batch=1, cost_aware=False)
    for prompt in PROMPTS[:3]:
        want = plain_dec.generate(prompt, penalised()).token_ids
        assert dec.generate(prompt, penalised()).token_ids == want
        [run] = dec.generate_batch([prompt], penalised(), method="medusa", engine=every_step)
        assert run.token_ids == want and run.stats.tree_nodes_proposed > 0


def exact_penalised_distribution(dec, prompt_ids: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    processor = LogitsProcessor(temperature=1.0, top_k=TOP_K, top_p=1.0, min_p=params.min_p)
    dist: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(NEW_TOKENS):
        grown = {}
        for seq, prob in dist.items():
            logits = reference_row(last_logits(dec, prompt_ids + list(seq)), prompt_ids, list(seq), params)
            probs = processor.probs(logits)
            for token in torch.nonzero(probs > 0).flatten().tolist():
                grown[seq + (token,)] = prob * probs[token].item()
        dist = grown
    return dist


def bias_params(dec, prompt_ids: list[int]) -> dict:
    """A bias that reorders the first row's top-k: its top token out, its 5th in; and min-p."""
    order = last_logits(dec, prompt_ids).argsort(descending=True).tolist()
    return {"logit_bias": {order[0]: -100.0, order[4]: 3.0}, "min_p": 0.05}


def sampled_params(extra: dict, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=TOP_K, max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True, **extra)


def penalised_chi_square(dec, method: str, setting: str, batch: bool = False) -> tuple[float, int] | None:
    """(statistic, df) of the draws against the exact distribution; None when a draw is a sequence
    the target cannot produce (a failure outright)."""
    prompt_ids = copyable_prompt(dec) if method == "ngram" else dec.encode("def quicksort(arr):")
    extra = PENALTIES if setting == "penalties" else bias_params(dec, prompt_ids)
    exact = exact_penalised_distribution(dec, prompt_ids, sampled_params(extra, 0))
    if batch:  # every draw in batches of 100 that share the engine's steps
        outputs = []
        for start in range(0, DRAWS, 100):
            params = [sampled_params(extra, seed) for seed in range(start, start + 100)]
            outputs += [r.token_ids for r in dec.generate_batch([prompt_ids] * 100, params, method=method, k=2)]
    else:
        outputs = [dec.generate(prompt_ids, sampled_params(extra, seed), method=method, k=2).token_ids
                   for seed in range(DRAWS)]
    counts = Counter(tuple(t) for t in outputs)
    return pearson(exact, counts) if set(counts) <= set(exact) else None


@pytest.mark.parametrize("setting", ["penalties", "bias"])
@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_penalised_output_follows_the_penalised_target(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path,
                                                               method: str, setting: str) -> None:
    result = penalised_chi_square(decoder(tiny_qwen2_dir, tiny_close_draft_dir), method, setting)
    assert result is not None, "sampled a sequence the penalised target cannot produce"
    stat, df = result
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_sampled_penalised_output_in_the_batch_engine(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    result = penalised_chi_square(decoder(tiny_qwen2_dir, tiny_close_draft_dir), "draft", "penalties", batch=True)
    assert result is not None, "sampled a sequence the penalised target cannot produce"
    stat, df = result
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


@pytest.mark.parametrize("method,setting,wrong", [("draft", "penalties", "committed_only"),
                                                  ("draft", "bias", "unbiased_rows"),
                                                  ("ngram", "bias", "unbiased_rows")])
def test_the_penalised_distribution_test_has_power(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path,
                                                   monkeypatch, method: str, setting: str, wrong: str) -> None:
    """It fails a verifier that penalises every row with the committed tokens only (ignoring the
    drafts before it), and one whose verify rows miss the bias (the draft's rows keep it). (Prompt
    lookup rarely gets a copy accepted under the strong penalties, so its rows past the first
    are seldom reached: the first wrong verifier is tested with the draft model.)"""
    real = TokenPenalties.chain_rows

    def committed_only(self, logits, drafts):
        return self._apply(logits, self.counts.expand(logits.shape[0], -1))

    def unbiased_rows(self, logits, drafts):
        bias, self.bias = self.bias, None
        try:
            return real(self, logits, drafts)
        finally:
            self.bias = bias

    monkeypatch.setattr(TokenPenalties, "chain_rows", committed_only if wrong == "committed_only" else unbiased_rows)
    result = penalised_chi_square(decoder(tiny_qwen2_dir, tiny_close_draft_dir), method, setting)
    # Caught either way: a sequence the penalised target cannot produce, or the statistic.
    assert result is None or result[0] > CHI2_CRITICAL_P001[result[1]], f"chi2={result}: the test cannot tell"


def penalised_margins(dec, params: SamplingParams, prompt_ids: list[int], continuation: list[int]) -> list[float]:
    """The penalised target's top-1 minus top-2 gap at each position of ``continuation``."""
    margins = []
    for i in range(len(continuation)):
        row = reference_row(last_logits(dec, prompt_ids + continuation[:i]), prompt_ids, continuation[:i], params)
        top2 = row.topk(2).values
        margins.append((top2[0] - top2[1]).item())
    return margins


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_llamacpp_greedy_penalised_speculation_equals_penalised_plain(tiny_ggufs: dict[str, Path],
                                                                      method: str) -> None:
    """Up to the first penalised near-tie (a pass over several rows may round differently)."""
    from helpers import assert_greedy_equal_up_to_near_tie, llamacpp_decoder

    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    for prompt in PROMPTS[:3]:
        prompt_ids = dec.encode(prompt)
        plain = dec.generate(prompt_ids, penalised(), method="none").token_ids
        margins = penalised_margins(dec, penalised(), prompt_ids, plain)
        run = dec.generate(prompt_ids, penalised(), method=method, k=3).token_ids
        compared = assert_greedy_equal_up_to_near_tie(run, plain, margins, f"{method} on {prompt!r}")
        assert compared >= len(plain) // 2, "a near-tie too early to prove anything"
        batch = dec.generate_batch([prompt_ids], penalised(), method=method, k=3)[0].token_ids
        assert_greedy_equal_up_to_near_tie(batch, plain, margins, f"batch {method} on {prompt!r}")
