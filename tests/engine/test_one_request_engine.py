"""``engine="batch"``: generate and stream on the batch engine holding one request
(engine/one_request.py), the step towards one engine for every path (issue 45). Greedy output
equals the single-request engine's for every chain method (fp32, exact; llama.cpp up to the
first near-tie), a sampled request equals the same request given to a batch engine directly,
a stream closed early aborts its request, a chat's next turn reuses the cached prefix, a
larger request gets a larger pool, and an unknown engine is refused by name; an int8 KV cache
and typical acceptance decode on either (compiled passes: tests/backends/test_compiled.py)."""

from pathlib import Path

import pytest
from helpers import PROMPTS

import specdecode.engine.one_request
from specdecode import SamplingParams, SpecDecoder
from specdecode.config import resolve_engine
from specdecode.engine.metrics import GenerationStats
from specdecode.engine.one_request import MIN_POOL_TOKENS, pool_tokens
from specdecode.errors import InvalidRequestError

CHAIN_METHODS = ("none", "ngram", "draft", "suffix", "auto")


def decoder(target: Path, draft: Path | None, engine: str, **options) -> SpecDecoder:
    return SpecDecoder.from_pretrained(str(target), str(draft) if draft else None, method="draft" if draft else "none",
                                       draft_confidence=0.0, dtype="fp32", device="cpu", show_progress=False,
                                       engine=engine, **options)


@pytest.fixture(scope="module")
def pair(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> tuple[SpecDecoder, SpecDecoder]:
    """(single, batch): the same models on either engine."""
    return (decoder(tiny_qwen2_dir, tiny_close_draft_dir, "single"),
            decoder(tiny_qwen2_dir, tiny_close_draft_dir, "batch"))


@pytest.mark.parametrize("method", CHAIN_METHODS)
def test_greedy_output_equals_the_single_engines(pair: tuple[SpecDecoder, SpecDecoder], method: str) -> None:
    single, batch = pair
    for prompt, n in zip(PROMPTS, (24, 7, 30, 16, 2), strict=False):
        params = SamplingParams(max_new_tokens=n)
        expected = single.generate(prompt, params, method=method)
        got = batch.generate(prompt, params, method=method)
        assert got.token_ids == expected.token_ids and got.text == expected.text, (method, prompt)
        assert got.stats.method == method and got.stats.new_tokens == len(got.token_ids)
    assert batch.one_request.engine is not None  # built once, kept


def test_a_fixed_k_drafts_every_step_as_on_the_single_engine(pair: tuple[SpecDecoder, SpecDecoder]) -> None:
    """A k given alone is fixed on both engines: each step after the first drafts k tokens."""
    _, batch = pair
    stats = batch.generate(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True), method="draft", k=3).stats
    assert len(stats.proposed_at_position) == 3 and stats.proposed_at_position[2] >= stats.verify_steps - 3


def test_a_sampled_request_is_the_batch_engines_own(pair: tuple[SpecDecoder, SpecDecoder]) -> None:
    """The adapter adds nothing to what the batch engine samples: the same seeded request given
    to a batch engine directly gives the same tokens (the batch engine's distribution tests:
    test_batch_engine.py, test_batch_auto.py)."""
    _, batch = pair
    params = SamplingParams(max_new_tokens=24, temperature=0.9, seed=7)
    got = batch.generate(PROMPTS[2], params, method="draft").token_ids
    engine = batch.batch_engine(max_batch=1, kv_cache_tokens=MIN_POOL_TOKENS)
    request_id = engine.add_request(batch.encode(PROMPTS[2]), params, "draft", batch.config.draft_k,
                                    stats=GenerationStats(), k_policy="fixed")
    assert engine.run()[request_id] == got


def test_a_stream_closed_early_aborts_its_request(pair: tuple[SpecDecoder, SpecDecoder]) -> None:
    single, batch = pair
    deltas = iter(batch.stream(PROMPTS[3], SamplingParams(max_new_tokens=30, ignore_eos=True), method="ngram"))
    next(deltas)
    deltas.close()  # as a caller that stops reading does
    engine = batch.one_request.engine
    assert engine is not None and not engine.has_unfinished
    pool = engine.target_cache
    assert not pool.tables  # its blocks went back (cached, for the prefix cache)
    params = SamplingParams(max_new_tokens=12)
    assert batch.generate(PROMPTS[1], params).token_ids == single.generate(PROMPTS[1], params).token_ids


def test_a_chats_next_turn_reuses_the_cached_prefix(pair: tuple[SpecDecoder, SpecDecoder]) -> None:
    _, batch = pair
    batch.forget_prefix()
    first = batch.generate(PROMPTS[0], SamplingParams(max_new_tokens=16), method="none")
    follow_up = batch.encode(PROMPTS[0]) + first.token_ids + batch.encode(" and then")
    second = batch.generate(follow_up, SamplingParams(max_new_tokens=8), method="none")
    assert first.stats.cached_tokens == 0 and second.stats.cached_tokens > 0


