"""Self-speculative layer skip: lossless output, shared weights, a consistent shared cache,
and the tune-layerskip search and file."""

import json
from pathlib import Path

import pytest
import torch
from helpers import CHI2_CRITICAL_P001, PROMPTS, chi_square

from specdecode import SamplingParams, SpecDecoder
from specdecode.drafters.layer_skip import LayerSkipDrafter
from specdecode.drafters.layer_skip_file import LayerSkipChoice, builtin_choice, check_skip_layers, parse_skip_layers
from specdecode.errors import InvalidRequestError
from specdecode.kv.static import reusable_cache
from specdecode.training.layer_search import block_influence, tune_layerskip

SKIP_SETS = [(1,), (2, 3), (1, 2, 3, 4)]


def layerskip_decoder(target: Path, skip: tuple[int, ...] = (2, 3), engine: str = "auto") -> SpecDecoder:
    return SpecDecoder.from_pretrained(
        str(target), method="layerskip", skip_layers=skip, draft_confidence=0.0, dtype="fp32", device="cpu",
        show_progress=False, engine=engine,
    )


def plain(dec: SpecDecoder, prompt: str, max_new_tokens: int = 24) -> list[int]:
    return dec.generate(prompt, SamplingParams(max_new_tokens=max_new_tokens), method="none").token_ids


@pytest.mark.parametrize("skip", SKIP_SETS)
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_layerskip_equals_plain(skip: tuple[int, ...], k: int, tiny_deep_dir: Path) -> None:
    dec = layerskip_decoder(tiny_deep_dir, skip)
    proposed = accepted = 0
    for prompt in PROMPTS[:4]:
        result = dec.generate(prompt, SamplingParams(max_new_tokens=24), k=k)
        assert result.token_ids == plain(dec, prompt), (skip, k, prompt)
        proposed += result.stats.draft_tokens_proposed
        accepted += result.stats.draft_tokens_accepted
    # Both outcomes happen, so rollback (overwrite) of rejected draft slots is exercised.
    assert proposed > accepted > 0


def test_layerskip_shares_the_targets_weights(tiny_deep_dir: Path) -> None:
    dec = layerskip_decoder(tiny_deep_dir)
    drafter = dec.drafters["layerskip"]
    assert isinstance(drafter, LayerSkipDrafter)
    assert drafter.model is dec.target.model  # the same module: no second copy of any weight
    own_tensors = [v for v in vars(drafter).values() if isinstance(v, (torch.Tensor, torch.nn.Module)) and v is not drafter.model]
    assert own_tensors == []
    assert drafter.kept_layers == (0, 1, 4, 5)


def test_shared_cache_matches_a_fresh_prefill_after_rollbacks(tiny_deep_dir: Path) -> None:
    # After a generation with many rejected drafts (draft passes wrote slots that the verify
    # passes then overwrote), every committed slot must hold what a plain prefill writes. The
    # single-request engine's cache, read directly (the batch engine's layer skip: test_batch_heads.py).
    dec = layerskip_decoder(tiny_deep_dir, (1, 2, 3, 4), engine="single")
    prompt_ids = dec.encode(PROMPTS[0])
    result = dec.generate(prompt_ids, SamplingParams(max_new_tokens=30), k=4)
    assert result.stats.draft_tokens_proposed > result.stats.draft_tokens_accepted
    sequence = prompt_ids + result.token_ids
    valid = len(sequence) - 1  # the last token is never fed
    used = dec.engine.target.cache
    assert used is not None and used.lengths[0] == valid
    model = dec.target.model
    fresh = reusable_cache(None, model.config, len(sequence) + 1, model.dtype, model.device)
    with torch.inference_mode():
        model.extend(fresh, torch.tensor([sequence[:valid]]), 0, compute_logits=False)
    for layer in range(model.config.num_layers):
        for got, want in zip(used.read(layer, valid), fresh.read(layer, valid)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)  # rounding of 1 vs many rows


