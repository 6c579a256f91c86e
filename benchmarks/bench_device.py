"""Speed of the engine on an accelerator, with random weights of the demo models' shapes.

    python benchmarks/bench_device.py --device cuda --out device.json [--shape demo|tiny]

No weights can reach a lent GPU machine, so this builds random bf16 models with the shapes of
the demo pair (Qwen2.5-1.5B target, Qwen2.5-0.5B draft; ``--shape tiny`` for a quick try on a
CPU) and measures what does not depend on the weights:
- one target pass over 1..16 rows (the verify cost curve; flat = verifying is nearly free);
- plain greedy decoding through the engine against the same model's bare one-row pass (the
  engine's overhead per step), and against transformers' ``generate`` on the same weights;
- speculative decoding with the target as its own draft (acceptance 1: the ceiling of what
  speculation can give at this k), ours against transformers' assisted generation with the
  same self-assistant;
- the 0.5B-shaped draft's pass cost (its acceptance with random weights means nothing);
- with ``--compile``: the same decoding with compiled passes (``compile=True``: CUDA graphs on
  CUDA), their compile time, the draft's pass cost compiled, and transformers' ``generate``
  with its static cache and ``torch.compile(mode="reduce-overhead")`` on the same weights.
Medians over ``--repeats``; every figure is a ratio or a per-pass time measured in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import make_tiny_tokenizer  # noqa: E402  (the tests' small tokenizer)

from specdecode import SamplingParams, SpecDecoder  # noqa: E402
from specdecode.backends.torch_backend import time_passes  # noqa: E402

SHAPES = {  # name -> (hidden, layers, heads, kv heads, intermediate, vocab)
    "demo-target": (1536, 28, 12, 2, 8960, 151936),
    "demo-draft": (896, 24, 14, 2, 4864, 151936),
    "tiny-target": (256, 4, 4, 2, 512, 4096),
    "tiny-draft": (128, 2, 4, 2, 256, 4096),
}


def build(shape: str, out: Path, device: torch.device, seed: int) -> Path:
    """A random bf16 Qwen2 model of ``shape`` saved as safetensors with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[shape]
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    with device:  # random init on the accelerator: seconds, not minutes, for 1.5B weights
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    make_tiny_tokenizer(out)
    del model
    return out


