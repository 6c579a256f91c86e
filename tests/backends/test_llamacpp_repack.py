"""How llama.cpp's weights are laid out (backends/llamacpp_repack.py): forced by the environment
variable, no probe without AMX, a probe in a child process where the CPU has AMX, its verdict
stored once per machine, the fallback to repacking without AMX where AMX faults, and greedy
decoding with repacked weights against plain ones.

This machine's CPU need not have AMX, so the AMX tests fake it: ``cpu_flags`` answers with
``amx_tile``, and ggml's ``CPU_REPACK`` buffer type stands in for ``AMX`` (``AMX_BUFFER``), so the
probe children and the list edit run for real on a buffer type this build has. A fault is a
real SIGILL: the child kills itself with it (``PROBE_FAULT_ENV``) before its first pass.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("llama_cpp")

import tiny_models
from helpers import NEAR_TIE, assert_greedy_equal_up_to_near_tie

from specdecode.backends import llamacpp_repack as repack
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.backends.llamacpp_binding import import_llama_cpp
from specdecode.backends.llamacpp_repack import EXTRA_BUFTS_ENV, NO_AMX, OFF, ON, PROBE_FAULT_ENV, UNDECIDED
from specdecode.cli.app import main

STAND_IN = "CPU_REPACK"  # plays AMX's part where a test fakes an AMX CPU
PRECISE = {"kv_type": "f32", "flash_attn": False}
PROMPT = [509, 5, 300, 200, 45, 67, 88, 12]
GREEDY_TOKENS = 24
_BUFFER_LINE = re.compile(r"(\S+) model buffer size\s*=")


@pytest.fixture(scope="module")
def q4k_gguf(tiny_qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 with every 2-D tensor in Q4_K: a type ggml repacks on AVX2/AVX-512 CPUs."""
    path = tmp_path_factory.mktemp("repack") / "q4k.gguf"
    tiny_models.write_gguf_from_hf(tiny_qwen2_dir, path, "Q4_K")
    return path


@pytest.fixture(autouse=True)
def fresh_verdicts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Each test starts with no remembered or stored verdict and no forced choice."""
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(EXTRA_BUFTS_ENV, raising=False)
    monkeypatch.delenv(PROBE_FAULT_ENV, raising=False)
    repack.forget_verdicts()
    yield
    repack.forget_verdicts()


@pytest.fixture
def amx_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with AMX whose llama.cpp build has the AMX buffer type (played by CPU_REPACK)."""
    if STAND_IN not in (repack.extra_buffer_names(import_llama_cpp()) or []):
        pytest.skip(f"this CPU or build has no {STAND_IN} buffer type to stand in for AMX")
    monkeypatch.setattr(repack, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "amx_tile", "amx_int8"}))
    monkeypatch.setattr(repack, "AMX_BUFFER", STAND_IN)


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The probe children started (their command lines), counted as they start."""
    started: list[list[str]] = []
    real_run = subprocess.run

    def run(command: list[str], **kwargs):
        started.append(command)
        return real_run(command, **kwargs)

    monkeypatch.setattr(repack.subprocess, "run", run)
    return started


def weight_buffers(path: Path, capfd: pytest.CaptureFixture[str], **kwargs) -> tuple[set[str], str]:
    """The buffer types a LlamaCppModel's load put weights in (from llama.cpp's log), and its
    repack mode."""
    capfd.readouterr()
    with LlamaCppModel(path, n_ctx=32, verbose=True, **kwargs) as model:
        mode = model.repack.mode
    return set(_BUFFER_LINE.findall(capfd.readouterr().err)), mode


@pytest.mark.parametrize(("value", "mode"), [("1", ON), ("0", OFF)])
def test_the_environment_variable_forces_the_choice_without_a_probe(
    q4k_gguf: Path, amx_cpu: None, probes: list, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
    value: str, mode: str,
) -> None:
    monkeypatch.setenv(EXTRA_BUFTS_ENV, value)
    choice = repack.repack_choice(q4k_gguf)
    assert (choice.mode, choice.why) == (mode, f"forced by {EXTRA_BUFTS_ENV}={value}")
    buffers, loaded_mode = weight_buffers(q4k_gguf, capfd)
    assert loaded_mode == mode
    assert (STAND_IN in buffers) == (mode == ON)
    assert probes == [] and not repack.verdict_path().exists()


def test_no_probe_on_a_cpu_without_amx(q4k_gguf: Path, probes: list, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repack, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_vnni"}))
    choice = repack.repack_choice(q4k_gguf)
    assert choice.mode == ON and "no AMX" in choice.why
    assert probes == []


def test_a_build_without_the_amx_buffer_type_is_not_probed(q4k_gguf: Path, probes: list,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repack, "cpu_flags", lambda: frozenset({"amx_tile"}))
    monkeypatch.setattr(repack, "extra_buffer_names", lambda llama_cpp: ["CPU_REPACK"])
    choice = repack.repack_choice(q4k_gguf)
    assert choice.mode == ON and "no AMX buffer type" in choice.why
    assert probes == []


def test_a_passing_probe_keeps_amx_and_is_stored_once_per_machine(q4k_gguf: Path, amx_cpu: None, probes: list) -> None:
    assert repack.repack_choice().mode == UNDECIDED  # nothing probed and no file to probe with
    choice = repack.repack_choice(q4k_gguf)
    assert choice.mode == ON and "probed ok" in choice.why
    assert len(probes) == 1 and repack.verdict_path().is_file()
    repack.repack_choice(q4k_gguf)
    repack.forget_verdicts()  # a new process on the same machine reads the stored verdict
    again = repack.repack_choice(q4k_gguf)
    assert again.mode == ON and "probed ok" in again.why and q4k_gguf.name in again.why
    assert repack.repack_choice().mode == ON  # known without a file now
    assert len(probes) == 1


def test_a_faulting_probe_falls_back_to_repacking_without_amx(
    q4k_gguf: Path, amx_cpu: None, probes: list, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv(PROBE_FAULT_ENV, ON)  # the child with every extra buffer dies by SIGILL
    choice = repack.repack_choice(q4k_gguf)
    assert choice.mode == NO_AMX and "SIGILL" in choice.why
    assert [command[-2:] for command in probes] == [[str(q4k_gguf), ON], [NO_AMX, STAND_IN]]
    # The model loads without the faulting buffer type, and ggml's list is whole again after.
    buffers, mode = weight_buffers(q4k_gguf, capfd)
    assert mode == NO_AMX and STAND_IN not in buffers and "CPU_Mapped" in buffers
    assert STAND_IN in repack.extra_buffer_names(import_llama_cpp())
    repack.forget_verdicts()
    assert repack.repack_choice(q4k_gguf).mode == NO_AMX and len(probes) == 2  # stored: no third child


def test_a_probe_that_faults_without_amx_too_turns_repacking_off(q4k_gguf: Path, amx_cpu: None, probes: list,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROBE_FAULT_ENV, f"{ON},{NO_AMX}")
    choice = repack.repack_choice(q4k_gguf)
    assert choice.mode == OFF and choice.why.count("SIGILL") == 2
    assert len(probes) == 2 and repack.read_verdict() is not None


def test_a_probe_of_a_model_without_amx_weights_decides_only_that_model(q4k_gguf: Path, probes: list,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Its weights all went to CPU_REPACK, none to AMX: the probe passed without testing AMX."""
    monkeypatch.setattr(repack, "cpu_flags", lambda: frozenset({"amx_tile"}))
    monkeypatch.setattr(repack, "extra_buffer_names", lambda llama_cpp: ["AMX", "CPU_REPACK"])
    choice = repack.repack_choice(q4k_gguf)
    assert choice.mode == ON and "no weights in AMX" in choice.why
    assert repack.read_verdict() is None and repack.repack_choice().mode == UNDECIDED
    assert repack.repack_choice(q4k_gguf) == choice and len(probes) == 1  # remembered for this file


