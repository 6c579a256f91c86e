"""Suffix decoding end to end on the torch backend (token trees): greedy output equal to plain
decoding for several k and tree sizes with proposals accepted and rejected, the distribution
test (and its power), earlier responses shared by requests of one group and kept from others,
a batch drafting from the shared tree with every output still its single-request greedy
output, the auto method with a suffix source, calibration and the cost-aware choice."""

import functools
from dataclasses import replace
from pathlib import Path

import pytest
from helpers import (
    CHI2_CRITICAL_P001,
    PROMPTS,
    broken_rejection_tree_verify,
    chi_square,
    copyable_prompt,
    decoder,
    plain_tokens,
)

import specdecode.engine.single
from specdecode import SamplingParams, SpecDecoder, cli
from specdecode.drafters.suffix import SuffixProposer, SuffixTreeDrafter
from specdecode.drafters.suffix_cache import SuffixCache

NEW_TOKENS = 32


@functools.cache
def expected(target_dir: Path, prompt: str) -> list[int]:
    return plain_tokens(target_dir, prompt, NEW_TOKENS)


def fresh(target_dir: Path, **spec) -> SpecDecoder:
    """A suffix decoder over the cached tiny target with its own (empty) cache of responses
    (``spec``: DecoderConfig fields, ``engine="single"`` for the single-request engine's own)."""
    base = decoder(target_dir, None, "none")
    return SpecDecoder(base.target, None, replace(base.config, method="suffix", **spec))


@pytest.mark.parametrize(("k", "tree_size"), [(1, 1), (4, 16), ("auto", 16)])
def test_greedy_suffix_equals_plain(k: int | str, tree_size: int, tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir, tree_size=tree_size)
    proposed = accepted = depths = nodes = 0
    for prompt in PROMPTS[:5]:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        for _ in range(2):  # the second time, the first answer is in the shared tree
            result = dec.generate(prompt, params, k=k)
            assert result.token_ids == expected(tiny_qwen2_dir, prompt), (prompt, k)
            stats = result.stats
            proposed, accepted = proposed + stats.draft_tokens_proposed, accepted + stats.draft_tokens_accepted
            depths, nodes = depths + stats.draft_tokens_proposed, nodes + stats.tree_nodes_proposed
    assert accepted > 0
    if k != "auto":  # (cost-aware, it may propose only what is sure on these costs, and branches rarely pay)
        assert proposed > accepted  # proposals both accepted and rejected
        if tree_size > 1:
            assert nodes > depths  # some trees branched: more nodes than their depth


def test_suffix_proposes_token_trees_on_torch(tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir)
    drafter = dec.plan("suffix", 5, suffix_group="").drafter
    assert isinstance(drafter, SuffixTreeDrafter) and drafter.max_tree_nodes == 17