def test_layerskip_sampling_matches_target_distribution(tiny_deep_dir: Path) -> None:
    dec = layerskip_decoder(tiny_deep_dir, (2, 3))
    stat, df = chi_square(dec, dec.encode("def quicksort(arr):"), "layerskip")
    assert stat < CHI2_CRITICAL_P001[df], f"chi2={stat:.1f} df={df}"


def test_skip_layer_arguments() -> None:
    assert parse_skip_layers("3,5,7-9") == (3, 5, 7, 8, 9)
    with pytest.raises(InvalidRequestError, match="ranges like"):
        parse_skip_layers("3,x")
    assert check_skip_layers([4, 2, 2], 6) == (2, 4)
    with pytest.raises(InvalidRequestError, match="0..5"):
        check_skip_layers([6], 6)
    with pytest.raises(InvalidRequestError, match="at least one layer to skip"):
        check_skip_layers([], 6)
    with pytest.raises(InvalidRequestError, match="keep at least one"):
        check_skip_layers(range(6), 6)


def test_layerskip_needs_layers_for_an_untuned_target(tiny_deep_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="tune-layerskip"):
        SpecDecoder.from_pretrained(str(tiny_deep_dir), method="layerskip", dtype="fp32", device="cpu", show_progress=False)
    dec = SpecDecoder.from_pretrained(str(tiny_deep_dir), method="none", dtype="fp32", device="cpu", show_progress=False)
    with pytest.raises(InvalidRequestError, match="no layers to skip"):
        dec.generate("def f():", method="layerskip")


def test_block_influence_is_one_value_per_layer(tiny_deep_dir: Path) -> None:
    dec = layerskip_decoder(tiny_deep_dir)
    ids = dec.encode(PROMPTS[1])
    influence = block_influence(dec.target.model, [(ids, 2)])
    assert len(influence) == 6 and all(0.0 <= v <= 2.0 for v in influence)


def test_tune_layerskip_writes_a_choice_that_generate_loads(tiny_deep_dir: Path, tmp_path: Path, capsys) -> None:
    from specdecode import cli

    prompts = tmp_path / "calibration.txt"
    prompts.write_text("def add(a, b):\nclass Stack:\n")
    out = tmp_path / "layerskip.json"
    common = ["--target", str(tiny_deep_dir), "--dtype", "fp32", "--device", "cpu"]
    assert cli.main(["tune-layerskip", *common, "--prompts", str(prompts), "--max-new-tokens", "8",
                     "--skip-counts", "1,2,3", "--measure-top", "2", "--out", str(out), "--quiet"]) == 0
    assert "saved to" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["num_layers"] == 6 and 1 <= len(data["skip_layers"]) <= 3
    assert 0 not in data["skip_layers"] and 5 not in data["skip_layers"]  # first and last are kept
    measured = [c for c in data["measured"]["candidates"] if c["measured_speedup"] is not None]
    assert len(measured) == 2 and len(data["measured"]["candidates"]) == 3
    choice = LayerSkipChoice.load(out, num_layers=6)
    assert choice.skip_layers == tuple(data["skip_layers"])
    with pytest.raises(InvalidRequestError, match="tuned for a 6-layer model"):
        LayerSkipChoice.load(out, num_layers=28)
    assert cli.main(["generate", *common, "--method", "layerskip", "--layerskip-config", str(out),
                     "--max-new-tokens", "6", "--quiet", "--json", "def f():"]) == 0
    assert '"token_ids"' in capsys.readouterr().out


def test_tune_layerskip_rejects_shallow_models(tiny_qwen2_dir: Path) -> None:
    dec = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", dtype="fp32", device="cpu", show_progress=False)
    with pytest.raises(InvalidRequestError, match="at least 3 layers"):
        tune_layerskip(dec, [dec.encode("def f():")], log=lambda line: None)


def test_demo_target_ships_a_tuned_choice() -> None:
    from specdecode.models import demo

    choice = builtin_choice(demo.DEFAULT_TARGET)
    assert choice is not None and choice.num_layers == 28
    assert 0 not in choice.skip_layers and 27 not in choice.skip_layers
    assert choice.measured["measured_speedup"] > 0  # the figures behind the choice travel with it
    assert builtin_choice("not-a-demo-model") is None
