"""What a bench run loads: a run of llama.cpp methods alone reads the GGUF files and never builds
a torch model (the demo target in bf16 would add 3 GiB to every method's peak RSS), and its
results still name the models, their bytes per pass and each turn's peak RSS."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdecode.bench.methods import TurnResult
from specdecode.bench.runner import Bench, BenchConfig
from specdecode.prompt_sets import BenchPrompt

MAX_NEW = 6


@pytest.fixture(scope="module")
def ggufs(tiny_ggufs: dict[str, Path]) -> dict[str, Path]:
    pytest.importorskip("llama_cpp")
    return tiny_ggufs


def test_llamacpp_methods_alone_load_no_torch_model(ggufs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import specdecode.loading
    from specdecode.bench.roofline import gguf_weight_bytes_per_forward

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a torch model was loaded for llama.cpp methods")

    monkeypatch.setattr(specdecode.loading, "load_model", refuse)  # the torch loader SpecDecoder uses
    config = BenchConfig(target=str(ggufs["target"]), draft=str(ggufs["close"]), methods=("none@llama.cpp", "draft@llama.cpp", "llamacpp"),
                         max_new_tokens=MAX_NEW, k=2, dtype="fp32", device="cpu", bandwidth_probe_bytes=0, quiet=True, warmup=False)
    bench = Bench(config)
    assert bench.decoder is bench.llamacpp.decoder and bench.decoder.backend == "llama.cpp"
    assert bench.llamacpp.context == 512  # the tiny GGUF's trained context, read from the file
    results = bench.run([BenchPrompt("mini:1", "qa", "qa", ("def fibonacci(n):",))])
    assert not results["failures"]
    target_bytes = gguf_weight_bytes_per_forward(ggufs["target"])
    assert results["models"]["target"]["weight_bytes_per_forward"] == target_bytes
    assert results["models"]["weight_bytes_by_method"]["llamacpp"] == [target_bytes, 0]
    assert results["models"]["target"]["name"] == ggufs["target"].name  # a file name, never a path
    assert results["summary"]["draft@llama.cpp"]["all"]["equality"]["equal_fraction"] == 1.0
    turn = results["records"][0]["repeats"][0][0]
    assert turn["peak_rss_bytes"] > 0 and turn["run_rss_bytes"] >= 0
    assert results["load_peak_rss_bytes"] > 0  # the loading's peak, which the turns' peaks leave out
    assert set(TurnResult.__dataclass_fields__) <= set(turn)
    header = bench.trace_header()  # a replay rebuilds the models from these: every shape is there
    assert header["target"]["intermediate_size"] > 0 and header["target"]["rope_theta"] > 0
    assert header["draft"]["num_layers"] == bench.decoder.draft.config.num_layers
