"""The auto method: the source chooser on synthetic costs, and that any mix of lookup, draft
model and plain steps keeps greedy output and the sampled distribution exact."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import CHI2_CRITICAL_P001, PROMPTS, chi_square, copyable_prompt, decoder, plain_tokens

from specdecode import SamplingParams
from specdecode.drafters.auto import CATCH_UP_HORIZON, DRAFT_RETRY_AFTER, PRIOR_GAIN, AutoDrafter, LookupMemory
from specdecode.drafters.ngram import NgramDrafter
from specdecode.errors import InvalidRequestError

# A bandwidth-bound CPU: a verify pass over r rows costs 1 + 0.1 (r - 1) units; a draft pass
# costs 0.35 (the demo pair's ratio), and catching the draft model up 0.035 per token (the
# demo draft's prefill per token against one target pass, measured on this machine).
FLAT_VERIFY = [1.0 + 0.1 * r for r in range(9)]
CATCH_UP_PER_TOKEN = 0.035


def chooser(draft_cached_len: int | None = 0, capacity: int = 1000, verify: list[float] = FLAT_VERIFY) -> AutoDrafter:
    """An AutoDrafter whose draft model is a stand-in that has read ``draft_cached_len`` tokens."""
    draft = None if draft_cached_len is None else SimpleNamespace(cached_len=draft_cached_len)
    auto = AutoDrafter(NgramDrafter(), draft, verify, k_max=8, draft_k=5, draft_token_seconds=CATCH_UP_PER_TOKEN)
    auto._capacity = capacity
    return auto


def observe(auto: AutoDrafter, source: str, proposed: int, accepted: int, times: int = 1, match_size: int = 3) -> None:
    draft_seconds = 0.35 * proposed if source == "draft" else 0.0
    for _ in range(times):
        auto.source, auto._match_size, auto._catch_up = source, match_size, 1
        auto.observe(proposed, accepted, draft_seconds, proposed, auto.verify_seconds[proposed])


def test_untried_sources_are_tried() -> None:
    # Both start from the hopeful prior (PRIOR_GAIN x plain): a lookup match is free, so it goes first.
    assert chooser(draft_cached_len=100).plan(100, 8, lookup_tokens=3, match_size=2) == ("ngram", 3)
    assert chooser(draft_cached_len=100).plan(100, 8, lookup_tokens=0, match_size=0) == ("draft", 5)
    assert chooser(draft_cached_len=None).plan(100, 8, lookup_tokens=0, match_size=0) == ("none", 0)
    assert PRIOR_GAIN > 1


def test_lookup_wins_when_its_matches_are_accepted() -> None:
    auto = chooser(draft_cached_len=100)
    observe(auto, "ngram", 4, 4, times=5)  # 5 tokens per 1.4 units: 3.6x plain
    observe(auto, "draft", 5, 2, times=5)  # 3 tokens per 3.25 units: 0.9x plain
    assert auto.plan(100, 8, lookup_tokens=6, match_size=3) == ("ngram", 6)
    # No match this step, and the draft model measured slower than plain: decode plainly.
    assert auto.plan(100, 8, lookup_tokens=0, match_size=0) == ("none", 0)


def test_draft_model_wins_where_it_measured_fastest() -> None:
    auto = chooser(draft_cached_len=100)
    observe(auto, "draft", 5, 5, times=5)  # 6 tokens per 3.25 units: 1.8x plain
    observe(auto, "ngram", 2, 0, times=5, match_size=1)  # 1 token per 1.2 units
    assert auto.plan(100, 8, lookup_tokens=2, match_size=1) == ("draft", 5)
    assert auto.plan(100, 3, lookup_tokens=0, match_size=0) == ("draft", 3)  # the engine's limit holds


def test_lookup_that_is_always_rejected_gives_way() -> None:
    auto = chooser(draft_cached_len=None)  # no draft model: lookup or plain
    observe(auto, "ngram", 1, 0, times=40, match_size=1)
    assert auto.plan(100, 8, lookup_tokens=1, match_size=1) == ("none", 0)
    # Another match length has its own estimate (still the prior).
    assert auto.plan(100, 8, lookup_tokens=1, match_size=3)[0] == "ngram"


def test_a_lookup_that_lost_in_earlier_requests_is_not_relearnt_in_each() -> None:
    # Extra verify rows cost whole passes (llama.cpp on 2 cores): a rejected 1-token lookup
    # costs 2 units for 1 token. The first request learns that by losing steps; the next
    # requests of the same decoder (one memory) do not try that match size, until the old
    # evidence fades and it is measured once more. A match size that paid keeps the hopeful prior.
    compute_bound = [float(rows) for rows in range(1, 10)]
    memory = LookupMemory()

    def request() -> AutoDrafter:
        auto = AutoDrafter(NgramDrafter(), None, compute_bound, k_max=8, memory=memory)
        auto._capacity = 1000
        memory.start_request()  # what start() does for each request
        return auto

    first = request()
    losses = 0
    while first.plan(100, 8, lookup_tokens=1, match_size=1) == ("ngram", 1):
        observe(first, "ngram", 1, 0, match_size=1)
        observe(first, "ngram", 4, 4, match_size=3)  # another match size pays
        losses += 1
    assert losses >= 2  # learnt by losing, as without memory
    tried_later = []
    for _ in range(8):
        auto = request()
        tried_later.append(auto.plan(100, 8, lookup_tokens=1, match_size=1)[0] == "ngram")
        if tried_later[-1]:
            observe(auto, "ngram", 1, 0, match_size=1)  # and loses again
        assert auto.plan(100, 8, lookup_tokens=4, match_size=3)[0] == "ngram"
    assert not tried_later[0] and 1 <= sum(tried_later) <= 3, tried_later
    # Without the memory every request starts hopeful and pays the losses again.
    fresh = AutoDrafter(NgramDrafter(), None, compute_bound, k_max=8)
    assert fresh.plan(100, 8, lookup_tokens=1, match_size=1) == ("ngram", 1)


def test_long_prompts_keep_their_own_lookup_memory() -> None:
    """Lookups that lost on short prompts do not hold back a request with a long prompt (a
    document to copy from), and the reverse: the memory is kept per prompt-length class."""
    from specdecode.drafters.auto import LONG_PROMPT_TOKENS

    compute_bound = [float(rows) for rows in range(1, 10)]
    memory = LookupMemory()

    def request(prompt_len: int) -> AutoDrafter:
        auto = AutoDrafter(NgramDrafter(), None, compute_bound, k_max=8, memory=memory)
        auto.start(prompt_len, prompt_len + 200)
        return auto

    short = request(40)
    while short.plan(100, 8, lookup_tokens=1, match_size=1) == ("ngram", 1):
        observe(short, "ngram", 1, 0, match_size=1)  # loses on short prompts
    assert request(40).plan(100, 8, lookup_tokens=1, match_size=1)[0] == "none"  # remembered
    assert request(LONG_PROMPT_TOKENS).plan(1000, 8, lookup_tokens=1, match_size=1) == ("ngram", 1)  # hopeful


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
    assert auto.plan(50, 8, 4, 3)[0] == "ngram"


def cycle_sources(pattern: list[tuple[str, int]]):
    """A plan that ignores costs and follows ``pattern`` by committed length: it depends only on
    the past, so decoding must stay lossless whatever the pattern is."""

    def plan(self: AutoDrafter, length: int, num_tokens: int, lookup_tokens: int, match_size: int, suffix_tokens: int = 0,
             suffix_bucket: int = 0) -> tuple[str, int]:
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
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir, method="auto")
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
    dec = decoder(tiny_qwen2_dir, tiny_far_draft_dir, method="auto")
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
        assert auto.plan(100, 8, lookup_tokens=0, match_size=0) == ("none", 0)
        auto.observe(0, 0, 0.0, 0, 1.0)
    cheap = AutoDrafter(NgramDrafter(), SimpleNamespace(cached_len=0), FLAT_VERIFY, k_max=8, draft_k=5,
                        draft_pass_seconds=0.5)
    assert cheap.draft_can_pay
