"""Draft distillation: the training loop learns the target's answers, resumes from its
checkpoint, and writes a model folder the loader reads back with the trained weights."""

import json
from pathlib import Path

import pytest
import torch
from helpers import PROMPTS, decoder, plain_tokens

from specdecode import SpecDecoder
from specdecode.errors import InvalidRequestError
from specdecode.models.loader import load_model
from specdecode.training.distill import DistillConfig, compare_drafts, make_data, train_draft

TOKENS = 16


@pytest.fixture(scope="module")
def distilled(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The far (unrelated) tiny draft trained on the tiny target's answers to PROMPTS."""
    base = decoder(tiny_qwen2_dir, tiny_far_draft_dir)
    out = tmp_path_factory.mktemp("distilled")
    data = make_data(base, PROMPTS, out / "data.jsonl", TOKENS, chat=False, show_progress=False)
    config = DistillConfig(out=out, max_new_tokens=TOKENS, train_layers=2, epochs=1, lr=3e-3, accumulate=1, show_progress=False)
    target = base.target.model
    first = train_draft(base.draft.folder, data, config, log=lambda line: None, target=target)
    # A second run with more epochs resumes after epoch 1 instead of starting again.
    messages: list[str] = []
    config.epochs = 12
    result = train_draft(base.draft.folder, data, config, log=messages.append, target=target)
    return base, out, data, first, result, messages


def test_data_is_the_targets_greedy_output_and_resumes(distilled, tiny_qwen2_dir: Path) -> None:
    base, out, data, *_ = distilled
    assert len(data) == len(PROMPTS)
    for text, (prompt_ids, answer_ids) in zip(PROMPTS, data):
        assert answer_ids == plain_tokens(tiny_qwen2_dir, text, TOKENS)
        assert prompt_ids == base.encode(text)
    # A rerun reads the file instead of generating again (it would append otherwise).
    again = make_data(base, PROMPTS, out / "data.jsonl", TOKENS, chat=False, show_progress=False)
    assert again == data and len((out / "data.jsonl").read_text().splitlines()) == len(PROMPTS)


def test_training_lowers_the_loss_and_resumes(distilled) -> None:
    _, _, _, first, result, messages = distilled
    assert any("resuming after epoch 1" in m for m in messages)
    history = result["history"]
    assert [h["epoch"] for h in history] == list(range(1, 13))
    assert history[0] == first["history"][0]
    assert result["loss"] == "kl" and result["loss_before"] == pytest.approx(first["loss_before"])
    assert history[-1]["train_loss"] < 0.5 * result["loss_before"]


def test_ce_loss_trains_too(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path, tmp_path: Path) -> None:
    base = decoder(tiny_qwen2_dir, tiny_far_draft_dir)
    data = make_data(base, PROMPTS[:3], tmp_path / "data.jsonl", 8, chat=False, show_progress=False)
    config = DistillConfig(out=tmp_path, train_layers=1, epochs=4, lr=3e-3, accumulate=1, loss="ce", warmup_steps=3, show_progress=False)
    result = train_draft(base.draft.folder, data, config, log=lambda line: None)  # ce needs no target
    assert result["history"][-1]["train_loss"] < result["loss_before"]
    with pytest.raises(InvalidRequestError, match="kl loss needs the target"):
        train_draft(base.draft.folder, data, DistillConfig(out=tmp_path / "kl", show_progress=False, train_layers=1))


def test_distilled_draft_is_accepted_more(distilled, tiny_qwen2_dir: Path) -> None:
    base, out, *_ = distilled
    tuned_draft = load_model(str(out), torch.float32, torch.device("cpu"), show_progress=False)
    tuned = SpecDecoder(base.target, tuned_draft, base.config)
    reports = compare_drafts({"before": base, "after": tuned}, PROMPTS, chat=False, max_new_tokens=TOKENS)
    assert reports["after"].acceptance > reports["before"].acceptance + 0.2
    assert reports["after"].prompts == len(PROMPTS)


def test_written_folder_holds_the_trained_layers(distilled, tiny_far_draft_dir: Path) -> None:
    base, out, *_ = distilled
    before = base.draft.model
    after = load_model(str(out), torch.float32, torch.device("cpu"), show_progress=False).model
    changed = [name for name, p in after.named_parameters() if not torch.equal(p, before.get_parameter(name))]
    assert changed and all(name.startswith(("layers.", "norm.")) for name in changed)
    torch.testing.assert_close(after.embed_tokens.weight, before.embed_tokens.weight)
    assert json.loads((out / "config.json").read_text()) == json.loads((tiny_far_draft_dir / "config.json").read_text())


def test_bad_settings_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="train_layers="):
        DistillConfig(out=tmp_path, train_layers=0)
    with pytest.raises(InvalidRequestError, match="lr="):
        DistillConfig(out=tmp_path, lr=2.0)
    with pytest.raises(InvalidRequestError, match="loss="):
        DistillConfig(out=tmp_path, loss="mse")


def test_cli_distill_reports_before_and_after(tiny_qwen2_dir: Path, tiny_far_draft_dir: Path, tmp_path: Path, capsys) -> None:
    from specdecode import cli

    one_line = [p for p in PROMPTS if "\n" not in p]
    train, held = tmp_path / "train.txt", tmp_path / "held.txt"
    train.write_text("\n".join(one_line[:4]) + "\n")
    held.write_text("\n".join(one_line[4:6]) + "\n")
    out = tmp_path / "draft"
    args = ["distill", "--target", str(tiny_qwen2_dir), "--draft", str(tiny_far_draft_dir), "--prompts", str(train),
            "--eval-prompts", str(held), "--max-new-tokens", "8", "--epochs", "1", "--train-layers", "2", "--dtype", "fp32", "--device", "cpu",
            "--out", str(out), "--quiet"]
    assert cli.main(args) == 0
    assert "held-apart prompts" in capsys.readouterr().out
    report = json.loads((out / "distill_report.json").read_text())
    assert report["training_prompts"] == 4 and set(report["held_apart"]) == {"before", "after"}
    assert report["held_apart"]["before"]["prompts"] == 2
    held.write_text(one_line[0] + "\n")
    assert cli.main(args) == 2  # an evaluation prompt that was trained on
    assert "keep them apart" in capsys.readouterr().err
    held.write_text(one_line[5] + "\n")
    assert cli.main([*args, "--train-layers", "3"]) == 2  # checked before any answer is generated
    assert "exceeds the draft's 2 layers" in capsys.readouterr().err
