"""Logprobs (core/logprobs.py): read off the verify rows, equal to plain decoding's.

- plain decoding's logprobs are the target's own log-softmax at each position (teacher-forced
  reference), with the top tokens sorted, most likely first;
- under every method (draft, ngram, suffix, medusa on the single path; draft, ngram in the
  batch engine) each token's logprob and top logprobs equal plain decoding's for the same
  tokens: fp32 torch, to 1e-4 (a verify pass over k + 1 rows may round in the last bits
  differently from a one-row pass; the ids must be equal);
- "processed" logprobs are the distribution sampled from (temperature, top-k, penalties);
- one per kept token, a stop string included.
"""

from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, copyable_prompt, decoder, last_logits

from specdecode import SamplingParams
from specdecode.core.logprobs import MIN_LOGPROB
from specdecode.core.sampling import LogitsProcessor

TOL = 1e-4


def assert_same_logprobs(actual, expected, context: str) -> None:
    assert len(actual) == len(expected), context
    for i, (got, want) in enumerate(zip(actual, expected, strict=True)):
        assert got.token == want.token, f"{context}: token {i}"
        assert got.logprob == pytest.approx(want.logprob, abs=TOL), f"{context}: token {i}"
        assert [t for t, _ in got.top] == [t for t, _ in want.top], f"{context}: top ids at {i}"
        assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=TOL), f"{context}: top at {i}"


def test_plain_logprobs_are_the_targets_log_softmax(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, "none")
    prompt_ids = dec.encode(PROMPTS[0])
    result = dec.generate(prompt_ids, SamplingParams(max_new_tokens=12, logprobs=5, ignore_eos=True))
    assert [e.token for e in result.logprobs] == result.token_ids
    for i, entry in enumerate(result.logprobs):
        logp = last_logits(dec, prompt_ids + result.token_ids[:i]).float().log_softmax(-1)
        assert entry.logprob == pytest.approx(logp[entry.token].item(), abs=TOL)
        best = logp.topk(5)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        assert entry.top[0][0] == entry.token  # greedy: the chosen token heads the list
    # Not asked: none recorded.
    assert dec.generate(prompt_ids, SamplingParams(max_new_tokens=4)).logprobs is None
    assert dec.generate(prompt_ids, SamplingParams(max_new_tokens=4, logprobs=0)).logprobs[0].top == ()


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
def test_speculative_logprobs_equal_plain_logprobs(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path,
                                                   method: str) -> None:
    # Both engines: the default (the batch engine holding one request) and the single-request
    # engine (the copyable prompt's one copyable token is the first: lookups' drafts are
    # accepted there, on both engines).
    dec, single = decoder(tiny_qwen2_dir, tiny_close_draft_dir), decoder(tiny_qwen2_dir, tiny_close_draft_dir,
                                                                          engine="single")
    accepted = {"auto": 0, "single": 0}
    for prompt in [*PROMPTS[:3], copyable_prompt(dec)]:
        params = SamplingParams(max_new_tokens=20, logprobs=3)
        plain = dec.generate(prompt, params, method="none")
        for engine, on in (("auto", dec), ("single", single)):
            run = on.generate(prompt, params, method=method, k=3)
            assert run.token_ids == plain.token_ids
            assert_same_logprobs(run.logprobs, plain.logprobs, f"{method} on {prompt!r} ({engine})")
            accepted[engine] += run.stats.draft_tokens_accepted
        if method != "suffix":
            batch = dec.generate_batch([prompt, PROMPTS[5]], [params, SamplingParams(max_new_tokens=8)], method=method)
            assert_same_logprobs(batch[0].logprobs, plain.logprobs, f"batch {method} on {prompt!r}")
            assert batch[1].logprobs is None
    # Drafts were accepted, so logprobs came from rows past the first.
    assert accepted["single"] > 0 and accepted["auto"] > 0


def test_tree_logprobs_equal_plain_logprobs(tiny_qwen2_dir: Path, medusa_dir: Path) -> None:
    from specdecode import SpecDecoder

    dec = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="medusa", heads=str(medusa_dir), dtype="fp32",
                                      device="cpu", show_progress=False)
    plain_dec = decoder(tiny_qwen2_dir, None, "none")
    params = SamplingParams(max_new_tokens=20, logprobs=2)
    for prompt in PROMPTS[:3]:
        run = dec.generate(prompt, params)
        assert_same_logprobs(run.logprobs, plain_dec.generate(prompt, params).logprobs, f"medusa on {prompt!r}")


def test_processed_logprobs_are_the_sampled_distribution(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    prompt_ids = dec.encode(PROMPTS[1])
    params = SamplingParams(temperature=0.8, top_k=4, max_new_tokens=10, seed=3, logprobs=6,
                            logprobs_mode="processed", ignore_eos=True)
    for method in ("none", "draft"):
        result = dec.generate(prompt_ids, params, method=method, k=2)
        processor = LogitsProcessor.from_params(params)
        for i, entry in enumerate(result.logprobs):
            probs = processor.probs(last_logits(dec, prompt_ids + result.token_ids[:i])[None])[0]
            assert entry.logprob == pytest.approx(torch.log(probs[entry.token]).item(), abs=TOL)
            # Top-k 4 leaves 4 tokens; the other two are excluded: the floor stands for -inf.
            assert [v for _, v in entry.top][4:] == [MIN_LOGPROB, MIN_LOGPROB]


def test_one_logprob_per_kept_token(tiny_qwen2_dir: Path) -> None:
    dec = decoder(tiny_qwen2_dir, None, "none")
    full = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=16, logprobs=1, ignore_eos=True))
    stop = full.text[len(full.text) // 2 :][:3]
    cut = dec.generate(PROMPTS[0], SamplingParams(max_new_tokens=16, logprobs=1, stop=(stop,), ignore_eos=True))
    assert len(cut.logprobs) == len(cut.token_ids) < len(full.token_ids)
    assert "logprobs" in cut.to_dict()


def test_llamacpp_logprobs_equal_plain_logprobs(tiny_ggufs: dict[str, Path]) -> None:
    """On llama.cpp, to 1e-3 (its multi-row passes round differently from one-row passes), up to
    where the outputs part at a near-tie."""
    from helpers import llamacpp_decoder

    dec = llamacpp_decoder(tiny_ggufs["target"], tiny_ggufs["close"])
    params = SamplingParams(max_new_tokens=16, logprobs=2)
    prompt_ids = dec.encode(PROMPTS[0])
    plain = dec.generate(prompt_ids, params, method="none")
    for run in (dec.generate(prompt_ids, params, method="draft", k=3),
                dec.generate_batch([prompt_ids], params, method="draft", k=3)[0]):
        same = 0
        while same < len(plain.token_ids) and run.token_ids[same] == plain.token_ids[same]:
            same += 1
        assert same >= 8
        for got, want in zip(run.logprobs[:same], plain.logprobs[:same], strict=True):
            assert got.logprob == pytest.approx(want.logprob, abs=1e-3)
            assert [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-3)