def test_a_request_larger_than_the_pool_gets_a_larger_one(pair: tuple[SpecDecoder, SpecDecoder], tiny_qwen2_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    single, _ = pair
    monkeypatch.setattr(specdecode.engine.one_request, "MIN_POOL_TOKENS", 64)
    monkeypatch.setattr(specdecode.engine.one_request, "STEP_SLOTS", 16)
    batch = decoder(tiny_qwen2_dir, None, "batch")  # no engine yet: the first gets the patched minimum
    small = SamplingParams(max_new_tokens=4)
    batch.generate(PROMPTS[4], small)
    engine = batch.one_request.engine
    large = SamplingParams(max_new_tokens=60)
    assert batch.generate(PROMPTS[2], large).token_ids == single.generate(PROMPTS[2], large).token_ids
    assert batch.one_request.engine is not engine
    assert pool_tokens(65) == 128 and pool_tokens(1) == 64  # the patched minimum


def test_an_unknown_engine_and_typical_acceptance_for_a_chain_are_refused(
        tiny_qwen2_dir: Path, pair: tuple[SpecDecoder, SpecDecoder]) -> None:
    # compile= runs on the batch engine too (tests/backends/test_compiled.py): nothing is left
    # that only the single engine runs.
    with pytest.raises(InvalidRequestError, match="engine="):
        decoder(tiny_qwen2_dir, None, "fastest")
    _, batch = pair
    with pytest.raises(InvalidRequestError, match="typical"):
        batch.generate(PROMPTS[0], SamplingParams(max_new_tokens=4), method="none", acceptance="typical")


def test_llamacpp_greedy_output_equals_the_single_engines_up_to_a_near_tie(tiny_ggufs: dict[str, Path]) -> None:
    pytest.importorskip("llama_cpp")
    from helpers import assert_greedy_equal_up_to_near_tie, greedy_margins, llamacpp_decoder

    single = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"], engine="single")
    batch = SpecDecoder.from_pretrained(str(tiny_ggufs["target"]), str(tiny_ggufs["close"]), method="draft",
                                        draft_confidence=0.0, dtype="fp32", device="cpu", backend="llama.cpp",
                                        show_progress=False, engine="batch")
    on_torch = llamacpp_decoder(tiny_ggufs["target"], None, backend="torch")
    compared = total = 0
    for method in CHAIN_METHODS:
        for prompt in PROMPTS[:3]:
            params = SamplingParams(max_new_tokens=16)
            alone = single.generate(prompt, params, method="none").token_ids
            margins = greedy_margins(on_torch, on_torch.encode(prompt), alone)
            compared += assert_greedy_equal_up_to_near_tie(batch.generate(prompt, params, method=method).token_ids,
                                                           alone, margins, f"{method} {prompt!r}")
            total += len(alone)
    assert compared >= total * 3 // 4


def test_auto_takes_the_batch_engine() -> None:
    assert resolve_engine("auto") == "batch"  # compiled passes too (tests/backends/test_compiled.py)
    assert resolve_engine("single") == "single"
    with pytest.raises(InvalidRequestError, match="is not one of"):
        resolve_engine("one")


def test_an_int8_kv_cache_decodes_on_the_batch_engine_as_on_the_single(tiny_qwen2_dir: Path,
                                                                      tiny_close_draft_dir: Path) -> None:
    """kv_dtype="int8" runs on the batch engine's paged pools (kv/paged.py), quantized as the
    single engine's cache is (the same K/V; logits within ~1e-5, kv/test_paged_int8.py): greedy
    output equal on prompts without near-ties, and different from the unquantized cache's
    somewhere (it is quantized)."""
    single = decoder(tiny_qwen2_dir, tiny_close_draft_dir, "single", kv_dtype="int8", backend="torch")
    batch = decoder(tiny_qwen2_dir, tiny_close_draft_dir, "auto", kv_dtype="int8", backend="torch")
    for method in ("none", "draft", "ngram"):
        for prompt in PROMPTS[:3]:
            params = SamplingParams(max_new_tokens=16)
            got = batch.generate(prompt, params, method=method)
            assert got.token_ids == single.generate(prompt, params, method=method).token_ids, (method, prompt)
    assert batch.one_request.engine is not None and single.one_request.engine is None


def test_one_request_at_a_time_and_a_fixed_k_past_k_max(pair: tuple[SpecDecoder, SpecDecoder],
                                                        tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    """A second stream while one is open is refused by name (it would step the same engine and
    pools), as is forget_prefix, and the first still ends as alone; a fixed k past k_max decodes on the one-seat
    batch engine (built with a k_max that holds it) with the single engine's greedy tokens."""
    single, batch = pair
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    first = batch.stream(PROMPTS[0], params, method="draft", k=3)
    pieces = iter(first)
    next(pieces)
    with pytest.raises(InvalidRequestError, match="already decoding a request"):
        batch.generate(PROMPTS[1], params)
    with pytest.raises(InvalidRequestError, match="while a request decodes"):  # the pools are in use
        batch.forget_prefix()
    rest = list(pieces)
    assert first.result is not None and first.result.token_ids == single.generate(PROMPTS[0], params).token_ids
    assert rest and batch.generate(PROMPTS[1], params).token_ids == single.generate(PROMPTS[1], params).token_ids
    auto = decoder(tiny_qwen2_dir, tiny_close_draft_dir, "auto", k_max=4)
    wide = auto.generate(PROMPTS[2], params, method="draft", k=6)
    assert wide.token_ids == single.generate(PROMPTS[2], params, method="draft", k=6).token_ids
    assert wide.stats.proposed_at_position[5] > 0  # six deep, as the single engine's steps
    assert auto.one_request.engine is not None and auto.one_request.engine.k_max >= 6
