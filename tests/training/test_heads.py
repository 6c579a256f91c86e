"""Medusa and EAGLE heads: training learns, decoding with them is lossless, tree KV compaction is exact."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import CHI2_CRITICAL_P001, PATTERN, chi_square, train_pattern_heads

import specdecode.training.features
from specdecode import SamplingParams, SpecDecoder
from specdecode.core.tree import TokenTree
from specdecode.drafters.medusa import build_static_tree
from specdecode.drafters.plan import RequestPlan
from specdecode.engine.metrics import GenerationStats
from specdecode.errors import InvalidRequestError, ModelLoadError
from specdecode.kv.static import Int8KVCache, KVCache
from specdecode.models.heads import HeadConfig, load_heads, new_heads
from specdecode.models.loader import load_model
from specdecode.training.features import FeatureSpec, extract, iter_sequences, read_shards
from specdecode.training.heads import TrainConfig, medusa_accuracy

PROMPTS = ["def add(a, b):", "class Counter:", "return fibonacci(n - 1)"]


def _decoder(target: Path, method: str, heads: Path, tree_size: int | None = None, engine: str = "auto") -> SpecDecoder:
    return SpecDecoder.from_pretrained(str(target), method=method, heads=str(heads), tree_size=tree_size,
                                       dtype="fp32", device="cpu", show_progress=False, engine=engine)


def test_training_learns_a_repeated_pattern(pattern_features, medusa_dir: Path, eagle_dir: Path) -> None:
    import json

    medusa = json.loads((medusa_dir / "train_report.json").read_text())
    eagle = json.loads((eagle_dir / "train_report.json").read_text())
    # Untrained Medusa heads (zero residual blocks) repeat the target's guess for the next
    # token one position too early: right by coincidence only.
    target_dir, shards = pattern_features
    loaded = load_model(str(target_dir), torch.float32, torch.device("cpu"), show_progress=False)
    fresh = new_heads(HeadConfig.for_target("medusa", loaded.config, loaded.config.vocab_size, num_heads=3))
    fresh.init_vocab(torch.arange(loaded.config.vocab_size), loaded.model.lm_head.weight)
    held_apart = list(iter_sequences(shards))[-2:]
    untrained = medusa_accuracy(fresh, held_apart)[0][0]
    # The random target's greedy tokens on the repeated text are only partly periodic, so
    # ~0.75 (Medusa) and ~0.85 (EAGLE depth 1) is what 12 epochs reach on held-apart data.
    assert untrained < 0.3
    assert medusa["accuracy"][0] > 0.6, medusa["accuracy"]
    assert eagle["accuracy"][0] > 0.7, eagle["accuracy"]
    assert medusa["epoch_losses"][-1] < medusa["epoch_losses"][0]
    assert eagle["epoch_losses"][-1] < eagle["epoch_losses"][0]
    assert len(medusa["tree"]) == 6 and all(len(p) <= 3 for p in medusa["tree"])


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_greedy_tree_decoding_equals_plain(method: str, tiny_qwen2_dir: Path, medusa_dir: Path, eagle_dir: Path) -> None:
    heads = medusa_dir if method == "medusa" else eagle_dir
    # generate's default k on torch is fixed: a tree every step, on either engine.
    dec = _decoder(tiny_qwen2_dir, method, heads)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    accepted = 0
    for prompt in PROMPTS + [PATTERN[:60]]:
        plain = dec.generate(prompt, params, method="none").token_ids
        tree = dec.generate(prompt, params)
        assert tree.token_ids == plain, prompt
        accepted += tree.stats.draft_tokens_accepted
        assert tree.stats.tree_nodes_proposed > 0
    assert accepted > 0  # the trees were used, not only rejected


def test_one_token_prompt_and_untrained_heads(tiny_qwen2_dir: Path, pattern_features, tmp_path: Path) -> None:
    train_pattern_heads("eagle", pattern_features, tmp_path / "e", epochs=1)
    dec = _decoder(tiny_qwen2_dir, "eagle", tmp_path / "e")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    one = dec.encode("def")[:1]
    assert dec.generate(one, params).token_ids == dec.generate(one, params, method="none").token_ids


@pytest.mark.parametrize("method", ["medusa", "eagle"])
def test_tree_sampling_matches_target_distribution(method: str, tiny_qwen2_dir: Path, medusa_dir: Path, eagle_dir: Path) -> None:
    # The chi-square test of test_engine.py (first three tokens, 1,500 draws, p = 0.001).
    dec = _decoder(tiny_qwen2_dir, method, medusa_dir if method == "medusa" else eagle_dir)
    prompt_ids = dec.encode("def quicksort(arr):")
    stat, df = chi_square(dec, prompt_ids, method)
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_tree_cache_keeps_exactly_the_accepted_path(tiny_qwen2_dir: Path, eagle_dir: Path) -> None:
    dec = _decoder(tiny_qwen2_dir, "eagle", eagle_dir, engine="single")  # its engine's cache, read below
    result = dec.generate(PATTERN[:60], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert result.stats.draft_tokens_accepted > 0
    assert_cache_equals_fresh_prefill(dec, dec.encode(PATTERN[:60]) + result.token_ids)


def assert_cache_equals_fresh_prefill(dec: SpecDecoder, tokens: list[int]) -> None:
    """Every committed slot of the engine's target cache equals a fresh prefill of ``tokens``."""
    cache = dec.engine.target.cache
    valid = cache.lengths[0]
    fresh = KVCache(len(cache.keys), 1, cache.keys[0].shape[1], cache.keys[0].shape[3], valid, torch.float32, "cpu")
    with torch.inference_mode():
        dec.target.model.extend(fresh, torch.tensor([tokens])[:, :valid], 0)
    for layer in range(len(cache.keys)):
        torch.testing.assert_close(cache.keys[layer][:, :, :valid], fresh.keys[layer], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache.values[layer][:, :, :valid], fresh.values[layer], rtol=1e-4, atol=1e-4)


