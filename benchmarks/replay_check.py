"""Does a pass trace predict the run it was recorded from? (issue 33 part 1)

For each prompt and method, one request runs for real with its passes traced
(``SpecDecoder.trace_passes``); then the trace is replayed (``bench/replay.py``) on the same
decoder's sequences, the recorded acceptance forced by the recorded commits, with none of the
engine's own work (drafting logic, verification, sampling, the host side). Rounds interleave
real runs and replays; each prompt's median real and replayed seconds are compared, pooled per
method. A replay within ~10% of the real run says the passes are the run's cost, so a replay
elsewhere (a GPU with random weights of the same shapes) predicts what the same schedule costs
there. The traces are written out (``--traces``) with the models' shapes, for that replay.

    python benchmarks/replay_check.py --backend llama.cpp --methods none,draft,auto \\
        --out benchmarks/results/replay/check-llamacpp.json --traces benchmarks/traces/demo-llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from specdecode import SamplingParams, SpecDecoder
from specdecode.bench.replay import model_config_dict, replay
from specdecode.engine.trace import DRAFT, TARGET, save_traces
from specdecode.prompt_sets import load_prompts, select_prompts

METHOD_K = {"none": None, "draft": 5, "ngram": "auto", "suffix": "auto", "auto": "auto"}  # draft: a fixed k, so it drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="llama.cpp", choices=("llama.cpp", "torch"))
    parser.add_argument("--methods", default="none,draft,auto", help="comma-separated: " + ", ".join(METHOD_K))
    parser.add_argument("--per-category", type=int, default=1, help="first N prompts of each default category")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="real run and replay per prompt, interleaved; median kept")
    parser.add_argument("--out", type=Path, required=True, help="JSON of the comparison")
    parser.add_argument("--traces", type=Path, help="also write the first round's traces here (with the models' shapes)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    unknown = set(methods) - set(METHOD_K)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHOD_K)}")

    decoder = SpecDecoder.from_pretrained(method="draft", backend=args.backend)
    prompts = select_prompts(load_prompts(["default"]), ["all"], args.per_category)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    draft = decoder.resources.draft_model
    sequences = {TARGET: decoder.engine.target, DRAFT: draft.model if draft is not None else None}
    decoder.generate(decoder.encode("Warm up: count to five."), SamplingParams(max_new_tokens=16))  # first passes
    rows, kept = [], []
    for prompt in prompts:
        ids = decoder.encode([{"role": "user", "content": prompt.turns[0]}], chat=True)
        for method in methods:
            real, replayed, trace = [], [], None
            for round_ in range(args.rounds):
                decoder.forget_prefix()
                decoder.suffix_cache.clear()
                with decoder.trace_passes() as recorded:
                    result = decoder.generate(ids, params, method=method, k=METHOD_K[method])
                real.append(result.stats.total_seconds)
                trace = trace or recorded
                decoder.forget_prefix()
                started = time.perf_counter()
                replay(recorded, {role: s for role, s in sequences.items() if s is not None})
                replayed.append(time.perf_counter() - started)
            assert trace is not None
            trace.meta.update(method=method, prompt_id=prompt.prompt_id, prompt_tokens=len(ids),
                              tokens=len(result.token_ids), backend=args.backend)
            kept.append(trace)
            row = {"prompt_id": prompt.prompt_id, "category": prompt.category, "method": method,
                   "tokens": len(result.token_ids), "real_seconds": statistics.median(real),
                   "replay_seconds": statistics.median(replayed)}
            row["replay_over_real"] = row["replay_seconds"] / row["real_seconds"]
            rows.append(row)
            print(f"{prompt.prompt_id:28s} {method:7s} {row['tokens']:4d} tokens real {row['real_seconds']:6.2f} s "
                  f"replay {row['replay_seconds']:6.2f} s  ratio {row['replay_over_real']:.3f}", flush=True)
    pooled = {}
    for method in methods:
        mine = [r for r in rows if r["method"] == method]
        real, replayed = sum(r["real_seconds"] for r in mine), sum(r["replay_seconds"] for r in mine)
        worst = max((r["replay_over_real"] for r in mine), key=lambda x: abs(x - 1))  # farthest from 1
        pooled[method] = {"real_seconds": real, "replay_seconds": replayed, "replay_over_real": replayed / real,
                          "worst_prompt_ratio": worst}
        print(f"{method:7s} pooled: real {real:7.2f} s replay {replayed:7.2f} s ratio {replayed / real:.3f} "
              f"(worst prompt {pooled[method]['worst_prompt_ratio']:.3f})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python benchmarks/replay_check.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None), "backend": args.backend,
        "rounds": args.rounds, "max_new_tokens": args.max_new_tokens, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "pooled": pooled, "rows": rows}, indent=1) + "\n")
    if args.traces:
        header = {"target": model_config_dict(decoder.target.config),
                  "draft": model_config_dict(decoder.draft.config) if decoder.draft is not None else None,
                  "backend": args.backend, "recorded_on": "CPU (benchmarks/replay_check.py)"}
        save_traces(kept, args.traces, header)
        print(f"wrote {args.traces} ({len(kept)} traces)")


if __name__ == "__main__":
    main()

