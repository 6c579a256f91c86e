"""Every llama.cpp pass of the process runs on one thread, whichever thread asks
(backends/llamacpp_threads.py: libgomp throttled every pass's barriers once a second thread had
run passes, ~35% slower on two cores). Speed is the benchmarks' business; what is tested here is
the structure that gives it, and that results and errors still reach the caller."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from specdecode.backends import llamacpp_threads
from specdecode.backends.llamacpp import LlamaCppModel
from specdecode.backends.llamacpp_threads import run_on_pass_thread

PROMPT = [509, 5, 300, 200, 45, 67, 88, 12]


def test_results_and_errors_come_back_to_the_caller() -> None:
    assert run_on_pass_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        run_on_pass_thread(lambda: 1 / 0)
    # A call made from the pass thread itself runs there at once instead of waiting on itself.
    assert run_on_pass_thread(lambda: run_on_pass_thread(threading.get_ident)) == run_on_pass_thread(threading.get_ident)


def test_passes_from_many_threads_and_models_run_on_one_thread(
    tiny_ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    original = llama_cpp.llama_decode
    decoding_threads: list[int] = []

    def recording_decode(ctx: object, batch: object) -> int:
        decoding_threads.append(threading.get_ident())
        return original(ctx, batch)

    monkeypatch.setattr(llama_cpp, "llama_decode", recording_decode)
    with LlamaCppModel(tiny_ggufs["target"], n_ctx=64, kv_type="f32", flash_attn=False) as target, \
            LlamaCppModel(tiny_ggufs["close"], n_ctx=64, kv_type="f32", flash_attn=False) as draft:
        expected = target.forward(0, PROMPT, 0, logits="all")
        results: dict[str, object] = {}

        def run(name: str, model: LlamaCppModel) -> None:
            results[name] = model.forward(0, PROMPT, 0, logits="all")

        callers = [threading.Thread(target=run, args=(name, model))
                   for name, model in (("target", target), ("draft", draft))]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join()
    assert len(decoding_threads) == 3
    assert len(set(decoding_threads)) == 1, "every pass runs on the one pass thread"
    caller_ids = {threading.get_ident()} | {caller.ident for caller in callers}
    assert decoding_threads[0] not in caller_ids
    assert results["target"].equal(expected)  # the same pass, asked from another thread


def test_a_forked_child_gets_its_own_pass_thread() -> None:
    # The executor's thread does not survive fork(): a child that reused it would wait forever.
    import os

    run_on_pass_thread(int)  # the parent's thread exists
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if a pass-thread call returns
        try:
            os._exit(0 if run_on_pass_thread(lambda: 7) == 7 else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert llamacpp_threads._PASS_THREAD._pid == os.getpid()
