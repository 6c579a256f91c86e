"""Greedy output in a batch against the same request alone, per dtype (issue 32 item 5): how often
a batch row parts from its single-request output, and the top-2 logit gap where it does.

A batch pass over B rows may round differently from a one-row pass (other kernel shapes), so in
bf16 an output can part at a near-tie; in fp32 the gaps that rounding reaches are far smaller.
Tiny random models (the test suite's, built here), method none, 32 prompts in batches of 8:

    python benchmarks/batch_greedy_dtype.py --dtypes fp32,bf16 --prompts 32 --tokens 24
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tiny_models  # noqa: E402 - the suite's tiny model builder, found through the line above

from specdecode import SamplingParams, SpecDecoder  # noqa: E402

WORDS = ["def", "quicksort", "the", "fox", "import", "numpy", "class", "for", "range", "print", "once", "upon",
         "meeting", "budget", "return", "list", "x", "1,", "2,", "3,"]


def prompts(count: int) -> list[str]:
    generator = torch.Generator().manual_seed(0)
    return [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (3 + p % 9,), generator=generator))
            for p in range(count)]


def gap_at(dec: SpecDecoder, prompt_ids: list[int], continuation: list[int], position: int) -> float:
    """The alone run's top-2 logit gap at ``position`` of its continuation (one cacheless pass)."""
    ids = prompt_ids + continuation[:position]
    with torch.inference_mode():
        tokens = torch.tensor([ids])
        logits = dec.target.model(tokens, torch.arange(len(ids))[None]).logits[0, -1].float()
    top2 = logits.topk(2).values
    return float(top2[0] - top2[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--max-batch", type=int, default=8)
    args = parser.parse_args()
    folder = tiny_models.make_tiny_hf_model(Path(tempfile.mkdtemp()) / "tiny", arch="qwen2", seed=0)
    params = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    texts = prompts(args.prompts)
    report = {}
    for dtype in args.dtypes.split(","):
        dec = SpecDecoder.from_pretrained(str(folder), method="none", dtype=dtype, device="cpu", show_progress=False)
        engine = dec.batch_engine(max_batch=args.max_batch, kv_cache_tokens=4096, cost_aware=False)
        batched = dec.generate_batch(texts, params, method="none", engine=engine)
        parted = []
        for text, together in zip(texts, batched, strict=True):
            alone = dec.generate(text, params, method="none").token_ids
            if together.token_ids != alone:
                position = next(i for i, (a, b) in enumerate(zip(together.token_ids, alone)) if a != b)
                parted.append({"prompt": text, "position": position,
                               "top2_gap": gap_at(dec, dec.encode(text), alone, position)})
        report[dtype] = {"prompts": len(texts), "parted": len(parted),
                         "max_gap": max((p["top2_gap"] for p in parted), default=None), "rows": parted}
        print(json.dumps({dtype: {k: v for k, v in report[dtype].items() if k != "rows"}}), flush=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
