"""Every method through the server's one engine (issue 45): medusa, eagle and layerskip requests
sent at once decode in the same batch steps as plain ones (no engine lock, no second engine),
and each greedy answer equals the plain one; the server refuses the configurations its batch
engine cannot serve before loading anything."""

import threading
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import MODEL, running_server

import specdecode.engine.batch
from specdecode import DecoderConfig, SpecDecoder
from specdecode.errors import InvalidRequestError
from specdecode.models.heads import load_heads
from specdecode.serving.server import create_app
from specdecode.serving.spec import ServerSpec
from specdecode.serving.worker import BatchWorker

METHODS = ("medusa", "eagle", "layerskip", "none")
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):"


def test_heads_and_layerskip_requests_share_the_batch(tiny_qwen2_dir: Path, medusa_dir: Path, eagle_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    dec = SpecDecoder.from_pretrained(str(tiny_qwen2_dir), method="medusa", heads=str(medusa_dir), skip_layers=(1,),
                                      draft_confidence=0.0, dtype="fp32", device="cpu", show_progress=False)
    dec.attach_heads(load_heads(eagle_dir, torch.float32, torch.device("cpu")))
    worker = BatchWorker(dec.batch_engine(max_batch=4, kv_cache_tokens=1024, cost_aware=False))
    widest: list[set[str]] = []
    real_verify = specdecode.engine.batch.BatchEngine._verify

    def spy(self, running, proposals):  # which methods each step's pass carried
        widest.append({seq.state.method for seq in running})
        return real_verify(self, running, proposals)

    monkeypatch.setattr(specdecode.engine.batch.BatchEngine, "_verify", spy)
    answers: dict[str, dict] = {}
    try:
        with running_server(create_app(dec, MODEL, worker)) as base:
            def send(method: str) -> None:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "method": method,
                        "k": 3}
                answers[method] = httpx.post(base + "/v1/completions", json=body, timeout=120).json()

            threads = [threading.Thread(target=send, args=(method,)) for method in METHODS]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
    finally:
        worker.close()
    texts = {method: answer["choices"][0]["text"] for method, answer in answers.items()}
    assert len(set(texts.values())) == 1, texts  # greedy: every method writes the plain answer
    assert max(len(methods) for methods in widest) >= 3, "the methods should have shared steps"
    assert all(answer["specdecode"]["method"] == method for method, answer in answers.items())


def test_the_server_refuses_what_its_batch_engine_cannot_serve() -> None:
    with pytest.raises(InvalidRequestError, match="--max-batch"):
        ServerSpec(max_batch=0)
    assert ServerSpec(decoder=DecoderConfig(kv_dtype="int8")).decoder.kv_dtype == "int8"  # its paged pools store int8
