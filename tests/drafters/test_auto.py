"""The auto method: the source chooser on synthetic costs, and that any mix of lookup, draft
model and plain steps keeps greedy output and the sampled distribution exact."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import CHI2_CRITICAL_P001, PROMPTS, chi_square, copyable_prompt, decoder, plain_tokens

from specdecode import SamplingParams
from specdecode.drafters.auto import (
    AFTER_AGREEMENT,
    AFTER_MISS,
    CATCH_UP_HORIZON,
    DRAFT_RETRY_AFTER,
    PRIOR_GAIN,
    AutoDrafter,
    LookupAgreement,
)
from specdecode.drafters.ngram import NgramDrafter
from specdecode.errors import InvalidRequestError

# A bandwidth-bound CPU: a verify pass over r rows costs 1 + 0.1 (r - 1) units; a draft pass
# costs 0.35 (the demo pair's ratio), and catching the draft model up 0.035 per token (the
# demo draft's prefill per token against one target pass, measured on this machine).
FLAT_VERIFY = [1.0 + 0.1 * r for r in range(9)]
CATCH_UP_PER_TOKEN = 0.035
# A compute-bound CPU (llama.cpp on 2 AVX2 cores, the bench's measured table in one-row passes):
# a second row costs almost a whole pass, so a lookup pays only where it is nearly sure.
STEEP_VERIFY = [1.0, 1.96, 2.42, 2.88, 3.5, 4.12, 5.92, 7.73, 7.78]


def chooser(draft_cached_len: int | None = 0, capacity: int = 1000, verify: list[float] = FLAT_VERIFY) -> AutoDrafter:
    """An AutoDrafter whose draft model is a stand-in that has read ``draft_cached_len`` tokens."""
    draft = None if draft_cached_len is None else SimpleNamespace(cached_len=draft_cached_len)
    auto = AutoDrafter(NgramDrafter(), draft, verify, k_max=8, draft_k=5, draft_token_seconds=CATCH_UP_PER_TOKEN)
    auto._capacity = capacity
    return auto


def observe(auto: AutoDrafter, source: str, proposed: int, accepted: int, times: int = 1) -> None:
    draft_seconds = 0.35 * proposed if source == "draft" else 0.0
    for _ in range(times):
        auto.source, auto._catch_up = source, 1
        auto.observe(proposed, accepted, draft_seconds, proposed, auto.verify_seconds[proposed])


def agree(auto: AutoDrafter, source: str, offered: list[int], emitted: list[int], times: int = 1) -> None:
    """``source`` offered ``offered`` and the target then emitted ``emitted``, ``times`` over."""
    for _ in range(times):
        auto.agreement[source].offer(offered)
        auto.agreement[source].score(emitted)


def test_untried_sources_are_tried() -> None:
    # A lookup starts from the acceptance prior (0.6 per token), which pays where verify rows are
    # cheap; the draft model from the hopeful goodput prior (PRIOR_GAIN x plain).
    assert chooser(draft_cached_len=100).plan(100, 8, lookup_tokens=3) == ("ngram", 3)
    assert chooser(draft_cached_len=100).plan(100, 8, lookup_tokens=0) == ("draft", 5)
    assert chooser(draft_cached_len=None).plan(100, 8, lookup_tokens=0) == ("none", 0)
    assert PRIOR_GAIN > 1


def test_lookup_wins_when_its_matches_are_accepted() -> None:
    auto = chooser(draft_cached_len=100)
    agree(auto, "ngram", [1, 2, 3, 4], [1, 2, 3, 4, 5], times=5)  # whole offers emitted
    observe(auto, "draft", 5, 2, times=5)  # 3 tokens per 3.25 units: 0.9x plain
    assert auto.plan(100, 8, lookup_tokens=6) == ("ngram", 6)
    # No match this step, and the draft model measured slower than plain: decode plainly.
    assert auto.plan(100, 8, lookup_tokens=0) == ("none", 0)


def test_draft_model_wins_where_it_measured_fastest() -> None:
    auto = chooser(draft_cached_len=100)
    observe(auto, "draft", 5, 5, times=5)  # 6 tokens per 3.25 units: 1.8x plain
    agree(auto, "ngram", [1, 2], [9], times=5)  # the lookup's first token was wrong every time
    assert auto.plan(100, 8, lookup_tokens=2) == ("draft", 5)
    assert auto.plan(100, 3, lookup_tokens=0) == ("draft", 3)  # the engine's limit holds


def test_lookup_that_is_always_rejected_gives_way() -> None:
    auto = chooser(draft_cached_len=None)  # no draft model: lookup or plain
    agree(auto, "suffix", [7, 8, 9], [1], times=40)  # its first token wrong every time
    assert auto.plan(100, 8, lookup_tokens=0, suffix_tokens=3) == ("none", 0)
    # The other source has its own score (still the prior).
    assert auto.plan(100, 8, lookup_tokens=3)[0] == "ngram"


def test_agreement_is_scored_per_state_on_what_was_emitted() -> None:
    scores = LookupAgreement()
    scores.offer([1, 2, 3])
    scores.score([1])  # a plain step: only the first token is checked
    assert scores.state == AFTER_AGREEMENT
    assert (scores.rates[AFTER_MISS].trials, scores.rates[AFTER_MISS].accepted) == (1, 1)
    scores.offer([4, 5, 6])
    scores.score([4, 5, 0, 7])  # two right, the third wrong: scored in the after-agreement state
    assert scores.state == AFTER_MISS
    assert (scores.rates[AFTER_AGREEMENT].trials, scores.rates[AFTER_AGREEMENT].accepted) == (3, 2)
    scores.offer([])  # no match: nothing scored, and no agreement to carry
    scores.score([8])
    assert scores.state == AFTER_MISS and scores.rates[AFTER_MISS].trials < 1.5


def test_a_lookup_is_learnt_from_plain_steps_and_drafts_inside_a_copy() -> None:
    # Where a second verify row costs almost a pass, the prior's 0.6 does not pay: auto decodes
    # plainly, but each plain step still checks the lookup's first offered token. Once the
    # offers keep agreeing (a copy), the lookup drafts without having had to lose steps to
    # learn it; after a miss the after-miss score prices it again, and it stands down.
    auto = chooser(draft_cached_len=None, verify=STEEP_VERIFY)
    assert auto.plan(100, 8, lookup_tokens=4) == ("none", 0)
    for token in range(10):  # plain steps, each the token the lookup offered first
        agree(auto, "ngram", [token, token + 1, token + 2, token + 3], [token])
    source, k = auto.plan(100, 8, lookup_tokens=4)
    assert source == "ngram" and k >= 2
    agree(auto, "ngram", [1, 2, 3], [9])  # the copy ends
    assert auto.plan(100, 8, lookup_tokens=4) == ("none", 0)


def test_draft_catch_up_must_pay_within_the_horizon() -> None:
    # 700 prompt tokens the draft model has not read cost 24.4 units; spread over 64 tokens
    # that is 0.38 per token on top of the prior's 0.8: slower than plain.
    long_prompt = chooser(draft_cached_len=0, capacity=700 + 128 + 1)
    assert long_prompt.plan(700, 8, 0, 0) == ("none", 0)
    # The same catch-up on a 40-token prompt (1.3 units / 64) pays.
    short_prompt = chooser(draft_cached_len=0, capacity=40 + 128 + 1)
    assert short_prompt.plan(40, 8, 0, 0)[0] == "draft"
    # ... unless almost nothing is left to generate, which shortens the horizon.
    ending = chooser(draft_cached_len=0, capacity=40 + 128 + 1)
    assert ending.plan(40 + 124, 3, 0, 0) == ("none", 0)
    assert CATCH_UP_HORIZON < 128


def test_failing_draft_goes_plain_then_probes_again() -> None:
    auto = chooser(draft_cached_len=50)
    auto._draft_used = True
    observe(auto, "draft", 3, 0, times=10)
    assert auto.plan(50, 8, 0, 0) == ("none", 0)
    for _ in range(DRAFT_RETRY_AFTER):
        auto.source = "none"
        auto.observe(0, 0, 0.0, 0, FLAT_VERIFY[0])
    assert auto.plan(50, 8, 0, 0) == ("draft", 5)
    # A lookup match is not interrupted by the probe.
    assert auto.plan(50, 8, 4)[0] == "ngram"


def cycle_sources(pattern: list[tuple[str, int]]):
    """A plan that ignores costs and follows ``pattern`` by committed length: it depends only on
    the past, so decoding must stay lossless whatever the pattern is."""

    def plan(self: AutoDrafter, length: int, num_tokens: int, lookup_tokens: int, suffix_tokens: int = 0) -> tuple[str, int]:
        source, k = pattern[length % len(pattern)]
        found = {"ngram": lookup_tokens, "suffix": suffix_tokens}
        if source in found:
            return (source, min(k, found[source])) if found[source] else ("none", 0)
        return source, min(k, num_tokens)

    return plan


MIXES = {
    "draft-none-ngram": [("draft", 3), ("none", 0), ("ngram", 4)],
    "ngram-draft": [("ngram", 2), ("draft", 2), ("draft", 5)],
    "mostly-plain": [("none", 0), ("none", 0), ("none", 0), ("draft", 4)],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_forced_source_mix_keeps_greedy_output(
    mix: str, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The draft model is skipped for runs of steps and must catch up on what it missed; its
    # cache must stay consistent through that.
    monkeypatch.setattr(AutoDrafter, "plan", cycle_sources(MIXES[mix]))
    # The single-request engine's AutoDrafter (a batch row's sources: test_batch_auto.py).
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir, method="auto", engine="single")
    used: dict[str, int] = {}
    for prompt in PROMPTS[:5]:
        result = dec.generate(prompt, SamplingParams(max_new_tokens=24))
        assert result.token_ids == plain_tokens(tiny_qwen2_dir, prompt), prompt
        for source, steps in result.stats.steps_by_source.items():
            used[source] = used.get(source, 0) + steps
    assert used.get("draft", 0) > 0 and used.get("none", 0) > 0


def test_auto_greedy_equals_plain(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir, method="auto")
    for prompt in PROMPTS[:4]:
        result = dec.generate(prompt, SamplingParams(max_new_tokens=24))
        assert result.token_ids == plain_tokens(tiny_qwen2_dir, prompt), prompt
        assert sum(result.stats.steps_by_source.values()) == result.stats.verify_steps


def test_auto_without_draft_model_uses_lookup(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, method="auto")
    prompt_ids = copyable_prompt(dec)
    result = dec.generate(prompt_ids, SamplingParams(max_new_tokens=16))
    assert result.token_ids == plain_tokens(tiny_qwen2_dir, prompt_ids, 16)
    assert result.stats.draft_forward_passes == 0
    assert set(result.stats.steps_by_source) <= {"ngram", "suffix", "none"}


def test_mixed_sources_sample_the_target_distribution(
    tiny_qwen2_dir: Path, tiny_far_draft_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # test_engine's chi-square (1,500 seeded 3-token generations, p = 0.001) with steps that
    # alternate between the draft model (sampled q), the lookup (one-hot q) and plain decoding
    # depending on how many tokens were accepted so far.
    dec = decoder(tiny_qwen2_dir, tiny_far_draft_dir, method="auto", engine="single")  # AutoDrafter's steps
    prompt_ids = copyable_prompt(dec)  # its first lookup finds a match
    pattern: list[tuple[str, int]] = [("none", 0)] * 3
    pattern[len(prompt_ids) % 3], pattern[(len(prompt_ids) + 1) % 3] = ("ngram", 2), ("draft", 2)
    monkeypatch.setattr(AutoDrafter, "plan", cycle_sources(pattern))
    used: dict[str, int] = {}
    for seed in range(40):
        params = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=3, seed=seed, ignore_eos=True)
        for source, steps in dec.generate(prompt_ids, params).stats.steps_by_source.items():
            used[source] = used.get(source, 0) + steps
    assert all(used.get(source, 0) > 0 for source in ("draft", "ngram", "none")), used
    stat, df = chi_square(dec, prompt_ids, "auto")
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_cli_method_auto(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, capsys) -> None:
    from specdecode import cli

    base = ["generate", "--target", str(tiny_qwen2_dir), "--draft", str(tiny_close_draft_dir), "--dtype", "fp32",
            "--device", "cpu", "--max-new-tokens", "8", "def f():"]
    assert cli.main(base + ["--method", "auto", "--k-max", "4"]) == 0
    assert "steps by source:" in capsys.readouterr().err


def test_bench_label_auto() -> None:
    from specdecode.bench.methods import parse_method, uses_draft_model

    assert parse_method("auto").base == "auto" and uses_draft_model("auto")
    assert parse_method("auto:3").k == 3  # the draft model's k within auto
    with pytest.raises(InvalidRequestError, match="chooses its own"):
        parse_method("auto:auto")



def test_a_draft_model_that_cannot_pay_even_at_full_acceptance_is_never_tried() -> None:
    # Every verify row costs a whole pass (a compute-bound target) and a draft pass half one:
    # k accepted drafts cost more than the k plain steps they save, so only lookup and plain
    # decoding compete, and the draft model is not probed after plain steps either.
    compute_bound = [float(rows) for rows in range(1, 10)]
    auto = AutoDrafter(NgramDrafter(), SimpleNamespace(cached_len=0), compute_bound, k_max=8, draft_k=5,
                       draft_pass_seconds=0.5)
    auto._capacity = 1000
    assert not auto.draft_can_pay
    for _ in range(20):
        assert auto.plan(100, 8, lookup_tokens=0) == ("none", 0)
        auto.observe(0, 0, 0.0, 0, 1.0)
    cheap = AutoDrafter(NgramDrafter(), SimpleNamespace(cached_len=0), FLAT_VERIFY, k_max=8, draft_k=5,
                        draft_pass_seconds=0.5)
    assert cheap.draft_can_pay


def test_live_steps_keep_the_cost_tables_shape() -> None:
    # Plain steps inflate the measured one-row cost; drafting rows, never run, must not look
    # cheaper against it than at start-up (per-row blending did that, and auto over-drafted).
    auto = chooser(draft_cached_len=None, verify=list(STEEP_VERIFY))
    for _ in range(40):
        auto.source = "none"
        auto.observe(0, 0, 0.0, 0, 1.2)
    assert auto.verify_seconds[0] == pytest.approx(1.2, rel=1e-3)
    assert [c / auto.verify_seconds[0] for c in auto.verify_seconds] == pytest.approx(STEEP_VERIFY)
