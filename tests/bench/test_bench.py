"""The benchmark harness: prompt sets, every method through a run, aggregation, failures, Ctrl-C."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from specdecode import cli
from specdecode.bench import methods as bench_methods
from specdecode.bench.report import ALL, aggregate, first_difference, summarize
from specdecode.bench.roofline import ceiling_tokens_per_second, measure_copy_bandwidth, weight_bytes_per_forward
from specdecode.bench.runner import Bench, BenchConfig, write_results
from specdecode.config import ModelConfig, SamplingParams
from specdecode.engine.metrics import GenerationStats
from specdecode.errors import InvalidRequestError
from specdecode.prompt_sets import (
    CATEGORIES,
    HUMANEVAL,
    MT_BENCH,
    MT_BENCH_SUBCATEGORIES,
    load_prompts,
    load_spec_bench,
    select_prompts,
)

ALL_METHODS = ("none", "draft", "ngram", "hf", "hf-assisted", "hf-lookup", "draft+nocache")
MAX_NEW = 10

# ---------------------------------------------------------------- prompt sets


def test_default_set_is_the_documented_fixed_subset() -> None:
    chosen = select_prompts(load_prompts(["default"]), ["all"], 3)
    ids = {c: [p.prompt_id for p in chosen if p.category == c] for c in CATEGORIES}
    assert list(ids) == list(CATEGORIES) and all(len(v) == 3 for v in ids.values())
    # The numbers the prompts module's docstring promises.
    assert ids[MT_BENCH] == ["spec_bench:81", "spec_bench:91", "spec_bench:101"]
    assert ids["translation"] == ["spec_bench:161", "spec_bench:163", "spec_bench:165"]
    assert ids["summarization"] == ["spec_bench:241", "spec_bench:243", "spec_bench:245"]
    assert ids["rag"] == ["spec_bench:481", "spec_bench:483", "spec_bench:485"]
    assert ids[HUMANEVAL] == ["humaneval:HumanEval/0", "humaneval:HumanEval/1", "humaneval:HumanEval/2"]
    assert all(len(p.turns) == 2 for p in chosen if p.category == MT_BENCH)
    first_problem = next(p for p in chosen if p.category == HUMANEVAL).turns[0]
    assert "```python\n" in first_problem and "def has_close_elements" in first_problem


def test_mt_bench_rows_round_robin_over_subcategories() -> None:
    mt = [p for p in load_spec_bench() if p.category == MT_BENCH]
    assert [p.subcategory for p in mt[:8]] == list(MT_BENCH_SUBCATEGORIES)
    assert len(mt) == 40 and len({p.prompt_id for p in mt}) == 40


def test_text_and_jsonl_prompt_files(tmp_path: Path) -> None:
    text = tmp_path / "mine.txt"
    text.write_text("first prompt\n\n second\\nline \n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question_id": 7, "category": "writing", "turns": ["a", "b"]}) + "\n")
    prompts = load_prompts([str(text), str(rows)])
    assert [p.turns for p in prompts] == [("first prompt",), (" second\nline ",), ("a", "b")]
    assert [p.category for p in prompts] == ["text", "text", MT_BENCH]
    # An MT-bench row under a sub-category Spec-Bench does not have (here "mt_bench" itself) is kept.
    rows.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": ["t"]}) + "\n"
                            for i, c in ((1, "mt_bench"), (2, "writing"), (3, "qa"))))
    assert [p.prompt_id for p in load_spec_bench(rows)] == ["rows:2", "rows:1", "rows:3"]


@pytest.mark.parametrize(
    "content, pattern",
    [("not json\n", "not a Spec-Bench row"), (json.dumps({"question_id": 1, "category": "qa", "turns": []}), "turns")],
)
def test_bad_prompt_files_are_clear_errors(tmp_path: Path, content: str, pattern: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(InvalidRequestError, match=pattern):
        load_prompts([str(path)])


def test_unknown_category_and_duplicate_source() -> None:
    with pytest.raises(InvalidRequestError, match="No prompts in category poetry"):
        select_prompts(load_prompts(["spec_bench"]), ["poetry"], 3)
    with pytest.raises(InvalidRequestError, match="appears twice"):
        load_prompts(["humaneval", "humaneval"])


# ---------------------------------------------------------------- aggregation on hand-built traces


def turn(
    steps: list[tuple[int, int]], seconds: float, draft_passes: int = 0, tokens: list[int] | None = None, prefill: float = 0.0
) -> dict[str, Any]:
    """A turn dict as the harness stores it, from (proposed, accepted) per verify step."""
    stats = GenerationStats()
    for proposed, accepted in steps:
        stats.record_step(proposed, accepted)
    emitted = stats.emitted_by_steps
    return bench_methods.TurnResult(
        tokens=tokens if tokens is not None else list(range(emitted)),
        text="", prompt_tokens=5, seconds=seconds, prefill_seconds=prefill, draft_seconds=0.25 * seconds,
        verify_seconds=0.5 * seconds, target_passes=stats.target_forward_passes + 1, draft_passes=draft_passes,
        verify_steps=stats.verify_steps, emitted_by_steps=emitted,
        draft_tokens_proposed=stats.draft_tokens_proposed, draft_tokens_accepted=stats.draft_tokens_accepted,
        proposed_at_position=stats.proposed_at_position, accepted_at_position=stats.accepted_at_position,
    ).to_dict()


def test_tau_and_acceptance_are_pooled_over_steps_not_averaged_over_prompts() -> None:
    # Prompt A: 3 steps of 4 drafts, accepting 4, 0, 2 -> emits 5 + 1 + 3 = 9 tokens in 3 s.
    # Prompt B: 1 step of 2 drafts, accepting 0 -> emits 1 token in 1 s.
    runs = {"A": [turn([(4, 4), (4, 0), (4, 2)], 3.0)], "B": [turn([(2, 0)], 1.0)]}
    entry = aggregate(runs, failed=0, target_bytes=100, draft_bytes=10, bandwidth=1000.0)
    assert entry["tau"] == pytest.approx(10 / 4)  # mean of per-prompt taus would say (3 + 1) / 2 = 2
    assert entry["acceptance_rate"] == pytest.approx(6 / 14)  # the per-prompt mean would say 0.25
    assert entry["acceptance_per_position"] == pytest.approx([2 / 4, 2 / 4, 1 / 3, 1 / 3])
    assert entry["tokens_per_second"] == pytest.approx(10 / 4)  # not the mean of rates, 2.0
    assert entry["time_split"] == pytest.approx({"prefill": 0.0, "draft": 0.25, "verify": 0.5, "other": 0.25})
    # Ceiling: 10 tokens, 6 target passes x 100 bytes at 1000 bytes/s.
    assert entry["ceiling_tokens_per_second"] == pytest.approx(10 * 1000 / 600)
    assert entry["fraction_of_ceiling"] == pytest.approx(2.5 / (10 * 1000 / 600))


def test_decode_speedup_leaves_out_the_prefill_both_methods_share() -> None:
    # Both spend 6 s in prefill; plain then decodes 8 tokens in 8 s, draft in 2 s. End to end
    # that is 14 s against 8 s (1.75x); the decoding loops alone, 8 s against 2 s (4x).
    plain = [turn([(0, 0)] * 8, 14.0, prefill=6.0)]
    spec = [turn([(4, 3), (4, 3)], 8.0, draft_passes=8, prefill=6.0)]
    summary = summarize([record("none", "A", plain), record("draft", "A", spec)], ["none", "draft"], greedy=False,
                        weight_bytes={}, bandwidth=None)
    entry = summary["draft"][ALL]
    assert entry["speedup_vs_none"] == pytest.approx(14 / 8)
    assert entry["decode_speedup_vs_none"] == pytest.approx(4.0)
    assert entry["decode_tokens_per_second"] == pytest.approx(8 / 2)
    assert summary["none"][ALL]["decode_speedup_vs_none"] == pytest.approx(1.0)


def record(method: str, prompt_id: str, turns: list[dict[str, Any]] | None, error: str | None = None, category: str = "qa") -> dict[str, Any]:
    return {"prompt_id": prompt_id, "category": category, "subcategory": category, "method": method,
            "repeats": [turns] if turns else [], "error": error}


def test_speedups_use_the_same_prompts_and_equality_flags_a_planted_mismatch() -> None:
    plain = {p: [turn([(0, 0)] * n, float(n), tokens=list(range(n)))] for p, n in (("A", 8), ("B", 4), ("C", 6))}
    spec_a = [turn([(4, 3), (4, 3)], 2.0, draft_passes=8, tokens=list(range(8)))]
    planted = list(range(4))
    planted[2] = 99  # the speculative output differs from plain at token 2 of turn 0
    spec_b = [turn([(4, 3)], 1.0, draft_passes=4, tokens=planted)]
    records = [record("none", p, t) for p, t in plain.items()]
    records += [record("draft", "A", spec_a), record("draft", "B", spec_b), record("draft", "C", None, error="RuntimeError: boom")]
    summary = summarize(records, ["none", "draft"], greedy=True, weight_bytes={"none": (100, 0), "draft": (100, 10)}, bandwidth=None)
    entry = summary["draft"][ALL]
    assert entry["failed"] == 1 and entry["prompts"] == 2
    # 12 tokens in 3 s against plain's 12 tokens in 12 s on A and B (C failed, so it is left out).
    assert entry["speedup_vs_none"] == pytest.approx(4.0)
    assert entry["equality"]["equal_fraction"] == 0.5
    assert entry["equality"]["first_differences"] == {"B": {"turn": 0, "position": 2}}
    assert summary["none"][ALL]["equality"] is None  # its reference, hf, was not run
    assert first_difference([{"tokens": [1, 2]}], [{"tokens": [1, 2, 3]}]) == {"turn": 0, "position": 2}


def test_repeats_contribute_their_median_time_run() -> None:
    fast, mid, slow = (turn([(0, 0)] * 4, s) for s in (1.0, 2.0, 9.0))
    rec = {"prompt_id": "A", "category": "qa", "subcategory": "qa", "method": "none", "repeats": [[slow], [fast], [mid]], "error": None}
    summary = summarize([rec], ["none"], greedy=True, weight_bytes={"none": (1, 1)}, bandwidth=None)
    assert summary["none"][ALL]["seconds"] == 2.0


# ---------------------------------------------------------------- roofline


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_match_the_hf_model_parameters(tmp_path: Path, tied: bool) -> None:
    import tiny_models
    from transformers import AutoModelForCausalLM

    folder = tiny_models.make_tiny_hf_model(tmp_path / "m", arch="qwen2", tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    if not tied:
        total -= model.get_input_embeddings().weight.numel()  # a lookup reads one row, not the table
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    assert weight_bytes_per_forward(config, torch.float32) == 4 * total
    assert weight_bytes_per_forward(config, torch.bfloat16) == 2 * total


def test_bandwidth_probe_and_ceiling() -> None:
    bandwidth = measure_copy_bandwidth(torch.device("cpu"), num_bytes=8 << 20, repeats=3)
    assert 0 < bandwidth < float("inf")  # its size is the machine's business, not a test's
    assert ceiling_tokens_per_second(0, 1, 0, 10, 0, 1.0) is None
    assert ceiling_tokens_per_second(6, 2, 10, 100, 10, 600.0) == pytest.approx(12.0)


# ---------------------------------------------------------------- the harness end to end


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "mini.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a short poem about code.", "Now make it rhyme."]},
        {"question_id": 2, "category": "qa", "turns": ["def fibonacci(n):"]},
        {"question_id": 3, "category": "qa", "turns": ["class Counter:"]},
        {"question_id": 4, "category": "rag", "turns": ["return " * 600]},  # beyond the tiny 512-token context
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def bench_run(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path, prompt_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    config = BenchConfig(
        target=str(tiny_qwen2_dir), draft=str(tiny_close_draft_dir), methods=ALL_METHODS, prompts=(str(prompt_file),),
        max_prompts_per_category=None, max_new_tokens=MAX_NEW, k=3, draft_confidence=0.0, dtype="fp32", device="cpu",
        bandwidth_probe_bytes=8 << 20, quiet=True, warmup=True,
    )
    bench = Bench(config)
    prompts = select_prompts(load_prompts(config.prompts), None, None)
    results = bench.run(prompts)
    out = tmp_path_factory.mktemp("bench_out")
    from rich.console import Console

    write_results(results, out, plots=True, console=Console(quiet=True))
    return results, out


def test_from_results_recomputes_the_summary_without_loading_a_model(
    bench_run: tuple[dict, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results, out = bench_run
    stored = json.loads((out / "results.json").read_text())
    for entry in stored["summary"].values():  # as a run from before a figure existed would have it
        for group in entry.values():
            group.pop("decode_speedup_vs_none")
    (tmp_path / "old.json").write_text(json.dumps(stored))
    assert cli.main(["bench", "--from-results", str(tmp_path / "old.json"), "--out", str(tmp_path / "new"), "--no-plots", "--quiet"]) == 0
    redone = json.loads((tmp_path / "new" / "results.json").read_text())
    assert redone["records"] == stored["records"]
    assert redone["summary"] == json.loads(json.dumps(results["summary"]))
    assert "decode vs none" in (tmp_path / "new" / "report.md").read_text()
    # A run from before quantized variants stored no per-method weight bytes: the two models' serve.
    del stored["models"]["weight_bytes_by_method"]
    (tmp_path / "older.json").write_text(json.dumps(stored))
    assert cli.main(["bench", "--from-results", str(tmp_path / "older.json"), "--out", str(tmp_path / "older"), "--no-plots", "--quiet"]) == 0
    older = json.loads((tmp_path / "older" / "results.json").read_text())["summary"]
    assert older["draft"][ALL]["tokens_per_second"] == redone["summary"]["draft"][ALL]["tokens_per_second"]
    assert older["draft"][ALL]["ceiling_tokens_per_second"] == pytest.approx(redone["summary"]["draft"][ALL]["ceiling_tokens_per_second"])
    (tmp_path / "bad.json").write_text("{}")
    assert cli.main(["bench", "--from-results", str(tmp_path / "bad.json"), "--out", str(tmp_path / "x"), "--quiet"]) == cli.EXIT_USER_ERROR
    assert "not a specdecode bench results.json" in capsys.readouterr().err


def test_every_method_runs_through_the_harness(bench_run: tuple[dict, Path]) -> None:
    results, _ = bench_run
    assert results["complete"] and not results["warmup_errors"]
    ok = [r for r in results["records"] if not r["error"]]
    assert {r["method"] for r in ok} == set(ALL_METHODS)
    for r in ok:
        for t in r["repeats"][0]:
            assert 0 < len(t["tokens"]) <= MAX_NEW and t["seconds"] > 0 and t["target_passes"] >= 1
    # Plain decodings have tau 1 exactly; the close draft gets some tokens accepted.
    summary = results["summary"]
    assert summary["none"][ALL]["tau"] == 1.0 and summary["hf"][ALL]["tau"] == 1.0
    assert summary["draft"][ALL]["tau"] > 1.0 and 0 < summary["draft"][ALL]["acceptance_rate"] <= 1
    assert summary["draft"][ALL]["draft_passes_per_step"] > 0 and summary["hf-assisted"][ALL]["draft_passes"] > 0


def test_greedy_outputs_equal_their_plain_decoding(bench_run: tuple[dict, Path]) -> None:
    summary = bench_run[0]["summary"]
    assert summary["draft"][ALL]["equality"]["equal_fraction"] == 1.0  # lossless
    assert summary["ngram"][ALL]["equality"]["equal_fraction"] == 1.0
    assert summary["draft+nocache"][ALL]["equality"]["equal_fraction"] == 1.0  # the same outputs as with the cache
    assert summary["none"][ALL]["equality"]["reference"] == "hf"
    assert summary["none"][ALL]["equality"]["equal_fraction"] == 1.0  # same model code as transformers


def test_multi_turn_history_holds_the_models_own_answer(bench_run: tuple[dict, Path]) -> None:
    results, _ = bench_run
    for r in results["records"]:
        if r["prompt_id"] == "mini:1" and not r["error"]:
            first, second = r["repeats"][0]
            assert second["prompt_tokens"] > first["prompt_tokens"] + len(first["tokens"]) - 1
            if r["method"] in ("none", "draft", "ngram"):
                # The second turn reuses the first's K/V (the prefix cache); the first starts cold,
                # though another method just answered the same prompt.
                assert first["cached_tokens"] == 0 and second["cached_tokens"] >= first["prompt_tokens"]
            elif r["method"] == "draft+nocache":
                assert first["cached_tokens"] == second["cached_tokens"] == 0


def test_a_failing_prompt_is_recorded_and_the_run_goes_on(bench_run: tuple[dict, Path]) -> None:
    results, _ = bench_run
    failures = {(f["prompt_id"], f["method"]) for f in results["failures"]}
    assert ("mini:4", "none") in failures and ("mini:4", "draft") in failures
    assert all("context" in f["error"] for f in results["failures"] if f["method"] in ("none", "draft"))
    assert results["summary"]["draft"]["rag"]["failed"] == 1
    assert results["summary"]["draft"][ALL]["prompts"] == 3


DOCUMENTED_TOP = {"schema", "complete", "env", "config", "chat_template", "num_speculative_tokens", "draft_confidence",
                  "models", "bandwidth", "wall_seconds", "load_peak_rss_bytes", "compile", "warmup_errors", "prompts", "summary",
                  "oracle", "failures", "records"}
DOCUMENTED_ENTRY = {"prompts", "failed", "new_tokens", "seconds", "tokens_per_second", "tokens_per_second_median", "tau",
                    "acceptance_rate", "acceptance_per_position", "draft_passes_per_step", "target_passes", "draft_passes",
                    "time_split", "peak_rss_bytes", "run_rss_bytes", "ceiling_tokens_per_second", "fraction_of_ceiling",
                    "speedup_vs_none", "speedup_vs_hf", "equality", "decode_tokens_per_second", "decode_speedup_vs_none"}


def test_results_json_has_the_documented_fields(bench_run: tuple[dict, Path]) -> None:
    _, out = bench_run
    data = json.loads((out / "results.json").read_text())
    assert set(data) == DOCUMENTED_TOP and data["oracle"] is None  # --oracle not asked for
    assert DOCUMENTED_ENTRY <= set(data["summary"]["draft"][ALL])
    for key in ("torch", "transformers", "cpu", "threads", "dtype", "git_commit", "date"):
        assert key in data["env"]
    assert data["bandwidth"]["copy_bytes_per_second"] > 0
    assert data["models"]["target"]["weight_bytes_per_forward"] == data["models"]["draft"]["weight_bytes_per_forward"] > 0  # a same-size noisy copy
    for name in ("report.md", "speedup.png", "acceptance.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"


class _Interrupting:
    """A method that is Ctrl-C'd on its second prompt."""

    name = "none"

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def run_turn(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        self.calls += 1
        if self.calls == 3:  # warm-up, first prompt, then the second prompt
            raise KeyboardInterrupt
        return self.inner.run_turn(prompt_ids, params)


def test_ctrl_c_keeps_what_was_measured(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    config = BenchConfig(target=str(tiny_qwen2_dir), methods=("none",), prompts=("humaneval",), max_new_tokens=4,
                         dtype="fp32", device="cpu", bandwidth_probe_bytes=0, quiet=True)
    bench = Bench(config)
    bench.methods["none"] = _Interrupting(bench.methods["none"])
    prompts = select_prompts(load_prompts(config.prompts), None, 3)
    results = bench.run(prompts)
    assert results["complete"] is False
    assert [r["prompt_id"] for r in results["records"]] == ["humaneval:HumanEval/0"]
    assert results["summary"]["none"][ALL]["new_tokens"] == 4
    from rich.console import Console

    written = write_results(results, tmp_path, plots=True, console=Console(quiet=True))
    assert json.loads(written[0].read_text())["complete"] is False


def test_bench_holds_one_decoder_config(tiny_qwen2_dir: Path) -> None:
    """A BenchConfig's decoder settings are one DecoderConfig, given whole or field by field, and
    every method's decoder is built from it: fields bench never names (k_max, jump_forward) reach
    each method, and a copy with other methods keeps them."""
    from dataclasses import replace

    from specdecode.config import DecoderConfig

    bench_fields = dict(methods=("none", "ngram"), max_new_tokens=4, bandwidth_probe_bytes=0, quiet=True, warmup=False)
    flat = BenchConfig(target=str(tiny_qwen2_dir), k=3, k_max=4, jump_forward=False, dtype="fp32", device="cpu",
                       draft_confidence=None, **bench_fields)  # None keeps the decoder's default
    whole = BenchConfig(decoder=DecoderConfig(target=str(tiny_qwen2_dir), k=3, k_max=4, jump_forward=False,
                                              dtype="fp32", device="cpu"), **bench_fields)
    assert flat == whole and flat.decoder.k == 3 and flat.decoder.draft_confidence == DecoderConfig().draft_confidence
    assert replace(flat, methods=("none",)).decoder == flat.decoder
    bench = Bench(flat)
    for name in ("none", "ngram"):
        config = bench.methods[name].decoder.config  # type: ignore[attr-defined]  # a SpecDecodeMethod
        assert (config.k_max, config.jump_forward, config.backend, config.dtype) == (4, False, "torch", "fp32")
    assert bench.methods["ngram"].k == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"draft_confidnce": 0.1}, "Unknown bench option 'draft_confidnce'. Did you mean 'draft_confidence'?"),
        ({"draft_confidence": 2.0}, "draft_confidence must be in [0, 1)"),
        ({"kv_dtype": "fp8"}, "kv_dtype='fp8' is not one of"),
        ({"backend": "llama.cpp"}, "backend='llama.cpp': bench sets it for each method (a label sets it: none@llama.cpp)"),
        ({"method": "ngram"}, "method='ngram': bench sets it for each method"),
        ({"k": "auto"}, "bench sets a method's k policy in its label"),
        ({"decoder": {"k": 3}}, "decoder must be a DecoderConfig, got dict"),
    ],
)
def test_bad_bench_options_are_clear_errors(options: dict[str, Any], message: str) -> None:
    import re

    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        BenchConfig(**options)


