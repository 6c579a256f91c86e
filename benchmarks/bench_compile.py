"""Compiled passes against eager ones, side by side in one run (``compile=``: backends/compiled_batch.py, compiled.py).

    python benchmarks/bench_compile.py --out compile.json                 # demo pair, bf16, CPU
    python benchmarks/bench_compile.py --only-passes --mode max-autotune-no-cudagraphs

Both decoders share the loaded weights; the compiled one compiles its passes first (timed: the
first run's compile time with an empty inductor cache, ``--fresh-cache``; then, with
``--cached-rerun``, a second process compiles the same passes from the on-disk cache). Then:

- the batch engine's target passes (``--batch-shapes``, B sequences feeding T tokens each), eager
  and compiled back to back in each round, at 64 cached positions each; compiled/eager medians;
- the single engine's pass costs (unless ``--skip-single-passes``): the draft's one-row pass and
  the target's passes over ``--rows`` rows, eager and compiled back to back in each round, at 64
  cached positions; the draft/target cost ratio and the compiled/eager ratio per round; medians
  over ``--rounds``;
- end to end (unless ``--only-passes``; on the batch engine, as ``generate`` decodes): plain
  decoding and the draft method, eager and compiled, interleaved per prompt on the bench's prompts (first turns, chat template, greedy),
  with greedy equality checked within each path.
Machines are shared: every figure is a ratio within one run or a median, and the load average
is recorded before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from specdecode import SamplingParams, SpecDecoder
from specdecode.config import DecoderConfig
from specdecode.engine.one_request import MIN_POOL_TOKENS
from specdecode.models import demo
from specdecode.models.loader import load_model
from specdecode.prompt_sets import load_prompts, select_prompts

PROBE_CONTEXT = 64  # cached positions before a timed pass, as core.timing's probe


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def pass_costs(eager: SpecDecoder, compiled: SpecDecoder, rows: list[int], rounds: int) -> dict[str, object]:
    """Median milliseconds per pass and median ratios over ``rounds``: each round times every
    pass once eagerly and once compiled, back to back (in alternating order), so that a load
    spike hits both sides of a ratio alike."""
    sequences = {"target": (eager.engine.target, compiled.engine.target),
                 "draft": (eager.resources.draft_model.model, compiled.resources.draft_model.model)}
    tokens = torch.zeros((1, max(rows)), dtype=torch.long)
    for pair in sequences.values():
        for seq in pair:
            seq.begin(PROBE_CONTEXT + max(rows) + 1)
            seq.extend(tokens[:, :1], PROBE_CONTEXT)  # compiles nothing new: warm_up did; a first call per shape
    samples: dict[str, list[float]] = {}
    for index in range(rounds):
        for role, pair in sequences.items():
            for count in [1] if role == "draft" else rows:
                sides = list(zip(("eager", "compiled"), pair, strict=True))
                for path, seq in sides if index % 2 == 0 else reversed(sides):
                    started = time.perf_counter()
                    seq.extend(tokens[:, :count], PROBE_CONTEXT)
                    samples.setdefault(f"{role}/{count}/{path}", []).append(time.perf_counter() - started)
    out: dict[str, object] = {"ms": {key: round(1000 * statistics.median(v), 2) for key, v in samples.items()}}
    ratios = {}
    for path in ("eager", "compiled"):
        per_round = [d / t for d, t in zip(samples[f"draft/1/{path}"], samples[f"target/1/{path}"], strict=True)]
        ratios[f"draft_over_target_{path}"] = round(statistics.median(per_round), 3)
    for key, compiled_samples in samples.items():
        if key.endswith("/compiled"):
            base = key.removesuffix("/compiled")
            per_round = [c / e for c, e in zip(compiled_samples, samples[f"{base}/eager"], strict=True)]
            ratios[f"compiled_over_eager/{base}"] = round(statistics.median(per_round), 3)
    out["ratios"] = ratios
    return out


def batch_pass_costs(eager: SpecDecoder, compiled: SpecDecoder, shapes: list[tuple[int, int]],
                     rounds: int) -> dict[str, object]:
    """``pass_costs`` for the batch engine's target passes (what ``generate`` and the server run):
    B sequences of ``PROBE_CONTEXT`` cached positions each feeding T tokens, eager and compiled
    (``backends/compiled_batch.py``) back to back in each round; median ms and compiled/eager."""
    models = {path: decoder.one_request.engine_for(MIN_POOL_TOKENS).target
              for path, decoder in (("eager", eager), ("compiled", compiled))}
    samples: dict[str, list[float]] = {}
    for index in range(rounds + 1):  # round 0 compiles a new shape (and warms the eager kernels): not kept
        sides = list(models.items()) if index % 2 == 0 else list(reversed(models.items()))
        for batch, rows in shapes:
            for path, model in sides:
                seqs = [-1 - b for b in range(batch)]
                for seq in seqs:
                    model.pool.add(seq)
                    model.pool.reserve(seq, PROBE_CONTEXT + rows)
                inputs = [torch.zeros(rows, dtype=torch.long)] * batch
                started = time.perf_counter()
                model.forward(seqs, inputs, [PROBE_CONTEXT] * batch)
                if index:
                    samples.setdefault(f"{batch}x{rows}/{path}", []).append(time.perf_counter() - started)
                for seq in seqs:
                    model.pool.free(seq)
    ratios = {}
    for batch, rows in shapes:
        pairs = zip(samples[f"{batch}x{rows}/compiled"], samples[f"{batch}x{rows}/eager"], strict=True)
        ratios[f"{batch}x{rows}"] = round(statistics.median(c / e for c, e in pairs), 3)
    return {"ms": {key: round(1000 * statistics.median(v), 2) for key, v in samples.items()},
            "compiled_over_eager": ratios}


def end_to_end(eager: SpecDecoder, compiled: SpecDecoder, args: argparse.Namespace) -> dict[str, object]:
    prompts = select_prompts(load_prompts(["default"]), None, args.prompts_per_category)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    runs = {(path, method): [] for path in ("eager", "compiled") for method in ("none", "draft")}
    decoders = {"eager": eager, "compiled": compiled}
    for index, prompt in enumerate(prompts):
        ids = eager.encode([{"role": "user", "content": prompt.turns[0]}], chat=True)
        order = list(runs) if index % 2 == 0 else list(reversed(runs))  # no method always runs first
        for path, method in order:
            result = decoders[path].generate(ids, params, method=method, k=args.k)
            runs[path, method].append(result)
        print(f"  {prompt.prompt_id}: " + " ".join(
            f"{p}/{m}={runs[p, m][-1].stats.tokens_per_second:.2f}" for p, m in runs), file=sys.stderr, flush=True)
    table: dict[str, object] = {}
    for (path, method), results in runs.items():
        tokens = sum(r.stats.new_tokens for r in results)
        seconds = sum(r.stats.total_seconds for r in results)
        table[f"{path}/{method}"] = {"tok_per_s": round(tokens / seconds, 3), "tokens": tokens,
                                     "compile_seconds": round(sum(r.stats.compile_seconds for r in results), 2)}
        if method == "draft":
            table[f"{path}/{method}"]["tau"] = round(statistics.mean(r.stats.tau for r in results), 3)

    def per_prompt(a: tuple[str, str], b: tuple[str, str]) -> float:
        ratios = [x.stats.total_seconds / x.stats.new_tokens / (y.stats.total_seconds / y.stats.new_tokens)
                  for x, y in zip(runs[b], runs[a], strict=True)]
        return round(statistics.median(ratios), 3)  # speed of a over b, per prompt

    table["median_per_prompt"] = {
        "eager draft over eager none": per_prompt(("eager", "draft"), ("eager", "none")),
        "compiled draft over compiled none": per_prompt(("compiled", "draft"), ("compiled", "none")),
        "compiled none over eager none": per_prompt(("compiled", "none"), ("eager", "none")),
        "compiled draft over eager none": per_prompt(("compiled", "draft"), ("eager", "none")),
        "compiled draft over eager draft": per_prompt(("compiled", "draft"), ("eager", "draft")),
    }
    table["greedy_equal"] = {
        path: sum(a.token_ids == b.token_ids for a, b in zip(runs[path, "draft"], runs[path, "none"], strict=True))
        for path in ("eager", "compiled")
    }
    table["compiled_none_equals_eager_none"] = sum(
        a.token_ids == b.token_ids for a, b in zip(runs["compiled", "none"], runs["eager", "none"], strict=True))
    table["prompts"] = len(prompts)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=demo.DEFAULT_TARGET)
    parser.add_argument("--draft", default=demo.DEFAULT_DRAFT)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--mode", default="default", help="torch.compile mode of the compiled decoder")
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds of pass timings")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--rows", default="1,2,4,6", help="target pass row counts to time")
    parser.add_argument("--prompts-per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--only-passes", action="store_true")
    parser.add_argument("--batch-shapes", default="1x1,1x4,4x1,4x4",
                        help="the batch engine's target passes to time, BxT (B sequences feeding T tokens); '' for none")
    parser.add_argument("--skip-single-passes", action="store_true", help="no single-engine pass costs")
    parser.add_argument("--fresh-cache", action="store_true", help="compile into an empty inductor cache (a first run)")
    parser.add_argument("--cached-rerun", action="store_true", help="then time a second process compiling from the cache")
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    results: dict[str, object] = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                                  "mode": args.mode, "k": args.k, "load_before": load_average()}
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    device = torch.device("cpu")
    target = load_model(args.target, dtype, device, show_progress=False)
    draft = load_model(args.draft, dtype, device, show_progress=False)
    config = DecoderConfig(method="draft", k=args.k, k_policy="fixed")
    compiled = SpecDecoder(target, draft, replace(config, compile=args.mode))
    started = time.perf_counter()
    log = compiled.warm_up(show_progress=not args.compile_only)
    results["compile"] = {"seconds": round(time.perf_counter() - started, 1), "passes": len(log.passes),
                          "cache_hits": log.cache_hits, "cache_misses": log.cache_misses,
                          "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    print(json.dumps(results["compile"]), file=sys.stderr, flush=True)
    if args.compile_only:
        print(json.dumps(results["compile"]))
        return
    if args.cached_rerun:
        command = [sys.executable, __file__, "--compile-only", "--mode", args.mode, "--k", str(args.k),
                   "--target", args.target, "--draft", args.draft, "--dtype", args.dtype]
        if args.threads:
            command += ["--threads", str(args.threads)]  # the thread count is part of inductor's cache key
        rerun = subprocess.run(command, capture_output=True, text=True, check=True, env=os.environ.copy())
        results["compile_cached_rerun"] = json.loads(rerun.stdout.strip().splitlines()[-1])
        print(json.dumps(results["compile_cached_rerun"]), file=sys.stderr, flush=True)
    eager = SpecDecoder(target, draft, config)
    rows = [int(r) for r in args.rows.split(",")]
    if args.batch_shapes:
        shapes = [(int(b), int(t)) for b, t in (shape.split("x") for shape in args.batch_shapes.split(","))]
        results["batch_passes"] = batch_pass_costs(eager, compiled, shapes, args.rounds)
        print(json.dumps(results["batch_passes"], indent=1), file=sys.stderr, flush=True)
    if not args.skip_single_passes:
        results["passes"] = pass_costs(eager, compiled, rows, args.rounds)
        print(json.dumps(results["passes"], indent=1), file=sys.stderr, flush=True)
    if not args.only_passes:
        results["end_to_end"] = end_to_end(eager, compiled, args)
    results["load_after"] = load_average()
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    with torch.inference_mode():
        main()
