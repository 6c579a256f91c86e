"""Speculative decoding on the llama.cpp backend: lossless against plain decoding on the same
backend, the same text as the torch backend on the same F32 GGUF, and clear refusals.

The decoders load with ``dtype="fp32"``: llama.cpp keeps its KV cache in f32 and flash
attention off, so its logits are within ~1e-5 of fp32 torch (test_llamacpp_model.py). Its
multi-row and one-row passes still differ by ~3e-6 (not bit-equal), so greedy equality is
asserted up to the target's first near-tie (helpers.NEAR_TIE, 5e-3: three orders of magnitude
above that difference), and the tests check that they kept their power (most tokens compared).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")

import tiny_models
from helpers import (
    CHI2_CRITICAL_P001,
    PROMPTS,
    assert_greedy_equal_up_to_near_tie,
    chi_square,
    copyable_prompt,
    greedy_margins,
    install_wrong_residual,
    llamacpp_decoder,
    merged_and_apart,
)

from specdecode import SamplingParams, SpecDecoder, cli
from specdecode.backends import select
from specdecode.errors import InvalidRequestError

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def ggufs(tiny_ggufs: dict[str, Path]) -> dict[str, Path]:
    return tiny_ggufs


def test_backend_is_llamacpp_and_plain_output_equals_the_torch_backend(ggufs: dict[str, Path]) -> None:
    on_llama = llamacpp_decoder(ggufs["target"], None)
    on_torch = llamacpp_decoder(ggufs["target"], None, backend="torch")
    assert on_llama.backend == "llama.cpp" and on_torch.backend == "torch"
    compared = total = 0
    for prompt in PROMPTS[:4]:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        reference = on_torch.generate(prompt, params).token_ids
        margins = greedy_margins(on_torch, on_torch.encode(prompt), reference)
        got = on_llama.generate(prompt, params).token_ids
        compared += assert_greedy_equal_up_to_near_tie(got, reference, margins, f"prompt={prompt!r}")
        total += len(reference)
    assert compared >= total * 3 // 4


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_draft_model_equals_plain_for_every_k(ggufs: dict[str, Path], k: int) -> None:
    dec = llamacpp_decoder(ggufs["target"], ggufs["close"])
    accepted = proposed = compared = total = 0
    for prompt in PROMPTS[:3]:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        plain = dec.generate(prompt, params, method="none").token_ids
        margins = greedy_margins(dec, dec.encode(prompt), plain)
        result = dec.generate(prompt, params, k=k)
        compared += assert_greedy_equal_up_to_near_tie(result.token_ids, plain, margins, f"k={k} prompt={prompt!r}")
        total += len(plain)
        accepted += result.stats.draft_tokens_accepted
        proposed += result.stats.draft_tokens_proposed
    assert 0 < accepted < proposed  # drafts were both accepted and rejected (rollbacks exercised)
    assert compared >= total * 3 // 4


@pytest.mark.parametrize(("method", "k"), [("ngram", 4), ("auto", 5), ("draft", "auto"), ("ngram", "auto"), ("auto", "auto")])
def test_greedy_lookup_auto_and_cost_aware_k_equal_plain(ggufs: dict[str, Path], method: str, k: int | str) -> None:
    dec = llamacpp_decoder(ggufs["target"], ggufs["close"])
    compared = total = 0
    # A prompt the lookup can copy from, and two it mostly cannot.
    for prompt in [copyable_prompt(dec), *PROMPTS[1:3]]:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        plain = dec.generate(prompt, params, method="none").token_ids
        margins = greedy_margins(dec, prompt if isinstance(prompt, list) else dec.encode(prompt), plain)
        result = dec.generate(prompt, params, method=method, k=k)
        context = f"method={method} k={k} prompt={prompt!r}"
        compared += assert_greedy_equal_up_to_near_tie(result.token_ids, plain, margins, context)
        total += len(plain)
    assert compared >= total * 3 // 4


def test_lookup_proposals_are_verified_on_llamacpp(ggufs: dict[str, Path]) -> None:
    """A prompt whose continuation the lookup can copy: proposals are made and some accepted."""
    dec = llamacpp_decoder(ggufs["target"], ggufs["close"])
    prompt_ids = copyable_prompt(dec)
    result = dec.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS), method="ngram", k=4)
    assert result.stats.draft_tokens_proposed > 0


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampling_matches_the_target_distribution(ggufs: dict[str, Path], method: str) -> None:
    # helpers.chi_square: 1,500 seeded 3-token generations (temperature 1, top-k 3) against the
    # exact distribution enumerated from the llama.cpp target alone; p = 0.001 critical value.
    dec = llamacpp_decoder(ggufs["target"], ggufs["far"])
    prompt_ids = dec.encode("def quicksort(arr):") if method == "draft" else copyable_prompt(dec)
    stat, df = chi_square(dec, prompt_ids, method)
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_distribution_test_has_power_on_llamacpp(ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    dec = llamacpp_decoder(ggufs["target"], ggufs["far"])
    install_wrong_residual(monkeypatch)
    stat, df = chi_square(dec, dec.encode("def quicksort(arr):"), "draft")
    assert stat > CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}: the test has no power"


def test_a_second_architecture_generates(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    """Qwen3 (q/k norms), which our torch model does not implement, decodes through llama.cpp,
    speculation included (the model drafting for itself accepts every token)."""
    path = tmp_path / "qwen3.gguf"
    tiny_models.write_tiny_qwen3_gguf(tiny_tokenizer_dir, path)
    dec = SpecDecoder.from_pretrained(str(path), str(path), method="draft", dtype="fp32", device="cpu",
                                      draft_confidence=0.0, show_progress=False)
    assert dec.backend == "llama.cpp"
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = dec.generate("def quicksort(arr):", params, method="none")
    spec = dec.generate("def quicksort(arr):", params, k=4)
    assert len(plain.token_ids) == 12 and spec.token_ids == plain.token_ids
    assert spec.stats.draft_tokens_accepted == spec.stats.draft_tokens_proposed > 0


def test_auto_backend_choice(ggufs: dict[str, Path], tiny_qwen2_dir: Path) -> None:
    cpu = torch.device("cpu")
    common = {"draft_is_gguf": None, "device": cpu, "method": "draft", "weight_quant": False, "kv_int8": False}
    assert select.choose_backend("auto", target_is_gguf=True, **common).name == "llama.cpp"
    assert select.choose_backend("auto", target_is_gguf=False, **common).name == "torch"
    assert select.choose_backend("auto", target_is_gguf=True, **{**common, "method": "layerskip"}).name == "torch"
    assert select.choose_backend("auto", target_is_gguf=True, **{**common, "weight_quant": True}).name == "torch"
    # A safetensors folder loads on torch under auto.
    dec = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu", show_progress=False)
    assert dec.backend == "torch"


def test_refusals_name_the_torch_backend(ggufs: dict[str, Path], tiny_qwen2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidRequestError, match='backend="torch"'):
        SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", backend="llama.cpp", show_progress=False)
    with pytest.raises(InvalidRequestError, match='layerskip.*backend="torch"'):
        SpecDecoder.from_pretrained(str(ggufs["target"]), method="layerskip", skip_layers=[0], backend="llama.cpp",
                                    show_progress=False)
    monkeypatch.setattr(select, "llamacpp_installed", lambda: False)
    with pytest.raises(InvalidRequestError, match="pip install llama-cpp-python"):
        SpecDecoder.from_pretrained(str(ggufs["target"]), method="none", backend="llama.cpp", show_progress=False)
    # Without the binding, auto falls back to torch and still decodes the GGUF file.
    dec = SpecDecoder.from_pretrained(str(ggufs["target"]), method="none", dtype="fp32", device="cpu", show_progress=False)
    assert dec.backend == "torch"


def test_cli_refusal_is_one_line_and_exit_status_2(tiny_qwen2_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["generate", "--target", str(tiny_qwen2_dir), "--method", "none", "--backend", "llama.cpp",
                     "--quiet", "hello"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == cli.EXIT_USER_ERROR == 2
    assert len(err) == 1 and err[0].startswith("specdecode: error:") and "--backend torch" in err[0]


def test_the_prompt_is_fed_in_the_first_verify_pass(ggufs: dict[str, Path]) -> None:
    """One pass before the first token: the prompt with the first drafts, logits for the last
    prompt token and the drafts only (not a prefill, then a pass). The output equals a decode
    that prefills first, up to the first near-tie (the first pass has another row count)."""
    dec = llamacpp_decoder(ggufs["target"], ggufs["close"], engine="single")  # its first pass
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    compared = total = 0
    for prompt in PROMPTS[:3]:
        ids = dec.encode(prompt)
        for method in ("none", "draft"):
            (merged, first), (apart, first_apart) = merged_and_apart(dec, ids, params, method, 3)
            start, rows, logit_rows = first
            assert (start, rows - logit_rows) == (0, len(ids) - 1) and logit_rows == (1 if method == "none" else 4)
            assert first_apart == (0, len(ids) - 1, 0)
            margins = greedy_margins(dec, ids, apart.token_ids)
            compared += assert_greedy_equal_up_to_near_tie(merged.token_ids, apart.token_ids, margins,
                                                           f"{method} {prompt!r}")
            total += len(apart.token_ids)
    assert compared >= total * 3 // 4
