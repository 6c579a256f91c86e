"""Which torch.compile options pay for one model's decode pass on this CPU, and what they cost.

    python benchmarks/bench_compile_options.py --threads 1 --variants default,cpp-wrapper,max-autotune,freezing
    python benchmarks/bench_compile_options.py --threads 1 --attention

For each variant, a fresh process compiles the one-row pass (and, for the memory figure, the
two-row catch-up) of ``--model`` (default: the demo draft, bf16) into an empty inductor cache,
then times it against the eager pass back to back, ``--calls`` times, at positions 64..163:

- ``default``: what ``compile=True`` does (inductor, the packed oneDNN matmuls as a custom op);
- ``cpp-wrapper``: inductor's C++ wrapper instead of its Python one;
- ``max-autotune``: ``mode="max-autotune-no-cudagraphs"``;
- ``freezing``: inductor's ``freezing`` on unpacked weights (inductor packs them itself);
- ``freezing-max-autotune``: both.

Printed per variant: compile seconds of each shape, resident memory after loading and after
each shape, the median eager and compiled pass, and the median of per-call compiled/eager
ratios. ``--attention`` instead times the eager pass reading 65 cache slots against the same
pass reading a whole 512-, 1024- or 2048-slot cache under a mask (what a fixed-shape graph
reads). Every figure is a ratio within one process or a median.
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
from pathlib import Path

import torch

from specdecode.backends.compiled import CompiledSequence, CompileLog
from specdecode.backends.torch_backend import TorchSequence
from specdecode.kv.static import KVCache, fixed_view
from specdecode.models import demo
from specdecode.models.loader import load_model, load_weights, read_model_config, resolve_model_folder

VARIANTS = ("default", "cpp-wrapper", "max-autotune", "freezing", "freezing-max-autotune")
CONTEXT = 64


def resident_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 2**20, 2)
    return float("nan")


def run_variant(model_name: str, variant: str, calls: int) -> dict[str, object]:
    """One variant in this process (called in a fresh subprocess per variant)."""
    import torch._inductor.config as inductor_config

    dtype, device = torch.bfloat16, torch.device("cpu")
    eager_model = load_model(model_name, dtype, device, show_progress=False).model
    compiled_model = eager_model
    mode = "max-autotune-no-cudagraphs" if variant.endswith("max-autotune") else "default"
    if variant == "cpp-wrapper":
        inductor_config.cpp_wrapper = True
    if variant.startswith("freezing"):
        # Freezing treats weights as constants and packs its own copy: it needs dense weights.
        folder = resolve_model_folder(model_name, dtype, show_progress=False)
        compiled_model = load_weights(folder, read_model_config(folder), dtype, device, pack=False)
        inductor_config.freezing = True
    out: dict[str, object] = {"variant": variant, "mode": mode, "rss_gib_loaded": resident_gib()}
    compiled = CompiledSequence(compiled_model, mode, 2, CompileLog(), "model")
    eager = TorchSequence(eager_model)
    tokens = torch.zeros((1, 2), dtype=torch.long)
    with torch.inference_mode():
        for rows, last in ((1, None), (2, 1)):
            started = time.perf_counter()
            compiled.warm_up([(rows, last)])
            out[f"compile_seconds_{rows}_rows"] = round(time.perf_counter() - started, 1)
            out[f"rss_gib_after_{rows}_rows"] = resident_gib()
        for seq in (eager, compiled):
            seq.begin(CONTEXT + 128)
            seq.extend(tokens[:, :1], CONTEXT)
        samples: dict[str, list[float]] = {"eager": [], "compiled": []}
        for call in range(calls):
            sides = [("eager", eager), ("compiled", compiled)]
            for path, seq in sides if call % 2 == 0 else reversed(sides):
                started = time.perf_counter()
                seq.extend(tokens[:, :1], CONTEXT + call % 100)
                samples[path].append(time.perf_counter() - started)
    out["eager_ms"] = round(1000 * statistics.median(samples["eager"]), 2)
    out["compiled_ms"] = round(1000 * statistics.median(samples["compiled"]), 2)
    out["compiled_over_eager"] = round(statistics.median(
        c / e for c, e in zip(samples["compiled"], samples["eager"], strict=True)), 3)
    return out


def attention_widths(model_name: str, calls: int) -> dict[str, float]:
    """Median eager pass reading 65 slots, and reading whole caches of 512..2048 slots masked."""
    model = load_model(model_name, torch.bfloat16, torch.device("cpu"), show_progress=False).model
    cfg = model.config
    token, position = torch.zeros((1, 1), dtype=torch.long), torch.tensor([[CONTEXT]])
    samples: dict[str, list[float]] = {}
    with torch.inference_mode():
        for slots in (512, 1024, 2048):
            cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, slots, model.dtype, "cpu")
            runs = {
                "sliced_65": lambda cache=cache: model.extend(cache, token, CONTEXT),
                f"masked_{slots}": lambda cache=cache, slots=slots: model(
                    token, position, cache, fixed_view(position, slots), contiguous_start=CONTEXT),
            }
            for run in runs.values():
                run()
            for _ in range(calls):
                for label, run in runs.items():
                    started = time.perf_counter()
                    run()
                    samples.setdefault(label, []).append(time.perf_counter() - started)
    return {label: round(1000 * statistics.median(v), 2) for label, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=demo.DEFAULT_DRAFT)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--attention", action="store_true", help="time masked whole-cache reads instead")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one variant in this process
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(run_variant(args.model, args.one, args.calls)))
        return
    results: dict[str, object] = {"model": args.model, "threads": torch.get_num_threads(),
                                  "load_before": [round(x, 2) for x in os.getloadavg()]}
    if args.attention:
        results["attention_ms"] = attention_widths(args.model, args.calls)
    else:
        for variant in args.variants.split(","):
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
            command = [sys.executable, __file__, "--one", variant, "--model", args.model, "--calls", str(args.calls)]
            if args.threads:
                command += ["--threads", str(args.threads)]
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            results[variant] = (json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                                else {"error": done.stderr.strip().splitlines()[-1:]})
            print(json.dumps(results[variant]), file=sys.stderr, flush=True)
    results["load_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
