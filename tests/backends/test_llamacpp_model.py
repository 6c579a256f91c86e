"""The llama.cpp backend against our torch model, on tiny F32 GGUF files built in tiny_models.

Tolerances (measured on the tiny 2-layer models, logits of magnitude up to ~5.5):
- kv_type "f32" with flash attention off: max |llama.cpp - torch| ~5e-6, so PRECISE_ATOL is
  1e-4 (20x margin). llama.cpp's multi-row and one-row passes differ by ~3e-6 (not bit-equal).
- llama.cpp's defaults (f16 KV cache, flash attention on, whose CPU kernel works in f16):
  ~5e-3, so DEFAULT_ATOL is 2e-2.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")

import tiny_models

from specdecode.backends.llamacpp import (
    BackendUnavailableError,
    ContextOverflowError,
    LlamaCppModel,
    physical_core_count,
)
from specdecode.backends.llamacpp_binding import LogSink, import_llama_cpp
from specdecode.errors import InvalidRequestError, ModelLoadError, SpecDecodeError, UnsupportedModelError

PRECISE_ATOL = 1e-4
DEFAULT_ATOL = 2e-2
PRECISE = {"kv_type": "f32", "flash_attn": False}  # the settings that match fp32 torch closely
# Fixed ids below TINY_VOCAB_SIZE, long enough to exercise RoPE over several positions.
PROMPT = [509, 5, 300, 200, 45, 67, 88, 12, 400, 3, 250, 510]
OTHER_TAIL = [17, 230, 99, 480]  # fed after a rollback instead of PROMPT's tail
ROLLBACK_TO = 5


@pytest.fixture(scope="module")
def ggufs(tiny_qwen2_dir: Path, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per arch, the tiny HF model written as an all-F32 GGUF file."""
    root = tmp_path_factory.mktemp("llamacpp_ggufs")
    paths = {}
    for arch, hf_dir in (("qwen2", tiny_qwen2_dir), ("llama", tiny_llama_dir)):
        paths[arch] = root / f"{arch}.gguf"
        tiny_models.write_gguf_from_hf(hf_dir, paths[arch], "F32")
    return paths


