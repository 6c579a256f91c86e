"""End-to-end decoding on tiny random models: greedy equality and sampled distributions."""

from pathlib import Path

import pytest
import torch
from helpers import (
    CHI2_CRITICAL_P001,
    PROMPTS,
    chi_square,
    decoder,
    install_wrong_residual,
    merged_and_apart,
    plain_tokens,
)
from transformers import AutoModelForCausalLM

from specdecode import SamplingParams


def test_plain_greedy_matches_transformers_generate(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, "none")
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    for prompt in PROMPTS[:4]:
        ids = dec.encode(prompt)
        expected = hf.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=dec.eos_token_ids, pad_token_id=0
        )[0, len(ids) :].tolist()
        assert dec.generate(ids, SamplingParams(max_new_tokens=24)).token_ids == expected


@pytest.mark.parametrize("draft_kind", ["self", "unrelated", "close"])
def test_greedy_speculative_equals_plain_for_every_k(
    draft_kind: str, tiny_qwen2_dir: Path, tiny_draft_dir: Path, tiny_close_draft_dir: Path
) -> None:
    draft = {"self": tiny_qwen2_dir, "unrelated": tiny_draft_dir, "close": tiny_close_draft_dir}[draft_kind]
    dec = decoder(tiny_qwen2_dir, draft)
    accepted = proposed = 0
    for prompt in PROMPTS:
        expected = plain_tokens(tiny_qwen2_dir, prompt)
        for k in range(1, 9):
            result = dec.generate(prompt, SamplingParams(max_new_tokens=24), k=k)
            assert result.token_ids == expected, f"k={k} prompt={prompt!r}"
            accepted += result.stats.draft_tokens_accepted
            proposed += result.stats.draft_tokens_proposed
    rate = accepted / proposed
    # The three drafts must cover the paths: always accepted, mostly rejected, mixed.
    if draft_kind == "self":
        assert rate == 1.0
    elif draft_kind == "unrelated":
        assert rate < 0.2
    else:
        assert 0.2 < rate < 0.95


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_confidence_cutoff_shortens_drafts_and_keeps_output(
    temperature: float, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path
) -> None:
    eager = decoder(tiny_qwen2_dir, tiny_close_draft_dir, draft_confidence=0.0)
    cautious = decoder(tiny_qwen2_dir, tiny_close_draft_dir, draft_confidence=0.9)
    params = SamplingParams(max_new_tokens=24, temperature=temperature, seed=5)
    full = eager.generate(PROMPTS[0], params, k=6)
    short = cautious.generate(PROMPTS[0], params, k=6)
    assert short.stats.draft_tokens_proposed < full.stats.draft_tokens_proposed
    if temperature == 0.0:
        assert short.token_ids == full.token_ids == plain_tokens(tiny_qwen2_dir, PROMPTS[0])


def test_greedy_equality_llama_target(tiny_llama_dir: Path) -> None:
    dec = decoder(tiny_llama_dir, tiny_llama_dir)
    for prompt in PROMPTS[:4]:
        expected = plain_tokens(tiny_llama_dir, prompt)
        assert dec.generate(prompt, SamplingParams(max_new_tokens=24), k=4).token_ids == expected


@pytest.mark.parametrize("engine", ["auto", "single"])
def test_self_draft_tau_counts_bonus_token(tiny_qwen2_dir: Path, engine: str) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_qwen2_dir, engine=engine)
    stats = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=31, ignore_eos=True), k=5).stats
    assert stats.new_tokens == 31
    assert stats.acceptance_rate == 1.0
    assert stats.acceptance_per_position == [1.0] * 5
    if engine == "single":
        # 31 tokens = 5 full steps of 6 (5 accepted + bonus) + 1 step with k=0; the prompt is
        # fed in the first verify pass, no prefill of its own.
        assert stats.tau == pytest.approx(31 / 6) and stats.target_forward_passes == 6
    else:
        # The batch engine's draft model waits for a row's second token: a plain first step
        # (1 token) and 5 full steps of 6, 31 tokens in 6 steps too; its prompt prefilled in a
        # pass of its own first (beside other rows' steps, in a batch).
        assert stats.tau == pytest.approx(31 / 6) and stats.target_forward_passes == 7


