"""Replay recorded pass traces on a device with random weights of the same shapes (issue 33).

The traces (``benchmarks/replay_check.py --traces`` or ``specdecode bench --oracle``'s
traces.json) hold each request's passes as the real run on the CPU made them, the real demo
pair's acceptance included. Replayed on a GPU with random bf16 weights of the shapes in the
file's header, they cost exactly the passes the same schedule would cost there; each method's
replay against the plain decoding replay of the same prompt is the speedup the real acceptance
would give on that device (the engine's own work, a few hundred microseconds per step, left out).

    python benchmarks/replay_traces.py --traces benchmarks/traces/demo-llamacpp.json --device cuda \\
        --compile --out replay-cuda.json

``--compile`` replays on compiled sequences (CUDA graphs on CUDA), each pass shape compiled
by a first untimed replay of every trace. Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specdecode.backends.compiled import CompiledSequence, CompileLog, resolve_compile_mode
from specdecode.backends.torch_backend import TorchSequence
from specdecode.bench.replay import model_config_from_dict, random_model, replay
from specdecode.engine.trace import DRAFT, EXTEND, TARGET, load_traces

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--compile", action="store_true", help="replay on compiled sequences (CUDA graphs on CUDA)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N traces (a quick try)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    header, traces = load_traces(args.traces)
    traces = traces[: args.limit] if args.limit else traces
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    models = {role: random_model(model_config_from_dict(header[role]), device, dtype, seed=i)
              for i, role in enumerate((TARGET, DRAFT)) if header.get(role)}
    mode = resolve_compile_mode(True, device) if args.compile else None
    log = CompileLog()
    # Every traced pass shape compiles (rows up to the longest non-prefill pass in the file).
    rows = max((e.rows for t in traces for e in t.passes() if not (e.op == EXTEND and e.args[2] == 0)), default=1)
    sequences = {role: (CompiledSequence(model, mode, rows, log, role) if mode else TorchSequence(model))
                 for role, model in models.items()}
    started = time.perf_counter()
    for trace in traces:  # warm-up: first-shape kernels (and every compiled graph) before timing
        replay(trace, sequences)
    warm_seconds = time.perf_counter() - started
    print(f"warm-up replay of {len(traces)} traces: {warm_seconds:.1f} s", flush=True)
    rows_out = []
    for trace in traces:
        seconds = statistics.median(replay(trace, sequences).seconds for _ in range(args.repeats))
        meta = trace.meta
        rows_out.append({**{k: meta.get(k) for k in ("method", "prompt_id", "tokens", "prompt_tokens")},
                         "seconds": seconds, "target_passes": len(list(trace.passes(TARGET))),
                         "draft_passes": len(list(trace.passes(DRAFT)))})
        print(f"{meta.get('prompt_id')!s:28s} {meta.get('method')!s:8s} {seconds * 1e3:9.1f} ms", flush=True)
    plain = {r["prompt_id"]: r["seconds"] for r in rows_out if r["method"] == "none"}
    pooled = {}
    for method in dict.fromkeys(r["method"] for r in rows_out):
        mine = [r for r in rows_out if r["method"] == method and r["prompt_id"] in plain]
        if mine:
            seconds = sum(r["seconds"] for r in mine)
            pooled[method] = {"seconds": seconds, "speedup_vs_none": sum(plain[r["prompt_id"]] for r in mine) / seconds,
                              "tokens_per_second": sum(r["tokens"] or 0 for r in mine) / seconds, "prompts": len(mine)}
            print(f"{method:8s} {pooled[method]['tokens_per_second']:8.1f} tok/s  "
                  f"{pooled[method]['speedup_vs_none']:.2f}x the plain replay")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "traces": str(args.traces), "device": str(device), "dtype": args.dtype, "compile": mode,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "warm_up_seconds": warm_seconds, "compile_log": {"seconds": log.seconds, "passes": len(log.passes)},
        "repeats": args.repeats, "pooled": pooled, "rows": rows_out,
    }, indent=1) + "\n")


if __name__ == "__main__":
    main()