@pytest.fixture(scope="module")
def torch_models(ggufs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per arch, our torch model loaded from the same GGUF file (converted into a private cache)."""
    from specdecode.models.loader import load_model

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDECODE_CACHE", str(tmp_path_factory.mktemp("specdecode_cache")))
        return {
            arch: load_model(str(path), torch.float32, torch.device("cpu"), show_progress=False)
            for arch, path in ggufs.items()
        }


def torch_logits(loaded, tokens: list[int]) -> torch.Tensor:  # -> (T, V)
    """The torch model's logits for a whole sequence, no cache: the reference."""
    with torch.inference_mode():
        ids = torch.tensor([tokens])
        return loaded.model(ids, torch.arange(len(tokens))[None]).logits[0]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = PRECISE_ATOL) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def assert_same_argmax_where_clear(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    """actual, expected: (T, V). Greedy tokens agree wherever the top-2 margin exceeds 2 * atol."""
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * atol
    assert clear.any(), "no row has a clear winner: the check would be vacuous"
    assert torch.equal(actual.argmax(-1)[clear], expected.argmax(-1)[clear])


# ------------------------------------------------------------------------------- against torch


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_match_torch_full_stepwise_and_after_rollback(ggufs: dict, torch_models: dict, arch: str) -> None:
    expected = torch_logits(torch_models[arch], PROMPT)  # (T, V)
    with LlamaCppModel(ggufs[arch], n_ctx=64, **PRECISE) as model:
        assert model.vocab_size == expected.shape[-1]
        full = model.forward(0, PROMPT, 0, "all")
        assert full.dtype == torch.float32 and full.shape == expected.shape
        assert_close(full, expected)

        model.clear(0)
        steps = torch.cat([model.forward(0, [token], pos, "last") for pos, token in enumerate(PROMPT)])
        assert_close(steps, expected)

        # Rollback: keep ROLLBACK_TO positions, then feed a different continuation.
        model.truncate(0, ROLLBACK_TO)
        assert model.cached_length(0) == ROLLBACK_TO
        new_sequence = PROMPT[:ROLLBACK_TO] + OTHER_TAIL
        after_rollback = model.forward(0, OTHER_TAIL, ROLLBACK_TO, "all")
        assert_close(after_rollback, torch_logits(torch_models[arch], new_sequence)[ROLLBACK_TO:])
        model.clear(0)
        fresh = model.forward(0, new_sequence, 0, "all")[ROLLBACK_TO:]
        assert_close(after_rollback, fresh)
        # The stale tail is gone: its logits differ from the ones the old tokens gave.
        assert not torch.allclose(after_rollback, full[ROLLBACK_TO : ROLLBACK_TO + len(OTHER_TAIL)], atol=1e-2)


def test_refeeding_from_an_earlier_start_drops_the_stale_tail(ggufs: dict, torch_models: dict) -> None:
    """forward(start) without an explicit truncate: the verify-after-rejection path."""
    with LlamaCppModel(ggufs["qwen2"], n_ctx=64, **PRECISE) as model:
        model.forward(0, PROMPT, 0, "none")
        out = model.forward(0, OTHER_TAIL, ROLLBACK_TO, "all")
        assert model.cached_length(0) == ROLLBACK_TO + len(OTHER_TAIL)
    assert_close(out, torch_logits(torch_models["qwen2"], PROMPT[:ROLLBACK_TO] + OTHER_TAIL)[ROLLBACK_TO:])


def test_llama_cpp_defaults_are_close_to_torch(ggufs: dict, torch_models: dict) -> None:
    """f16 KV cache and flash attention: looser, but greedy tokens agree where the choice is clear."""
    expected = torch_logits(torch_models["llama"], PROMPT)
    with LlamaCppModel(ggufs["llama"], n_ctx=64) as model:
        actual = model.forward(0, PROMPT, 0, "all")
    assert_close(actual, expected, atol=DEFAULT_ATOL)
    assert_same_argmax_where_clear(actual, expected, DEFAULT_ATOL)


def test_inputs_longer_than_n_batch_are_split(ggufs: dict) -> None:
    with LlamaCppModel(ggufs["qwen2"], n_ctx=64, n_batch=4, **PRECISE) as small, \
            LlamaCppModel(ggufs["qwen2"], n_ctx=64, **PRECISE) as large:
        assert_close(small.forward(0, PROMPT, 0, "all"), large.forward(0, PROMPT, 0, "all"))
        assert_close(small.forward(0, OTHER_TAIL, 3, "last"), large.forward(0, OTHER_TAIL, 3, "last"))


# ------------------------------------------------------------------------------- batches


def test_forward_batch_equals_each_sequence_alone(ggufs: dict) -> None:
    # (seq, tokens already cached, truncate to, tokens fed in the batch, logits mode)
    plans = [
        (0, PROMPT, 4, OTHER_TAIL[:3], "all"),  # rolled back, then a 3-token "verify"
        (1, [], 0, PROMPT[:7], "all"),  # a fresh 7-token prefill with logits
        (2, PROMPT[:5], 5, [42], "last"),  # a one-token decode step
        (3, PROMPT[:2], 2, PROMPT[2:9], 3),  # a prompt's tail with two drafts: logits of the last 3 only
    ]
    with LlamaCppModel(ggufs["qwen2"], n_ctx=64, n_seq_max=4, **PRECISE) as model:
        for seq, cached, keep, _, _ in plans:
            if cached:
                model.forward(seq, cached, 0, "none")
            model.truncate(seq, keep)
        batched = model.forward_batch([(seq, fed, keep, mode) for seq, _, keep, fed, mode in plans])
        assert [model.cached_length(seq) for seq, *_ in plans] == [7, 7, 6, 9]
    with LlamaCppModel(ggufs["qwen2"], n_ctx=64, **PRECISE) as alone:
        for (seq, cached, keep, fed, mode), got in zip(plans, batched):
            alone.clear()
            expected = alone.forward(0, cached[:keep] + fed, 0, "all")[keep:]
            expected = expected if mode == "all" else expected[-1:] if mode == "last" else expected[-mode:]
            assert got.shape == expected.shape
            assert_close(got, expected)
            assert_same_argmax_where_clear(got, expected, PRECISE_ATOL)


@contextmanager
def counted_micro_batches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Lines llama.cpp logs per micro-batch ("ubatch") it cuts a batch into, for contexts created
    inside the block: ``LLAMA_BATCH_DEBUG`` is read when a context is created."""
    llama_cpp = import_llama_cpp()
    lines: list[str] = []

    def log(level: int, text: bytes | None, user_data: int | None) -> None:
        if text and b"added ubatch to split" in text:
            lines.append(text.decode())

    callback = llama_cpp.llama_log_callback(log)  # held until the sink is back
    monkeypatch.setenv("LLAMA_BATCH_DEBUG", "1")
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        LogSink.install(llama_cpp)
        monkeypatch.delenv("LLAMA_BATCH_DEBUG")


@pytest.mark.parametrize("kv_unified", [True, False])
def test_a_ragged_batch_on_any_sequence_ids_is_one_micro_batch(ggufs: dict, monkeypatch: pytest.MonkeyPatch,
                                                               kv_unified: bool) -> None:
    """A batch engine's step (rows of 5, 3, 1 and 1 tokens on sequences 3, 0, 2, 1) runs as one
    llama.cpp micro-batch, one read of the weights, by default (unified KV). With one KV stream
    per sequence llama.cpp's split_equal cuts it into equal tokens per sequence on consecutive
    ids in batch order ({3} x 5, {0, 1} x 1, {0} x 2, {2} x 1), each costing up to a pass on a
    CPU (benchmarks/llamacpp_batch_passes.py). The kv_unified=False case shows the count can fail."""
    with counted_micro_batches(monkeypatch) as lines, \
            LlamaCppModel(ggufs["qwen2"], n_ctx=64, n_seq_max=4, kv_unified=kv_unified) as model:
        for seq in range(4):
            model.forward(seq, PROMPT[: 4 + seq], 0, "none")
        lines.clear()
        model.forward_batch([(3, PROMPT[:5], 7, "all"), (0, OTHER_TAIL[:3], 4, "all"),
                             (2, [42], 6, "all"), (1, [7], 5, "all")])
        assert len(lines) == (1 if kv_unified else 4)
    assert LlamaCppModel.__init__.__kwdefaults__["kv_unified"] is True


def test_a_copied_prefix_outlives_its_source_in_the_unified_cache(ggufs: dict) -> None:
    """``copy_sequence`` in the unified cache shares the prefix's cells: the copy holds exactly
    ``length`` positions, continues as the source would, and keeps them when the source is cut
    back and rewritten, or cleared."""
    with LlamaCppModel(ggufs["qwen2"], n_ctx=64, n_seq_max=3, **PRECISE) as model:
        model.forward(0, PROMPT, 0, "none")
        model.copy_sequence(0, 1, ROLLBACK_TO)
        assert model.cached_length(1) == ROLLBACK_TO and model.cached_length(0) == len(PROMPT)
        expected = model.forward(2, PROMPT[:ROLLBACK_TO] + OTHER_TAIL, 0, "all")[ROLLBACK_TO:]
        model.forward(0, OTHER_TAIL[:1], 2, "none")  # the source rewrites positions the copy holds
        assert_close(model.forward(1, OTHER_TAIL, ROLLBACK_TO, "all"), expected)
        model.clear(0)
        model.truncate(1, ROLLBACK_TO)
        assert_close(model.forward(1, OTHER_TAIL, ROLLBACK_TO, "all"), expected)
        model.copy_sequence(1, 0, 0)
        assert model.cached_length(0) == 0


def test_a_second_context_shares_the_loaded_weights(ggufs: dict) -> None:
    """``with_sequences`` (the batch engine's context) runs on the same llama_model, not a second
    load (which repacks the weights again), gives the same logits, and the weights live until
    the last context on them closes."""
    first = LlamaCppModel(ggufs["qwen2"], n_ctx=64, **PRECISE)
    second = first.with_sequences(2, 64)
    try:
        assert second._model is first._model and first._weights is second._weights
        assert first._weights is not None and first._weights.users == 2
        expected = first.forward(0, PROMPT, 0, "all")
        first.close()  # the second context keeps the weights
        assert second._weights is not None and second._weights.users == 1
        assert_close(second.forward(1, PROMPT, 0, "all"), expected)
    finally:
        first.close()
        second.close()
    assert second._weights is None and first._weights is None


def test_forward_batch_rejects_a_sequence_twice(ggufs: dict) -> None:
    with LlamaCppModel(ggufs["qwen2"], n_ctx=32, n_seq_max=2) as model:
        with pytest.raises(InvalidRequestError, match="twice"):
            model.forward_batch([(0, [1, 2], 0, "all"), (0, [3], 2, "all")])
        with pytest.raises(InvalidRequestError, match="outside"):
            model.forward(2, [1], 0)
        for bad in (0, True, "first"):
            with pytest.raises(InvalidRequestError, match="logits must be"):
                model.forward(0, [1, 2], 0, bad)


# ------------------------------------------------------------------------------- prefill


def test_none_returns_nothing_but_fills_the_cache(ggufs: dict) -> None:
    with LlamaCppModel(ggufs["llama"], n_ctx=64, **PRECISE) as model:
        assert model.forward(0, PROMPT[:-1], 0, "none") is None
        assert model.cached_length(0) == len(PROMPT) - 1
        last = model.forward(0, PROMPT[-1:], len(PROMPT) - 1, "last")
        model.clear()
        assert model.cached_length(0) == 0
        full = model.forward(0, PROMPT, 0, "all")
    assert last.shape == (1, model.vocab_size)
    assert_close(last, full[-1:])


# ------------------------------------------------------------------------------- an architecture torch lacks


def test_runs_an_architecture_the_torch_loader_does_not(tiny_tokenizer_dir: Path, tmp_path: Path) -> None:
    from specdecode.models.loader import load_model

    path = tmp_path / "qwen3.gguf"
    tiny_models.write_tiny_qwen3_gguf(tiny_tokenizer_dir, path)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(UnsupportedModelError):
        patch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
        load_model(str(path), torch.float32, torch.device("cpu"), show_progress=False)

    runs = []
    for _ in range(2):
        with LlamaCppModel(path, n_ctx=64) as model:
            runs.append(model.forward(0, PROMPT, 0, "all"))
    assert runs[0].shape == (len(PROMPT), tiny_models.TINY_VOCAB_SIZE)
    assert torch.isfinite(runs[0]).all()
    assert runs[0].std() > 0.1  # real logits, not a zeroed buffer
    assert torch.equal(runs[0], runs[1])


# ------------------------------------------------------------------------------- errors and setup


def test_missing_file_is_a_model_load_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.gguf"
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        LlamaCppModel(missing)


def test_a_file_that_is_not_gguf_is_a_model_load_error(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="weights.gguf"):
        LlamaCppModel(bogus)


def test_feeding_past_n_ctx_is_a_clear_error(ggufs: dict) -> None:
    with LlamaCppModel(ggufs["qwen2"], n_ctx=16) as model:
        model.forward(0, PROMPT, 0, "none")
        with pytest.raises(ContextOverflowError, match="larger n_ctx") as caught:
            model.forward(0, PROMPT[:5], len(PROMPT), "last")
        assert isinstance(caught.value, SpecDecodeError)
        assert model.cached_length(0) == len(PROMPT)  # a refused pass leaves the cache as it was
        with pytest.raises(InvalidRequestError, match="without holes"):
            model.forward(0, [1], len(PROMPT) + 1)
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            model.forward(0, [model.vocab_size], 0)


def test_closed_model_refuses_work(ggufs: dict) -> None:
    model = LlamaCppModel(ggufs["qwen2"], n_ctx=16)
    model.close()
    model.close()  # twice is fine
    with pytest.raises(SpecDecodeError, match="closed"):
        model.forward(0, [1], 0)


def test_missing_binding_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(BackendUnavailableError, match="pip install llama-cpp-python"):
        LlamaCppModel(tmp_path / "any.gguf")


def test_loading_is_silent(ggufs: dict, capfd: pytest.CaptureFixture[str]) -> None:
    with LlamaCppModel(ggufs["qwen2"], n_ctx=16) as model:
        model.forward(0, PROMPT[:3], 0, "last")
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_default_threads_are_physical_cores() -> None:
    threads = physical_core_count()
    assert 1 <= threads <= len(os.sched_getaffinity(0))