def test_cli_bench_runs_and_rejects_bad_input(capsys, tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    base = ["bench", "--target", str(tiny_qwen2_dir), "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "4",
            "--bandwidth-probe-mib", "0", "--no-warmup", "--prompts", str(prompts), "--out", str(tmp_path / "o")]
    assert cli.main(base + ["--methods", "none,hf", "--no-plots", "--quiet", "--k", "2", "--no-jump-forward"]) == 0
    data = json.loads((tmp_path / "o" / "results.json").read_text())
    assert data["summary"]["none"][ALL]["prompts"] == 1 and data["bandwidth"]["copy_bytes_per_second"] is None
    # Every decoder flag reaches the run's DecoderConfig, recorded whole.
    assert data["config"]["decoder"]["k"] == 2 and data["config"]["decoder"]["jump_forward"] is False
    assert not (tmp_path / "o" / "speedup.png").exists()
    capsys.readouterr()
    assert cli.main(base + ["--methods", "none,lora"]) == cli.EXIT_USER_ERROR
    assert "Unknown method 'lora'" in capsys.readouterr().err
    assert cli.main(base + ["--methods", "none,eagle"]) == cli.EXIT_USER_ERROR
    assert "--eagle-heads" in capsys.readouterr().err
    assert cli.main(base + ["--methods", "draft", "--prompts", str(tmp_path / "missing.txt")]) == cli.EXIT_USER_ERROR
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(base + ["--methods", "none", "--temperature", "-1"]) == cli.EXIT_USER_ERROR
    assert "temperature" in capsys.readouterr().err
    assert cli.main(base + ["--methods", "none", "--k", "auto"]) == cli.EXIT_USER_ERROR
    assert "--methods ngram:auto" in capsys.readouterr().err


def test_hf_peers_ignore_checkpoint_sampling_defaults_and_sampling_runs(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    """A checkpoint whose generation_config.json asks for a repetition penalty and top-k must
    still be decoded by the same rule in both libraries, or the comparison is meaningless."""
    import shutil

    folder = tmp_path / "with_defaults"
    shutil.copytree(tiny_qwen2_dir, folder)
    gen_cfg = json.loads((folder / "generation_config.json").read_text()) if (folder / "generation_config.json").exists() else {}
    gen_cfg.update(repetition_penalty=3.0, top_k=2, temperature=0.5, do_sample=True)
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg))
    prompts = tmp_path / "p.txt"
    prompts.write_text("def fibonacci(n):\nclass Counter:\n")
    common = dict(target=str(folder), methods=("none", "hf"), prompts=(str(prompts),), max_new_tokens=24,
                  dtype="fp32", device="cpu", bandwidth_probe_bytes=0, quiet=True, warmup=False)
    bench = Bench(BenchConfig(**common))
    greedy = bench.run(select_prompts(load_prompts((str(prompts),)), None, None))
    assert greedy["summary"]["hf"][ALL]["equality"]["equal_fraction"] == 1.0
    sampled = Bench(BenchConfig(**common, temperature=0.8, seed=3)).run(select_prompts(load_prompts((str(prompts),)), None, None))
    assert not sampled["failures"] and sampled["summary"]["hf"][ALL]["equality"] is None  # only checked under greedy
    assert sampled["summary"]["none"][ALL]["new_tokens"] > 0


def test_missing_optional_dependency_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from specdecode.bench import runner

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(InvalidRequestError, match=r"matplotlib.*specdecode\[bench\].*plots=False"):
        runner.run_bench(BenchConfig(quiet=True))
