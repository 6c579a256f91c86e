"""``specdecode audit``: it passes correct methods, fails broken verifiers (and says why), and
refuses bad input with one line."""

import json
from pathlib import Path

import pytest
import torch
from helpers import CHI2_CRITICAL_P001, NEAR_TIE, decoder, install_accept_every_draft, install_wrong_residual

from specdecode import SamplingParams, audit, cli
from specdecode.audit.chi_square import builtin_critical_value, chi2_sf
from specdecode.errors import InvalidRequestError

GREEDY_ROW_FIELDS = {"prompt_id", "method", "verdict", "tokens", "compared", "position", "plain_token",
                     "method_token", "top2_gap", "token_gap", "threshold", "pair_gaps"}
DISTRIBUTION_ROW_FIELDS = {"method", "draws", "statistic", "df", "critical", "critical_source", "verdict", "cells",
                           "impossible", "boundary_ties", "q_statistic", "power", "power_note", "accepted", "proposed"}
REPORT_FIELDS = {"target", "draft", "backend", "precision", "near_tie", "alpha", "config", "greedy", "distribution",
                 "distribution_prompt", "seconds", "passed"}
PROMPT = "def quicksort(arr):"


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models gain nothing from threads, and on a shared 2-core machine a second thread
    # makes each of the thousands of small passes wait for the other (~20x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.txt"
    path.write_text(f"{PROMPT}\nThe quick brown fox\n")
    return path


def run_audit_cli(capsys, target: Path, draft: Path | None, *extra: str) -> tuple[int, str, str]:
    argv = ["audit", "--target", str(target), "--dtype", "fp32", "--device", "cpu", "--quiet", *extra]
    code = cli.main(argv + (["--draft", str(draft)] if draft else []))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_builtin_critical_values_match_the_tests_table() -> None:
    for df, value in CHI2_CRITICAL_P001.items():
        assert builtin_critical_value(df, 0.001) == pytest.approx(value, abs=0.01)
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, abs=1e-6)


def test_audit_passes_draft_and_ngram_with_documented_json(
    capsys, tmp_path: Path, prompt_file: Path, tiny_qwen2_dir: Path, tiny_far_draft_dir: Path
) -> None:
    out_file = tmp_path / "audit.json"
    code, out, err = run_audit_cli(
        capsys, tiny_qwen2_dir, tiny_far_draft_dir, "--method", "draft,ngram", "--prompts", str(prompt_file),
        "--max-new-tokens", "16", "--draws", "400", "--json", "--out", str(out_file),
    )
    assert code == 0, out + err
    report = json.loads(out)
    assert report == json.loads(out_file.read_text())
    assert set(report) == REPORT_FIELDS and report["passed"] is True
    assert report["precision"] == "fp32" and report["backend"] == "torch"
    assert [(r["prompt_id"], r["method"]) for r in report["greedy"]] == [
        ("prompts:1", "draft"), ("prompts:1", "ngram"), ("prompts:2", "draft"), ("prompts:2", "ngram")]
    for row in report["greedy"]:
        assert set(row) == GREEDY_ROW_FIELDS
        assert row["verdict"] == "equal" and row["compared"] == row["tokens"] == 16
    rows = {r["method"]: r for r in report["distribution"]}
    assert set(rows) == {"draft", "ngram"}
    for row in rows.values():
        assert set(row) == DISTRIBUTION_ROW_FIELDS
        assert row["verdict"] == "pass" and row["statistic"] < row["critical"] and row["impossible"] == 0
        assert row["critical"] == pytest.approx(builtin_critical_value(row["df"], 0.001), rel=1e-6)
    # The far draft's own tokens are easy to tell from the target's: the test has power there.
    assert rows["draft"]["proposed"] > rows["draft"]["accepted"] > 0
    assert rows["draft"]["q_statistic"] > rows["draft"]["critical"] and rows["draft"]["power"] >= audit.GOOD_POWER
    # A random tiny model never continues a copy, so lookup's drafts are all rejected (or, where
    # the sampled text repeats nothing, none proposed): the report must say that this run could
    # not see a wrong residual rather than claim power.
    if rows["ngram"]["proposed"] == 0:
        assert "nothing was drafted" in rows["ngram"]["power_note"]
    elif rows["ngram"]["accepted"] == 0:
        assert "wrong residual" in rows["ngram"]["power_note"]


def test_audit_fails_a_sampler_that_recovers_from_p(
    capsys, monkeypatch: pytest.MonkeyPatch, prompt_file: Path, tiny_qwen2_dir: Path, tiny_far_draft_dir: Path
) -> None:
    install_wrong_residual(monkeypatch)
    code, out, err = run_audit_cli(
        capsys, tiny_qwen2_dir, tiny_far_draft_dir, "--method", "draft", "--prompts", str(prompt_file),
        "--num-prompts", "1", "--max-new-tokens", "8", "--draws", "400", "--k", "2",
    )
    assert code == audit_failed(), out + err
    assert any(line.split()[:2] == ["draft", "FAIL"] for line in out.splitlines()), out  # the distribution row
    assert out.rstrip().splitlines()[-1].startswith("FAIL")


def audit_failed() -> int:
    from specdecode.cli.audit import EXIT_AUDIT_FAILED

    return EXIT_AUDIT_FAILED


