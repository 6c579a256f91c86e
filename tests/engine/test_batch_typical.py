"""Medusa's typical acceptance on the batch engine's tree rows (issue 45: one engine).

A request of a tree method (medusa, eagle) may opt into ``acceptance="typical"``, Medusa's LOSSY
rule; its sampled trees are then verified by ``typical_tree_pick``, the other rows as before:

- ``verify_trees`` gives each tree row exactly what the single-request verifier of its rule
  gives for the same logits and seed (greedy rows: greedy, whatever the rule);
- a step whose sampled tree rows are typical reads the host once (their picks ride in the
  step's one read); a lossless sampled tree reads more (the power check of the count);
- greedy typical rows equal plain decoding (typical acceptance is for sampling);
- seeded sampled rows, typical and lossless, give the same tokens in a mixed batch as alone,
  and typical rows accept more drafts than the same requests verified losslessly;
- ``OneRequestEngine.decode`` and ``run_samples`` pass the rule on;
- a chain method, or an unknown rule, is refused with InvalidRequestError.

A seeded sampled tree request gives different tokens on the two engines even under lossless
verification (their steps differ in what they draft and draw: measured on these rows), so the
verifiers are compared directly instead (the first test).
"""

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import PATTERN, PROMPTS, run_until_done
from torch.utils._python_dispatch import TorchDispatchMode

from specdecode import SamplingParams, SpecDecoder
from specdecode.core.sampling import LogitsProcessor
from specdecode.core.tree import TokenTree
from specdecode.drafters.base import DraftProposal
from specdecode.engine.batch import BatchEngine
from specdecode.engine.batch_pass import VerifiedStep
from specdecode.engine.batch_run import run_samples
from specdecode.engine.batch_verify import verify_trees
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.one_request import MIN_POOL_TOKENS, OneRequestEngine
from specdecode.engine.scheduler import ScheduledSequence
from specdecode.engine.verify import greedy_tree_read, greedy_tree_verify, rejection_tree_verify, typical_tree_verify
from specdecode.errors import InvalidRequestError
from specdecode.models.heads import load_heads

TREE_METHODS = ("medusa", "eagle")
SAMPLED = {"temperature": 0.8, "ignore_eos": True}
# (prompt, method, seed): rows whose typical runs accept drafts on the tiny target
ROWS = [
    (PATTERN[:60], "medusa", 1),
    (PATTERN[7:80], "eagle", 2),
    (PROMPTS[0], "medusa", 3),
    (PATTERN[3:90], "eagle", 4),
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, medusa_dir: Path, eagle_dir: Path) -> SpecDecoder:
    decoder = SpecDecoder.from_pretrained(
        str(tiny_qwen2_dir),
        method="medusa",
        heads=str(medusa_dir),
        draft_confidence=0.0,
        dtype="fp32",
        device="cpu",
        show_progress=False,
    )
    decoder.attach_heads(load_heads(eagle_dir, torch.float32, torch.device("cpu")))
    return decoder


def engine(dec: SpecDecoder, **kwargs) -> BatchEngine:
    # Not cost-aware: every tree row drafts each step, so every step verifies trees.
    options = {"max_batch": 4, "kv_cache_tokens": 1024, "block_size": 4, "cost_aware": False} | kwargs
    return dec.batch_engine(**options)


def decode(
    dec: SpecDecoder,
    rows: list[tuple[str, str, int, str]],
    temperature: float = 0.8,
) -> tuple[list[list[int]], list[GenerationStats]]:
    """(prompt, method, seed, acceptance) rows decoded together in one engine; their tokens and stats."""
    eng = engine(dec)
    stats = [GenerationStats() for _ in rows]
    ids = [
        eng.add_request(
            dec.encode(prompt),
            SamplingParams(max_new_tokens=NEW_TOKENS, seed=seed, ignore_eos=True, temperature=temperature),
            method,
            None,
            stats=s,
            acceptance=acceptance,
        )
        for (prompt, method, seed, acceptance), s in zip(rows, stats, strict=True)
    ]
    tokens, errors = run_until_done(eng)
    assert not errors
    return [tokens[i] for i in ids], stats