def test_suffix_sampling_matches_target_distribution(tiny_qwen2_dir: Path) -> None:
    # test_engine's chi-square (1,500 seeded 3-token generations against the exact target
    # distribution, p = 0.001) with suffix trees as proposals: the prompt is P x P, so the first
    # step proposes x (accepted sometimes), and the shared tree fills with earlier samples, so
    # later trees branch over several deterministic children.
    dec = fresh(tiny_qwen2_dir)
    prompt_ids = copyable_prompt(dec)
    proposed = accepted = 0
    for seed in range(40):
        params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, seed=seed, ignore_eos=True)
        stats = dec.generate(prompt_ids, params, k=2).stats
        proposed, accepted = proposed + stats.draft_tokens_proposed, accepted + stats.draft_tokens_accepted
    assert proposed > accepted > 0
    stat, df = chi_square(dec, prompt_ids, "suffix")
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_suffix_distribution_test_has_power(tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree verifier that forgets to take a rejected proposal out of the residual must fail
    the same test. The single-request engine's verifier (the batch engine's: test_batch_trees.py)."""
    dec = fresh(tiny_qwen2_dir, engine="single")
    broken = functools.partial(broken_rejection_tree_verify, broken_kind="deterministic")
    monkeypatch.setattr(specdecode.engine.single, "rejection_tree_verify", broken)
    stat, df = chi_square(dec, copyable_prompt(dec), "suffix")
    assert stat > CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}: the test has no power"


def test_earlier_responses_are_shared_within_a_group_only(tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir)
    prompt, params = PROMPTS[0], SamplingParams(max_new_tokens=NEW_TOKENS)
    want = expected(tiny_qwen2_dir, prompt)
    first = dec.generate(prompt, params, k=8)
    again = dec.generate(prompt, params, k=8)  # the first answer is in the group's tree
    alone = dec.generate(prompt, params, k=8, suffix_group=None)  # its own prompt and output only
    other = dec.generate(prompt, params, k=8, suffix_group="other")  # another group: nothing there yet
    for result in (first, again, alone, other):
        assert result.token_ids == want
    assert again.stats.verify_steps <= first.stats.verify_steps // 2
    assert alone.stats.verify_steps > again.stats.verify_steps and other.stats.verify_steps > again.stats.verify_steps
    assert dec.suffix_cache.stats().groups == 2  # "" and "other"; suffix_group=None wrote nothing


def test_a_batch_drafts_from_the_shared_tree_and_keeps_every_greedy_output(tiny_qwen2_dir: Path) -> None:
    dec = fresh(tiny_qwen2_dir)
    engine = dec.batch_engine(max_batch=8, cost_aware=False)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    prompts = PROMPTS[:5]
    want = [expected(tiny_qwen2_dir, p) for p in prompts]
    first = dec.generate_batch(prompts, params, method="suffix", k=8, engine=engine)
    assert [r.token_ids for r in first] == want
    # Written into the shared tree as they committed: every response token is there.
    assert dec.suffix_cache.stats().tokens == sum(len(t) for t in want)
    # The same prompts again in reverse order: each row drafts from the earlier batch's answers.
    second = dec.generate_batch(prompts[::-1], params, method="suffix", k=8, engine=engine)
    assert [r.token_ids for r in second] == want[::-1]
    steps = [sum(r.stats.verify_steps for r in run) for run in (first, second)]
    assert steps[1] < steps[0]
    # Alone, each request of the second batch decodes the same tokens.
    for prompt, result in zip(prompts[::-1], second, strict=True):
        assert result.token_ids == dec.generate(prompt, params, k=8).token_ids


def test_auto_drafts_with_suffix_trees_and_keeps_greedy_output(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, "auto")
    used: dict[str, int] = {}
    for prompt in PROMPTS[:3] * 2:
        result = dec.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS))
        assert result.token_ids == expected(tiny_qwen2_dir, prompt)
        for source, steps in result.stats.steps_by_source.items():
            used[source] = used.get(source, 0) + steps
    assert used.get("suffix", 0) > 0, used


def test_calibration_follows_measured_acceptance() -> None:
    # Counts promise a sure continuation (1 2 -> 3, three times over); the target always writes
    # a token never seen instead. Counts alone would keep proposing 3 for 27 more rounds (until
    # 3 / (3 + r) < 0.1); the acceptance measured against them stops proposals within ten.
    proposer = SuffixProposer(SuffixCache(max_tokens=0), None, depth=4)
    proposer.start(prompt_len=11)
    proposer.extend([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2])
    rounds = 0
    while proposer.propose(4, tree=False).tokens:
        proposer.extend([1000 + rounds, 1, 2])  # rejected at once
        rounds += 1
        assert rounds <= 10
    assert rounds >= 1


def test_cost_aware_choice_proposes_only_what_pays() -> None:
    history = [1, 2, 3, 4, 5] * 4 + [1, 2, 3]
    cheap_rows = [1.0] * 17  # extra verify rows cost nothing: draft all that is likely
    dear_rows = [1.0] + [10.0] * 16  # one extra row costs ten passes: never draft
    for costs, expect_some in ((cheap_rows, True), (dear_rows, False)):
        proposer = SuffixProposer(SuffixCache(max_tokens=0), None, depth=8, verify_seconds=costs)
        proposer.start(prompt_len=len(history))
        proposer.extend(history)
        assert bool(proposer.propose(8, tree=True).tokens) == expect_some


def test_cli_generate_with_suffix(capsys, tiny_qwen2_dir: Path) -> None:
    base = ["generate", "for i in range(10):\n    print(i)\n", "--target", str(tiny_qwen2_dir), "--dtype", "fp32",
            "--max-new-tokens", "16"]
    assert cli.main(base + ["--method", "suffix", "--k", "4"]) == 0
    out, err = capsys.readouterr()
    assert "method=suffix" in err
    assert cli.main(base + ["--method", "none", "--quiet"]) == 0
    assert capsys.readouterr().out == out


def test_auto_drafts_beyond_k_max_when_a_long_match_makes_it_pay(tiny_qwen2_dir: Path) -> None:
    # The same prompt twice: the second answer repeats the first, which is in the shared tree, so
    # the match grows with every step and, with k "auto", so does the draft, past k_max (model-
    # free: no draft pass per token) up to suffix.AUTO_DEPTH; output still equal to plain decoding.
    # The single-request engine's suffix method (a batch's suffix row is capped at k_max; its
    # auto rows go past it: test_batch_auto.py).
    dec = fresh(tiny_qwen2_dir, k_max=4, engine="single")
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=48)
    want = plain_tokens(tiny_qwen2_dir, prompt, 48)
    assert dec.generate(prompt, params, k="auto").token_ids == want
    again = dec.generate(prompt, params, k="auto")
    assert again.token_ids == want
    accepted = again.stats.accepted_at_position
    assert len(accepted) > 4 and sum(accepted[4:]) > 0, accepted  # tokens accepted past k_max deep
    assert again.stats.verify_steps < 48 / 4


def test_deep_drafts_need_a_long_match_and_cheap_rows() -> None:
    from specdecode.drafters.suffix import AUTO_DEPTH

    history = list(range(100, 140)) + list(range(100, 120))  # a 40-token run, its first 20 repeated
    for costs, most in (([1.0] * (AUTO_DEPTH + 1), AUTO_DEPTH), ([1.0 + 10.0 * r for r in range(AUTO_DEPTH + 1)], 0)):
        proposer = SuffixProposer(SuffixCache(max_tokens=0), None, depth=AUTO_DEPTH, verify_seconds=costs)
        proposer.start(prompt_len=len(history))
        proposer.extend(history)
        drafted = proposer.propose(AUTO_DEPTH, tree=False).tokens
        # at most the match length deep (20 tokens matched: 120..139 follow), none where rows are dear
        assert drafted == (list(range(120, 140)) if most else []), drafted


def test_a_new_request_starts_from_its_groups_calibration() -> None:
    # Requests of group "a" keep drafting 3 after "1 2" and the target keeps writing something
    # else. On llama.cpp-like costs (a 2-row verify costs 1.65 passes) a new request of that
    # group does not pay for the same failed draft again; one of another group, or a private
    # one (group None), still starts from the hopeful prior and drafts.
    cache = SuffixCache(max_tokens=0)  # no responses kept: the calibration memory still is
    costs = [1.0, 1.65, 2.3, 2.9, 3.5]
    history = [7, 1, 2, 3, 8, 1, 2, 3, 9, 1, 2]

    def request(group: str | None) -> SuffixProposer:
        proposer = SuffixProposer(cache, group, depth=4, verify_seconds=costs)
        proposer.start(prompt_len=len(history))
        proposer.extend(history)
        return proposer

    for _ in range(3):
        proposer = request("a")
        for rounds in range(10):
            if not proposer.propose(4, tree=False).tokens:
                break
            proposer.extend([1000 + rounds, 1, 2])  # rejected at once
    assert request("a").propose(4, tree=False).tokens == []
    assert request("b").propose(4, tree=False).tokens == [3]
    assert request(None).propose(4, tree=False).tokens == [3]


def test_auto_drafts_suffix_chains_beyond_k_max(tiny_qwen2_dir: Path) -> None:
    # As above, with the auto method: its suffix source may draft past k_max (prompt lookup and
    # the draft model stay within it), and output stays plain decoding's.
    base = decoder(tiny_qwen2_dir, None, "none")
    dec = SpecDecoder(base.target, None, replace(base.config, method="auto", k_max=4))
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=48)
    want = plain_tokens(tiny_qwen2_dir, prompt, 48)
    assert dec.generate(prompt, params).token_ids == want
    again = dec.generate(prompt, params)
    assert again.token_ids == want
    accepted = again.stats.accepted_at_position
    assert again.stats.steps_by_source.get("suffix", 0) > 0
    assert len(accepted) > 4 and sum(accepted[4:]) > 0, (accepted, again.stats.steps_by_source)
