"""The transformer against Hugging Face transformers, and the KV cache's rollback."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdecode.core.device import cpu_supports_bf16
from specdecode.errors import ModelLoadError, UnsupportedModelError
from specdecode.kv.static import KVCache, causal_view
from specdecode.models.loader import load_weights, read_model_config

ATOL = 1e-4  # fp32, tiny models: differences are summation order only


def ours(folder: Path, dtype: torch.dtype = torch.float32, pack: bool = True):
    return load_weights(folder, read_model_config(folder), dtype, torch.device("cpu"), pack=pack)


def prompt_ids(vocab: int, length: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def cached_forward(model, cache: KVCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    logits = model.extend(cache, ids, start).logits
    cache.commit(0, start + ids.shape[1])
    return logits


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_logits_match_transformers_prefill_and_step_by_step(arch: str, tiny_qwen2_dir: Path, tiny_llama_dir: Path) -> None:
    folder = tiny_qwen2_dir if arch == "qwen2" else tiny_llama_dir
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = ours(folder)
    ids = prompt_ids(model.config.vocab_size)
    with torch.inference_mode():
        expected = reference(ids).logits
        full = model(ids, torch.arange(ids.shape[1])[None]).logits
        torch.testing.assert_close(full, expected, atol=ATOL, rtol=0)
        cfg = model.config
        cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32, "cpu")
        pieces = [cached_forward(model, cache, ids[:, :10], 0)]
        pieces += [cached_forward(model, cache, ids[:, t : t + 1], t) for t in range(10, ids.shape[1])]
        torch.testing.assert_close(torch.cat(pieces, 1), expected, atol=ATOL, rtol=0)


def test_tied_embeddings_and_hidden_states(tmp_path: Path) -> None:
    import tiny_models

    folder = tiny_models.make_tiny_hf_model(tmp_path, arch="qwen2", seed=3, tie_word_embeddings=True, num_layers=3)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = ours(folder)
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = prompt_ids(model.config.vocab_size)
    with torch.inference_mode():
        expected = reference(ids, output_hidden_states=True)
        out = model(ids, torch.arange(ids.shape[1])[None], return_layers=(0, 1))
    torch.testing.assert_close(out.logits, expected.logits, atol=ATOL, rtol=0)
    # HF's hidden_states[i + 1] is the output of layer i; its last entry is after the final norm.
    torch.testing.assert_close(out.layer_hidden[0], expected.hidden_states[1], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.layer_hidden[1], expected.hidden_states[2], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, expected.hidden_states[-1], atol=ATOL, rtol=0)


def test_layer_subset_runs_only_those_layers(tiny_qwen2_dir: Path) -> None:
    model = ours(tiny_qwen2_dir)
    ids = prompt_ids(model.config.vocab_size)
    positions = torch.arange(ids.shape[1])[None]
    with torch.inference_mode():
        skipped = model(ids, positions, layers=[0]).logits
        full = model(ids, positions).logits
        # Running layer 0 only equals a model whose layer 1 contributes nothing.
        layer1 = model.layers[1]
        saved = (layer1.self_attn.o_proj.weight.clone(), layer1.mlp.down_proj.weight.clone())
        layer1.self_attn.o_proj.weight.zero_()
        layer1.mlp.down_proj.weight.zero_()
        zeroed = model(ids, positions).logits
        layer1.self_attn.o_proj.weight.copy_(saved[0])
        layer1.mlp.down_proj.weight.copy_(saved[1])
    torch.testing.assert_close(skipped, zeroed, atol=ATOL, rtol=0)
    assert not torch.allclose(skipped, full, atol=1e-3)


def test_cache_rollback_then_new_continuation_matches_fresh_computation(tiny_qwen2_dir: Path) -> None:
    model = ours(tiny_qwen2_dir)
    cfg = model.config
    vocab = cfg.vocab_size
    prefix, rejected, accepted = prompt_ids(vocab, 12, 1), prompt_ids(vocab, 5, 2), prompt_ids(vocab, 4, 3)
    with torch.inference_mode():
        cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32, "cpu")
        cached_forward(model, cache, prefix, 0)
        cached_forward(model, cache, rejected, 12)  # speculative tokens that get rejected...
        cache.rollback(0, 14)  # ...except the first two
        got = cached_forward(model, cache, accepted, 14)
        fresh_ids = torch.cat([prefix, rejected[:, :2], accepted], dim=1)
        expected = model(fresh_ids, torch.arange(fresh_ids.shape[1])[None]).logits[:, 14:]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert cache.lengths == [18]
    with pytest.raises(ValueError):
        cache.rollback(0, 19)  # cannot roll forward


def test_scattered_cache_write_equals_slice_write() -> None:
    cache_a = KVCache(1, 2, 2, 4, 16, torch.float32, "cpu")
    cache_b = KVCache(1, 2, 2, 4, 16, torch.float32, "cpu")
    keys, values = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4)
    positions = torch.tensor([[5, 6, 7], [5, 6, 7]])
    cache_a.write(0, positions, keys, values, contiguous_start=5)
    cache_b.write(0, positions, keys, values)
    assert torch.equal(cache_a.keys[0], cache_b.keys[0]) and torch.equal(cache_a.values[0], cache_b.values[0])
    # Per-sequence positions: each row lands at its own slots.
    cache_b.write(0, torch.tensor([[0, 1, 2], [9, 10, 11]]), keys, values)
    assert torch.equal(cache_b.keys[0][1, :, 9:12], keys[1])


def test_causal_view_masks_future_and_window() -> None:
    positions = torch.tensor([[3, 4]])
    view = causal_view(positions, [[3, 4]])
    assert view.kv_len == 5
    assert view.mask[0, 0].tolist() == [[True] * 4 + [False], [True] * 5]
    windowed = causal_view(positions, [[3, 4]], sliding_window=2)
    assert windowed.mask[0, 0].tolist() == [[False, False, True, True, False], [False, False, False, True, True]]
    assert causal_view(torch.tensor([[7]]), [[7]]).mask is None


@pytest.mark.skipif(not cpu_supports_bf16(), reason="needs a CPU with native bf16")
def test_prepacked_bf16_weights_give_identical_logits(tiny_qwen2_dir: Path) -> None:
    packed = ours(tiny_qwen2_dir, torch.bfloat16, pack=True)
    dense = ours(tiny_qwen2_dir, torch.bfloat16, pack=False)
    assert packed.layers[0].mlp.gate_up_proj.packed_weight is not None
    assert dense.layers[0].mlp.gate_up_proj.packed_weight is None
    ids = prompt_ids(packed.config.vocab_size)
    with torch.inference_mode():
        for rows in (1, 5):
            positions = torch.arange(rows)[None]
            a = packed(ids[:, :rows], positions).logits
            b = dense(ids[:, :rows], positions).logits
            torch.testing.assert_close(a, b, atol=0.05, rtol=0.01)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*llama, qwen2, mistral"):
        read_model_config(tmp_path)


def test_missing_and_corrupt_weights_are_reported(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_qwen2_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="Cannot read weights"):
        ours(broken)
    weights.unlink()
    with pytest.raises(ModelLoadError, match="No \\*.safetensors"):
        ours(broken)


def test_hub_ids_download_only_model_files_and_errors_are_clear(tiny_qwen2_dir: Path, monkeypatch) -> None:
    import huggingface_hub

    from specdecode.models.loader import HUB_ALLOW_PATTERNS, resolve_model_folder

    calls = []

    def fake_download(repo_id: str, allow_patterns: list[str]) -> str:
        calls.append((repo_id, allow_patterns))
        return str(tiny_qwen2_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert resolve_model_folder("someone/tiny-model", torch.float32) == tiny_qwen2_dir
    assert calls == [("someone/tiny-model", HUB_ALLOW_PATTERNS)]

    def offline(repo_id: str, allow_patterns: list[str]) -> str:
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError, match="someone/tiny-model.*network unreachable"):
        resolve_model_folder("someone/tiny-model", torch.float32)
    with pytest.raises(ModelLoadError, match="neither a local file"):
        resolve_model_folder("not-a-model-anywhere", torch.float32)