# -- the verifier ---------------------------------------------------------------------------------
def test_verify_trees_gives_each_tree_row_its_rules_single_request_result() -> None:
    vocab = 8
    tree = TokenTree([-1, 0, 0, 1, 1, 2, 5], torch.tensor([3, 1, 4, 2, 5, 0, 6]), [False] * 7)
    # Flat rows (logits of scale 0.3): typical acceptance keeps every plausible token, so it
    # walks deep where lossless acceptance (p(token) ~ 1 / 8 a child) stops early.
    logits = 0.3 * torch.randn(4, tree.size, vocab, generator=torch.Generator().manual_seed(0))  # (B, N, V)
    proposal = DraftProposal(tree.tokens[None, 1:], None, tree=tree)
    processors = [LogitsProcessor.from_params(SamplingParams(temperature=t)) for t in (0.0, 1.0, 1.0, 0.7)]
    rules = ["typical", "typical", "lossless", "typical"]

    def seeded(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    generators = [None, seeded(5), seeded(5), seeded(6)]
    picks, results = verify_trees(logits, [proposal] * 4, processors, generators, rules)
    assert set(picks) == {0, 1, 3} and set(results) == {2}  # typical rows wait for the step's one read
    assert greedy_tree_read(tree, picks[0].tolist()) == greedy_tree_verify(tree, logits[0])
    for b, seed in ((1, 5), (3, 6)):
        expected = typical_tree_verify(tree, processors[b].probs(logits[b]), seeded(seed))
        assert greedy_tree_read(tree, picks[b].tolist()) == expected
    assert results[2] == rejection_tree_verify(tree, processors[2].probs(logits[2]), seeded(5))
    # The rules differ here: the same row, seed and logits verified both ways accept different paths.
    assert typical_tree_verify(tree, processors[1].probs(logits[1]), seeded(5)).path != results[2].path


# -- the engine ---------------------------------------------------------------------------------
class _ScalarReads(TorchDispatchMode):
    """Counts ``.item()`` reads (``.tolist()`` does not dispatch: it is counted apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def host_reads_of_tree_steps(dec: SpecDecoder, monkeypatch: pytest.MonkeyPatch, sampled_rule: str) -> list[int]:
    """The host reads (``tolist`` and ``item``) of each verify pass that verified trees, in a batch of
    a sampled medusa row and a sampled eagle row by ``sampled_rule`` and a greedy typical medusa row."""
    eng = engine(dec)
    for (prompt, method, seed), temperature in zip(ROWS[:3], (0.8, 0.8, 0.0), strict=True):
        params = SamplingParams(max_new_tokens=12, seed=seed, temperature=temperature, ignore_eos=True)
        eng.add_request(dec.encode(prompt), params, method, None, acceptance=sampled_rule if temperature else "typical")
    reads: list[int] = []
    real_verify, real_tolist = eng._verify, torch.Tensor.tolist

    def counted_verify(running: list[ScheduledSequence], proposals: list[DraftProposal]) -> VerifiedStep:
        if not any(p.tree is not None for p in proposals):
            return real_verify(running, proposals)
        tolists: list[int] = []
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: tolists.append(1) or real_tolist(t))
        try:
            with _ScalarReads() as items:
                out = real_verify(running, proposals)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", real_tolist)
        reads.append(len(tolists) + items.count)
        return out

    monkeypatch.setattr(eng, "_verify", counted_verify)
    run_until_done(eng)
    assert reads, "the rows drafted trees"
    return reads


def test_typical_tree_rows_keep_the_steps_one_host_read(dec: SpecDecoder, monkeypatch: pytest.MonkeyPatch) -> None:
    assert set(host_reads_of_tree_steps(dec, monkeypatch, "typical")) == {1}
    # Power: a lossless sampled tree reads the host as it walks down, so the count sees more.
    assert max(host_reads_of_tree_steps(dec, monkeypatch, "lossless")) > 1


def test_greedy_typical_rows_equal_plain_decoding(dec: SpecDecoder) -> None:
    rows = [
        (prompt, method, seed, rule)
        for (prompt, method, seed), rule in zip(ROWS, ("typical", "lossless") * 2, strict=True)
    ]
    outputs, stats = decode(dec, rows, temperature=0.0)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert outputs == [dec.generate(prompt, params, method="none").token_ids for prompt, _, _, _ in rows]
    assert sum(s.draft_tokens_accepted for s in stats) > 0


def test_sampled_rows_give_their_tokens_alone_and_typical_rows_accept_more(dec: SpecDecoder) -> None:
    typical = [(prompt, method, seed, "typical") for prompt, method, seed in ROWS[:2]]
    lossless = [(prompt, method, seed, "lossless") for prompt, method, seed in ROWS[:2]]
    mixed = [typical[0], lossless[1], typical[1], lossless[0]]
    together, _ = decode(dec, mixed)
    alone = [decode(dec, [row])[0][0] for row in mixed]
    assert together == alone
    assert all(len(tokens) == NEW_TOKENS for tokens in together)
    typical_tokens, typical_stats = decode(dec, typical)
    lossless_tokens, lossless_stats = decode(dec, lossless)
    assert typical_tokens != lossless_tokens  # same requests, same seeds: the rule decided
    accepted_typical = sum(s.draft_tokens_accepted for s in typical_stats)
    accepted_lossless = sum(s.draft_tokens_accepted for s in lossless_stats)
    # The tiny target's sampled rows are flat: losslessly the heads' guesses are rarely kept,
    # typically every plausible one is (measured: tau ~2 against ~1).
    assert accepted_typical > 2 * accepted_lossless + 4, (accepted_typical, accepted_lossless)


def test_one_request_engine_and_run_samples_pass_the_rule_on(dec: SpecDecoder) -> None:
    prompt, method, seed = ROWS[0]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, seed=seed, **SAMPLED)
    expected = {rule: decode(dec, [(prompt, method, seed, rule)])[0][0] for rule in ("typical", "lossless")}
    assert expected["typical"] != expected["lossless"]
    for rule in ("typical", "lossless"):
        # Fresh engines for each rule: a prompt cached by the first would start the second
        # without its prompt's features, so its heads could not draft its first token.
        one = OneRequestEngine(lambda tokens, k_max: engine(dec, max_batch=1, kv_cache_tokens=tokens, k_max=k_max),
                               dec.config.k_max)
        eng = engine(dec, kv_cache_tokens=MIN_POOL_TOKENS)
        steps = one.decode(
            dec.encode(prompt), params, method, None, None, GenerationStats(), None, None, None, acceptance=rule
        )
        assert [t for step in steps for t in step] == expected[rule], rule
        [result] = run_samples(
            eng, dec.tokenizer, [(dec.encode(prompt), params, None)], 1, method, None, None, None, acceptance=rule
        )
        assert result.token_ids == expected[rule], rule


def test_typical_is_refused_for_a_chain_method_and_an_unknown_rule_always(dec: SpecDecoder) -> None:
    eng = engine(dec)
    prompt, params = dec.encode(PROMPTS[0]), SamplingParams(max_new_tokens=4, **SAMPLED)
    for method in ("none", "ngram", "suffix", "auto"):
        with pytest.raises(InvalidRequestError, match="typical"):
            eng.add_request(prompt, params, method, 3, acceptance="typical")
    with pytest.raises(InvalidRequestError, match="acceptance"):
        eng.add_request(prompt, params, "medusa", 3, acceptance="lossy")
    with pytest.raises(InvalidRequestError, match="typical"):  # checked before a request is submitted, too
        eng.check_request(len(prompt), params, "ngram", 3, "typical")
    assert not eng.has_unfinished
    for method in TREE_METHODS:  # what the tree methods take
        eng.add_request(prompt, params, method, 3, acceptance="typical")
    assert not run_until_done(eng)[1]


def test_typical_rows_leave_the_pooled_acceptance_to_lossless_rows(dec: SpecDecoder) -> None:
    """A new row of a method starts from the acceptance pooled over that method's rows; a lossy
    rule accepts more than lossless verification would, so its rows do not feed that prior."""
    eng = engine(dec)
    prompt, method, seed = ROWS[0]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, seed=seed, **SAMPLED)
    typical = GenerationStats()
    eng.add_request(dec.encode(prompt), params, method, None, stats=typical, acceptance="typical")
    run_until_done(eng)
    assert typical.draft_tokens_accepted > 0 and eng._pooled_acceptance[method].trials == 0
    eng.add_request(dec.encode(prompt), params, method, None, acceptance="lossless")
    run_until_done(eng)
    assert eng._pooled_acceptance[method].trials > 0
