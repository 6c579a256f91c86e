"""The llama.cpp side of the benchmark: labels, our methods on llama.cpp next to torch in one
run, llama-cpp-python's Llama as a peer (its pass counting checked with an oracle drafter),
the GGUF bytes for the ceiling, and llama.cpp's binaries (their output parsed from text
written to the printf formats in their source, run through stand-in executables)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny_models
import torch

from specdecode import cli
from specdecode.bench.llamacpp_bin import LlamaCppBinaryMethod, binary_turn, parse_binary_output
from specdecode.bench.methods import parse_method, plain_counterpart
from specdecode.bench.report import ALL, equality_reference
from specdecode.bench.roofline import gguf_weight_bytes_per_forward, weight_bytes_per_forward
from specdecode.bench.runner import Bench, BenchConfig, write_results
from specdecode.config import ModelConfig, SamplingParams
from specdecode.errors import InvalidRequestError
from specdecode.prompt_sets import load_prompts, select_prompts

MAX_NEW = 10
LLAMACPP_RUN = ("none", "none@llama.cpp", "draft@llama.cpp", "ngram@llama.cpp", "llamacpp", "llamacpp-lookup")


# ---------------------------------------------------------------- labels (no model needed)


def test_llamacpp_labels_and_their_references() -> None:
    label = parse_method("ngram:auto@llama.cpp")
    assert (label.base, label.k_policy, label.backend, label.on_llamacpp) == ("ngram", "cost", "llama.cpp", True)
    assert parse_method("auto:3@llama.cpp").k == 3
    assert plain_counterpart("draft@llama.cpp") == "none@llama.cpp"
    assert plain_counterpart("llamacpp-lookup") == plain_counterpart("llamacpp-bin-draft") == "llamacpp"
    assert not parse_method("draft@int8").on_llamacpp and parse_method("llamacpp").on_llamacpp
    run = ["none", "none@llama.cpp", "draft@llama.cpp", "llamacpp", "llamacpp-lookup"]
    assert equality_reference("none@llama.cpp", run) == "none"  # backend parity
    assert equality_reference("llamacpp", run) == "none@llama.cpp"  # library parity on one backend
    assert equality_reference("llamacpp", ["llamacpp"]) is None
    assert equality_reference("draft@llama.cpp", ["none", "draft@llama.cpp"]) is None  # never the torch plain


@pytest.mark.parametrize(
    "label, message",
    [
        ("draft@llama.cpp/int8", "quantization and llama.cpp cannot be combined"),
        ("draft@int8/llama.cpp", "quantization and llama.cpp cannot be combined"),
        ("draft@llama.cp", "quantization must be one of"),
        ("layerskip@llama.cpp", "needs the torch model"),
        ("llamacpp@llama.cpp", "specdecode's methods only"),
        ("llamacpp-lookup:3", "draft length applies to specdecode's"),
        ("hf@llama.cpp", "specdecode's methods only"),
    ],
)
def test_bad_llamacpp_labels_are_one_clear_error(label: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        parse_method(label)


def test_binaries_need_their_folder() -> None:
    with pytest.raises(InvalidRequestError, match="llamacpp_bin=DIR"):
        BenchConfig(methods=("none", "llamacpp-bin-lookup"))


# ---------------------------------------------------------------- GGUF bytes for the ceiling


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_weight_bytes_follow_the_torch_rule(tmp_path: Path, tied: bool) -> None:
    folder = tiny_models.make_tiny_hf_model(tmp_path / "m", arch="qwen2", tie_word_embeddings=tied)
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    tiny_models.write_gguf_from_hf(folder, tmp_path / "f32.gguf", "F32")
    tiny_models.write_gguf_from_hf(folder, tmp_path / "q8.gguf", "Q8_0")
    assert gguf_weight_bytes_per_forward(tmp_path / "f32.gguf") == weight_bytes_per_forward(config, torch.float32)
    # As stored: Q8_0 is 34 bytes per 32 weights, about a quarter of F32.
    ratio = gguf_weight_bytes_per_forward(tmp_path / "q8.gguf") / weight_bytes_per_forward(config, torch.float32)
    assert 0.25 < ratio < 0.35


# ---------------------------------------------------------------- llama.cpp's binaries: output format

PROMPT = "<|im_start|>user\nSay hi\\n twice<|im_end|>\n<|im_start|>assistant\n"
# As speculative-simple.cpp prints: LOG("\n\n"), the prompt's pieces, the generated pieces (it
# stops before printing an end token), LOG("\n\n") twice; the figures via LOG_INF.
SPEC_STDOUT = "\n\n" + PROMPT + "Hi! Hi!\n\n\n\n"
SPEC_STDERR = """main: loading model
encoded   14 tokens in    0.050 seconds, speed:  280.000 t/s
decoded    8 tokens in    0.400 seconds, speed:   20.000 t/s