def timed(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median seconds of ``repeats`` synchronised calls after one warm-up; the last result."""
    result = fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples), result


def graph_pass(model) -> dict[str, object]:
    """One-row target pass replayed as a CUDA graph against the same pass run eagerly.

    A measurement, not a feature: the pass is captured at one fixed position, as a decode loop
    built on graphs would capture one per shape. It says how much of a pass is launch overhead.
    """
    from specdecode.core.timing import COST_PROBE_CONTEXT
    from specdecode.kv.static import reusable_cache

    try:
        cache = reusable_cache(None, model.config, COST_PROBE_CONTEXT + 1, model.dtype, model.device)
        tokens = torch.zeros((1, 1), dtype=torch.long, device=model.device)

        def one_pass() -> object:
            return model.extend(cache, tokens, COST_PROBE_CONTEXT)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                one_pass()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one_pass()

        def per_call_ms(run, calls: int = 30) -> float:
            run()
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(calls):
                run()
            end.record()
            torch.cuda.synchronize()
            return begin.elapsed_time(end) / calls

        eager, replay = per_call_ms(one_pass), per_call_ms(graph.replay)
        return {"eager_ms": eager, "graph_ms": replay, "eager_over_graph": eager / replay}
    except Exception as err:  # noqa: BLE001 - a capture failure is a finding, not a crash
        return {"error": repr(err)}


def compiled_runs(eager: SpecDecoder, target_dir: Path, prompt: list[int], params: SamplingParams,
                  args: argparse.Namespace, eager_plain_s: float, device: torch.device) -> dict[str, object]:
    """Decoding with compiled passes on the models ``eager`` loaded, against eager decoding
    (``eager_plain_s``), and transformers with a static cache compiled the way its docs show."""
    from specdecode.backends.torch_backend import time_passes

    out: dict[str, object] = {}
    # The k + 1 verify shapes and the draft's two, not every k up to k_max: compiling costs device time.
    compiled = SpecDecoder(eager.target, eager.draft, replace(eager.config, k=args.k, compile=True))
    started = time.perf_counter()
    log = compiled.warm_up()
    out["compile"] = {"mode": compiled.compile_mode, "seconds": round(time.perf_counter() - started, 1),
                      "passes": len(log.passes), "cache_hits": log.cache_hits}
    target_seq, draft_seq = compiled.engine.target, compiled.resources.draft_model.model
    out["target_pass_ms_by_rows"] = {r: round(1000 * s, 3) for r, s in target_seq.pass_seconds([1, 2, 4, 8], 5).items()}
    out["draft_pass_ms"] = round(1000 * draft_seq.pass_seconds([1], 5)[1], 3)
    eager_draft = time_passes(eager.draft.model, (1,), repeats=5)[1]
    eager_target = time_passes(eager.target.model, (1,), repeats=5)[1]
    out["draft_over_target"] = {"eager": round(eager_draft / eager_target, 3),
                                "compiled": round(draft_seq.pass_seconds([1], 5)[1] / target_seq.pass_seconds([1], 5)[1], 3)}
    plain_s, plain = timed(lambda: compiled.generate(prompt, params, method="none"), device, args.repeats)
    draft_s, drafted = timed(lambda: compiled.generate(prompt, params, method="draft", k=args.k), device, args.repeats)
    out["plain"] = {"tok_per_s": args.new_tokens / plain_s, "speedup_vs_eager_plain": eager_plain_s / plain_s}
    out["small_draft"] = {"tok_per_s": args.new_tokens / draft_s, "speedup_vs_compiled_plain": plain_s / draft_s,
                          "tau": drafted.stats.tau}
    try:  # transformers' own fast path: static cache + torch.compile (its documented recipe)
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead" if device.type == "cuda" else None, fullgraph=True)
        ids = torch.tensor([prompt], device=device)
        gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
        started = time.perf_counter()
        hf.generate(ids, **gen)  # compiles
        out["hf_static_compiled_compile_seconds"] = round(time.perf_counter() - started, 1)
        hf_s, hf_out = timed(lambda: hf.generate(ids, **gen), device, args.repeats)
        out["hf_static_compiled"] = {"tok_per_s": args.new_tokens / hf_s, "ours_compiled_plain_over_hf": hf_s / plain_s,
                                     "ours_compiled_draft_over_hf": hf_s / draft_s,
                                     "same_tokens": hf_out[0, len(prompt):].tolist() == plain.token_ids}
    except Exception as err:  # noqa: BLE001 - report, do not lose the figures above
        out["hf_static_compiled_error"] = repr(err)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=("demo", "tiny"), default="demo")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only-passes", action="store_true", help="time the passes only, no decoding")
    parser.add_argument("--compile", action="store_true", help="also decode with compiled passes, and compiled transformers")
    args = parser.parse_args()
    device = torch.device(args.device)
    results: dict[str, object] = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                  "torch": torch.__version__, "shape": args.shape, "new_tokens": args.new_tokens}

    def save() -> None:
        print(json.dumps(results, indent=1))
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))

    work = Path(tempfile.mkdtemp())
    target_dir = build(f"{args.shape}-target", work / "target", device, seed=0)
    draft_dir = build(f"{args.shape}-draft", work / "draft", device, seed=1)
    prompt = torch.randint(2, 4000, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)

    common = dict(dtype="bf16", device=args.device, show_progress=False, draft_confidence=0.0)
    selfspec = SpecDecoder.from_pretrained(str(target_dir), str(target_dir), method="draft", **common)
    time_passes(selfspec.target.model, (1, 2, 4, 8, 16), repeats=1)  # warm-up: the first shapes pay for set-up
    costs = time_passes(selfspec.target.model, (1, 2, 4, 8, 16), repeats=5)
    results["target_pass_ms_by_rows"] = {rows: round(1000 * s, 3) for rows, s in costs.items()}
    # One decoder layer alone (plus embedding and LM head): far above its weight bytes / bandwidth
    # means the pass is bound by kernel launches and Python, not by memory.
    one_layer = time_passes(selfspec.target.model, (1,), repeats=5, layers=(0,))[1]
    results["one_layer_pass_ms"] = round(1000 * one_layer, 3)
    results["target_weight_bytes"] = sum(p.numel() * p.element_size() for p in selfspec.target.model.parameters())
    if device.type == "cuda":
        results["cuda_graph_one_row_pass"] = graph_pass(selfspec.target.model)
        save()
    if args.only_passes:
        save()
        return

    def run(dec: SpecDecoder, method: str, k: int):
        return dec.generate(prompt, params, method=method, k=k)

    plain_s, plain = timed(lambda: run(selfspec, "none", 0), device, args.repeats)
    self_s, spec = timed(lambda: run(selfspec, "draft", args.k), device, args.repeats)
    # Random weights give near-flat logits: bf16 passes of 1 and k + 1 rows can break argmax ties
    # differently, so the self-draft's output may drift from plain decoding (the fp32 tests
    # check equality); the share of equal tokens says how often.
    same = next((i for i, (a, b) in enumerate(zip(spec.token_ids, plain.token_ids)) if a != b), args.new_tokens)
    step_ms = 1000 * plain_s / args.new_tokens
    results["plain"] = {"tok_per_s": args.new_tokens / plain_s, "ms_per_token": step_ms,
                        "engine_overhead_ms_per_step": step_ms - 1000 * costs[1]}
    results["self_draft"] = {"tok_per_s": args.new_tokens / self_s, "speedup_vs_plain": plain_s / self_s,
                             "tau": spec.stats.tau, "k": args.k, "tokens_equal_to_plain_before_first_difference": same,
                             "draft_share": spec.stats.draft_seconds / max(spec.stats.total_seconds, 1e-9)}
    save()
    selfspec = None  # free its memory before the next decoder loads (a del would leave the lambdas above unbound names)

    small = SpecDecoder.from_pretrained(str(target_dir), str(draft_dir), method="draft", **common)
    _, drafted = timed(lambda: run(small, "draft", args.k), device, 1)
    results["small_draft"] = {"draft_pass_ms": 1000 * drafted.stats.draft_seconds / max(drafted.stats.draft_forward_passes, 1),
                              "tau": drafted.stats.tau}
    save()
    if args.compile:
        results["compiled"] = compiled_runs(small, target_dir, prompt, params, args, plain_s, device)
        save()
    small = None  # free its memory (as above)

    try:  # transformers on the same weights, the reference a user would compare against
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
        assistant = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
        ids = torch.tensor([prompt], device=device)
        gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        hf_plain_s, hf_out = timed(lambda: hf.generate(ids, **gen), device, args.repeats)
        results["hf_plain"] = {"tok_per_s": args.new_tokens / hf_plain_s, "ours_plain_over_hf": hf_plain_s / plain_s,
                               "same_tokens": hf_out[0, len(prompt):].tolist() == plain.token_ids}
        gen_assisted = dict(gen, assistant_model=assistant, num_assistant_tokens=args.k,
                            num_assistant_tokens_schedule="constant")
        hf_self_s, _ = timed(lambda: hf.generate(ids, **gen_assisted), device, args.repeats)
        results["hf_assisted_self"] = {"tok_per_s": args.new_tokens / hf_self_s, "ours_self_over_hf": hf_self_s / self_s}
    except Exception as err:  # noqa: BLE001 - report, do not lose the figures above
        results["hf_error"] = repr(err)
    save()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
