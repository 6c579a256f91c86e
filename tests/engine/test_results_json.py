"""Every method's result, single and batched, is plain JSON (``specdecode generate --json``, the
server's metrics): ``json.dumps`` of ``to_dict()`` round-trips."""

import json
from pathlib import Path

import pytest

from specdecode import SamplingParams, SpecDecoder
from specdecode.engine.batch import BATCH_METHODS

PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def dec(tiny_qwen2_dir: Path, tiny_close_draft_dir: Path) -> SpecDecoder:
    return SpecDecoder.from_pretrained(str(tiny_qwen2_dir), str(tiny_close_draft_dir), dtype="fp32", device="cpu",
                                       skip_layers=[0], show_progress=False)


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "auto", "suffix", "layerskip"])
def test_a_single_result_round_trips_through_json(dec: SpecDecoder, method: str) -> None:
    data = dec.generate("def quicksort(arr):", PARAMS, method=method, k="auto" if method != "layerskip" else 3).to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["stats"]["method"] == method


def test_batched_results_round_trip_through_json(dec: SpecDecoder) -> None:
    for method in BATCH_METHODS:
        for result in dec.generate_batch(["def quicksort(arr):", "The quick brown fox"], PARAMS, method=method):
            data = result.to_dict()
            assert json.loads(json.dumps(data)) == data
