"""n samples of one prompt (parallel sampling): the samples after the first start from the
first's prompt K/V (a fork of its blocks on torch, a copy of its slot on llama.cpp) instead of
prefilling; sample i is seeded with seed + i, so it equals the request with n = 1 and that seed,
token for token (fp32 torch: exact, sampled or greedy), whatever the batch around it."""

from pathlib import Path

import pytest
from helpers import assert_greedy_equal_up_to_near_tie, decoder, greedy_margins, small_batch_engine

from specdecode import SamplingParams, SpecDecoder
from specdecode.config import MAX_CHOICES
from specdecode.engine.batch import BatchEngine
from specdecode.errors import InvalidRequestError

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1234, ignore_eos=True)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> SpecDecoder:
    return decoder(tiny_qwen2_dir, tiny_close_draft_dir)


def engine(dec: SpecDecoder, **kwargs) -> BatchEngine:
    return small_batch_engine(dec, **{"kv_cache_tokens": 2048} | kwargs)


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_each_sample_equals_the_single_request_with_its_seed(dec: SpecDecoder, method: str) -> None:
    prompt = "Write a function that merges two sorted lists."
    samples = dec.generate_batch([prompt], SAMPLED, method=method, k=3, engine=engine(dec), n=4)
    alone = [dec.generate_batch([prompt], SAMPLED.for_choice(i), method=method, k=3, engine=engine(dec))[0]
             for i in range(4)]
    assert [s.token_ids for s in samples] == [a.token_ids for a in alone]
    assert len({tuple(s.token_ids) for s in samples}) > 1, "four seeded samples should not all be equal"
    prompt_len = samples[0].stats.prompt_tokens
    # The first sample prefilled the prompt; the others started from its K/V.
    assert samples[0].stats.cached_tokens == 0
    assert [s.stats.cached_tokens for s in samples[1:]] == [prompt_len - 1] * 3


def test_greedy_samples_are_the_greedy_output(dec: SpecDecoder) -> None:
    prompts = ["def quicksort(arr):", "The quick brown fox"]
    samples = dec.generate_batch(prompts, GREEDY, method="draft", k=3, engine=engine(dec, prefix_cache=False), n=3)
    plain = [dec.generate(p, GREEDY, method="none").token_ids for p in prompts]
    assert [s.token_ids for s in samples] == [plain[0]] * 3 + [plain[1]] * 3  # prompt-major


def test_forks_prefill_the_prompt_once(dec: SpecDecoder) -> None:
    """Target tokens computed for the prompt: once with n = 4, four times without forks (the
    prefix cache off, so nothing else shares it)."""
    prompt = dec.encode("Summarize: the meeting covered budgets, hiring and the road map. " * 3)
    counted = []
    for n in (4, 1):
        eng = engine(dec, prefix_cache=False)
        fed = []
        real = eng.target.forward

        def forward(seqs, inputs, starts, logits="all", logit_rows=None, real=real, fed=fed):
            fed.append(sum(x.shape[0] for x in inputs) if logits == "none" else 0)  # prefill passes only
            return real(seqs, inputs, starts, logits, logit_rows)

        eng.target.forward = forward
        dec.generate_batch([prompt] * (4 // n), SAMPLED, method="none", engine=eng, n=n)
        counted.append(sum(fed))
    assert counted == [len(prompt) - 1, 4 * (len(prompt) - 1)]


def test_a_shared_block_is_never_written_and_the_pool_ends_empty(dec: SpecDecoder) -> None:
    """Forks end inside a partly filled block (prompt lengths not a multiple of 4); the paged
    view asserts on every pass that no shared or registered block is written."""
    eng = engine(dec)
    for text in ("x", "def add(a, b):", "import numpy as np\n\nclass Counter:"):
        dec.generate_batch([text], SAMPLED, method="draft", k=3, engine=eng, n=4)
    pool = eng.target_cache
    assert not pool.tables and pool.free_blocks == pool.usable_blocks
    assert not eng.drafter.cache.tables


def test_n_is_validated(dec: SpecDecoder) -> None:
    for bad in (0, MAX_CHOICES + 1, True, 2.0):
        with pytest.raises(InvalidRequestError, match="n \\(samples per prompt\\)"):
            dec.generate_batch(["x"], SAMPLED, method="none", engine=engine(dec), n=bad)


def test_a_fork_needs_the_same_prompt(dec: SpecDecoder) -> None:
    eng = engine(dec)
    first = eng.add_request(dec.encode("def f():"), SAMPLED, "none")
    with pytest.raises(InvalidRequestError, match="can fork only"):
        eng.add_request(dec.encode("def g():"), SAMPLED, "none", fork_of=first)


def test_llamacpp_samples_start_from_a_copied_slot(tiny_ggufs: dict[str, Path]) -> None:
    dec = SpecDecoder.from_pretrained(str(tiny_ggufs["target"]), str(tiny_ggufs["close"]), method="draft",
                                      backend="llama.cpp", show_progress=False)
    eng = dec.batch_engine(max_batch=4, kv_cache_tokens=1024, cost_aware=False)
    prompt = dec.encode("import numpy as np\n\nclass Counter:")
    samples = dec.generate_batch([prompt], GREEDY, method="draft", k=3, engine=eng, n=3)
    want = dec.generate(prompt, GREEDY, method="none").token_ids
    margins = greedy_margins(dec, prompt, want)
    for i, sample in enumerate(samples):
        compared = assert_greedy_equal_up_to_near_tie(sample.token_ids, want, margins, f"llama.cpp sample {i}")
        assert compared >= len(want) // 2
    assert [s.stats.cached_tokens for s in samples] == [0, len(prompt) - 1, len(prompt) - 1]
