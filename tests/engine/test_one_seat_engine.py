"""The one-seat batch engine under ``generate`` (engine/one_request.py) at the depth of its own
choices: a fixed k past the decoder's k_max decodes on it (built with a k_max that holds k),
drafting k tokens every step with plain decoding's greedy output, while a request under a
policy gets the decoder's k_max back; ``forget_prefix`` drops the cached prefixes of its pools
(target's and draft model's, torch and llama.cpp) and keeps the engine with its pass costs."""

from pathlib import Path

import pytest
from helpers import PROMPTS

from specdecode import SamplingParams, SpecDecoder
from specdecode.config import MAX_K_MAX
from specdecode.engine.one_request import OneRequestEngine

K_MAX = 4
WIDE_K = 7  # past K_MAX
LONG_PROMPT = " ".join(PROMPTS)  # several full KV blocks of 16 positions: a prefix to cache


def tiny(target: Path, draft: Path | None, **options) -> SpecDecoder:
    return SpecDecoder.from_pretrained(
        str(target),
        str(draft) if draft else None,
        method="draft" if draft else "none",
        draft_confidence=0.0,
        dtype="fp32",
        device="cpu",
        show_progress=False,
        **options,
    )


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> SpecDecoder:
    """engine="auto" (the default: the batch engine) with a small k_max."""
    return tiny(tiny_qwen2_dir, tiny_close_draft_dir, k_max=K_MAX)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_fixed_k_past_k_max_drafts_k_a_step_on_the_batch_engine(dec: SpecDecoder, method: str) -> None:
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = dec.generate(PROMPTS[2], params, method="none").token_ids
    wide = dec.generate(PROMPTS[2], params, method=method, k=WIDE_K)
    assert wide.token_ids == plain  # greedy: lossless at any k
    engine = dec.one_request.engine
    assert engine is not None and engine.k_max >= WIDE_K  # the one-seat engine, not the single one
    stats = wide.stats
    if method == "draft":  # the draft model proposes k every step (no cut-off: draft_confidence=0)
        # but the first (it waits for a row's second token) and the last two (little left)
        assert len(stats.proposed_at_position) == WIDE_K
        assert stats.proposed_at_position[WIDE_K - 1] >= stats.verify_steps - 3
        assert stats.draft_tokens_proposed >= WIDE_K * (stats.verify_steps - 3)
    else:  # a lookup drafts at most k: never past it
        assert len(stats.proposed_at_position) <= WIDE_K


def test_a_fixed_k_past_the_largest_k_max_decodes_too(dec: SpecDecoder) -> None:
    """No bound on a fixed k but the context, as on the single engine: the engine is built with a
    k_max past what a decoder's config may name (MAX_K_MAX)."""
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)  # room for the first step's k
    deep = dec.generate(PROMPTS[3], params, method="draft", k=MAX_K_MAX + 8)
    assert deep.token_ids == dec.generate(PROMPTS[3], params, method="none").token_ids
    assert len(deep.stats.proposed_at_position) == MAX_K_MAX + 8


def test_a_policys_request_gets_the_decoders_k_max_back(dec: SpecDecoder) -> None:
    """After a fixed k past k_max built a wider engine, k "auto" decodes as on one built for it
    (its choice of k ranges over the decoder's k_max), and a fixed k within the wide engine's
    k_max keeps it (a fixed row reads nothing else of k_max)."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    dec.generate(PROMPTS[0], params, method="draft", k=WIDE_K)
    wide = dec.one_request.engine
    assert wide is not None and wide.k_max >= WIDE_K
    dec.generate(PROMPTS[0], params, method="draft", k=WIDE_K - 1)
    assert dec.one_request.engine is wide
    dec.generate(PROMPTS[0], params, method="none")
    assert dec.one_request.engine is wide  # plain rows read no k_max
    auto = dec.generate(PROMPTS[0], params, method="draft", k="auto")
    engine = dec.one_request.engine
    assert engine is not None and engine is not wide and engine.k_max == K_MAX
    assert len(auto.stats.proposed_at_position) <= K_MAX


def test_k_max_for_each_kind_of_row() -> None:
    one = OneRequestEngine(lambda tokens, k_max: None, K_MAX)  # type: ignore[arg-type,return-value]
    assert one.k_max_for("draft", WIDE_K, "fixed") == (WIDE_K, True)
    assert one.k_max_for("draft", 2, "fixed") == (K_MAX, True)
    assert one.k_max_for("draft", WIDE_K, "threshold") == (K_MAX, False)  # its own k moves up to k_max
    assert one.k_max_for("draft", WIDE_K, "cost") == (K_MAX, False)
    assert one.k_max_for("auto", WIDE_K, "fixed") == (K_MAX, False)  # auto chooses its own, up to k_max
    assert one.k_max_for("none", None, "fixed") == (K_MAX, True)


def test_forget_prefix_keeps_the_engine_and_drops_its_cached_prefixes(dec: SpecDecoder) -> None:
    params = SamplingParams(max_new_tokens=10)
    follow = dec.generate(LONG_PROMPT, params, method="draft", k=3)  # fills both pools' caches
    engine = dec.one_request.engine
    assert engine is not None and engine.drafter is not None
    again = dec.generate(LONG_PROMPT, params, method="draft", k=3)
    assert again.stats.cached_tokens > 0  # the cache serves a repeated prompt
    assert engine.target_cache.cached_blocks > 0 and engine.drafter.cache.cached_blocks > 0
    dec.forget_prefix()
    assert engine.target_cache.cached_blocks == 0 and engine.drafter.cache.cached_blocks == 0
    fresh = dec.generate(LONG_PROMPT, params, method="draft", k=3)
    assert fresh.stats.cached_tokens == 0 and fresh.token_ids == follow.token_ids
    assert dec.one_request.engine is engine  # kept: its pools and pass costs too


def test_forget_prefix_on_llamacpp_drops_the_slots_records(tiny_ggufs: dict[str, Path]) -> None:
    pytest.importorskip("llama_cpp")
    dec = SpecDecoder.from_pretrained(
        str(tiny_ggufs["target"]),
        str(tiny_ggufs["close"]),
        method="draft",
        draft_confidence=0.0,
        dtype="fp32",
        device="cpu",
        backend="llama.cpp",
        show_progress=False,
        engine="batch",
    )
    params = SamplingParams(max_new_tokens=8)
    first = dec.generate(LONG_PROMPT, params, k=3)
    assert dec.generate(LONG_PROMPT, params, k=3).stats.cached_tokens > 0
    engine = dec.one_request.engine
    assert engine is not None and engine.drafter is not None
    dec.forget_prefix()
    assert engine.target_cache.cached_blocks == 0 and engine.drafter.cache.cached_blocks == 0
    fresh = dec.generate(LONG_PROMPT, params, k=3)
    assert fresh.stats.cached_tokens == 0 and fresh.token_ids == first.token_ids
    assert dec.one_request.engine is engine
