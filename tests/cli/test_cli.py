"""The command line: output formats, and a clear error (no traceback) for each bad input."""

import json
import shutil
from pathlib import Path

import pytest

from specdecode import cli


def run_cli(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def common(target: Path, draft: Path | None = None) -> list[str]:
    args = ["--target", str(target), "--dtype", "fp32", "--device", "cpu", "--quiet", "--max-new-tokens", "12"]
    return args + (["--draft", str(draft)] if draft else [])


def test_json_output_has_text_tokens_and_stats(capsys, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    code, out, err = run_cli(capsys, "generate", "def quicksort(arr):", *common(tiny_qwen2_dir, tiny_close_draft_dir), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert set(data) == {"text", "token_ids", "stats"}
    assert len(data["token_ids"]) == data["stats"]["new_tokens"] <= 12
    for key in ("tau", "acceptance_rate", "acceptance_per_position", "draft_seconds", "verify_seconds",
                "total_seconds", "tokens_per_second", "target_forward_passes"):
        assert key in data["stats"]


def test_plain_and_speculative_cli_print_the_same_text(capsys, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    _, plain, _ = run_cli(capsys, "generate", "Once upon a time", *common(tiny_qwen2_dir), "--method", "none")
    _, spec, _ = run_cli(capsys, "generate", "Once upon a time", *common(tiny_qwen2_dir, tiny_close_draft_dir), "--k", "3")
    assert plain == spec and plain.strip()


def test_generate_on_the_batch_engine_prints_the_single_engines_text(
        capsys, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    argv = ["generate", "Once upon a time", *common(tiny_qwen2_dir, tiny_close_draft_dir), "--method", "auto"]
    _, single, _ = run_cli(capsys, *argv, "--engine", "single")
    code, batch, err = run_cli(capsys, *argv)  # the default, auto: the batch engine here
    assert code == 0, err
    assert batch == single and batch.strip()
    # --compile: the batch engine's passes compiled (backends/compiled_batch.py), the same text.
    code, compiled, err = run_cli(capsys, *argv, "--compile")
    assert code == 0, err
    assert compiled == single


def test_chat_mode_and_metrics_on_stderr(capsys, tiny_qwen2_dir: Path) -> None:
    args = ["--target", str(tiny_qwen2_dir), "--dtype", "fp32", "--method", "none", "--max-new-tokens", "5"]
    code, out, err = run_cli(capsys, "generate", "hello", *args, "--chat")
    assert code == 0
    assert "tau=1.00" in err and "tokens/s=" in err


def expect_error(capsys, argv: list[str], pattern: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == cli.EXIT_USER_ERROR
    assert "Traceback" not in err
    assert pattern.lower() in err.lower(), err


def test_missing_model_file(capsys, tmp_path: Path) -> None:
    expect_error(capsys, ["generate", "hi", "--target", str(tmp_path / "nope.gguf"), "--method", "none"], "does not exist")


def test_corrupt_gguf(capsys, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    expect_error(capsys, ["generate", "hi", "--target", str(bad), "--method", "none"], "bad.gguf")


def test_unsupported_architecture(capsys, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}')
    expect_error(capsys, ["generate", "hi", "--target", str(tmp_path), "--method", "none"], "MambaForCausalLM")


def test_draft_with_another_tokenizer(capsys, tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(tiny_qwen2_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    expect_error(capsys, ["generate", "hi", *common(tiny_qwen2_dir, other)], "different tokenizers")


def test_draft_whose_vocab_differs_only_by_padding_is_fine(capsys, tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    import tiny_models

    padded = tiny_models.make_tiny_hf_model(tmp_path / "padded", arch="qwen2", seed=0, vocab_pad=64)
    _, plain, _ = run_cli(capsys, "generate", "x = 1", *common(tiny_qwen2_dir), "--method", "none")
    code, spec, err = run_cli(capsys, "generate", "x = 1", *common(tiny_qwen2_dir, padded))
    assert code == 0, err
    assert spec == plain


def test_prompt_longer_than_context(capsys, tiny_qwen2_dir: Path) -> None:
    long_prompt = "word " * 2000
    expect_error(capsys, ["generate", long_prompt, *common(tiny_qwen2_dir), "--method", "none"], "context")


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
    ],
)
def test_invalid_sampling_parameters(capsys, tiny_qwen2_dir: Path, flags: list[str], pattern: str) -> None:
    expect_error(capsys, ["generate", "hi", *common(tiny_qwen2_dir), "--method", "none", *flags], pattern)


def test_k_below_one_is_rejected(capsys, tiny_qwen2_dir: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["generate", "hi", *common(tiny_qwen2_dir, tiny_qwen2_dir), "--k", "0"])
    assert exit_info.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_draft_method_without_draft_model(capsys, tiny_qwen2_dir: Path) -> None:
    expect_error(capsys, ["generate", "hi", *common(tiny_qwen2_dir)], "--draft")


def test_demo_models_not_installed(capsys, monkeypatch) -> None:
    from specdecode.errors import DemoModelsNotInstalledError
    from specdecode.models import demo

    def missing(name: str, show_progress: bool = True):
        raise DemoModelsNotInstalledError('The demo models are not installed: pip install "specdecode[demo]"')

    monkeypatch.setattr(demo, "demo_model_path", missing)
    expect_error(capsys, ["generate", "hi", "--quiet"], "specdecode[demo]")


def test_library_errors_name_parameters_and_the_cli_names_flags(capsys, tiny_qwen2_dir: Path) -> None:
    from specdecode import SpecDecoder
    from specdecode.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as caught:
        SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="none", backend="llama.cpp", show_progress=False)
    assert 'backend="torch"' in str(caught.value) and "--backend" not in str(caught.value)
    code, _, err = run_cli(capsys, "generate", "hi", *common(tiny_qwen2_dir), "--method", "none", "--backend", "llama.cpp")
    assert code == cli.EXIT_USER_ERROR == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--backend torch" in lines[0] and 'backend="torch"' not in lines[0]


@pytest.mark.parametrize(
    ("message", "worded"),
    [
        ('need the torch backend (backend="torch").', "need the torch backend (--backend torch)."),
        ("method='medusa' needs heads (heads=FOLDER).", "--method medusa needs heads (--heads FOLDER)."),
        ("k_max=40 is out of range: use 1..32.", "--k-max 40 is out of range: use 1..32."),
        ("pass skip_layers= or layerskip_config=.", "pass --skip-layers or --layerskip-config."),
        ("drop chat=True.", "drop --chat."),
        ("pass target=/draft= explicitly.", "pass --target/--draft explicitly."),
        ("data='my notes': no such folder", "--data 'my notes': no such folder"),
        ("num_heads=0 must be positive", "--heads 0 must be positive"),
        ("(or pass plots=False to skip matplotlib)", "(or pass --no-plots to skip matplotlib)"),
        ("compile='max-autotune' replays CUDA graphs; use compile=True.",
         "--compile-mode max-autotune replays CUDA graphs; use --compile."),
        # Names no flag sets, and text that only looks like a parameter, stay as they are.
        ("with n_ctx=4096 x n_seq_max=1", "with n_ctx=4096 x n_seq_max=1"),
        ("run `specdecode train medusa --out HEADS` and --k=3 a==b", "run `specdecode train medusa --out HEADS` and --k=3 a==b"),
    ],
)
def test_cli_names_the_parameters_of_library_errors_as_flags(message: str, worded: str) -> None:
    from specdecode.cli.args import cli_message
    from specdecode.errors import InvalidRequestError

    assert cli_message(InvalidRequestError(message)) == worded


def test_show_drafts_colours_accepted_drafts_on_a_terminal_only(
    capsys, monkeypatch, tiny_qwen2_dir: Path, tiny_close_draft_dir: Path
) -> None:
    """The coloured text is the plain text once the colour codes are taken out; without a
    terminal, or with NO_COLOR, the flag prints plain text."""
    import sys

    from specdecode.cli.generate import DRAFT_COLOUR, RESET

    args = ["generate", "Once upon a time", *common(tiny_qwen2_dir, tiny_close_draft_dir), "--k", "3", "--show-drafts"]
    _, plain, _ = run_cli(capsys, *args)
    assert "\x1b[" not in plain and plain.strip()
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    _, coloured, _ = run_cli(capsys, *args)
    assert DRAFT_COLOUR in coloured and coloured.replace(DRAFT_COLOUR, "").replace(RESET, "") == plain
    monkeypatch.setenv("NO_COLOR", "1")
    _, uncoloured, _ = run_cli(capsys, *args)
    assert uncoloured == plain


def test_stream_spans_mark_exactly_the_accepted_drafts(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> None:
    """spans() gives iteration's text, and the engine's step chunks mark as drafted exactly the
    accepted drafts the stats count (the close draft gets most accepted; bonus tokens are the
    target's)."""
    from helpers import decoder

    from specdecode import SamplingParams
    from specdecode.engine.metrics import GenerationStats

    dec = decoder(tiny_qwen2_dir, tiny_close_draft_dir)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    text = "".join(dec.stream("Once upon a time", params, k=3))
    stream = dec.stream("Once upon a time", params, k=3)
    pieces = list(stream.spans())
    assert "".join(p for p, _ in pieces) == text
    assert any(d for _, d in pieces) and not all(d for _, d in pieces)
    stats = GenerationStats(method="draft")
    chunks = list(dec.engine.decode(dec.encode("Once upon a time"), params, dec.plan(k=3), stats))
    assert sum(c.drafted for c in chunks) == stats.draft_tokens_accepted > 0
    assert all(len(c) - c.drafted == 1 for c in chunks)  # no cut: every step ends with the target's token


def test_the_cli_runs_without_the_server_extras() -> None:
    """The README's first command installs no server extras (fastapi, uvicorn): every command's
    parser must build without them (the serve parser's connection defaults once imported uvicorn,
    and `specdecode generate` failed on a fresh install), and `serve` says which extra it needs."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for name in ('fastapi', 'uvicorn', 'starlette'):\n"
        "    sys.modules[name] = None  # import fails, as where the serve extra is not installed\n"
        "from specdecode.cli.app import build_parser, main\n"
        "args = build_parser().parse_args(['generate', '--chat', 'hi'])\n"
        "assert args.chat\n"
        "sys.exit(main(['serve']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and 'pip install "specdecode[serve]"' in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
