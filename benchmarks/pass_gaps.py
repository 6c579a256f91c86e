"""Time between llama.cpp passes: the Python a greedy token costs around its pass (issue 29's
session speed against llama-server, whose own gap is C++).

    python benchmarks/pass_gaps.py --repeats 3                 # in one process: single path, batch engine
    python benchmarks/pass_gaps.py --server --chats 4          # through `specdecode serve`, streamed chats

In one process, each ``llama_decode`` call is timed and the rest of the wall time is divided by
the passes (128 greedy tokens, the demo target, method none). With ``--server`` a
``specdecode serve --backend llama.cpp --method none`` child runs with the same timer and
``benchmarks/multi_turn_server.py`` drives it; the median time between two consecutive
one-token passes is printed (the server's Python, the HTTP stream's included).
"""

from __future__ import annotations

import argparse
import atexit
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PORT = 8149


def timed_passes() -> list[tuple[float, float, int]]:
    """Wrap ``LlamaCppModel._decode`` to record (start, end, tokens) of every pass."""
    import specdecode.backends.llamacpp as llamacpp

    passes: list[tuple[float, float, int]] = []
    decode = llamacpp.LlamaCppModel._decode

    def timed(self, tokens, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        started = time.perf_counter()
        out = decode(self, tokens, *args, **kwargs)
        passes.append((started, time.perf_counter(), len(tokens)))
        return out

    llamacpp.LlamaCppModel._decode = timed
    return passes


def in_process(repeats: int, tokens: int) -> None:
    passes = timed_passes()
    from specdecode import SamplingParams, SpecDecoder

    dec = SpecDecoder.from_pretrained(None, method="none", backend="llama.cpp", show_progress=False)
    engine = dec.batch_engine(max_batch=8)
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    prompt = dec.encode("Write a quicksort in Python", chat=True)
    dec.generate(prompt, params)
    gaps: dict[str, list[float]] = {"single": [], "batch": []}
    for _ in range(repeats):
        for name, run in (("single", lambda: dec.generate(prompt, params)),
                          ("batch", lambda: dec.generate_batch([prompt], params, engine=engine))):
            dec.forget_prefix()
            passes.clear()
            started = time.perf_counter()
            run()
            wall = time.perf_counter() - started
            gaps[name].append((wall - sum(end - start for start, end, _ in passes)) / len(passes) * 1e3)
    for name, values in gaps.items():
        print(f"{name}: {', '.join(f'{v:.2f}' for v in values)} ms of Python per pass")


def serve_child(out: str, argv: list[str]) -> int:
    passes = timed_passes()
    atexit.register(lambda: Path(out).write_text(json.dumps(passes)))
    from specdecode.cli.app import main

    return main(argv)


def through_server(chats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "passes.json"
        child = subprocess.Popen([sys.executable, __file__, "--serve-child", str(out), "serve", "--backend", "llama.cpp",
                                  "--method", "none", "--port", str(PORT)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import httpx

            for _ in range(180):
                try:
                    if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(1)
            subprocess.run([sys.executable, str(Path(__file__).with_name("multi_turn_server.py")), "--url",
                            f"http://127.0.0.1:{PORT}", "--chats", str(chats)], check=True)
        finally:
            child.send_signal(2)  # SIGINT: the server drains and exits, the timings are written
            child.wait(timeout=120)
        passes = json.loads(out.read_text())
    one = [(start, end) for start, end, n in passes if n == 1]
    gaps = [b[0] - a[1] for a, b in zip(one, one[1:]) if b[0] - a[1] < 0.05]  # within one request
    print(f"{len(passes)} passes; one-token pass median {statistics.median(e - s for s, e in one) * 1e3:.2f} ms; "
          f"between two one-token passes median {statistics.median(gaps) * 1e3:.2f} ms, "
          f"mean {statistics.mean(gaps) * 1e3:.2f} ms")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-child":
        return serve_child(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", action="store_true", help="through `specdecode serve` (else in one process)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--chats", type=int, default=4)
    args = parser.parse_args()
    if args.server:
        through_server(args.chats)
    else:
        in_process(args.repeats, args.tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
