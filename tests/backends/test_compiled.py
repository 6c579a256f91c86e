"""Compiled passes (``compile=``, backends/compiled.py) on the CPU: logits as eager's, greedy
output as eager's and as plain decoding's for every chain method, no recompilation once warm,
the on-disk compile cache, the sampled distribution, and the refusals.

Compiling costs seconds per shape even for the tiny models, so the tests share one compiled
decoder (k = 2: verify passes of 1 to 3 rows, and the draft's 1- and 2-row passes) and keep
to few shapes.
"""

from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
import torch
from helpers import CHI2_CRITICAL_P001, PROMPTS, chi_square

from specdecode import SamplingParams, SpecDecoder
from specdecode.backends.compiled import (
    MIN_CAPACITY,
    CompiledSequence,
    compiled_capacity,
    configure_compile_cache,
    resolve_compile_mode,
)
from specdecode.backends.torch_backend import TorchSequence
from specdecode.errors import InvalidRequestError

K = 2
K_MAX = 3  # the target compiles verify passes of up to K_MAX + 1 rows (on first use)
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


@cache
def pair(target: Path, draft: Path) -> tuple[SpecDecoder, SpecDecoder]:
    """(eager, compiled) fp32 decoders over the same models, the compiled one warm."""
    options = {"method": "draft", "k": K, "k_max": K_MAX, "draft_confidence": 0.0, "dtype": "fp32", "device": "cpu",
               "show_progress": False}
    eager = SpecDecoder.from_pretrained(str(target), str(draft), **options)
    compiled = SpecDecoder(eager.target, eager.draft, replace(eager.config, compile=True))
    compiled.warm_up()
    return eager, compiled


def test_compiled_passes_give_eager_logits(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    eager, compiled = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    plain, fast = eager.engine.target, compiled.engine.target
    assert isinstance(fast, CompiledSequence) and not isinstance(plain, CompiledSequence)
    ids = torch.tensor([eager.encode(PROMPTS[0])])  # (1, L)
    length = ids.shape[1]
    with torch.inference_mode():
        for seq in (plain, fast):
            seq.begin(length + 8)
            seq.extend(ids[:, :-3], 0, compute_logits=False)  # a prefill: eager on both
        # One row, then three rows (a verify pass), then a two-row catch-up with the last
        # row's logits, each after the same committed prefix: compiled passes read the whole
        # cache under a mask where eager ones read a slice.
        for rows, logits_last in ((1, None), (3, None), (2, 1)):
            start = length - 3
            want = plain.extend(ids[:, start : start + rows], start, logits_last=logits_last).logits
            got = fast.extend(ids[:, start : start + rows], start, logits_last=logits_last).logits
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["none", "draft", "ngram"])
def test_compiled_greedy_equals_eager_and_plain(method: str, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    eager, compiled = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    # Prompt lookup finds repeats only in longer outputs of the tiny model.
    prompts, params = (PROMPTS, SamplingParams(max_new_tokens=40)) if method == "ngram" else (PROMPTS[:4], PARAMS)
    accepted = 0
    for prompt in prompts:
        want = eager.generate(prompt, params, method=method).token_ids
        got = compiled.generate(prompt, params, method=method)
        assert got.token_ids == want, prompt
        assert got.token_ids == compiled.generate(prompt, params, method="none").token_ids, prompt
        accepted += got.stats.draft_tokens_accepted
    assert method == "none" or accepted > 0  # speculation happened, or the test proves nothing


def test_more_rows_than_compiled_run_eagerly(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    # A per-call k above the decoder's k_max verifies more rows than were compiled: those
    # passes run eagerly on the same cache, and the output is still plain decoding's.
    eager, compiled = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    target = compiled.engine.target
    assert isinstance(target, CompiledSequence) and not target.compiles(K_MAX + 2)
    for prompt in PROMPTS[:2]:
        got = compiled.generate(prompt, PARAMS, method="draft", k=K_MAX + 3)
        assert got.token_ids == eager.generate(prompt, PARAMS, method="none").token_ids
    # Rows up to K_MAX + 1 compile when first needed (and are timed); more never do.
    assert not [p for p in compiled.compile_log.passes if p.startswith("target") and int(p.split()[1]) > K_MAX + 1]


def test_no_recompilation_once_warm(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    from torch._dynamo.utils import counters

    _, compiled = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=0)
    compiled.generate(PROMPTS[1], PARAMS, method="draft", k="auto")  # compiles the 4-row pass of --k auto
    graphs = counters["stats"]["unique_graphs"]
    passes = list(compiled.compile_log.passes)
    # Every kind of step, sampled and greedy, new prompt lengths and new request capacities
    # below MIN_CAPACITY: a recompilation raises here.
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in PROMPTS:
            for method, k in (("none", None), ("draft", None), ("ngram", None), ("draft", "auto")):
                result = compiled.generate(prompt, params if method == "draft" else PARAMS, method=method, k=k)
                assert result.stats.compile_seconds == 0
    assert counters["stats"]["unique_graphs"] == graphs
    assert compiled.compile_log.passes == passes


@pytest.mark.slow  # 1,500 seeded generations; .ci/run runs it on its own line
def test_compiled_sampling_matches_target_distribution(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path) -> None:
    _, compiled = pair(tiny_qwen2_dir, tiny_far_draft_dir)
    stat, df = chi_square(compiled, compiled.encode("def quicksort(arr):"), "draft")
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_a_second_decoder_compiles_from_the_disk_cache(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    # The shared decoder compiled this graph already (into the cache folder of this machine:
    # a fresh folder would also rebuild inductor's precompiled headers, minutes on 2 cores).
    eager, _ = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    log = SpecDecoder(eager.target, None, replace(eager.config, method="none", compile=True)).warm_up()
    assert log.passes == ["target 1 rows"]
    assert log.cache_hits == 1 and log.cache_misses == 0
    assert any(configure_compile_cache().rglob("*.py"))  # inductor's generated code, on disk


def test_capacity_rounds_up_so_requests_share_graphs() -> None:
    # One slot more than asked: a symbolic attention width stays below the cache's size.
    assert compiled_capacity(1) == compiled_capacity(MIN_CAPACITY - 1) == MIN_CAPACITY
    assert compiled_capacity(MIN_CAPACITY) == 2 * MIN_CAPACITY


def test_refusals(tiny_qwen2_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="CUDA graphs"):
        resolve_compile_mode("reduce-overhead", torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="compile must be"):
        resolve_compile_mode("fastest", torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="compile"):
        SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", backend="llama.cpp", compile=True,
                                    show_progress=False)
    for options in ({"target_quant": "int8"}, {"kv_dtype": "int8"}):
        with pytest.raises(InvalidRequestError, match="compile"):
            SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu", compile=True,
                                        show_progress=False, **options)
    assert isinstance(SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu",
                                                  show_progress=False).engine.target, TorchSequence)
