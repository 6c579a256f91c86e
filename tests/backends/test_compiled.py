"""Compiled passes (``compile=``) on the CPU. ``generate`` decodes on the batch engine holding one
request, whose chain passes run compiled (``backends/compiled_batch.py``): logits as eager's,
greedy output as eager's and as plain decoding's for every chain method (and for a tree method,
whose passes stay eager), a batch of several rows, no recompilation once warm, the on-disk
compile cache, the sampled distribution. The single-request engine's compiled passes
(``backends/compiled.py``, ``engine="single"``) keep their own tests while that engine is kept,
and the refusals.

Compiling costs seconds per graph even for the tiny models, so the tests share one compiled
decoder (k = 2) and keep to few graphs: on the CPU one graph serves every batch size, row count
and attention width above one.
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
from specdecode.backends.compiled_batch import CompiledPagedBatchModel
from specdecode.backends.torch_backend import TorchSequence
from specdecode.backends.torch_batch import PagedBatchModel
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


def test_compiled_batch_passes_give_eager_logits(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    eager, compiled = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    assert compiled.batch_graphs is not None
    model = eager.target.model
    plain = PagedBatchModel.with_pool(model, 512)
    fast = CompiledPagedBatchModel.over_pool(model, 512, 16, compiled.batch_graphs, max_rows=4, role="target")
    padded = CompiledPagedBatchModel.over_pool(model, 512, 16, compiled.batch_graphs, max_rows=4, role="target")
    padded.pad_shapes = True  # CUDA graphs' shapes: batch, rows and width padded to powers of two
    generator = torch.Generator().manual_seed(0)
    lengths = (20, 33, 12)  # each sequence's prompt, then 8 tokens fed by the passes below
    ids = [torch.randint(0, model.config.vocab_size, (n + 8,), generator=generator) for n in lengths]
    with torch.inference_mode():
        for batch in (plain, fast, padded):
            for seq, n in enumerate(lengths):  # prefills longer than max_rows: eager on both
                batch.pool.add(seq)
                batch.pool.reserve(seq, n + 8)
                batch.forward([seq], [ids[seq][:n]], [0], logits="none")
        # One row; a verify pass; three ragged rows at different lengths (padding rows and
        # an attention width each); the last rows' logits only (the draft model's pass); and
        # five rows, past max_rows, which run eagerly. Each pass writes the same K/V on both.
        for seqs, rows, logits in (([0], [1], "all"), ([0], [3], "all"), ([0, 1, 2], [2, 4, 1], "all"),
                                   ([2, 1], [1, 2], "last"), ([1], [5], "all")):
            starts = [lengths[s] for s in seqs]
            inputs = [ids[s][lengths[s] : lengths[s] + r] for s, r in zip(seqs, rows, strict=True)]
            want = plain.forward(seqs, inputs, starts, logits=logits)
            passes = len(compiled.compile_log.passes)
            for model_under_test in (fast, padded):
                got = model_under_test.forward(seqs, inputs, starts, logits=logits)
                assert got.shape == want.shape
                # Padding positions of a ragged row are not compared: neither side's is used.
                for b, r in enumerate(rows):
                    torch.testing.assert_close(got[b, :r] if logits == "all" else got[b],
                                               want[b, :r] if logits == "all" else want[b], atol=1e-4, rtol=1e-4)
            if max(rows) > fast.max_rows:
                assert len(compiled.compile_log.passes) == passes  # eager: nothing compiled


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "suffix", "auto"])
def test_compiled_greedy_equals_eager_and_plain(method: str, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    eager, compiled = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    # Lookups find repeats only in longer outputs of the tiny model. Suffix rows draft token
    # trees, whose passes stay eager beside the compiled plain ones.
    lookup = method in ("ngram", "suffix", "auto")
    prompts, params = (PROMPTS, SamplingParams(max_new_tokens=40)) if lookup else (PROMPTS[:4], PARAMS)
    accepted = 0
    for prompt in prompts:
        want = eager.generate(prompt, params, method=method).token_ids
        got = compiled.generate(prompt, params, method=method)
        assert got.token_ids == want, prompt
        assert got.token_ids == compiled.generate(prompt, params, method="none").token_ids, prompt
        accepted += got.stats.draft_tokens_accepted
    assert method == "none" or accepted > 0  # speculation happened, or the test proves nothing


def test_a_batch_of_rows_decodes_compiled_as_each_alone(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    # A server's engine (batch_engine, then warm_up_engine as `specdecode serve --compile` does):
    # rows of several lengths and methods share each compiled pass (a graph whose batch, rows and
    # attention width are symbolic), nothing compiles after the warm-up, and each row's output
    # is its plain output.
    eager, compiled = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    engine = compiled.batch_engine(max_batch=4, kv_cache_tokens=2048)
    compiled.warm_up_engine(engine)
    assert any(" batch 2 x " in p for p in compiled.compile_log.passes)
    passes = list(compiled.compile_log.passes)
    prompts = PROMPTS[:3]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for method in ("draft", "ngram", "none"):
            got = compiled.generate_batch(prompts, PARAMS, method=method, engine=engine)
            for prompt, result in zip(prompts, got, strict=True):
                assert result.token_ids == eager.generate(prompt, PARAMS, method="none").token_ids, (method, prompt)
    assert compiled.compile_log.passes == passes


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
    # The shared decoder compiled these graphs already (into the cache folder of this machine:
    # a fresh folder would also rebuild inductor's precompiled headers, minutes on 2 cores).
    eager, _ = pair(tiny_qwen2_dir, tiny_close_draft_dir)
    log = SpecDecoder(eager.target, None, replace(eager.config, method="none", compile=True)).warm_up()
    # Its four graphs (one row or more, logits or not), each named by the shape that first met
    # it: the engine's cost timing (rows its cost store lacks) or the warm-up.
    assert len(log.passes) == 4 and all(p.startswith("target batch 1 x ") for p in log.passes), log.passes
    assert sum(p.endswith("(no logits)") for p in log.passes) == 2
    assert sum(p.startswith("target batch 1 x 1 rows") for p in log.passes) == 2
    assert log.cache_hits == 4 and log.cache_misses == 0
    assert any(configure_compile_cache().rglob("*.py"))  # inductor's generated code, on disk


@cache
def single_engine(target: Path, draft: Path) -> SpecDecoder:
    """The shared pair's compiled decoder on the single-request engine (``engine="single"``)."""
    eager, compiled = pair(target, draft)
    return SpecDecoder(eager.target, eager.draft, replace(compiled.config, engine="single"))


def test_single_engine_compiled_passes_give_eager_logits(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    eager = pair(tiny_qwen2_dir, tiny_close_draft_dir)[0]
    plain, fast = eager.engine.target, single_engine(tiny_qwen2_dir, tiny_close_draft_dir).engine.target
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


def test_single_engine_compiled_greedy_equals_plain(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    eager = pair(tiny_qwen2_dir, tiny_close_draft_dir)[0]
    single = single_engine(tiny_qwen2_dir, tiny_close_draft_dir)
    accepted = 0
    for prompt in PROMPTS[:3]:
        got = single.generate(prompt, PARAMS, method="draft")
        assert got.token_ids == eager.generate(prompt, PARAMS, method="none").token_ids, prompt
        accepted += got.stats.draft_tokens_accepted
    assert accepted > 0


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
