"""Suffix decoding on the llama.cpp backend: no tree attention there, so it proposes the best
chain of its token tree; greedy output equal to plain decoding on the same backend (up to the
target's first near-tie, as test_llamacpp_engine.py explains), proposals accepted and rejected,
earlier responses shared, and the cost-aware choice."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from helpers import PROMPTS, assert_greedy_equal_up_to_near_tie, copyable_prompt, greedy_margins, llamacpp_decoder

from specdecode import SamplingParams, SpecDecoder
from specdecode.drafters.suffix import SuffixDrafter

NEW_TOKENS = 24


@pytest.mark.parametrize("k", [2, 6, "auto"])
def test_greedy_suffix_chain_equals_plain_on_llamacpp(tiny_ggufs: dict[str, Path], k: int | str) -> None:
    dec = llamacpp_decoder(tiny_ggufs["target"], None)
    dec.suffix_cache.clear()
    assert dec.backend == "llama.cpp" and isinstance(dec.plan("suffix", 4, suffix_group="").drafter, SuffixDrafter)
    proposed = accepted = compared = total = 0
    for prompt in [copyable_prompt(dec), *PROMPTS[:3]]:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        plain = dec.generate(prompt, params, method="none").token_ids
        margins = greedy_margins(dec, prompt if isinstance(prompt, list) else dec.encode(prompt), plain)
        for _ in range(2):  # the second time, the first answer is in the shared tree
            result = dec.generate(prompt, params, method="suffix", k=k)
            compared += assert_greedy_equal_up_to_near_tie(result.token_ids, plain, margins, f"k={k} prompt={prompt!r}")
            total += len(plain)
            proposed += result.stats.draft_tokens_proposed
            accepted += result.stats.draft_tokens_accepted
    assert compared >= total * 3 // 4
    if k != "auto":  # (cost-aware on this CPU, llama.cpp's extra rows may never pay: it may not draft)
        assert proposed > accepted > 0


def test_suffix_rows_in_a_llamacpp_batch_share_the_tree_and_keep_greedy_output(tiny_ggufs: dict[str, Path]) -> None:
    """The batch engine on llama.cpp: suffix rows draft from one shared tree (the same prompts a
    second time draft from the first batch's answers), each output its single-request plain output."""
    dec = llamacpp_decoder(tiny_ggufs["target"], None)
    dec.suffix_cache.clear()
    on_torch = llamacpp_decoder(tiny_ggufs["target"], None, backend="torch")
    prompts, params = PROMPTS[:3], SamplingParams(max_new_tokens=NEW_TOKENS)
    eng = dec.batch_engine(max_batch=3, kv_cache_tokens=3 * 256, cost_aware=False)
    runs = [dec.generate_batch(prompts, params, method="suffix", k=6, engine=eng) for _ in range(2)]
    compared = total = 0
    for index, prompt in enumerate(prompts):
        alone = dec.generate(prompt, params, method="none").token_ids
        margins = greedy_margins(on_torch, on_torch.encode(prompt), alone)
        for run in runs:
            compared += assert_greedy_equal_up_to_near_tie(run[index].token_ids, alone, margins, f"{prompt!r}")
            total += len(alone)
    assert compared >= total * 3 // 4
    steps = [sum(r.stats.verify_steps for r in run) for run in runs]
    assert steps[1] < steps[0] and sum(r.stats.draft_tokens_accepted for r in runs[1]) > 0


def test_suffix_chains_go_past_k_max_on_llamacpp(tiny_ggufs: dict[str, Path]) -> None:
    # The same prompt twice with k "auto": the second answer repeats the first, in the shared
    # tree, so its chains grow past k_max (4 here) and are accepted there, output still plain's.
    # On both engines (a batch's suffix row under k "auto" drafts its chain as an auto row whose
    # one source is the suffix tree).
    for engine in ("single", "auto"):
        assert_suffix_chains_go_past_k_max(llamacpp_decoder(tiny_ggufs["target"], None, engine=engine))


def assert_suffix_chains_go_past_k_max(base: SpecDecoder) -> None:
    dec = SpecDecoder(base.target, None, replace(base.config, k_max=4))
    prompt, params = PROMPTS[0], SamplingParams(max_new_tokens=48)
    plain = dec.generate(prompt, params, method="none").token_ids
    margins = greedy_margins(dec, dec.encode(prompt), plain)
    dec.generate(prompt, params, method="suffix", k="auto")
    again = dec.generate(prompt, params, method="suffix", k="auto")
    assert assert_greedy_equal_up_to_near_tie(again.token_ids, plain, margins, "second answer") >= len(plain) * 3 // 4
    accepted = again.stats.accepted_at_position
    assert len(accepted) > 4 and sum(accepted[4:]) > 0, accepted
