"""One client's agentic session on the two engines: the single-request engine (``generate``) and
the batch engine holding one request (what the server runs for one client). Issue 45's second
target: one client within 3% of the single path.

    python benchmarks/one_client_engines.py --method auto --tokens 128 --turns 3 --sessions 2 --repeats 2

Multi-turn code-editing sessions from the agentic set (each turn's prompt is the conversation so
far, the previous answers included), greedy, the demo pair by default (llama.cpp on a CPU). Each
repeat runs both engines, alternating which goes first; also the median time to first token of
turns after a session's first (their prompts mostly cached); each keeps its own prefix cache, so a
later turn prefills only what the previous turn did not hold, as in a chat; no suffix group, so
neither drafts from the other's earlier answers (each session drafts from its own text only). Prints tokens/s per
engine and repeat, tau per turn, the median ratio batch/single, and whether both engines wrote
the same tokens (on torch in fp32 they must; on llama.cpp a multi-row pass may round a near-tie
the other way, after which the texts part).
"""

from __future__ import annotations

import argparse
import statistics
import time

from specdecode import SamplingParams, SpecDecoder
from specdecode.engine.metrics import GenerationStats
from specdecode.prompt_sets import load_agentic


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--tokens", type=int, default=128, help="max new tokens per turn")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=4, help="the batch engine's seats (the server's default is 4)")
    args = parser.parse_args()

    # generate on the single-request engine (the default is the one-seat batch engine now);
    # the batch engine is built explicitly below.
    dec = SpecDecoder.from_pretrained(args.target, args.draft, method=args.method, engine="single", show_progress=False)
    started = time.perf_counter()
    engine = dec.batch_engine(max_batch=args.max_batch)
    print(f"batch engine built (its pass costs timed) in {time.perf_counter() - started:.1f} s", flush=True)
    sessions = load_agentic()[: args.sessions]
    params = SamplingParams(max_new_tokens=args.tokens)

    def single(ids: list[int]) -> tuple[list[int], GenerationStats]:
        result = dec.generate(ids, params, suffix_group=None)
        return result.token_ids, result.stats

    def batch(ids: list[int]) -> tuple[list[int], GenerationStats]:
        stats = GenerationStats()
        request_id = engine.add_request(ids, params, args.method, None, stats=stats, suffix_group=None)
        return engine.run()[request_id], stats

    rates: dict[str, list[float]] = {"single": [], "batch": []}
    ttfts: dict[str, list[float]] = {"single": [], "batch": []}  # turns after a session's first
    texts: dict[str, list[list[int]]] = {}
    for repeat in range(args.repeats):
        order = [("single", single), ("batch", batch)]
        for name, run in order if repeat % 2 == 0 else order[::-1]:
            tokens, seconds, taus, outputs = 0, 0.0, [], []
            for session in sessions:
                messages: list[dict[str, str]] = []
                for index, turn in enumerate(session.turns[: args.turns]):
                    messages.append({"role": "user", "content": turn})
                    ids = dec.encode(messages, chat=True)
                    begun = time.perf_counter()
                    output, stats = run(ids)
                    seconds += time.perf_counter() - begun
                    tokens += len(output)
                    outputs.append(output)
                    taus.append(stats.emitted_by_steps / max(1, stats.verify_steps))
                    if index > 0:
                        ttfts[name].append(stats.first_token_seconds)
                    messages.append({"role": "assistant", "content": dec.tokenizer.decode(output, skip_special_tokens=True)})
            rates[name].append(tokens / seconds)
            texts[name] = outputs
            print(f"repeat {repeat} {name:6s} {tokens / seconds:6.2f} tok/s  tau per turn "
                  f"{' '.join(f'{t:.2f}' for t in taus)}", flush=True)
    ratio = statistics.median(rates["batch"]) / statistics.median(rates["single"])
    print(f"median tok/s: single {statistics.median(rates['single']):.2f}, batch {statistics.median(rates['batch']):.2f}, "
          f"batch/single {ratio:.3f}; same tokens: {texts['single'] == texts['batch']}")
    ttft = {name: statistics.median(values) for name, values in ttfts.items() if values}
    if len(ttft) == 2:
        print(f"median time to first token, later turns: single {ttft['single']:.3f} s, batch {ttft['batch']:.3f} s, "
              f"batch/single {ttft['batch'] / ttft['single']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