def test_extra_buffers_without_restores_ggmls_list() -> None:
    llama_cpp = import_llama_cpp()
    whole = repack.extra_buffer_names(llama_cpp)
    if not whole:
        pytest.skip("this build lists no extra buffer types")
    with repack.extra_buffers_without(llama_cpp, [whole[0]]):
        assert repack.extra_buffer_names(llama_cpp) == whole[1:]
    assert repack.extra_buffer_names(llama_cpp) == whole


def greedy(model: LlamaCppModel, steps: int) -> tuple[list[int], torch.Tensor, list[float]]:
    """Plain greedy decoding of PROMPT, one row per pass after the prompt's pass: the tokens, the
    prompt pass's logits (len(PROMPT), V) and each chosen token's top-2 logit gap."""
    model.clear()
    prompt_logits = model.forward(0, PROMPT, 0, "all")
    logits, tokens, margins = prompt_logits[-1], [], []
    for _ in range(steps):
        top2 = logits.topk(2)
        tokens.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        logits = model.forward(0, tokens[-1:], len(PROMPT) + len(tokens) - 1, "last")[-1]
    return tokens, prompt_logits, margins


def test_greedy_with_repacked_weights_equals_plain_weights_up_to_a_near_tie(
    q4k_gguf: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    """Repacked weights change the kernels, not the model: the same greedy tokens (up to a
    near-tie of the plain weights' logits), and an 8-row pass within rounding (~2e-6 measured).

    Passes of 16 rows and more are left out: there ggml's tiled matmul (plain weights) and its
    repacked GEMM quantize differently from its one-row kernel, ~3e-2 and ~7e-2 apart on these
    weights (measured on a Zen 4 EPYC; ``GGML_CPU_TILED_MM=0`` closes the first gap)."""
    monkeypatch.setenv(EXTRA_BUFTS_ENV, "1")
    buffers, _ = weight_buffers(q4k_gguf, capfd)
    if STAND_IN not in buffers:
        pytest.skip(f"ggml does not repack Q4_K on this CPU (its weights went to {sorted(buffers)})")
    with LlamaCppModel(q4k_gguf, n_ctx=64, **PRECISE) as model:
        repacked, repacked_prompt, _ = greedy(model, GREEDY_TOKENS)
    monkeypatch.setenv(EXTRA_BUFTS_ENV, "0")
    with LlamaCppModel(q4k_gguf, n_ctx=64, **PRECISE) as model:
        plain, plain_prompt, margins = greedy(model, GREEDY_TOKENS)
    compared = assert_greedy_equal_up_to_near_tie(repacked, plain, margins, "repacked Q4_K weights")
    assert compared >= GREEDY_TOKENS // 2, f"a near-tie (< {NEAR_TIE}) after only {compared} tokens"
    torch.testing.assert_close(repacked_prompt, plain_prompt, atol=1e-4, rtol=0)


def test_env_prints_the_choice_and_why(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(EXTRA_BUFTS_ENV, "0")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert f"llama.cpp repacked weights off: forced by {EXTRA_BUFTS_ENV}=0" in out
    assert "cpu: " in out and "llama-cpp-python " in out