def test_plain_decoding_has_tau_one(tiny_qwen2_dir: Path) -> None:
    stats = decoder(tiny_qwen2_dir, None, "none").generate("x", SamplingParams(max_new_tokens=10, ignore_eos=True)).stats
    assert stats.tau == 1.0 and stats.acceptance_rate is None and stats.new_tokens == 10


def test_stop_string_truncates_text(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, "none")
    full = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=24)).text
    stop = full[5:8]
    assert stop and stop in full
    result = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=24, stop=(stop,)))
    assert result.text == full[: full.index(stop)]
    assert result.stats.stop_reason == "stop_string"
    streamed = "".join(dec.stream(PROMPTS[0], SamplingParams(max_new_tokens=24, stop=(stop,))))
    assert streamed == result.text


def test_streaming_concatenates_to_the_full_text(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    stream = dec.stream(PROMPTS[2], SamplingParams(max_new_tokens=30))
    chunks = list(stream)
    assert len(chunks) > 1
    assert "".join(chunks) == stream.result.text


def test_eos_stops_generation(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_qwen2_dir, engine="single")  # its engine's end tokens, patched
    eos = dec.eos_token_ids[0]
    free = dec.generate("x", SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    # Make the target's 4th greedy token an end-of-generation token for this one run.
    dec.engine.eos_token_ids = frozenset({free[3]})
    try:
        result = dec.generate("x", SamplingParams(max_new_tokens=12), k=5)
    finally:
        dec.engine.eos_token_ids = frozenset(dec.eos_token_ids)
    assert result.token_ids == free[: free.index(free[3]) + 1]
    assert result.stats.stop_reason == "eos"
    assert eos in dec.eos_token_ids


@pytest.mark.parametrize("method", ["none", "draft"])
def test_seeded_sampling_is_reproducible(method: str, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir, method)
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=20, seed=1234)
    first = dec.generate(PROMPTS[1], params).token_ids
    assert dec.generate(PROMPTS[1], params).token_ids == first
    other = dec.generate(PROMPTS[1], SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=20, seed=99)).token_ids
    assert other != first


@pytest.fixture(scope="module")
def sampling_setup(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path):
    dec = decoder(tiny_qwen2_dir, tiny_far_draft_dir)
    return dec, dec.encode("def quicksort(arr):")


@pytest.mark.parametrize("draft_confidence", [0.0, 0.5])
def test_speculative_sampling_matches_target_distribution(
    draft_confidence: float, tiny_qwen2_dir: Path, tiny_far_draft_dir: Path
) -> None:
    # 0.5: the draft stops early when unsure, so the draft length depends on the draft's own
    # samples; verification must stay exact.
    dec = decoder(tiny_qwen2_dir, tiny_far_draft_dir, draft_confidence=draft_confidence)
    prompt_ids = dec.encode("def quicksort(arr):")
    stat, df = chi_square(dec, prompt_ids, "draft")
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_distribution_test_catches_wrong_residual(sampling_setup, monkeypatch) -> None:
    dec, prompt_ids = sampling_setup
    install_wrong_residual(monkeypatch)
    stat, df = chi_square(dec, prompt_ids, "draft")
    assert stat > CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}: the test has no power"


def test_the_prompt_is_fed_in_the_first_verify_pass(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    """No prefill pass of its own: the first target pass feeds the whole prompt with the first
    drafts and computes logits for the last prompt token and the drafts only, so the first token
    costs one pass. The output equals a decode that prefills the prompt first (exact in fp32).
    The single-request engine's first pass (on torch the batch engine prefills the prompt in a
    pass of its own; its merged first pass on llama.cpp: test_batch_trace.py)."""
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir, engine="single")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ids = dec.encode(PROMPTS[1])
    for method, k in (("none", None), ("draft", 3), ("ngram", 3)):
        (merged, first), (apart, first_apart) = merged_and_apart(dec, ids, params, method, k)
        assert merged.token_ids == apart.token_ids, method
        start, rows, logit_rows = first
        drafted = rows - len(ids)
        assert (start, logit_rows) == (0, drafted + 1), (method, first)
        assert drafted == 0 if method == "none" else method == "ngram" or drafted == 3, (method, first)
        assert first_apart == (0, len(ids) - 1, 0)  # apart: a prefill without logits first
        assert merged.stats.target_forward_passes == apart.stats.target_forward_passes - 1
        assert merged.stats.prefill_seconds > 0