class OracleTreeDrafter:
    """Knows the target's greedy continuation and hides it in the second branch at every depth,
    so every step accepts a path that is not the first nodes: the cache must be compacted."""

    max_tree_nodes = 6
    last_forward_passes = 0

    def __init__(self, prompt_len: int, reference: list[int], vocab: int) -> None:
        self.prompt_len, self.reference, self.vocab = prompt_len, reference, vocab
        self.compacted_steps = 0

    def start(self, prompt_len: int, capacity: int, target_cache: KVCache, shared_prefix: int = 0) -> None:
        pass

    def observe(self, features: torch.Tensor, start: int) -> None:
        pass

    def propose_tree(self, committed, max_depth, processor, generator) -> TokenTree:
        done = committed.shape[1] - self.prompt_len
        right = self.reference[done : done + 3]
        if len(right) < 3 or max_depth < 3:
            return TokenTree([-1], committed[0, -1:], [False])
        wrong = [(t + 1) % self.vocab for t in right]
        # root -> {wrong0, right0}; right0 -> {wrong1, right1}; right1 -> right2
        tokens = [committed[0, -1].item(), wrong[0], right[0], wrong[1], right[1], right[2]]
        self.compacted_steps += 1
        return TokenTree([-1, 0, 0, 2, 2, 4], torch.tensor(tokens), [False] * 6)


def test_tree_kv_compaction_matches_recomputed_cache(tiny_qwen2_dir: Path) -> None:
    dec = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu", show_progress=False)
    prompt = dec.encode("def quicksort(arr):")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reference = dec.generate(prompt, params).token_ids
    oracle = OracleTreeDrafter(len(prompt), reference, dec.target.config.vocab_size)
    stats = GenerationStats()
    emitted = [t for chunk in dec.engine.decode(prompt, params, RequestPlan("medusa", oracle, tree=True), stats) for t in chunk]
    assert emitted == reference
    assert oracle.compacted_steps >= 5 and stats.tau > 3.5  # paths 0 -> 2 -> 4 -> 5 accepted
    assert_cache_equals_fresh_prefill(dec, prompt + reference)


@pytest.mark.parametrize("cache_class", [KVCache, Int8KVCache])
def test_keep_path_moves_path_slots_into_place(cache_class) -> None:
    cache = cache_class(2, 1, 2, 4, 16, torch.float32, "cpu")
    values = torch.arange(1, 9, dtype=torch.float32)[None, None, :, None].expand(1, 2, 8, 4)  # slot s holds s + 1
    for layer in range(2):
        cache.write(layer, torch.arange(3, 11)[None], values, values, contiguous_start=3)
    cache.keep_path(0, 3, [0, 2, 5])  # tree nodes 0, 2, 5 were written at slots 3, 5, 8
    keys, _ = cache.read(0, 6)
    torch.testing.assert_close(keys[0, 0, 3:6, 0], torch.tensor([1.0, 3.0, 6.0]), rtol=0.01, atol=0.01)


def test_static_tree_is_best_first_and_closed() -> None:
    accuracy = [[0.8, 0.1], [0.6, 0.2], [0.5, 0.1]]
    tree = build_static_tree(accuracy, 4)
    # Path probabilities: (0,) .8, (0,0) .48, (0,0,0) .24, (0,1) .16, (1,) .1 ...
    assert tree == ((0,), (0, 0), (0, 1), (0, 0, 0))
    with pytest.raises(InvalidRequestError):
        build_static_tree(accuracy, 0)


def test_heads_round_trip_and_errors(tiny_qwen2_dir: Path, tiny_deep_dir: Path, medusa_dir: Path, tmp_path: Path) -> None:
    heads = load_heads(medusa_dir, torch.float32, torch.device("cpu"))
    assert heads.config.kind == "medusa" and heads.config.tree
    with pytest.warns(UserWarning, match="were trained for"):
        heads.config = replace(heads.config, target_name="another-model")
        SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu",
                                    show_progress=False).attach_heads(heads)
    with pytest.raises(ModelLoadError, match="not a heads folder"):
        load_heads(tmp_path, torch.float32, torch.device("cpu"))
    with pytest.raises(InvalidRequestError, match="needs trained heads"):
        SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="eagle", dtype="fp32", device="cpu", show_progress=False)
    with pytest.raises(InvalidRequestError, match="needs eagle heads"):
        _decoder(tiny_qwen2_dir, "eagle", medusa_dir)
    with pytest.raises(InvalidRequestError, match="typical"):
        dec = _decoder(tiny_qwen2_dir, "medusa", medusa_dir)
        dec.generate("def", SamplingParams(max_new_tokens=2), method="none", acceptance="typical")
    with pytest.raises(InvalidRequestError, match="must be one of"):
        TrainConfig(kind="lora")