n_draft   = 3
n_predict = 8
n_drafted = 9
n_accept  = 5
accept    = 55.556%

draft:

statistics            draft: #calls(b,g,a) =    1      3      3, #gen drafts =      3, #acc drafts =      2, #gen tokens =      9, #acc tokens =      5
"""
# As lookup.cpp prints: it prints the end token itself and may sample past it in the same step.
LOOKUP_STDOUT = "\n\n" + PROMPT + "Hi! Hi!<|im_end|>Hi\n\n\n\n"
LOOKUP_STDERR = """encoded   14 tokens in    0.040 seconds, speed:  350.000 t/s
decoded   10 tokens in    0.500 seconds, speed:   20.000 t/s

n_draft      = 10
n_predict    = 10
n_drafted    = 6
t_draft_flat = 0.10 ms
t_draft      = 20.00 ms, 3.33 us per token, 300.00 tokens per second
n_accept     = 4
accept       = 66.667%

target:
"""


def test_speculative_simple_output_is_parsed() -> None:
    run = parse_binary_output(SPEC_STDOUT, SPEC_STDERR, PROMPT, ("<|im_end|>",))
    assert run.text == "Hi! Hi!" and not run.stopped_at_end
    assert (run.prompt_tokens, run.encode_seconds, run.decoded_tokens, run.decode_seconds) == (14, 0.05, 8, 0.4)
    assert (run.drafted, run.accepted, run.draft_seconds) == (9, 5, None)
    assert run.tokens_per_second == pytest.approx(20.0)


def test_lookup_output_is_cut_at_its_end_token() -> None:
    run = parse_binary_output(LOOKUP_STDOUT, LOOKUP_STDERR, PROMPT, ("<|im_end|>", "<|endoftext|>"))
    assert run.text == "Hi! Hi!" and run.stopped_at_end
    assert (run.drafted, run.accepted, run.draft_seconds) == (6, 4, pytest.approx(0.02))
    with pytest.raises(InvalidRequestError, match="does not echo the prompt"):
        parse_binary_output(LOOKUP_STDOUT, LOOKUP_STDERR, "another prompt")
    with pytest.raises(InvalidRequestError, match="'decoded ... tokens'"):
        parse_binary_output(LOOKUP_STDOUT, "error: failed to load model\n", PROMPT)


class _CharTokenizer:
    """One token per character (ids = code points), end token 0: counting rules in plain sight."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("<|im_end|>" if i == 0 else chr(i) for i in ids if not (skip_special_tokens and i == 0))