def test_audit_fails_a_greedy_verifier_that_accepts_everything(
    capsys, monkeypatch: pytest.MonkeyPatch, prompt_file: Path, tiny_qwen2_dir: Path, tiny_draft_dir: Path
) -> None:
    install_accept_every_draft(monkeypatch)
    code, out, err = run_audit_cli(
        capsys, tiny_qwen2_dir, tiny_draft_dir, "--method", "draft", "--prompts", str(prompt_file),
        "--max-new-tokens", "16", "--draws", "50", "--json",
    )
    assert code == audit_failed(), out + err
    report = json.loads(out)
    assert report["passed"] is False
    failed = [r for r in report["greedy"] if r["verdict"] == "FAIL"]
    assert failed, report["greedy"]
    for row in failed:
        # An unrelated draft's token is far from the target's choice: a bug, not a near-tie.
        assert row["plain_token"] != row["method_token"]
        assert row["token_gap"] >= row["threshold"] == NEAR_TIE
        assert row["top2_gap"] <= row["token_gap"] + 1e-6  # the gap between the two is at least the top-2 gap


def test_a_difference_within_the_near_tie_threshold_is_excused(
    monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path, tiny_draft_dir: Path
) -> None:
    dec = decoder(tiny_qwen2_dir, tiny_draft_dir)
    ids = dec.encode(PROMPT)
    plain = dec.generate(ids, SamplingParams(max_new_tokens=12), method="none").token_ids
    install_accept_every_draft(monkeypatch)
    config = audit.AuditConfig(methods=("draft",), max_new_tokens=12)
    strict = audit.greedy_check(dec, "p", ids, "draft", plain, config)
    assert strict.verdict == "FAIL"
    lenient = audit.greedy_check(dec, "p", ids, "draft", plain, audit.AuditConfig(methods=("draft",), max_new_tokens=12,
                                                                                  near_tie=strict.token_gap * 2))
    assert lenient.verdict == "near-tie" and lenient.position == strict.position


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["--method", "draft,beam"], "unknown method 'beam'"),
        (["--draws", "0"], "--draws 0: it must be >= 1"),
        (["--top-k", "1"], "--top-k 1: it must be >= 2"),
        (["--method", "medusa"], "--heads"),
        (["--out", "/nonexistent-folder/audit.json"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv: list[str], pattern: str, tiny_qwen2_dir: Path) -> None:
    code, _, err = run_audit_cli(capsys, tiny_qwen2_dir, None, *argv)
    assert code == cli.EXIT_USER_ERROR
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdecode: error:"), err
    assert pattern.lower() in lines[0].lower()


def test_draft_without_a_draft_model_is_refused(capsys, tiny_qwen2_dir: Path) -> None:
    code, _, err = run_audit_cli(capsys, tiny_qwen2_dir, None, "--method", "draft", "--draws", "5")
    assert code == cli.EXIT_USER_ERROR and "--draft" in err and "Traceback" not in err


def test_a_difference_is_rounding_only_where_a_pass_shape_orders_the_pair_the_methods_way() -> None:
    """pair gaps are logit(plain token) - logit(method token) by pass shape."""
    from specdecode.audit.run import near_tie_verdict

    assert near_tie_verdict({"all": 0.07, "1": 0.08, "k+1": 0.06}, 0.005) == "FAIL"
    assert near_tie_verdict({"all": 0.07, "1": 0.08, "k+1": -0.02}, 0.005) == "near-tie"  # k+1 rows pick the method's
    assert near_tie_verdict({"all": 0.004, "1": 0.08, "k+1": 0.06}, 0.005) == "near-tie"  # within the threshold
    assert near_tie_verdict({"all": 0.0, "1": 0.01, "k+1": 0.01}, 0.005) == "near-tie"  # an exact tie


def test_target_logits_by_pass_shape_agree_in_fp32(tiny_qwen2_dir: Path, tiny_draft_dir: Path) -> None:
    """The reads the verdict compares are the same logits up to rounding (fp32 torch), whatever
    the rows per pass: the split passes keep each other's K/V."""
    dec = decoder(tiny_qwen2_dir, tiny_draft_dir)
    ids = dec.encode(PROMPT)
    plain = dec.generate(ids, SamplingParams(max_new_tokens=10), method="none").token_ids
    whole = dec.target_logits(ids, [plain[:9], plain[:4]])
    for rows in (1, 3):
        torch.testing.assert_close(dec.target_logits(ids, [plain[:9], plain[:4]], rows_per_pass=rows), whole,
                                   atol=NEAR_TIE, rtol=0)
    # Row j of a pass over r rows, as a verify pass computes it (the prompt's last token as row 0
    # beside padding included): the same logits, and a request after the reads decodes as before.
    context = list(ids) + plain[:9]
    shapes = [(2, 0), (4, 1), (6, 5), (3, 0)]
    for read in dec.target_logits_in_passes(context, shapes):
        torch.testing.assert_close(read, whole[0], atol=NEAR_TIE, rtol=0)
    (read,) = dec.target_logits_in_passes(ids, [(4, 0)])
    torch.testing.assert_close(read, dec.target_logits(ids)[0], atol=NEAR_TIE, rtol=0)
    with pytest.raises(InvalidRequestError, match="row"):
        dec.target_logits_in_passes(ids[:2], [(6, 4)])  # the pass would start before the first token
    assert dec.generate(ids, SamplingParams(max_new_tokens=10), method="none").token_ids == plain


def test_prompts_file_of_spec_bench_rows_gives_each_rows_first_turn(tmp_path: Path) -> None:
    """A .jsonl file is read as Spec-Bench rows, as the bench reads it (not each line as text)."""
    from specdecode.cli.audit import _prompt_texts

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question_id": 7, "category": "qa", "turns": ["First turn.", "Second."]}) + "\n")
    assert [text for _, text in _prompt_texts(str(path), 5)] == ["First turn."]
    (tmp_path / "lines.txt").write_text("one\ntwo\n")
    assert [text for _, text in _prompt_texts(str(tmp_path / "lines.txt"), 1)] == ["one"]