def test_typical_acceptance_runs_and_is_opt_in(tiny_qwen2_dir: Path, medusa_dir: Path) -> None:
    dec = _decoder(tiny_qwen2_dir, "medusa", medusa_dir, tree_size=4)
    params = SamplingParams(temperature=0.7, max_new_tokens=20, seed=3, ignore_eos=True)
    result = dec.generate(PATTERN[:60], params, acceptance="typical")
    assert len(result.token_ids) == 20 and result.stats.tree_nodes_proposed > 0


def test_cli_train_then_generate(capsys, tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    import json

    from specdecode import cli

    data = tmp_path / "pattern.txt"
    data.write_text(PATTERN)
    base = ["train", "medusa", "--target", str(tiny_qwen2_dir), "--data", str(data), "--max-tokens", "400",
            "--seq-len", "64", "--epochs", "1", "--heads", "2", "--tree-size", "3", "--dtype", "fp32",
            "--device", "cpu", "--out", str(tmp_path / "h"), "--quiet"]
    assert cli.main(base) == 0
    assert "held-apart top-1 accuracy per head" in capsys.readouterr().err
    report = json.loads((tmp_path / "h" / "train_report.json").read_text())
    assert report["train_tokens"] > 0 and len(report["tree"]) == 3
    assert not (tmp_path / "h" / "checkpoint.pt").exists()
    gen = ["generate", "def add(a, b):", "--target", str(tiny_qwen2_dir), "--method", "medusa", "--heads",
           str(tmp_path / "h"), "--max-new-tokens", "8", "--dtype", "fp32", "--device", "cpu", "--json", "--quiet"]
    assert cli.main(gen) == 0
    out = json.loads(capsys.readouterr().out)
    plain = cli.main(gen[:5] + ["none"] + gen[6:])
    assert plain == 0 and json.loads(capsys.readouterr().out)["token_ids"] == out["token_ids"]
    assert out["stats"]["tree_nodes_proposed"] > 0
    bad = base[:5] + [str(tmp_path / "missing.txt")] + base[6:]
    assert cli.main(bad) == cli.EXIT_USER_ERROR
    assert "no such file or folder" in capsys.readouterr().err
    assert cli.main(gen[:-2] + ["--method", "ngram", "--acceptance", "typical", "--quiet"]) == cli.EXIT_USER_ERROR
    assert "typical applies to the tree methods" in capsys.readouterr().err


def test_cost_aware_tree_size_follows_the_verify_costs() -> None:
    from specdecode.drafters.medusa import cost_aware_tree_size

    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.1]]
    flat = [1.0] * 13  # a GPU: extra rows cost nothing, so every node pays
    steep = [1.0 + 0.25 * rows for rows in range(13)]  # a CPU: each row costs a quarter pass
    assert cost_aware_tree_size(accuracy, flat) == 12
    # Hand-computed: paths .6, .3, .2, .12 ... give (1 + .6) / 1.25 = 1.28, (1.9) / 1.5 = 1.27, ...
    assert cost_aware_tree_size(accuracy, steep) == 1
    assert cost_aware_tree_size(accuracy, [1.0 + 0.05 * rows for rows in range(13)]) > 3


def test_feature_extraction_extends_a_smaller_run(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "pattern.txt"
    data.write_text(PATTERN)
    loaded = load_model(str(tiny_qwen2_dir), torch.float32, torch.device("cpu"), show_progress=False)
    calls = []

    def encode(text: str) -> list[int]:
        return list(loaded.tokenizer(text, add_special_tokens=False)["input_ids"])

    real = specdecode.training.features.target_features

    def counting(model, tokens, top_k):
        calls.append(len(tokens))
        return real(model, tokens, top_k)

    specdecode.training.features.target_features = counting
    try:
        small = FeatureSpec(target="tiny", sources=(str(data),), seq_len=32, max_tokens=32 * 20, top_k=4)
        extract(loaded.model, encode, small, tmp_path / "f", show_progress=False)
        first = sum(calls)
        calls.clear()
        large = FeatureSpec(target="tiny", sources=(str(data),), seq_len=32, max_tokens=32 * 40, top_k=4)
        shards = read_shards(extract(loaded.model, encode, large, tmp_path / "f", show_progress=False))
    finally:
        specdecode.training.features.target_features = real
    # 20 sequences = one full shard of 16 (kept) and one of 4 (redone in the larger run).
    assert first == 32 * 20 and sum(calls) == 32 * 40 - 32 * 16
    assert sum(seq.tokens.numel() for seq in iter_sequences(shards)) == 32 * 40