def test_a_binary_run_becomes_a_turn_by_our_counting_rules() -> None:
    run = parse_binary_output(LOOKUP_STDOUT, LOOKUP_STDERR, PROMPT, ("<|im_end|>",))
    turn = binary_turn(run, _CharTokenizer(), [0], 14, max_new_tokens=5, draft_model=False)
    assert turn.tokens == [ord(c) for c in "Hi! H"]  # cut at max_new_tokens
    assert turn.seconds == pytest.approx(0.04 + 0.5 * 5 / 10)  # decode time scaled by the share kept
    assert (turn.verify_steps, turn.emitted_by_steps, turn.target_passes) == (6, 10, 7)  # each step: accepted + 1
    assert (turn.draft_tokens_proposed, turn.draft_tokens_accepted, turn.draft_passes) == (6, 4, 0)
    whole = binary_turn(run, _CharTokenizer(), [0], 14, max_new_tokens=64, draft_model=True)
    assert whole.tokens[-1] == 0 and len(whole.tokens) == 8  # "Hi! Hi!" and the end token it stopped at
    assert whole.draft_passes == 6 and whole.prefill_seconds == pytest.approx(0.04)


def _stand_in(folder: Path, name: str, body: str) -> None:
    """An executable that behaves like a llama.cpp binary (prints its formats) in Python."""
    path = folder / name
    path.write_text(f"#!{sys.executable}\nimport sys, time\nargs = sys.argv[1:]\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_binary_methods_run_with_greedy_arguments_and_a_timeout(tmp_path: Path) -> None:
    body = (
        "prompt = args[args.index('-p') + 1]\n"
        "open(sys.argv[0] + '.args', 'w').write('\\n'.join(args))\n"
        f"sys.stdout.write('\\n\\n' + prompt + 'Hi! Hi!\\n\\n\\n\\n')\nsys.stderr.write({SPEC_STDERR!r})\n"
    )
    _stand_in(tmp_path, "llama-speculative-simple", body)
    _stand_in(tmp_path, "llama-lookup", "time.sleep(30)")
    tokenizer = _CharTokenizer()
    common: dict[str, Any] = {"tokenizer": tokenizer, "eos_token_ids": [0], "threads": 3, "context": 512, "exact": True, "k": 4}
    draft = LlamaCppBinaryMethod("llamacpp-bin-draft", tmp_path, Path("t.gguf"), Path("d.gguf"), **common)
    turn = draft.run_turn(tokenizer.encode(PROMPT), SamplingParams(max_new_tokens=8))
    assert turn.text == "Hi! Hi!" and turn.draft_tokens_accepted == 5
    args = (tmp_path / "llama-speculative-simple.args").read_text().split("\n")
    pairs = {args[i]: args[i + 1] for i in range(len(args) - 1)}
    assert pairs["--temp"] == "0" and pairs["-t"] == "3" and pairs["-md"] == "d.gguf" and pairs["-m"] == "t.gguf"
    assert pairs["-n"] == "7" and pairs["--spec-draft-n-max"] == "4" and "--no-escape" in args  # it decodes one past -n
    assert pairs["--spec-type"] == "draft-simple"  # without it this llama.cpp refuses a plain draft file
    lookup = LlamaCppBinaryMethod("llamacpp-bin-lookup", tmp_path, Path("t.gguf"), None, **common, timeout=0.5)
    with pytest.raises(InvalidRequestError, match="took more than"):
        lookup.run_turn([72], SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidRequestError, match="build-llamacpp-tools.sh"):
        LlamaCppBinaryMethod("llamacpp-bin-lookup", tmp_path / "empty", Path("t.gguf"), None, **common)


# ---------------------------------------------------------------- needs llama-cpp-python


@pytest.fixture(scope="module")
def ggufs(tiny_ggufs: dict[str, Path]) -> dict[str, Path]:
    pytest.importorskip("llama_cpp")
    return tiny_ggufs


class _Oracle:
    """A draft model for Llama.generate that proposes the reference continuation (or, with
    ``wrong``, tokens that never match it): the acceptance counts are then known exactly."""

    def __init__(self, prompt_len: int, reference: list[int], proposals: int, wrong: bool = False) -> None:
        self.prompt_len, self.reference, self.proposals, self.wrong = prompt_len, reference, proposals, wrong

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        done = len(input_ids) - self.prompt_len  # tokens generated so far, the last one included
        drafts = self.reference[done : done + self.proposals]
        return np.array([t + 1 if self.wrong else t for t in drafts], dtype=np.intc)


def test_llama_peer_counts_passes_and_acceptance_exactly(ggufs: dict[str, Path]) -> None:
    from specdecode import SpecDecoder
    from specdecode.bench.llamacpp_peers import LlamaCppPyMethod

    dec = SpecDecoder.from_pretrained(str(ggufs["target"]), method="none", dtype="fp32", device="cpu", backend="llama.cpp", show_progress=False)
    prompt = dec.encode("def fibonacci(n):")
    reference = dec.generate(prompt, SamplingParams(max_new_tokens=32)).token_ids
    assert len(reference) == 32  # no end token within reach, so the counts below are exact
    args = (ggufs["target"], dec.tokenizer, list(dec.eos_token_ids))
    plain = LlamaCppPyMethod("llamacpp", *args, exact=True, context=512, lookup_tokens=3).run_turn(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    assert plain.tokens == reference[:MAX_NEW]
    assert (plain.target_passes, plain.verify_steps, plain.emitted_by_steps) == (MAX_NEW, MAX_NEW - 1, MAX_NEW - 1)
    assert plain.draft_tokens_proposed is None and plain.prefill_seconds > 0
    peer = LlamaCppPyMethod("llamacpp-lookup", *args, exact=True, context=512, lookup_tokens=3)
    peer.llama.draft_model = _Oracle(len(prompt), reference, proposals=3)
    right = peer.run_turn(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    # Prefill gives token 1; each step verifies 3 drafts and emits 4; the third step is drained
    # off the clock, so it counts its whole verdict though only 1 of its tokens is kept.
    assert right.tokens == reference[:MAX_NEW]
    assert (right.verify_steps, right.emitted_by_steps, right.draft_tokens_proposed, right.draft_tokens_accepted) == (3, 12, 9, 9)
    assert right.accepted_at_position == right.proposed_at_position == [3, 3, 3]
    peer.llama.draft_model = _Oracle(len(prompt), reference, proposals=3, wrong=True)
    wrong = peer.run_turn(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    assert wrong.tokens == reference[:MAX_NEW]  # rejected drafts never change the output
    assert (wrong.verify_steps, wrong.draft_tokens_accepted, wrong.draft_tokens_proposed) == (MAX_NEW - 1, 0, 3 * (MAX_NEW - 1))


@pytest.fixture(scope="module")
def llamacpp_run(ggufs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    prompts = tmp_path_factory.mktemp("prompts") / "mini.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["Write a short poem about code.", "Now make it rhyme."]},
        {"question_id": 2, "category": "qa", "turns": ["def fibonacci(n):"]},
        {"question_id": 3, "category": "rag", "turns": ["return " * 600]},  # beyond the tiny 512-token context
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = BenchConfig(
        target=str(ggufs["target"]), draft=str(ggufs["close"]), methods=LLAMACPP_RUN, prompts=(str(prompts),),
        max_prompts_per_category=None, max_new_tokens=MAX_NEW, k=3, draft_confidence=0.0, dtype="fp32", device="cpu",
        bandwidth_probe_bytes=8 << 20, quiet=True, warmup=True,
    )
    results = Bench(config).run(select_prompts(load_prompts(config.prompts), None, None))
    out = tmp_path_factory.mktemp("bench_llamacpp_out")
    from rich.console import Console

    write_results(results, out, plots=False, console=Console(quiet=True))
    return results, out


def test_llamacpp_methods_run_beside_torch_and_match_their_plain_decoding(llamacpp_run: tuple[dict, Path]) -> None:
    results, _ = llamacpp_run
    assert results["complete"] and not results["warmup_errors"]
    assert {f["method"] for f in results["failures"]} == set(LLAMACPP_RUN)  # only the over-long prompt fails
    assert all(f["prompt_id"] == "mini:3" and "context" in f["error"] for f in results["failures"])
    summary = results["summary"]
    for method in LLAMACPP_RUN:
        assert summary[method][ALL]["prompts"] == 2 and summary[method][ALL]["new_tokens"] > 0
    expected_reference = {"none@llama.cpp": "none", "draft@llama.cpp": "none@llama.cpp", "ngram@llama.cpp": "none@llama.cpp",
                          "llamacpp": "none@llama.cpp", "llamacpp-lookup": "llamacpp"}
    for method, reference in expected_reference.items():
        equality = summary[method][ALL]["equality"]
        assert equality["reference"] == reference and equality["prompts_compared"] == 2
        assert equality["equal_fraction"] == 1.0, (method, equality)
    draft = summary["draft@llama.cpp"][ALL]
    assert draft["tau"] > 1.0 and 0 < draft["acceptance_rate"] <= 1 and draft["draft_passes"] > 0
    assert summary["none@llama.cpp"][ALL]["speedup_vs_none_llamacpp"] == pytest.approx(1.0)
    assert summary["llamacpp"][ALL]["tau"] == 1.0
    for method in LLAMACPP_RUN:  # every method gets both baselines
        assert summary[method][ALL]["speedup_vs_none"] > 0 and summary[method][ALL]["speedup_vs_none_llamacpp"] > 0


def test_llamacpp_results_json_has_the_documented_fields(llamacpp_run: tuple[dict, Path], ggufs: dict[str, Path]) -> None:
    _, out = llamacpp_run
    data = json.loads((out / "results.json").read_text())
    entry = data["summary"]["draft@llama.cpp"][ALL]
    for key in ("speedup_vs_none_llamacpp", "decode_speedup_vs_none_llamacpp", "speedup_vs_none", "equality", "ceiling_tokens_per_second"):
        assert key in entry
    side = data["models"]["llamacpp"]
    assert side["llama_cpp_python"] and side["threads"] >= 1 and side["context"] == 512
    # Model files by name, size and hash, never by path (results are shared between machines).
    assert side["target"]["file"]["name"] == ggufs["target"].name and len(side["target"]["file"]["sha256_ends"]) == 64
    assert str(ggufs["target"].parent) not in json.dumps(data["models"])
    target_bytes = gguf_weight_bytes_per_forward(ggufs["target"])
    assert side["target"]["weight_bytes_per_forward"] == target_bytes
    by_method = data["models"]["weight_bytes_by_method"]
    assert by_method["draft@llama.cpp"] == [target_bytes, side["draft"]["weight_bytes_per_forward"]]
    assert by_method["llamacpp"] == [target_bytes, 0] and by_method["ngram@llama.cpp"] == [target_bytes, 0]
    assert list(by_method) == list(LLAMACPP_RUN)
    assert "vs none@llama.cpp" in (out / "report.md").read_text()


def test_llamacpp_methods_refuse_a_safetensors_target(capsys: pytest.CaptureFixture[str], tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    base = ["bench", "--target", str(tiny_qwen2_dir), "--dtype", "fp32", "--device", "cpu", "--max-new-tokens", "4",
            "--bandwidth-probe-mib", "0", "--no-warmup", "--prompts", str(prompts), "--out", str(tmp_path / "o"), "--quiet"]
    assert cli.main(base + ["--methods", "none,llamacpp"]) == cli.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert "llamacpp run on llama.cpp, which reads GGUF files" in err and "--target" in err and err.count("error") == 1
    assert cli.main(base + ["--methods", "none,draft@llama.cpp/int8"]) == cli.EXIT_USER_ERROR
    assert "cannot be combined" in capsys.readouterr().err
    assert cli.main(base + ["--methods", "llamacpp-bin-draft"]) == cli.EXIT_USER_ERROR
    assert "--llamacpp-bin" in capsys.readouterr().err
